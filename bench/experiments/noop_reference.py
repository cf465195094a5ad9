#!/usr/bin/env python3
"""Which no-op backend measures torch's own cost per call: the reference of bench/coll_bench.py.

    PYTHONPATH=<commux package> .venv/bin/python bench/experiments/noop_reference.py [--rounds 5]

One process (world size 1, WORLD on gloo), three groups that communicate nothing, each registered
through torch.distributed.Backend.register_backend with a creator:
  noop    commux._C._NoopBackend (src/c10d/noop_backend.hpp), C++, touches no tensor
  fake    torch's FakeProcessGroup (C++); from torch 2.13 on it copies input to output in
          allgather, reduce_scatter and alltoall
  python  a torch.distributed.ProcessGroup subclass in Python returning a completed Work
allreduce and all_gather_into_tensor at 8 B and 64 MiB, the groups interleaved per round; prints
the median over rounds of the time per call. The suite takes noop: fake's time grows with the
size (a 64 MiB copy) and python's adds a Python call that "ucx" does not make. Nothing is checked:
none of them computes anything.

--async8 measures instead what torch itself adds to an async call: 8 all_reduces of 64 KiB issued
with async_op=True and then waited, against 8 blocking ones, per group (async_overlap.py's and
schedule_ab.py's async8 pattern); prints µs per 8 calls, median over rounds.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.experiments.async_overlap import all_reduces  # noqa: E402
from bench.lib.launch import free_port  # noqa: E402


def python_backend():
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future

    class PythonNoop(dist.ProcessGroup):
        def _done(self):
            f = torch.futures.Future()
            f.set_result(None)
            return _create_work_from_future(f)

        def allreduce(self, tensors, opts=None):
            return self._done()

        def _allgather_base(self, out, inp, opts=None):
            return self._done()

        all_gather_single = _allgather_base  # torch >= 2.13's name

        def getBackendName(self):
            return "python"

    return lambda o, b=None: PythonNoop(o.group_rank, o.group_size)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--async8", action="store_true",
                   help="8 async all_reduces then waited against 8 blocking ones")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from commux import _C

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    dist.Backend.register_backend(
        "noop", lambda o, b=None: _C._NoopBackend(o.group_rank, o.group_size),
        extended_api=True, devices=["cpu"])
    dist.Backend.register_backend("python", python_backend(), extended_api=True, devices=["cpu"])
    dist.init_process_group("gloo")
    names = ["noop", "fake", "python"]
    groups = {b: dist.new_group(backend=b) for b in names}
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if args.async8:
        async8(dist, groups, names, args.rounds)
        dist.destroy_process_group()
        return 0
    print(f"torch {torch.__version__}; us per call, median of {args.rounds} rounds")
    for nbytes in (8, 64 << 20):
        i, o = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        iters = 2000 if nbytes < 4096 else 20
        for op in ("allreduce", "allgather"):
            times = {b: [] for b in names}
            for r in range(args.rounds):
                for b in names if r % 2 == 0 else names[::-1]:
                    g = groups[b]
                    run = ((lambda g=g: dist.all_reduce(i, group=g)) if op == "allreduce" else
                           (lambda g=g: gather(o, i, group=g)))
                    for _ in range(5):
                        run()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        run()
                    times[b].append((time.perf_counter() - t0) / iters * 1e6)
            cells = ", ".join(f"{b} {statistics.median(t):.2f}" for b, t in times.items())
            print(f"{op:9} {nbytes:>9} B: {cells}")
    dist.destroy_process_group()
    return 0


def async8(dist, groups, names, rounds, iters=200):
    """Prints µs per 8 all_reduces of 64 KiB, blocking and issued async then waited."""
    import torch
    xs = [torch.ones(16384) for _ in range(8)]
    print(f"torch {torch.__version__}; us per 8 all_reduces of 64 KiB, median of {rounds} rounds")
    for b in names:
        g = groups[b]
        times = {"blocking": [], "async8": []}
        for r in range(rounds):
            for mode in times if r % 2 == 0 else list(times)[::-1]:
                t0 = time.perf_counter()
                for _ in range(iters):
                    all_reduces(dist, xs, g, mode)
                times[mode].append((time.perf_counter() - t0) / iters * 1e6)
        blocking, asynced = (statistics.median(times[m]) for m in ("blocking", "async8"))
        print(f"{b:7} blocking {blocking:.2f}, async8 {asynced:.2f} ({asynced / blocking:.3f})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
