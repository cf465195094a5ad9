#!/usr/bin/env python3
"""Two builds of the commux package side by side at the torch level: launches of the same ranks
alternate between the installed package and another (OLD, a directory made with
`pip install --no-deps --no-build-isolation --target OLD .` in a worktree of the older commit),
in the order old-new, new-old, old-new, ... so that a drift of the machine during the run falls
on both alike.

    .venv/bin/python bench/experiments/package_ab.py OLD [--ops allreduce,broadcast,allgather,p2p]
                                                     [--bytes 64M] [--calls 25] [--pairs 6]
                                                     [--ranks 2]

build_ab.py does this for the C++ API; this one measures what a torch user sees, for a change
that must not slow large calls down (one build per process: a process loads one package). Each
launch runs, per op, --calls blocking calls of --bytes per rank (float32), each after a barrier,
and takes the slowest rank's median call. p2p: each rank isends to the next and irecvs from the
previous, both waited; allgather: all_gather_into_tensor. Every result is checked (values that
change per call). Prints, per op, each build's median over its launches and the median of the
pairs' new/old ratios (below 1: the installed build is faster).
UCX_NET_DEVICES=lo unless set.
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
from bench.lib.sizes import parse_list, parse_size, positive, size_name  # noqa: E402

OPS = ("allreduce", "broadcast", "allgather", "p2p")


def byte_count(text):
    """--bytes: bench.lib.sizes.parse_size's sizes, checked (argparse names a bad one)."""
    try:
        n = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64K or 64M")
    if n < 4 or n % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a multiple of 4 bytes (float32) is needed")
    return n


def fill(op, x, r, i):
    """The input of call i (outside the timed part)."""
    x.fill_(-1 if op == "broadcast" and r != 0 else (1 + i if op == "broadcast" else r + 1 + i))


def one_call(dist, op, x, out, r, w):
    """Call `op` once, blocking (the timed part)."""
    if op == "allreduce":
        dist.all_reduce(x)
    elif op == "broadcast":
        dist.broadcast(x, 0)
    elif op == "allgather":
        dist.all_gather_into_tensor(out, x)
    else:  # p2p: isend to the next rank, irecv from the previous, both waited
        works = [dist.irecv(out, (r - 1) % w), dist.isend(x, (r + 1) % w)]
        for work in works:
            work.wait()


def wrong_after(torch, op, x, out, r, w, i):
    """The wrong elements call i left (outside the timed part)."""
    if op == "allreduce":
        return int((x != sum(q + 1 + i for q in range(w))).sum())
    if op == "broadcast":
        return int((x != 1 + i).sum())
    if op == "allgather":
        want = torch.arange(1, w + 1, dtype=x.dtype).repeat_interleave(x.numel()) + i
        return int((out != want).sum())
    return int((out != (r - 1) % w + 1 + i).sum())


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    r, w = dist.get_rank(), dist.get_world_size()
    n = job["bytes"] // 4
    x = torch.empty(n)
    result = {"package": str(Path(commux.__file__).parent), "us": {}, "wrong": 0}
    for op in job["ops"]:
        out = torch.empty(n * w) if op == "allgather" else torch.empty(n) if op == "p2p" else None
        times = []
        for i in range(job["calls"] + 2):  # the first two are warm-up
            fill(op, x, r, i)
            dist.barrier()
            t0 = time.perf_counter()
            one_call(dist, op, x, out, r, w)
            t1 = time.perf_counter()
            if i >= 2:
                times.append(t1 - t0)
            result["wrong"] += wrong_after(torch, op, x, out, r, w, i)
        result["us"][op] = statistics.median(times) * 1e6
    dist.destroy_process_group()
    return result


def one_launch(a):
    """This process as one launch (the build its PYTHONPATH gives): prints one JSON line."""
    job = {"ops": a.ops, "bytes": a.bytes, "calls": a.calls, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, a.launch_timeout, "package_ab")
    if errors or len(results) != a.ranks:
        for e in errors:
            print(f"package_ab: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"package": results[0]["package"],
                      "us": {op: max(res["us"][op] for res in results.values()) for op in a.ops},
                      "wrong": sum(res["wrong"] for res in results.values())}))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", nargs="?", help="directory holding the other build's commux package")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--bytes", default=byte_count("64M"), type=byte_count, help="per rank, e.g. 64M")
    p.add_argument("--calls", type=int, default=25)
    p.add_argument("--pairs", type=positive, default=6)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--launch-timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.ops = parse_list(p, "--ops", a.ops, OPS)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if a.one_launch:
        return one_launch(a)
    old = build_dir(p, a.old)
    args = [sys.executable, __file__, "--one-launch", "--ops", ",".join(a.ops),
            "--bytes", str(a.bytes), "--calls", str(a.calls), "--ranks", str(a.ranks),
            "--launch-timeout", str(a.launch_timeout)]
    try:
        by_build = alternate_builds(args, [old, None], a.pairs, a.launch_timeout + 60,
                                    "package_ab")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    runs = {"old": by_build[old], "new": by_build[None]}
    wrong = sum(r["wrong"] for side in runs.values() for r in side)
    print(f"{a.ranks} ranks, {size_name(a.bytes)} per rank, {a.pairs} pairs of launches of {a.calls} calls"
          f" per op; new: {runs['new'][0]['package']}, old: {runs['old'][0]['package']}")
    print("| op | old µs | new µs | new/old of the medians | pairs' new/old | median of the pairs |")
    print("|---|---:|---:|---:|---|---:|")
    for op in a.ops:
        old = [r["us"][op] for r in runs["old"]]
        new = [r["us"][op] for r in runs["new"]]
        pairs = [n / o for n, o in zip(new, old)]
        print(f"| {op} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
              f"{statistics.median(new) / statistics.median(old):.3f} | "
              f"{' '.join(f'{q:.2f}' for q in pairs)} | {statistics.median(pairs):.3f} |")
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
