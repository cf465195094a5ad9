"""Launched by test_launch.py as `python -m torch.distributed.run --nproc-per-node=4 torchrun_smoke.py`.

The portable pattern users write: prefer commux's backend, fall back to gloo only when commux is not
installed. init_method env:// (torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE). Does an
all_reduce and a tagged p2p ring (receives posted before sends, two tags, out of order), checks
both, prints one line per rank, exits 0.

COMMUX_SMOKE_BACKEND=gloo forces gloo (the test suite's gloo development mode).
"""
import faulthandler
import os
import sys

faulthandler.dump_traceback_later(float(os.environ.get("COMMUX_SMOKE_WATCHDOG_S", "90")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ.get("COMMUX_SMOKE_BACKEND") == "gloo":
    backend = "gloo"
else:
    try:
        from commux import preferred_backend

        backend = preferred_backend()
    except ImportError:
        backend = "gloo"

dist.init_process_group(backend=backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == int(os.environ["WORLD_SIZE"]), (world, os.environ["WORLD_SIZE"])

x = torch.full((1001,), float(rank + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((1001,), float(world * (world + 1) // 2))), x[:4]

right, left = (rank + 1) % world, (rank - 1) % world
a, b = torch.zeros(100), torch.zeros(70_000)
reqs = [dist.irecv(b, src=left, tag=200), dist.irecv(a, src=left, tag=100)]  # opposite to the send order
reqs += [dist.isend(torch.full((100,), float(rank)), dst=right, tag=100),
         dist.isend(torch.full((70_000,), float(rank) + 0.5), dst=right, tag=200)]
for r in reqs:
    r.wait()
assert torch.equal(a, torch.full((100,), float(left))), a[:4]
assert torch.equal(b, torch.full((70_000,), float(left) + 0.5)), b[:4]

dist.barrier()
print(f"SMOKE rank={rank} world={world} backend={dist.get_backend()} allreduce=ok ring=ok", flush=True)
dist.destroy_process_group()
faulthandler.cancel_dump_traceback_later()
sys.exit(0)
