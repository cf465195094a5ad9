#!/usr/bin/env python3
"""What a rank blocked in a collective costs its machine: rank 0 calls all_reduce (or barrier)
while the other ranks join --late seconds later; prints the CPU time rank 0's process (every
thread: the caller, commux's progress thread, torch's) used meanwhile, as a share of one core,
for "ucx" and "gloo" in the same launch. Issue 14 asks for under 5% of a core.

    .venv/bin/python bench/experiments/blocked_cpu.py [--ranks 2] [--late 3] [--rounds 3]
                                                      [--op all_reduce|barrier]
                                                      [--mode blocking|wait|poll]

--mode wait issues the call with async_op=True and waits for its Work at once (a schedule a
waiter resumes); --mode poll issues it async and then sleeps in 10 ms steps until
Work.is_completed() (a schedule nobody waits for, resumed by the group's pool thread).

Every all_reduce result is checked. UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    groups = {"ucx": dist.new_group(backend="ucx"), "gloo": dist.new_group(backend="gloo")}
    me, world = dist.get_rank(), dist.get_world_size()
    shares = {b: [] for b in groups}
    wrong = 0
    for rnd in range(job["rounds"]):
        for backend in (list(groups) if rnd % 2 == 0 else list(reversed(list(groups)))):
            g = groups[backend]
            x = torch.full((1000,), float(me + 1))
            dist.all_reduce(x, group=g)  # warm
            dist.barrier()
            if me != 0:
                time.sleep(job["late"])
            c0, t0 = cpu_s(), time.monotonic()
            x.fill_(float(me + 1))
            mode = job["mode"]
            if job["op"] == "barrier":
                w = dist.barrier(group=g, async_op=mode != "blocking")
            else:
                w = dist.all_reduce(x, group=g, async_op=mode != "blocking")
            if mode == "wait":
                w.wait()
            elif mode == "poll":
                while not w.is_completed():
                    time.sleep(0.01)
                w.wait()
            if job["op"] != "barrier":
                wrong += int((x != float(world * (world + 1) // 2)).sum())
            if me == 0:
                shares[backend].append((cpu_s() - c0) / (time.monotonic() - t0))
    dist.destroy_process_group()  # before the interpreter ends (async_overlap.py says why)
    return {"shares": shares, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--late", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--op", choices=("all_reduce", "barrier"), default="all_reduce")
    p.add_argument("--mode", choices=("blocking", "wait", "poll"), default="blocking")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"late": a.late, "rounds": a.rounds, "op": a.op, "mode": a.mode, "env": {}}
    timeout = 120 + 3 * a.rounds * a.late
    results, errors = launch_ranks(a.ranks, run_rank, job, timeout, "blocked cpu")
    for e in errors:
        print(f"blocked_cpu: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    print(f"rank 0 blocked {a.late:g} s in {a.op} ({a.mode}) on {a.ranks} ranks: its process's CPU time over "
          f"that time, median of {a.rounds} rounds")
    print("| backend | % of a core |")
    print("|---|---:|")
    for backend, v in results[0]["shares"].items():
        print(f"| {backend} | {100 * statistics.median(v):.1f} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
