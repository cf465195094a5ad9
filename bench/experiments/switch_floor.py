#!/usr/bin/env python3
"""What a torch-level call costs where ranks outnumber the CPUs, beside what any backend would pay:
the same ranks run three loops, each round in turn.

    .venv/bin/python bench/experiments/switch_floor.py [--ranks 4] [--op barrier] [--calls 20000]
                                                       [--rounds 3]

  group   the call on the group of all ranks ("ucx"): every call waits for the other ranks;
  alone   the same call, each rank on a "ucx" group of its own rank only (dist.new_subgroups):
          torch's and commux's CPU per call, the ranks sharing the CPUs in the scheduler's
          slices with nothing to wait for;
  yield   "alone" with os.sched_yield() after each call: every call hands the CPU to another
          rank's process, as a call that must wait for a rank on its CPU does at least every
          other time (two ranks on one CPU alternate once per two calls at best).

Where "yield" takes as long as "group", the time goes to the ranks' processes taking turns on a
CPU: each turn evicts the other process's caches and branch history, and the Python and torch
code of a call runs at about half speed after it (on the development VM, 5.3 -> 11.3 µs of CPU
per call for two processes pinned to one CPU). No backend avoids that where ranks that share a
CPU must meet every call; only fewer turns per call would. µs per call (wall, the slowest rank)
and CPU µs per call and involuntary switches per call of each rank's main thread (mean over
ranks), the median of the rounds. --op: barrier, or allreduce (8 bytes, result checked).
UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402

LOOPS = ("group", "alone", "yield")


def main_thread_stats():
    """(CPU seconds, involuntary switches) of the calling thread."""
    with open(f"/proc/self/task/{os.getpid()}/status") as f:
        status = f.read()
    return time.thread_time(), int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    world = dist.get_world_size()
    own, _ = dist.new_subgroups(group_size=1)
    x = torch.ones(2)
    wrong = 0

    def call(group, expect):
        nonlocal wrong
        if job["op"] == "barrier":
            dist.barrier(group=group)
        else:
            x.fill_(1.0)
            dist.all_reduce(x, group=group)
            wrong += int((x != expect).sum())

    loops = {"group": (None, world, False), "alone": (own, 1, False), "yield": (own, 1, True)}
    out = {name: [] for name in LOOPS}
    for _ in range(job["rounds"]):
        for name in LOOPS:
            group, expect, yields = loops[name]
            for _ in range(max(100, job["calls"] // 10)):
                call(group, expect)
            dist.barrier()
            cpu0, inv0 = main_thread_stats()
            t0 = time.perf_counter()
            for _ in range(job["calls"]):
                call(group, expect)
                if yields:
                    os.sched_yield()
            seconds = time.perf_counter() - t0
            cpu1, inv1 = main_thread_stats()
            n = job["calls"]
            out[name].append((seconds / n * 1e6, (cpu1 - cpu0) / n * 1e6, (inv1 - inv0) / n))
    dist.destroy_process_group()
    return {"loops": out, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--op", default="barrier", choices=("barrier", "allreduce"))
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"op": a.op, "calls": a.calls, "rounds": a.rounds, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 900, "switch_floor")
    for e in errors:
        print(f"switch_floor: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    print(f"{a.ranks} ranks on {os.cpu_count()} CPUs, {a.op}, {a.calls} calls x {a.rounds} rounds;"
          " per call, median of the rounds:")
    print("| loop | µs (slowest rank) | CPU µs (mean of ranks) | involuntary switches |")
    print("|---|---:|---:|---:|")
    for name in LOOPS:
        rows = [res["loops"][name] for res in results.values()]  # rank -> [(us, cpu, inv)] rounds
        wall = statistics.median(max(r[k][0] for r in rows) for k in range(a.rounds))
        cpu = statistics.median(statistics.mean(r[k][1] for r in rows) for k in range(a.rounds))
        inv = statistics.median(statistics.mean(r[k][2] for r in rows) for k in range(a.rounds))
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {inv:.2f} |")
    wrong = sum(res["wrong"] for res in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
