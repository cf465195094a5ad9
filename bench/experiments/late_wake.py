#!/usr/bin/env python3
"""How late a rank that waited for another in a barrier leaves it, after a computation: each
round both ranks fill and check every element of a --mib MiB tensor (without calling commux),
rank 0 then sleeps --late ms more, and both call barrier(); rank 1 arrives first, spins and
goes to sleep. Prints the median, 90th percentile and largest time from rank 0's arrival to
rank 1's return (one clock, time.monotonic, for the processes of the machine), per build:
the installed package, and each OLD directory given (made with
`pip install --no-deps --no-build-isolation --target OLD .` in a worktree), in alternating
launches.

    .venv/bin/python bench/experiments/late_wake.py [OLD ...] [--rounds 30] [--launches 2]
                                                    [--mib 64] [--late 5]

The computation matters: while it runs nothing is in flight, and the progress thread's idle
naps grow towards 20 ms (docs/progress.md, "Large torch-level calls between computations").
Every check's wrong elements are counted (#wrong). UCX_NET_DEVICES=lo unless set.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.lib.launch import alternate_builds, build_dir, launch_ranks  # noqa: E402
from bench.lib.sizes import positive  # noqa: E402


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    me = dist.get_rank()
    x = torch.empty(job["mib"] << 18)  # float32
    out = {"package": str(Path(commux.__file__).parent), "arrived": [], "left": [], "wrong": 0}
    for i in range(job["rounds"] + 2):  # the first two are warm-up
        dist.barrier()
        x.fill_(i)
        out["wrong"] += int((x != i).sum())
        if me == 0:
            time.sleep(job["late"] / 1e3)
        arrived = time.monotonic()
        dist.barrier()
        left = time.monotonic()
        if i >= 2:
            out["arrived"].append(arrived)
            out["left"].append(left)
    dist.destroy_process_group()
    return out


def one_launch(a):
    """This process as one launch (the build its PYTHONPATH gives): prints one JSON line."""
    job = {"rounds": a.rounds, "mib": a.mib, "late": a.late, "env": {}}
    results, errors = launch_ranks(2, run_rank, job, 300, "late_wake")
    if errors or len(results) != 2:
        for e in errors:
            print(f"late_wake: {e}", file=sys.stderr)
        return 1
    r0, r1 = results[0], results[1]
    late = [(b - a) * 1e6 for a, b in zip(r0["arrived"], r1["left"])]
    print(json.dumps({"package": r0["package"], "late_us": late,
                      "wrong": r0["wrong"] + r1["wrong"]}))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", nargs="*", help="directories holding other builds' commux package")
    p.add_argument("--rounds", type=positive, default=30)
    p.add_argument("--launches", type=positive, default=2, help="per build")
    p.add_argument("--mib", type=int, default=64, help="the tensor computed over, MiB")
    p.add_argument("--late", type=float, default=5, help="how much later rank 0 arrives, ms")
    p.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if a.one_launch:
        return one_launch(a)
    builds = [None] + [build_dir(p, d) for d in a.old]
    args = [sys.executable, __file__, "--one-launch", "--rounds", str(a.rounds),
            "--mib", str(a.mib), "--late", str(a.late)]
    try:
        runs = alternate_builds(args, builds, a.launches, 400, "late_wake")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    late = {b: [t for r in runs[b] for t in r["late_us"]] for b in builds}
    names = {b: runs[b][0]["package"] for b in builds}
    wrong = sum(r["wrong"] for b in builds for r in runs[b])
    print(f"2 ranks, {a.mib} MiB computed over, rank 0 {a.late:g} ms later; {a.launches} "
          f"launches of {a.rounds} rounds per build")
    print("| build | median µs | p90 µs | max µs |")
    print("|---|---:|---:|---:|")
    for b in builds:
        v = sorted(late[b])
        print(f"| {names[b]} | {statistics.median(v):.0f} | {v[int(0.9 * (len(v) - 1))]:.0f} | "
              f"{v[-1]:.0f} |")
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
