"""The PyTorch stack above DDP on the backend under test, each check against the same run on gloo
(``ctx.ref`` or a gloo mesh over the same ranks), at world size 4 on the pooled ranks (sparse
all_reduce at 1 and 3 as well):

* FSDP2 (``fully_shard``) training a small float64 model: losses and parameters equal to gloo's
  run within the tolerance DDP meets (test_ddp.py: rtol=1e-12, atol=1e-14; 4 ranks may add in a
  different order);
* a 2-D DeviceMesh (``init_device_mesh("cpu", (2, 2))``): collectives on each dimension's groups
  and DTensor redistribution (Shard to Replicate and back, Partial to Replicate), exact;
* torch.distributed.checkpoint: a sharded (FSDP2) state dict saved and loaded back, bitwise;
* the object collectives (all_gather_object, broadcast_object_list, scatter_object_list,
  gather_object) with objects of different sizes per rank;
* all_reduce of sparse COO tensors, bitwise equal to gloo's (both add the ranks' tensors in rank
  order), and DDP over ``nn.Embedding(sparse=True)``;
* what torch itself refuses a third-party backend (README "Above DDP"): its monitored_barrier
  wrapper accepts only gloo (the group's own method works), its DDP logger names the backend
  "custom".

Models are tiny and runs short: the whole file takes a few seconds on a pool that is already up.
"""
import os
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import expect_raises, health_check, mentions
from suite import BACKEND, worlds

pytestmark = pytest.mark.ucx

STEPS = 3
TIMEOUT = 90
RTOL, ATOL = 1e-12, 1e-14  # test_ddp.py's tolerance at 3-4 ranks (float64)


def _close(what, a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _exact(what, a, b):
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise AssertionError(f"{what}: got {a.dtype}{tuple(a.shape)} {a.reshape(-1)[:8].tolist()}, "
                             f"want {b.dtype}{tuple(b.shape)} {b.reshape(-1)[:8].tolist()}")


def _meshes(ctx):
    """1-D meshes over the default group (backend under test) and the gloo group, and 2-D (2, 2)
    meshes on each backend; made once per pooled process (every rank makes them in one order)."""
    if "stack_meshes" not in ctx.cache:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        names = ("dp", "tp")
        ctx.cache["stack_meshes"] = {
            "mine": init_device_mesh("cpu", (ctx.world,)),
            "gloo": DeviceMesh.from_group(ctx.ref, "cpu"),
            "mine2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=names),
            "gloo2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=names,
                                       backend_override={"dp": "gloo", "tp": "gloo"}),
        }
    return ctx.cache["stack_meshes"]


# --- FSDP2 ------------------------------------------------------------------------------------
def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()


def _sharded(mesh, seed):
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)  # FSDP2 does not broadcast: the same seed on every rank
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp_train(ctx, mesh):
    model = _sharded(mesh, 1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7 + ctx.rank)  # each rank its own data
    losses = []
    for _ in range(STEPS):
        x = torch.randn(6, 8, generator=g, dtype=torch.float64)
        y = torch.randn(6, 4, generator=g, dtype=torch.float64)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return model, torch.stack(losses)


def _fsdp_vs_gloo(ctx):
    m = _meshes(ctx)
    mine, mine_losses = _fsdp_train(ctx, m["mine"])
    ref, ref_losses = _fsdp_train(ctx, m["gloo"])
    _close(f"rank {ctx.rank}: losses of {STEPS} steps", mine_losses, ref_losses)
    worst = (mine_losses - ref_losses).abs().max().item()
    for (name, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        if a.to_local().numel() == 0 and b.to_local().numel() == 0:
            continue
        _close(f"rank {ctx.rank}: shard of {name}", a.to_local(), b.to_local())
        full = a.full_tensor()  # all-gathered over the backend under test
        _close(f"full {name}", full, b.full_tensor())
        worst = max(worst, (a.to_local() - b.to_local()).abs().max().item())
    return worst


@worlds(4)
def test_fsdp2_matches_gloo(ranks, ws):
    ranks.run(_fsdp_vs_gloo, timeout=TIMEOUT)


# --- 2-D DeviceMesh and DTensor ---------------------------------------------------------------
def _mesh2d_checks(ctx, mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    out = {}
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        out[f"{dim} backend"] = dist.get_backend(group)
        out[f"{dim} ranks"] = dist.get_process_group_ranks(group)
        x = torch.full((5,), float(ctx.rank + 1))
        dist.all_reduce(x, group=group)
        out[f"{dim} all_reduce"] = x
        parts = [torch.empty(3) for _ in range(group.size())]
        dist.all_gather(parts, torch.arange(3.0) + 10 * ctx.rank, group=group)
        out[f"{dim} all_gather"] = torch.stack(parts)
        b = torch.arange(4.0) * (ctx.rank + 1)
        dist.broadcast(b, group=group, group_src=1)
        out[f"{dim} broadcast"] = b
    full = torch.arange(48, dtype=torch.float64).reshape(8, 6)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    out["shard local"] = d.to_local().clone()
    rep = d.redistribute(mesh, [Replicate(), Replicate()])
    out["replicated"] = rep.to_local().clone()
    back = rep.redistribute(mesh, [Shard(0), Shard(1)])
    out["sharded again"] = back.to_local().clone()
    row = rep.redistribute(mesh, [Shard(0), Replicate()])  # Shard on dp only
    out["row shard"] = row.to_local().clone()
    part = DTensor.from_local(torch.full((2, 3), float(ctx.rank + 1), dtype=torch.float64), mesh,
                              [Partial(), Partial()])
    out["partial summed"] = part.redistribute(mesh, [Replicate(), Replicate()]).to_local().clone()
    out["full_tensor"] = d.full_tensor()
    return out, full


def _mesh2d_vs_gloo(ctx):
    m = _meshes(ctx)
    mine, full = _mesh2d_checks(ctx, m["mine2d"])
    ref, _ = _mesh2d_checks(ctx, m["gloo2d"])
    problems = []
    for k in ("dp backend", "tp backend"):
        if mine[k] != BACKEND or ref[k] != "gloo":
            problems.append(f"{k}: the mesh's group runs on {mine[k]!r} (gloo mesh: {ref[k]!r})")
    for k, v in mine.items():
        if isinstance(v, torch.Tensor):
            try:
                _exact(k, v, ref[k])
            except AssertionError as e:
                problems.append(str(e))
        elif "backend" not in k and v != ref[k]:
            problems.append(f"{k}: {v} (gloo: {ref[k]})")
    # what the redistributions must give, whatever the backend
    for k, want in (("replicated", full), ("full_tensor", full), ("sharded again", mine["shard local"]),
                    ("partial summed", torch.full((2, 3), 10.0, dtype=torch.float64))):
        try:
            _exact(k, mine[k], want)
        except AssertionError as e:
            problems.append(str(e))
    if problems:
        raise AssertionError(f"rank {ctx.rank}: " + "; ".join(problems))
    return mine["dp ranks"], mine["tp ranks"]


@worlds(4)
def test_device_mesh_2d_and_dtensor_match_gloo(ranks, ws):
    groups = ranks.run(_mesh2d_vs_gloo, timeout=TIMEOUT)
    # the (2, 2) mesh [[0, 1], [2, 3]]: dp pairs a column, tp a row
    assert [g[0] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]], groups
    assert [g[1] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]], groups


# --- torch.distributed.checkpoint -------------------------------------------------------------
def _locals(model):
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _checkpoint_round_trip(ctx, name):
    import torch.distributed.checkpoint as dcp

    m = _meshes(ctx)
    base = os.path.join(ctx.dir, name)
    if ctx.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier(group=ctx.ref)
    saved = {}
    for key, mesh, group in (("mine", m["mine"], None), ("gloo", m["gloo"], ctx.ref)):
        model, _ = _fsdp_train(ctx, mesh)
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(base, key), process_group=group)
        saved[key] = _locals(model)
    problems = []
    # Each checkpoint loaded, through the group under test, into a model initialised differently.
    for key in ("mine", "gloo"):
        fresh = _sharded(m["mine"], 99)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(base, key))
        fresh.load_state_dict(sd)
        for k, v in _locals(fresh).items():
            try:
                _exact(f"{key}'s checkpoint, {k}", v, saved[key][k])
            except AssertionError as e:
                problems.append(str(e))
    dist.barrier(group=ctx.ref)
    if ctx.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    if problems:
        raise AssertionError(f"rank {ctx.rank}: " + "; ".join(problems))
    return sorted(saved["mine"])


@worlds(4)
def test_distributed_checkpoint_round_trip(ranks, ws):
    keys = ranks.run(_checkpoint_round_trip, "dcp", timeout=TIMEOUT)
    assert keys[0] == ["0.bias", "0.weight", "2.bias", "2.weight"], keys[0]


# --- object collectives -----------------------------------------------------------------------
def _obj(rank):
    return {"rank": rank, "text": "x" * (5 + 300 * rank), "t": torch.arange(rank + 1.0)}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and a["rank"] == b["rank"] and a["text"] == b["text"] and \
        torch.equal(a["t"], b["t"])


def _object_collectives(ctx, group):
    out = {}
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, _obj(ctx.rank), group=group)
    out["all_gather_object"] = gathered
    for src in (0, ctx.world - 1):
        objs = [_obj(src), "second"] if ctx.rank == src else [None, None]
        dist.broadcast_object_list(objs, src=src, group=group)
        out[f"broadcast_object_list from {src}"] = objs
        got = [None]
        dist.scatter_object_list(got, [_obj(10 + r) for r in range(ctx.world)] if ctx.rank == src else None,
                                 src=src, group=group)
        out[f"scatter_object_list from {src}"] = got[0]
        into = [None] * ctx.world if ctx.rank == src else None
        dist.gather_object(_obj(20 + ctx.rank), into, dst=src, group=group)
        out[f"gather_object to {src}"] = into
    return out


def _objects_vs_gloo(ctx):
    mine = _object_collectives(ctx, None)
    ref = _object_collectives(ctx, ctx.ref)
    want = {"all_gather_object": [_obj(r) for r in range(ctx.world)]}
    for src in (0, ctx.world - 1):
        want[f"broadcast_object_list from {src}"] = [_obj(src), "second"]
        want[f"scatter_object_list from {src}"] = _obj(10 + ctx.rank)
        want[f"gather_object to {src}"] = [_obj(20 + r) for r in range(ctx.world)] if ctx.rank == src else None

    def same(a, b):
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return _same(a, b)
        return a == b

    bad = [f"{k}: got {mine[k]!r:.200}" + (" (gloo agrees)" if same(ref[k], mine[k]) else "")
           for k in want if not same(mine[k], want[k])]
    bad += [f"gloo's {k} differs from the expectation" for k in want if not same(ref[k], want[k])]
    if bad:
        raise AssertionError(f"rank {ctx.rank}: " + "; ".join(bad))


@worlds(4)
def test_object_collectives_match_gloo(ranks, ws):
    ranks.run(_objects_vs_gloo, timeout=TIMEOUT)


# --- sparse all_reduce ------------------------------------------------------------------------
SPARSE_CASES = {  # name: (sizes, sparse_dim, dtype)
    "vector": ((50,), 1, torch.float64),
    "rows": ((12, 3), 1, torch.float32),  # dense values per index (an embedding's gradient)
    "matrix": ((6, 5), 2, torch.float64),
    "int64": ((9, 2), 1, torch.int64),
    "empty": ((7, 2), 1, torch.float64),  # no rank has a nonzero
}


def _sparse_input(rank, case):
    sizes, sdim, dtype = SPARSE_CASES[case]
    g = torch.Generator().manual_seed(100 * rank + len(case))
    nnz = 0 if rank == 1 or case == "empty" else 3 + 2 * rank  # rank 1 contributes nothing
    idx = torch.stack([torch.randint(0, sizes[d], (nnz,), generator=g) for d in range(sdim)])
    if nnz:
        idx[:, -1] = idx[:, 0]  # a duplicate index: an uncoalesced input
    vals = torch.randn((nnz,) + sizes[sdim:], generator=g, dtype=torch.float64)
    vals = (vals * 10).round().to(dtype) if not dtype.is_floating_point else vals.to(dtype)
    return torch.sparse_coo_tensor(idx, vals, sizes, check_invariants=True)


def _sparse_allreduce(ctx):
    out = {}
    for case in SPARSE_CASES:
        want = sum(_sparse_input(r, case).to_dense() for r in range(ctx.world))
        x = _sparse_input(ctx.rank, case)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        y = _sparse_input(ctx.rank, case)
        dist.all_reduce(y, group=ctx.ref)
        if not (x.is_sparse and x.is_coalesced()):
            raise AssertionError(f"{case}: the result is not a coalesced sparse tensor ({x.layout})")
        _exact(f"{case}: indices vs gloo's", x._indices(), y._indices())
        _exact(f"{case}: values vs gloo's", x._values(), y._values())
        _close(f"{case}: sum", x.to_dense(), want)
        res = work.get_future().value()  # what DDP's reducer reads
        if len(res) != 1 or not res[0].is_sparse or not torch.equal(res[0].to_dense(), x.to_dense()):
            raise AssertionError(f"{case}: the Work's future does not hold the reduced tensor: {res}")
        out[case] = x._nnz()
    return out


@worlds(1, 3, 4)  # 3: allgatherv off the power-of-two paths
def test_sparse_all_reduce_matches_gloo(ranks, ws):
    nnz = ranks.run(_sparse_allreduce, timeout=TIMEOUT)
    assert all(n == nnz[0] for n in nnz), nnz
    assert nnz[0].pop("empty") == 0 and all(v > 0 for v in nnz[0].values()), nnz[0]


def _sparse_refusals(ctx):
    x = _sparse_input(ctx.rank, "vector")
    out = {
        "max": expect_raises(lambda: dist.all_reduce(x, op=dist.ReduceOp.MAX)),
        "broadcast": expect_raises(lambda: dist.broadcast(x, src=0)),
        "all_gather": expect_raises(lambda: dist.all_gather([torch.empty(50, dtype=x.dtype)] * ctx.world, x)),
    }
    # sizes that differ between ranks: every rank fails, naming rank 1 and both sizes
    y = torch.sparse_coo_tensor(torch.zeros((1, 1), dtype=torch.long), torch.ones(1),
                                (10,) if ctx.rank == 0 else (12,), check_invariants=True)
    out["sizes"] = expect_raises(lambda: dist.all_reduce(y))
    z = torch.sparse_coo_tensor(torch.zeros((1, 1), dtype=torch.long),
                                torch.ones(1, 4) if ctx.rank != 2 else torch.ones(1),
                                (3, 4) if ctx.rank != 2 else (12,), check_invariants=True)
    out["dims"] = expect_raises(lambda: dist.all_reduce(z))
    health_check(ctx)
    return out


@pytest.mark.ucx_semantics
@worlds(4)
def test_sparse_refusals_name_the_op(ranks, ws):
    for rank, out in enumerate(ranks.run(_sparse_refusals, timeout=TIMEOUT)):
        for key, words in (("max", ("allreduce", "sparse", "SUM")), ("broadcast", ("broadcast", "sparse")),
                           ("all_gather", ("allgather", "sparse")),
                           ("sizes", ("allreduce", "rank 1", "sizes [12]", "rank 0 [10]")),
                           ("dims", ("allreduce", "rank 2", "1-dimensional"))):
            r = out[key]
            assert r["raised"] and r["runtime_or_value"], f"rank {rank}, {key}: {r}"
            assert mentions(r["msg"], *words), f"rank {rank}, {key}: {r['msg']}"


# --- DDP with sparse gradients ----------------------------------------------------------------
class _Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30, 4, sparse=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, idx):
        return self.head(self.emb(idx))


def _ddp_sparse_train(ctx, group):
    torch.manual_seed(500 + ctx.rank)  # DDP broadcasts rank 0's initialisation
    model = _Embedder().double()
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(40 + ctx.rank)
    for _ in range(STEPS):
        idx = torch.randint(0, 30, (8,), generator=g)
        y = torch.randn(8, 2, generator=g, dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(idx), y).backward()
        if not model.emb.weight.grad.is_sparse:
            raise AssertionError("the embedding's gradient is not sparse: the test would prove nothing")
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_sparse_vs_gloo(ctx):
    mine = _ddp_sparse_train(ctx, None)
    ref = _ddp_sparse_train(ctx, ctx.ref)
    flat = torch.cat([p.reshape(-1) for p in mine])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world)]
    dist.all_gather(everyone, flat, group=ctx.ref)
    for r in range(ctx.world):
        _exact(f"parameters on rank {r} vs rank 0's", everyone[r], everyone[0])
    for i, (a, b) in enumerate(zip(mine, ref)):
        if i == 0:  # the embedding: sparse sums in rank order on both backends
            _exact("embedding weight vs gloo's", a, b)
        else:
            _close(f"parameter {i}", a, b)


@worlds(4)
def test_ddp_sparse_embedding_matches_gloo(ranks, ws):
    ranks.run(_ddp_sparse_vs_gloo, timeout=TIMEOUT)


# --- what torch refuses a third-party backend -------------------------------------------------
def _torch_refusals(ctx):
    out = {"wrapper": expect_raises(lambda: dist.monitored_barrier(timeout=timedelta(seconds=30)))}
    # The group's own method (the path torch's wrapper takes for gloo) works.
    dist.distributed_c10d._get_default_group().monitored_barrier(timedelta(seconds=30))
    ddp = DDP(torch.nn.Linear(2, 2))
    out["ddp backend_name"] = ddp._get_ddp_logging_data().get("backend_name")
    return out


@pytest.mark.ucx_semantics
@worlds(4)
def test_torch_refusals_are_clear(ranks, ws):
    for rank, out in enumerate(ranks.run(_torch_refusals, timeout=TIMEOUT)):
        r = out["wrapper"]
        assert r["raised"] and r["type"] == "ValueError", f"rank {rank}: {r}"
        assert mentions(r["msg"], "monitored_barrier", "GLOO"), f"rank {rank}: {r['msg']}"
        # torch's DDP logger knows the backends it ships; every other one is "custom" (README)
        assert out["ddp backend_name"] == "custom", f"rank {rank}: {out['ddp backend_name']!r}"

