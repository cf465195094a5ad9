#!/usr/bin/env python3
"""Same-launch A/B of the torch backend's hand-off polling (COMMUX_SPIN_US).

    .venv/bin/python bench/experiments/spin_ab.py [--sizes 8,4096,65536,1048576] [--iters 300]
                                                  [--rounds 5]

Two ranks. Each creates two "ucx" groups in one launch: one with the default COMMUX_SPIN_US
(the waiter of a short collective and the worker thread poll before sleeping) and one created
with COMMUX_SPIN_US=0 (they sleep at once). Both run back-to-back allreduces of each size,
alternating per round; prints the median time per call and the ratio. Every result is checked
(the sum of the ranks' ones is 2). UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)  # two ranks on two cores: no OpenMP team for fill_
    dist.init_process_group("ucx", init_method="env://")
    os.environ["COMMUX_SPIN_US"] = "0"  # read when the group is created
    try:
        nospin = dist.new_group(backend="ucx")
    finally:
        os.environ.pop("COMMUX_SPIN_US", None)
    groups = {"poll": None, "no poll": nospin}
    gloo = dist.new_group(backend="gloo")
    out, wrong = [], 0
    for nbytes in job["sizes"]:
        times = {k: [] for k in groups}
        for r in range(job["rounds"]):
            for name in (list(groups) if r % 2 == 0 else list(groups)[::-1]):
                x = torch.ones(max(1, nbytes // 4))
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(job["iters"]):
                    x.fill_(1.0)
                    dist.all_reduce(x, group=groups[name])
                times[name].append((time.perf_counter() - t0) / job["iters"] * 1e6)
                wrong += int((x != 2.0).sum())
        out.append({"bytes": nbytes, **{k: statistics.median(v) for k, v in times.items()}})
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    return {"rows": out, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,4096,65536,1048576")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"sizes": [int(s) for s in a.sizes.split(",")], "iters": a.iters, "rounds": a.rounds,
           "env": {"COMMUX_SPIN_US": None}}
    results, errors = launch_ranks(2, run_rank, job, 600, "spin A/B")
    for e in errors:
        print(f"spin_ab: {e}", file=sys.stderr)
    if errors or 0 not in results:
        return 1
    wrong = sum(r["wrong"] for r in results.values())
    print("| bytes | poll µs | no poll µs | poll / no poll |\n|---:|---:|---:|---:|")
    for row in results[0]["rows"]:
        print(f"| {row['bytes']} | {row['poll']:.1f} | {row['no poll']:.1f} | "
              f"{row['poll'] / row['no poll']:.2f} |")
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
