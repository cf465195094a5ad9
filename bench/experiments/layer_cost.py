#!/usr/bin/env python3
"""What the torch layer of "ucx" costs per call beyond torch's own: one process, a group of one
rank (the collective itself returns at once), "ucx" and the no-op reference backend interleaved.

    .venv/bin/python bench/experiments/layer_cost.py [--calls 20000] [--rounds 5]

Prints, per call kind, the median over rounds of each backend's µs per call and ucx−noop: the
backend's bookkeeping (Task, Work, future, flight recorder, validation), without any peer or
transport in the way, so the figure moves little between runs (the two-rank suite's ucx−noop
swings by microseconds with the VM's placement). The calls are blocking all_reduce, all_gather
(list), all_gather_into_tensor, all_to_all_single, broadcast and barrier of 2 float32 elements,
and all_reduce(async_op=True).wait().
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import one_rank_groups  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000, help="timed calls per round and kind")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    groups = one_rank_groups()
    import torch
    import torch.distributed as dist
    t = torch.zeros(2)
    outs, flat = [torch.empty(2)], torch.empty(2)
    kinds = {
        "all_reduce": lambda g: dist.all_reduce(t, group=g),
        "all_gather (list)": lambda g: dist.all_gather(outs, t, group=g),
        "all_gather_into_tensor": lambda g: dist.all_gather_into_tensor(flat, t, group=g),
        "all_to_all_single": lambda g: dist.all_to_all_single(flat, t, group=g),
        "broadcast": lambda g: dist.broadcast(t, 0, group=g),
        "barrier": lambda g: dist.barrier(group=g),
        "all_reduce async+wait": lambda g: dist.all_reduce(t, group=g, async_op=True).wait(),
    }
    times = {}
    for _ in range(args.rounds):
        for kind, call in kinds.items():
            for name, g in groups.items():
                for _ in range(args.calls // 10):
                    call(g)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call(g)
                times.setdefault((kind, name), []).append((time.perf_counter() - t0) / args.calls * 1e6)
    dist.destroy_process_group()
    print(f"one rank, median of {args.rounds} rounds of {args.calls} calls, µs per call")
    print("| call | ucx | noop | ucx−noop |")
    print("|---|---:|---:|---:|")
    for kind in kinds:
        u, n = statistics.median(times[(kind, "ucx")]), statistics.median(times[(kind, "noop")])
        print(f"| {kind} | {u:.2f} | {n:.2f} | {u - n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
