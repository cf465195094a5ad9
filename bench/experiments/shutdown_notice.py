#!/usr/bin/env python3
"""How often a rank whose collective returned is told, by destroy_process_group right after
it, that another rank found the ranks' calls disagreeing. Each round makes a group, runs an
all_to_all_single in which rank 0 sends rank 1 one element more than rank 1's output splits
take (rank 1 fails the call and tells the others; the other ranks get what they expect and
return), and destroys the group at once, with no synchronization between the ranks. With
--case broadcast, a broadcast from rank 0 whose other ranks reject their tensor (a strided view)
instead: rank 0 returns at once. --late-ms MS: the ranks other than 0 make their call MS later
(rank 0 returns from a broadcast, and reaches its destroy, before they find anything).
--case all_to_all_single_async: the ranks other than 0 issue theirs with async_op=True and
destroy the group 5 ms later without waiting, while rank 0 makes its call --late-ms late: rank 1
finds the disagreement during its own destroy (a rank whose async call then succeeds counts as
one that returned). Prints,
per build, how many of the ranks that returned had destroy_process_group raise the
disagreement, how long their destroy took (median and largest, ms), and on how many ranks whose
own call failed destroy raised it once more (it should not): the installed package,
and each OLD directory given (made with `pip install --no-deps --no-build-isolation --target
OLD .` in a worktree), in alternating launches.

    .venv/bin/python bench/experiments/shutdown_notice.py [OLD ...] [--ranks 2] [--rounds 10]
                  [--launches 2] [--case all_to_all_single|broadcast|all_to_all_single_async]
                  [--late-ms 0]

A destroy that returns quietly here leaves wrong results unreported. UCX_NET_DEVICES=lo unless
set.
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
    me, w = dist.get_rank(), dist.get_world_size()
    out = {"package": str(Path(commux.__file__).parent), "returned": 0, "told": 0, "destroy_ms": [],
           "spurious": 0}
    asynchronous = job["case"] == "all_to_all_single_async" and me != 0
    late = me == 0 if job["case"] == "all_to_all_single_async" else me != 0
    for _ in range(job["rounds"]):
        g = dist.new_group(list(range(w)))
        if late and job["late_ms"] > 0:
            time.sleep(job["late_ms"] / 1e3)
        work = None
        try:
            if job["case"] == "broadcast":  # the other ranks' tensor is rejected before posting
                t = torch.zeros(8)
                dist.broadcast(t if me == 0 else t[::2], src=0, group=g)
            else:
                ins = [2] * w
                if me == 0:
                    ins[1] = 3
                x = torch.arange(sum(ins), dtype=torch.float32)
                y = torch.zeros(2 * w)
                work = dist.all_to_all_single(y, x, output_split_sizes=[2] * w,
                                              input_split_sizes=ins, group=g,
                                              async_op=asynchronous)
                if asynchronous:
                    time.sleep(0.005)  # a collective thread runs it
            returned = True
        except (RuntimeError, ValueError):
            returned = False
        t0 = time.monotonic()
        try:
            dist.destroy_process_group(g)
            told = False
        except RuntimeError as e:
            told = "results are wrong" in str(e)
        if asynchronous:
            try:
                work.wait()
            except RuntimeError:
                returned = False
        if returned:
            out["returned"] += 1
            out["told"] += int(told)
            out["destroy_ms"].append((time.monotonic() - t0) * 1e3)
        else:  # its own call failed, and said so: nothing more to say
            out["spurious"] += int(told)
    dist.destroy_process_group()
    return out


def one_launch(a):
    """This process as one launch (the build its PYTHONPATH gives): prints one JSON line."""
    job = {"rounds": a.rounds, "case": a.case, "late_ms": a.late_ms, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 300, "shutdown_notice")
    if errors or len(results) != a.ranks:
        for e in errors:
            print(f"shutdown_notice: {e}", file=sys.stderr)
        return 1
    rs = list(results.values())
    print(json.dumps({"package": rs[0]["package"], "returned": sum(r["returned"] for r in rs),
                      "told": sum(r["told"] for r in rs),
                      "spurious": sum(r["spurious"] for r in rs),
                      "destroy_ms": [t for r in rs for t in r["destroy_ms"]]}))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", nargs="*", help="directories holding other builds' commux package")
    p.add_argument("--ranks", type=positive, default=2)
    p.add_argument("--rounds", type=positive, default=10)
    p.add_argument("--launches", type=positive, default=2, help="per build")
    p.add_argument("--case", choices=("all_to_all_single", "broadcast", "all_to_all_single_async"),
                   default="all_to_all_single")
    p.add_argument("--late-ms", type=float, default=0.0,
                   help="the ranks other than 0 make their call this much later")
    p.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.ranks < 2:
        p.error("--ranks: at least 2 (one rank has nobody to disagree with)")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if a.one_launch:
        return one_launch(a)
    builds = [None] + [build_dir(p, d) for d in a.old]
    args = [sys.executable, __file__, "--one-launch", "--ranks", str(a.ranks),
            "--rounds", str(a.rounds), "--case", a.case, "--late-ms", str(a.late_ms)]
    try:
        runs = alternate_builds(args, builds, a.launches, 400, "shutdown_notice")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    who = "rank 0" if a.case == "all_to_all_single_async" else "others"
    print(f"{a.ranks} ranks, {a.case}, {who} {a.late_ms:g} ms late, {a.launches} launches of "
          f"{a.rounds} rounds per build")
    print("| build | ranks that returned | told at destroy | destroy median ms | max ms | "
          "told though its call failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for b in builds:
        returned = sum(r["returned"] for r in runs[b])
        told = sum(r["told"] for r in runs[b])
        ms = sorted(t for r in runs[b] for t in r["destroy_ms"])
        spurious = sum(r["spurious"] for r in runs[b])
        print(f"| {runs[b][0]['package']} | {returned} | {told} | {statistics.median(ms):.1f} | "
              f"{ms[-1]:.1f} | {spurious} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
