#!/usr/bin/env python3
"""A loop of one torch-level call on a group of one rank, for counting the instructions a call
costs (callgrind) or profiling it (perf): 2,000 warm-up calls, then --calls timed ones.

    PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 UCX_MEM_EVENTS=no valgrind --tool=callgrind \\
        .venv/bin/python bench/experiments/layer_loop.py --backend ucx --op allreduce --calls N

Instructions per call: the difference of the totals of two runs (N = 12000 and 2000) over 10000,
so that start-up cancels out. OPENBLAS_NUM_THREADS=1: OpenBLAS's idle thread otherwise spins a
timing-dependent number of instructions into the count. Another build of the package is measured
with PYTHONPATH pointing at it (pip install --no-deps --target DIR .). --backend noop is torch's
own cost (bench/suites/coll.py). --op p2p: an irecv and an isend of the rank to itself, both
waited; --op p2p-sent-first: the isend first, so that the irecv finds its message there (as in a
halo exchange whose neighbours sent first); --op allreduce-async: all_reduce(async_op=True), then
its wait() (DDP's pattern, with nothing between). Prints the µs per call (meaningless under valgrind).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import one_rank_groups  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("ucx", "noop"), default="ucx")
    p.add_argument("--op", choices=("allreduce", "allreduce-async", "broadcast", "barrier", "p2p",
                             "p2p-sent-first"),
                    default="allreduce")
    p.add_argument("--calls", type=int, default=20000)
    a = p.parse_args(argv)
    g = one_rank_groups()[a.backend]
    import torch
    import torch.distributed as dist
    t, u = torch.zeros(2), torch.zeros(2)

    def p2p():  # to itself: irecv, isend, both waited
        r = dist.irecv(u, 0, group=g)
        dist.isend(t, 0, group=g).wait()
        r.wait()

    def p2p_sent_first():  # to itself: isend, then irecv of the message already there
        s = dist.isend(t, 0, group=g)
        dist.irecv(u, 0, group=g).wait()
        s.wait()

    call = {"allreduce": lambda: dist.all_reduce(t, group=g),
            "allreduce-async": lambda: dist.all_reduce(t, group=g, async_op=True).wait(),
            "broadcast": lambda: dist.broadcast(t, 0, group=g),
            "barrier": lambda: dist.barrier(group=g), "p2p": p2p,
            "p2p-sent-first": p2p_sent_first}[a.op]
    for _ in range(2000):
        call()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        call()
    print(f"{a.backend} {a.op}: {(time.perf_counter() - t0) / a.calls * 1e6:.2f} us per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
