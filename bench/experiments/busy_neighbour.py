#!/usr/bin/env python3
"""Collectives beside CPU hogs: what a busy neighbour (a compile, a data loader) does to each wait.

Starts --hogs busy loops, then runs commux's C++ collectives (build/bench/commux_coll_bench) with
each COMMUX_YIELD value of --yield, optionally a second build of commux (--other-build, e.g. one
without a change, for a before/after), and Open MPI (build/bench/mpi_coll) beside them, in
alternating rounds of one launch. Every result is checked (a wrong element fails the script). It
prints, per (op, size), each variant's median over the rounds of its per-repetition medians, and
its ratio to MPI's. With --hogs 0 it is the same comparison on a quiet machine.

    bench/experiments/busy_neighbour.py [--hogs 2] [--np 2] [--rounds 3]
        [--yield auto,off] [--other-build DIR] [--ops allreduce,barrier] [--sizes 8,64K]

Times beside busy loops vary by orders of magnitude between rounds (which task the scheduler runs
when is luck): read the medians, and compare only within one launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_variant(cmd: list[str], env: dict[str, str], out: Path, timeout: int) -> list[dict]:
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd + ["--json", str(out)], env=env, stdout=f, stderr=f,
                            timeout=timeout).returncode
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} failed ({rc}):\n" + log.read_text()[-2000:])
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        if r["wrong"]:
            sys.exit(f"{' '.join(cmd)}: {r['op']} {r['bytes']} B: {r['wrong']} wrong elements")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=2, help="busy loops beside the ranks (default 2)")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--yield", dest="yields", default="auto,off",
                    help="COMMUX_YIELD values to run (default auto,off)")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--other-build", default=None,
                    help="a second commux build, run with COMMUX_YIELD=auto as 'other'")
    ap.add_argument("--ops", default="p2p,allreduce,broadcast,barrier")
    ap.add_argument("--sizes", default="8,64K")
    ap.add_argument("--no-mpi", action="store_true")
    a = ap.parse_args()

    common = ["--np", str(a.np), "--ops", a.ops, "--sizes", a.sizes, "--reps", "5",
              "--min-reps", "3", "--budget-ms", "200", "--timeout", "100"]
    variants: list[tuple[str, list[str], dict[str, str]]] = []
    base = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
                OMP_NUM_THREADS="1")
    for y in a.yields.split(","):
        variants.append((f"yield={y}", [f"{a.build}/bench/commux_coll_bench"] + common,
                         dict(base, COMMUX_YIELD=y)))
    if a.other_build:
        variants.append(("other", [f"{a.other_build}/bench/commux_coll_bench"] + common,
                         dict(base, COMMUX_YIELD="auto")))
    mpirun = shutil.which("mpirun")
    if not a.no_mpi and mpirun:
        mpi = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(a.np),
               f"{a.build}/bench/mpi_coll"] + [c for c in common[2:]]
        variants.append(("mpi", mpi, base))

    hogs = [hog() for _ in range(a.hogs)]
    times: dict[tuple[str, int], dict[str, list[float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(a.rounds):
                for name, cmd, env in variants:
                    out = Path(tmp) / f"{name}_{rnd}.json"
                    for r in run_variant(cmd + ["--salt", str(rnd)], env, out, 240):
                        times.setdefault((r["op"], r["bytes"]), {}).setdefault(name, []).append(
                            statistics.median(r["times_us"]))
    finally:
        for h in hogs:
            h.kill()
            h.wait()

    names = [v[0] for v in variants]
    print(f"{a.np} ranks beside {a.hogs} busy loops on {os.cpu_count()} CPUs, {a.rounds} rounds, "
          "median µs (0 wrong elements)")
    head = "| op | bytes | " + " | ".join(names)
    ratios = [n for n in names if n != "mpi"] if "mpi" in names else []
    head += "".join(f" | {n}/mpi" for n in ratios) + " |"
    print(head)
    print("|---|---:|" + "---:|" * (len(names) + len(ratios)))
    for (op, nb), per in times.items():
        med = {n: statistics.median(per[n]) for n in names}
        cells = [f"{med[n]:.2f}" for n in names] + [f"{med[n] / med['mpi']:.2f}" for n in ratios]
        print(f"| {op} | {nb} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
