"""Launched by test_multinode.py on each of two "hosts" (network namespaces) as
`torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --max-restarts=1 multinode_ddp.py OUT`.

A DDP training of a small float64 model on the "ucx" backend, every rank on its own shard of one
fixed data set; the final parameters of every rank go to OUT/params-rank<R>.pt, where the test
compares them with a single-process training on the whole data set.

Elastic restart: the first incarnation of global rank KILL_RANK kills itself with SIGKILL after
the first training step (OUT/killed marks that it happened); torchrun must restart the workers of
both hosts and the second round trains from scratch. OUT/attempts.log records each start per rank
with its TORCHELASTIC_RESTART_COUNT (which torch raises only on the node whose workers failed
before it saw the other node re-join). MULTINODE_BACKEND=gloo runs the same job on gloo.
"""
import faulthandler
import os
import signal
import sys

faulthandler.dump_traceback_later(float(os.environ.get("MULTINODE_WATCHDOG_S", "120")), exit=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

STEPS, BATCH, KILL_RANK = 4, 16, 3


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def data():
    g = torch.Generator().manual_seed(99)
    x = torch.randn(STEPS, BATCH, 8, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).sin()


def train(m, world, rank, on_step=None):
    """SGD on the mean squared error; rank `rank` of `world` takes its slice of every batch."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    xs, ys = data()
    per = BATCH // world
    for step in range(STEPS):
        x, y = xs[step, rank * per:(rank + 1) * per], ys[step, rank * per:(rank + 1) * per]
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        if on_step is not None:
            on_step(step)
    return m


def main(out):
    from commux import preferred_backend

    torch.set_num_threads(1)
    backend = os.environ.get("MULTINODE_BACKEND") or preferred_backend()
    dist.init_process_group(backend=backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(out, "attempts.log"), "a") as f:
        f.write(f"attempt {attempt} rank {rank} world {world} backend {dist.get_backend()} "
                f"node {os.environ.get('GROUP_RANK')}\n")

    def maybe_die(step):
        if rank != KILL_RANK or step != 0:
            return
        try:  # once per job: the first incarnation of KILL_RANK only
            os.close(os.open(os.path.join(out, "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        with open(os.path.join(out, "attempts.log"), "a") as f:
            f.write(f"attempt {attempt} rank {rank} kills itself\n")
        os.kill(os.getpid(), signal.SIGKILL)

    m = train(DDP(model()), world, rank, maybe_die).module
    torch.save({k: v.detach().clone() for k, v in m.state_dict().items()},
               os.path.join(out, f"params-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
