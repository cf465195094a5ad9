"""DistributedDataParallel on the backend under test against the same run on gloo.

Each rank starts from a different (rank-seeded) initialisation, so DDP's initial broadcast from
rank 0 matters; each rank trains on its own data for 5 SGD steps. The run on the backend under
test and the run on the gloo group must end with the same parameters, and every rank must hold
identical parameters.

Exactness: with 1 or 2 ranks a sum of gradients is order-independent (a + b == b + a), so the
parameters must be bitwise equal (torch.equal). With 3 or 4 ranks the two backends may add the
ranks' gradients in different orders (ring vs. tree), which changes float64 results in the last
bits; there we allow rtol=1e-12, atol=1e-14 (float64 eps is 2.2e-16: 5 steps of a few roundings).
Across ranks of one backend the parameters must be bitwise equal in every case.
"""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


pytestmark = pytest.mark.ucx

STEPS = 5


def _train(ctx, group, hook):
    torch.manual_seed(1000 + ctx.rank)  # different init per rank: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.0005)  # tiny buckets: several allreduces per step
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(state=group, hook=default_hooks.allreduce_hook)
    elif hook == "fp16_compress":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(state=group, hook=default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7 + ctx.rank)
    for _ in range(STEPS):
        x = torch.randn(12, 8, generator=g, dtype=torch.float64)
        y = torch.randn(12, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_vs_gloo(ctx, hook):
    mine = _train(ctx, None, hook)
    ref = _train(ctx, ctx.ref, hook)
    # identical on every rank (gathered over gloo)
    for name, params in (("backend under test", mine), ("gloo", ref)):
        flat = torch.cat([p.reshape(-1) for p in params])
        everyone = [torch.empty_like(flat) for _ in range(ctx.world)]
        dist.all_gather(everyone, flat, group=ctx.ref)
        for r in range(ctx.world):
            if not torch.equal(everyone[r], everyone[0]):
                raise AssertionError(f"{name}: parameters on rank {r} differ from rank 0's after {STEPS} steps")
    worst = 0.0
    for i, (a, b) in enumerate(zip(mine, ref)):
        if ctx.world <= 2:
            if not torch.equal(a, b):
                raise AssertionError(f"parameter {i}: not bitwise equal to gloo's; max abs diff "
                                     f"{(a - b).abs().max().item():.3g}")
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda m, i=i: f"parameter {i}: {m}")
        worst = max(worst, (a - b).abs().max().item())
    return worst


@pytest.mark.parametrize(
    "ws,hook",
    [(1, "none"), (2, "none"), (3, "none"), (4, "none"), (2, "allreduce"), (4, "allreduce"),
     # fp16 sums are order-dependent at float16 precision: only where the order cannot matter
     (2, "fp16_compress")],
    ids=lambda v: f"ws{v}" if isinstance(v, int) else v, scope="session")
def test_ddp_matches_gloo(ranks, ws, hook):
    ranks.run(_ddp_vs_gloo, hook, timeout=90)
