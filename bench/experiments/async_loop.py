#!/usr/bin/env python3
"""K async all_reduces issued back to back, then waited, against K blocking ones, with nothing
else in the processes: the default group is "ucx", its own barrier lines the ranks up, and the
buffers are reused. async_overlap.py measures the same beside gloo (whose barrier and threads
weigh on every figure); this isolates what commux itself does between a caller and its threads.

    .venv/bin/python bench/experiments/async_loop.py [--ranks 2] [--count 8] [--kib 64]
                                                     [--rounds 2000] [--schedule 1]

--schedule sets COMMUX_SCHEDULE (1: async collectives run as schedules; 0: on a collective
thread). Each round runs the K blocking calls, then the K async ones; prints the median over
rounds of each rank's time per mode, and async / blocking. Every result is checked (integer
inputs, exact sums); a wrong element fails the run. Run it under `perf stat -e context-switches`
to count the hand-offs. UCX_NET_DEVICES=lo unless set.
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
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()
    n, k = job["kib"] * 256, job["count"]
    xs = [torch.empty(n) for _ in range(k)]
    times = {"blocking": [], "async": []}
    wrong = 0
    for rnd in range(job["rounds"] + 10):  # the first ten are warm-up
        for mode in ("blocking", "async"):
            for i, x in enumerate(xs):
                x.fill_(float(me + i))
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "blocking":
                for x in xs:
                    dist.all_reduce(x)
            else:
                works = [dist.all_reduce(x, async_op=True) for x in xs]
                for w in works:
                    w.wait()
            dt = time.perf_counter() - t0
            for i, x in enumerate(xs):
                wrong += int((x != float(sum(r + i for r in range(world)))).sum())
            if rnd >= 10:
                times[mode].append(dt)
    return {m: statistics.median(t) * 1e6 for m, t in times.items()} | {"wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--schedule", default="1")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"kib": a.kib, "count": a.count, "rounds": a.rounds,
           "env": {"COMMUX_SCHEDULE": a.schedule}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 600, "async_loop")
    if errors or len(results) != a.ranks:
        print("async_loop: " + "; ".join(errors or ["a rank gave no result"]), file=sys.stderr)
        return 2
    print(f"{a.count} all_reduces of {a.kib} KiB on {a.ranks} ranks, COMMUX_SCHEDULE={a.schedule}, "
          f"median of {a.rounds} rounds")
    print("| rank | blocking µs | async µs | async / blocking |")
    print("|---:|---:|---:|---:|")
    for r in sorted(results):
        b, s = results[r]["blocking"], results[r]["async"]
        print(f"| {r} | {b:.1f} | {s:.1f} | {s / b:.2f} |")
    wrong = sum(results[r]["wrong"] for r in results)
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
