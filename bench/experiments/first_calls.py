#!/usr/bin/env python3
"""The first calls after init: how long 8 B exchanges take in the first tenths of a second.

Each launch starts 2 ranks, and right after init_process_group runs --blocks blocks of --calls
blocking send/recv exchanges (rank 0 sends then receives, rank 1 the reverse), timing each block.
It prints, per launch, rank 0's µs per exchange in each block, how many blocks were slower than
--slow-x times the steady state (the median of the last three blocks), and the time all blocks
took beyond the steady state. Results are checked.

    .venv/bin/python bench/experiments/first_calls.py [--launches 16] [--blocks 12]
        [--calls 200] [--slow-x 3]

A launch whose early blocks are many times its last shows a start-up phase in which the waits
cost a scheduler slice each (docs/progress.md, "Yielding"). COMMUX_* variables pass through.
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


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    me = dist.get_rank()
    peer = 1 - me
    out = torch.zeros(2)
    got = torch.zeros(2)
    wrong = 0
    blocks = []
    for b in range(job["blocks"]):
        t0 = time.perf_counter()
        for i in range(job["calls"]):
            out.fill_(me * 1000 + i)
            if me == 0:
                dist.send(out, peer)
                dist.recv(got, peer)
            else:
                dist.recv(got, peer)
                dist.send(out, peer)
            wrong += int((got != peer * 1000 + i).sum())
        blocks.append((time.perf_counter() - t0) / job["calls"] * 1e6)
    dist.destroy_process_group()
    return {"blocks": blocks, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=16)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--slow-x", type=float, default=3.0)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"blocks": a.blocks, "calls": a.calls, "env": {}}
    slow_launches = 0
    extras = []
    wrong = 0
    for launch in range(a.launches):
        results, errors = launch_ranks(2, run_rank, job, 300, "first_calls")
        for e in errors:
            print(f"first_calls: {e}", file=sys.stderr)
        if errors or len(results) != 2:
            return 1
        wrong += sum(r["wrong"] for r in results.values())
        blocks = results[0]["blocks"]
        steady = statistics.median(blocks[-3:])
        slow = sum(1 for b in blocks if b > a.slow_x * steady)
        slow_launches += slow > 0
        extra = sum(max(0.0, b - steady) for b in blocks) * a.calls / 1000
        extras.append(extra)
        print(f"launch {launch:2d}: slow blocks {slow:2d}, {extra:5.1f} ms over steady | "
              + " ".join(f"{b:6.1f}" for b in blocks), flush=True)
    print(f"{slow_launches} of {a.launches} launches had a slow block; time over the steady "
          f"state per launch: mean {statistics.mean(extras):.1f} ms, max {max(extras):.1f} ms; "
          f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
