#!/usr/bin/env python3
"""COMMUX_CALLER_RUNS=1 (the default: a blocking collective runs on the calling thread, a wait runs
a queued one there) against 0 (the group's pool thread runs every collective), through
torch.distributed, same build, same run.

    .venv/bin/python bench/experiments/caller_runs_ab.py [--rounds 3] [--worlds 2,4]
                                                     [--ops allreduce,broadcast,barrier,allgather]
                                                     [--sizes 8,4K,64K,1M]

Each round runs bench/coll_bench.py (backend "ucx" only) once with each setting, the order
alternating between rounds. Prints, per (op, ranks, size), the median over rounds of each and
on/off (below 1: running on the caller is faster). Every result is checked by coll_bench; a
wrong element fails the script. The VM's timings drift: only the ratio within a run means
anything.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--ops", default="allreduce,broadcast,barrier,allgather")
    ap.add_argument("--sizes", default="8,4K,64K,1M")
    a = ap.parse_args()
    times: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            order = ("0", "1") if rnd % 2 == 0 else ("1", "0")
            for setting in order:
                out = Path(tmp) / f"r{rnd}_{setting}"
                env = {**os.environ, "COMMUX_CALLER_RUNS": setting,
                       "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                       "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, str(REPO / "bench" / "coll_bench.py"), "--backends", "ucx",
                       "--worlds", a.worlds, "--ops", a.ops, "--sizes", a.sizes, "--rounds", "1",
                       "--out", str(out)]
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if p.returncode != 0:
                    sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
                    return 1
                for r in json.loads((out / "results.json").read_text())["rows"]:
                    if r["wrong"]:
                        print(f"CALLER_RUNS={setting}: {r['op']} {r['bytes']} B on {r['world']} "
                              f"ranks: {r['wrong']} wrong", file=sys.stderr)
                        return 1
                    key = (r["op"], r["world"], r["bytes"])
                    times.setdefault(key, {}).setdefault(setting, []).append(r["time_us"])
            print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    print(f"| op | ranks | bytes | off µs | on µs | on/off |  ({a.rounds} rounds, medians)")
    print("|---|---:|---:|---:|---:|---:|")
    ratios = []
    for (op, world, nbytes), v in sorted(times.items()):
        off, on = statistics.median(v["0"]), statistics.median(v["1"])
        ratios.append(on / off)
        print(f"| {op} | {world} | {nbytes} | {off:.2f} | {on:.2f} | {on / off:.2f} |")
    print(f"\ngeometric mean of on/off over {len(ratios)} rows: "
          f"{statistics.geometric_mean(ratios):.3f}; wrong elements: 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
