#!/usr/bin/env python3
"""Where the CPU goes per torch-level call: each thread's CPU time and context switches per call,
per rank, for a loop of one kind of call (from /proc/self/task, read before and after the loop).

    .venv/bin/python bench/experiments/thread_cpu.py [--ranks 4] [--op allreduce] [--calls 20000]
                                                     [--kib 0] [--backend ucx]

--op: allreduce, barrier, p2p (pairs of ranks exchange, blocking send then recv), async8 (8
all_reduces issued with async_op=True, then waited: one "call"), fut8 (the same waited through
their futures). --kib 0 is 8 bytes. Threads appear by name: python (the rank's main thread, and
torch's), commux-progress (the core's progress thread), commux-pool (the torch backend's
collective threads). Where ranks outnumber the CPUs, the time per call is bounded by the CPU all
ranks' threads use per call divided by the CPUs: this shows which threads use it. Results of the
collectives are checked. UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402


def thread_stats():
    """tid -> (name, CPU ticks, voluntary switches, involuntary switches)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, int(fields[11]) + int(fields[12]), vol, invol)
    return out


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group(job["backend"], init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()
    n = max(2, job["kib"] * 256)
    xs = [torch.ones(n) for _ in range(8)]
    op = job["op"]
    wrong = 0

    def call():
        nonlocal wrong
        if op == "allreduce":
            xs[0].fill_(1.0)
            dist.all_reduce(xs[0])
            wrong += int((xs[0] != world).sum())
        elif op == "barrier":
            dist.barrier()
        elif op == "p2p":
            peer = me ^ 1
            if peer < world:
                if me % 2 == 0:
                    dist.send(xs[0], peer)
                    dist.recv(xs[1], peer)
                else:
                    dist.recv(xs[1], peer)
                    dist.send(xs[0], peer)
        else:
            for x in xs:
                x.fill_(1.0)
            works = [dist.all_reduce(x, async_op=True) for x in xs]
            for w in works:
                if op == "async8":
                    w.wait()
                else:
                    w.get_future().wait()
            wrong += sum(int((x != world).sum()) for x in xs)

    for _ in range(max(100, job["calls"] // 10)):
        call()
    dist.barrier()
    before = thread_stats()
    t0 = time.perf_counter()
    for _ in range(job["calls"]):
        call()
    seconds = time.perf_counter() - t0
    after = thread_stats()
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    threads = []
    for tid, (name, cpu, vol, invol) in after.items():
        _, cpu0, vol0, invol0 = before.get(tid, (name, 0, 0, 0))
        row = (name, (cpu - cpu0) * tick_us / job["calls"], (vol - vol0) / job["calls"],
               (invol - invol0) / job["calls"])
        if max(row[1:]) >= 0.005:  # what shows as 0.00 is left out
            threads.append(row)
    dist.destroy_process_group()
    return {"us": seconds / job["calls"] * 1e6, "threads": threads, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--op", default="allreduce",
                   choices=("allreduce", "barrier", "p2p", "async8", "fut8"))
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--kib", type=int, default=0)
    p.add_argument("--backend", default="ucx")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"op": a.op, "calls": a.calls, "kib": a.kib, "backend": a.backend, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 600, "thread_cpu")
    for e in errors:
        print(f"thread_cpu: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    size = f"{a.kib} KiB" if a.kib else "8 B"
    print(f"{a.ranks} ranks on {os.cpu_count()} CPUs, {a.op} of {size} on {a.backend}, "
          f"{a.calls} calls; per call:")
    print("| rank | µs | thread | CPU µs | voluntary switches | involuntary switches |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in sorted(results):
        res = results[r]
        for i, (name, cpu, vol, invol) in enumerate(sorted(res["threads"], key=lambda t: -t[1])):
            us = f"{res['us']:.2f}" if i == 0 else ""
            print(f"| {r if i == 0 else ''} | {us} | {name} | {cpu:.2f} | {vol:.2f} | {invol:.2f} |")
    wrong = sum(res["wrong"] for res in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
