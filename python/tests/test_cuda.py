"""CUDA tensors end to end: tagged point-to-point, any-source, mixed CPU/CUDA pairs, stream
ordering, and every collective with its reductions on the device.

Every rank uses ``cuda:(rank % device_count)``, so two ranks share the one GPU of a single-GPU
machine (UCX then moves the data with cuda_ipc). Without a GPU these tests are skipped; the
device-validation test at the end runs everywhere (it uses torch's "meta" device, which commux
must refuse clearly).

Stream ordering is checked with ``torch.cuda._sleep``: a long kernel queued on the current stream
delays the write that produces (or the write that must precede) the data. Without the fence commux
records before posting, UCX would read the buffer before the write and the check would fail.
"""
import pytest
import torch
import torch.distributed as dist

from helpers import expect_raises, mentions
from suite import worlds

HAVE_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)")

pytestmark = pytest.mark.ucx

SLEEP_CYCLES = 200_000_000  # ~0.1 s on a ~2 GHz GPU: far longer than UCX needs to move the data
COUNTS = [0, 1, 1001, 1 << 20, (1 << 22) + 3]  # up to 16 MiB of float32: rendezvous, pipelining


def dev(ctx, where: str = "cuda") -> torch.device:
    if where == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", ctx.rank % torch.cuda.device_count())


def value(rank: int, count: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """A deterministic CPU tensor per (rank, salt); small integers, exact in every dtype."""
    i = torch.arange(count, dtype=torch.int64)
    v = (i * 7 + rank * 13 + salt * 5) % 11 - 5
    if dtype == torch.bool:
        return v > 0
    if dtype == torch.uint8:
        v = v + 5
    return v.to(dtype)


# ---------------------------------------------------------------------------------------------
# Point-to-point

def _tags_out_of_order(ctx, count):
    d = dev(ctx)
    tags = [7, 3, 11, 5]
    if ctx.rank == 0:
        works = [dist.isend(value(0, count, salt=t).to(d), dst=1, tag=t) for t in reversed(tags)]
        for w in works:
            w.wait()
    elif ctx.rank == 1:
        outs = {t: torch.full((count,), -99.0, device=d) for t in tags}
        works = [(t, dist.irecv(outs[t], src=0, tag=t)) for t in tags]  # the other order
        for _, w in works:
            w.wait()
        for t in tags:
            assert torch.equal(outs[t].cpu(), value(0, count, salt=t)), f"tag {t}, count {count}"
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("count", COUNTS)
def test_tagged_p2p_matches_exactly_on_cuda(ranks, count):
    assert all(ranks.run(_tags_out_of_order, count))


def _any_source(ctx):
    d = dev(ctx)
    if ctx.rank == 0:
        seen = set()
        for _ in range(ctx.world - 1):
            out = torch.zeros(1000, device=d)
            src = dist.recv(out, tag=42)  # recvAnysource: the real sender is reported
            assert torch.equal(out.cpu(), value(src, 1000, salt=42)), f"from {src}"
            seen.add(src)
        assert seen == set(range(1, ctx.world)), seen
    else:
        dist.send(value(ctx.rank, 1000, salt=42).to(d), dst=0, tag=42)
    return True


@needs_cuda
@worlds(2, 3)
def test_any_source_reports_the_sender_on_cuda(ranks):
    assert all(ranks.run(_any_source))


def _mixed(ctx, count):
    """CPU send -> CUDA receive and CUDA send -> CPU receive, in one group."""
    d = dev(ctx)
    if ctx.rank == 0:
        dist.send(value(0, count, salt=1), dst=1, tag=1)  # from host memory
        back = torch.full((count,), -1.0)  # into host memory
        dist.recv(back, src=1, tag=2)
        assert torch.equal(back, value(1, count, salt=2))
    elif ctx.rank == 1:
        got = torch.full((count,), -1.0, device=d)
        dist.recv(got, src=0, tag=1)
        assert torch.equal(got.cpu(), value(0, count, salt=1))
        dist.send(value(1, count, salt=2).to(d), dst=0, tag=2)
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("count", [1, 1 << 20])
def test_cpu_send_meets_cuda_recv(ranks, count):
    assert all(ranks.run(_mixed, count))


def _send_after_queued_write(ctx, count):
    """The sender's fill is queued behind a long kernel; send() must carry the filled values."""
    d = dev(ctx)
    if ctx.rank == 0:
        t = torch.zeros(count, device=d)
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(42.0)  # queued, not yet run when send() is called
        dist.send(t, dst=1, tag=9)
    elif ctx.rank == 1:
        out = torch.zeros(count, device=d)
        dist.recv(out, src=0, tag=9)
        got = out.cpu()
        assert bool((got == 42.0).all()), f"received {got[:4].tolist()}...: the send did not wait for the stream"
    return True


def _recv_after_queued_write(ctx, count):
    """The receiver's buffer has a queued write (fill -1) behind a long kernel when irecv() is
    called: the received data must land after it, and be what the current stream sees after wait()."""
    d = dev(ctx)
    if ctx.rank == 0:
        dist.send(torch.full((count,), 5.0, device=d), dst=1, tag=10)
    elif ctx.rank == 1:
        out = torch.zeros(count, device=d)
        torch.cuda._sleep(SLEEP_CYCLES)
        out.fill_(-1.0)
        w = dist.irecv(out, src=0, tag=10)
        w.wait()
        ok = (out == 5.0).all()  # on the current stream, right after wait()
        assert bool(ok.item()), f"got {out[:4].tolist()}...: the queued fill overwrote the data"
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("count", [1000, 1 << 22])
def test_stream_ordering_of_p2p(ranks, count):
    assert all(ranks.run(_send_after_queued_write, count))
    assert all(ranks.run(_recv_after_queued_write, count))


def _p2p_returns_while_the_stream_is_busy(ctx, count):
    """isend / irecv of a CUDA tensor whose stream is still busy return at once (the stream is
    still running when they return), the post waits for the stream in commux's progress path, and
    call order is kept: a CPU send of the same tag after it arrives after it; another tag's is not
    held up."""
    d = dev(ctx)
    if ctx.rank == 0:
        t = torch.zeros(count, device=d)
        torch.cuda._sleep(4 * SLEEP_CYCLES)
        t.fill_(42.0)  # queued behind the kernel
        w1 = dist.isend(t, dst=1, tag=11)
        busy = not torch.cuda.current_stream(d).query()
        w2 = dist.isend(torch.full((count,), 7.0), dst=1, tag=11)  # must arrive second
        w3 = dist.isend(torch.full((3,), 3.0), dst=1, tag=12)
        assert busy, "isend of a CUDA tensor waited for its stream before returning"
        for w in (w3, w2, w1):
            w.wait()
    elif ctx.rank == 1:
        other = torch.zeros(3)
        dist.recv(other, src=0, tag=12)
        assert bool((other == 3.0).all())
        out = torch.zeros(count, device=d)
        torch.cuda._sleep(4 * SLEEP_CYCLES)
        out.fill_(-1.0)
        w = dist.irecv(out, src=0, tag=11)
        busy = not torch.cuda.current_stream(d).query()
        second = torch.zeros(count)
        dist.recv(second, src=0, tag=11)
        w.wait()
        assert busy, "irecv of a CUDA tensor waited for its stream before returning"
        got = out.cpu()
        assert bool((got == 42.0).all()), f"first tag-11 message: {got[:4].tolist()}..."
        assert bool((second == 7.0).all()), f"second tag-11 message: {second[:4].tolist()}..."
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("count", [1000, 1 << 22])
def test_p2p_of_a_busy_stream_returns_at_once_in_call_order(ranks, count):
    assert all(ranks.run(_p2p_returns_while_the_stream_is_busy, count))


# ---------------------------------------------------------------------------------------------
# Collectives

REDUCTIONS = [
    ("SUM", torch.float32), ("SUM", torch.float16), ("SUM", torch.bfloat16), ("SUM", torch.int64),
    ("SUM", torch.bool), ("PRODUCT", torch.int32), ("MIN", torch.float32), ("MAX", torch.int8),
    ("BAND", torch.int32), ("BOR", torch.uint8), ("BXOR", torch.int64), ("AVG", torch.float32),
    ("PREMUL_SUM", torch.float64),
]


def expected(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    acc = inputs[0].clone()
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        acc = inputs[0].to(torch.float64) if acc.is_floating_point() else acc
        for x in inputs[1:]:
            acc = acc | x if acc.dtype == torch.bool else acc + x
        if op == "PREMUL_SUM":
            acc = acc * 0.5
        if op == "AVG":
            acc = acc / len(inputs)
        return acc.to(inputs[0].dtype)
    for x in inputs[1:]:
        acc = {"PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
               "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op](acc, x)
    return acc


def reduce_op(op: str):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(0.5)
    return getattr(dist.ReduceOp, op)


def _allreduce(ctx, op, dtype, count, where="cuda"):
    d = dev(ctx, where)
    t = value(ctx.rank, count, dtype).to(d)
    dist.all_reduce(t, op=reduce_op(op))
    want = expected(op, [value(r, count, dtype) for r in range(ctx.world)])
    assert torch.equal(t.cpu(), want), f"{op} {dtype} count {count}"
    return True


@needs_cuda
@worlds(2, 3)
@pytest.mark.parametrize("op,dtype", REDUCTIONS, ids=lambda x: str(x).replace("torch.", ""))
def test_allreduce_reductions_on_cuda(ranks, op, dtype):
    for count in (1, 1001, 70_000):
        assert all(ranks.run(_allreduce, op, dtype, count))


@needs_cuda
@worlds(2, 3, 4)
@pytest.mark.parametrize("count", COUNTS)
def test_allreduce_sizes_on_cuda(ranks, count):
    assert all(ranks.run(_allreduce, "SUM", torch.float32, count))


def _allreduce_after_queued_write(ctx, count):
    d = dev(ctx)
    t = torch.zeros(count, device=d)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(float(ctx.rank + 1))
    dist.all_reduce(t)
    want = float(sum(range(1, ctx.world + 1)))
    got = t.cpu()
    assert bool((got == want).all()), f"got {got[:4].tolist()}, want {want}"
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("count", [1000, 1 << 22])
def test_stream_ordering_of_allreduce(ranks, count):
    assert all(ranks.run(_allreduce_after_queued_write, count))


def _every_collective(ctx, count, where="cuda"):
    d, r, n = dev(ctx, where), ctx.rank, ctx.world
    vals = [value(q, count, salt=3) for q in range(n)]
    on = lambda x: x.to(d, copy=True)  # noqa: E731 -- a fresh tensor also when d is the CPU

    t = on(vals[r] if r == 1 % n else torch.zeros(count))
    dist.broadcast(t, src=1 % n)
    assert torch.equal(t.cpu(), vals[1 % n]), "broadcast"

    t = on(vals[r])
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    if r == 0:
        assert torch.equal(t.cpu(), expected("SUM", vals)), "reduce at the root"
    else:
        assert torch.equal(t.cpu(), vals[r]), "reduce changed a non-root's tensor"

    outs = [torch.full((count,), -1.0, device=d) for _ in range(n)]
    dist.all_gather(outs, on(vals[r]))
    for q in range(n):
        assert torch.equal(outs[q].cpu(), vals[q]), f"all_gather part {q}"

    flat = torch.full((n * count,), -1.0, device=d)
    dist.all_gather_into_tensor(flat, on(vals[r]))
    assert torch.equal(flat.cpu(), torch.cat(vals)), "all_gather_into_tensor"

    big = [value(q, n * count, salt=4) for q in range(n)]
    out = torch.full((count,), -1.0, device=d)
    dist.reduce_scatter_tensor(out, on(big[r]))
    assert torch.equal(out.cpu(), expected("SUM", big)[r * count:(r + 1) * count]), "reduce_scatter_tensor"

    out = torch.full((count,), -1.0, device=d)
    dist.reduce_scatter(out, [on(b) for b in big[r].split(count)] if count else [torch.zeros(0, device=d)] * n)
    assert torch.equal(out.cpu(), expected("SUM", big)[r * count:(r + 1) * count]), "reduce_scatter"

    # all_to_all_single with uneven splits: rank s sends (s + q) % 3 + count rows to rank q.
    rows = lambda s, q: (s + q) % 3 + count  # noqa: E731
    send = torch.cat([value(r * 100 + q, rows(r, q), salt=5) for q in range(n)])
    recv = torch.full((sum(rows(s, r) for s in range(n)),), -1.0, device=d)
    dist.all_to_all_single(recv, on(send), output_split_sizes=[rows(s, r) for s in range(n)],
                           input_split_sizes=[rows(r, q) for q in range(n)])
    want = torch.cat([value(s * 100 + r, rows(s, r), salt=5) for s in range(n)])
    assert torch.equal(recv.cpu(), want), "all_to_all_single"

    outs = [torch.full((rows(s, r),), -1.0, device=d) for s in range(n)]
    dist.all_to_all(outs, [on(value(r * 100 + q, rows(r, q), salt=5)) for q in range(n)])
    for s in range(n):
        assert torch.equal(outs[s].cpu(), value(s * 100 + r, rows(s, r), salt=5)), f"all_to_all from {s}"

    gathered = [torch.full((count,), -1.0, device=d) for _ in range(n)] if r == 0 else None
    dist.gather(on(vals[r]), gather_list=gathered, dst=0)
    if r == 0:
        for q in range(n):
            assert torch.equal(gathered[q].cpu(), vals[q]), f"gather part {q}"

    out = torch.full((count,), -1.0, device=d)
    dist.scatter(out, scatter_list=[on(v) for v in vals] if r == 0 else None, src=0)
    assert torch.equal(out.cpu(), vals[r]), "scatter"

    dist.barrier()
    return True


@needs_cuda
@worlds(2, 3)
@pytest.mark.parametrize("count", [0, 1, 1001, 1 << 20])
def test_every_collective_on_cuda(ranks, count):
    assert all(ranks.run(_every_collective, count))


def _ranks_on_different_devices(ctx, count):
    """Rank 0 holds its tensors on the GPU, the others on the CPU. Data movement sends the same
    messages whatever the memory, so all_gather matches at any size. A reduction over more than
    1 MiB cuts its ranges by memory class (16 MiB chunks on the device, 1 MiB on the host:
    docs/collectives.md), so there every rank fails, naming the device rank's call "in device
    memory", instead of pairing messages of different sizes; the group goes on working."""
    d = dev(ctx, "cuda" if ctx.rank == 0 else "cpu")
    t = value(ctx.rank, count).to(d)
    if count * 4 <= 1 << 20:
        dist.all_reduce(t)
        assert torch.equal(t.cpu(), expected("SUM", [value(r, count) for r in range(ctx.world)])), "all_reduce"
    else:
        e = expect_raises(lambda: dist.all_reduce(t))
        assert e["raised"], f"rank {ctx.rank}: a 4 MiB all_reduce of GPU and CPU ranks returned"
        # Rank 0 and its peer 1 name the device call; a third rank may learn of it second-hand.
        assert ctx.rank > 1 or mentions(e["msg"], "in device memory"), e
    out = torch.full((ctx.world * count,), -1.0, device=d)
    dist.all_gather_into_tensor(out, value(ctx.rank, count, salt=2).to(d))
    assert torch.equal(out.cpu(), torch.cat([value(r, count, salt=2) for r in range(ctx.world)])), "all_gather"
    small = value(ctx.rank, 1001).to(d)
    dist.all_reduce(small)
    assert torch.equal(small.cpu(), expected("SUM", [value(r, 1001) for r in range(ctx.world)])), "later all_reduce"
    return True


@needs_cuda
@worlds(2, 3)
@pytest.mark.parametrize("count", [1001, 1 << 20])
def test_collectives_across_ranks_on_different_devices(ranks, count):
    assert all(ranks.run(_ranks_on_different_devices, count))


def _mixed_devices_refused(ctx):
    """Called on the backend itself: torch's own checks in front of it vary between releases."""
    d = dev(ctx)
    be = dist.distributed_c10d._get_default_group()._get_backend(d)
    e = expect_raises(lambda: be._allgather_base(torch.zeros(2 * ctx.world), torch.ones(2, device=d)))
    assert e["type"] == "ValueError" and mentions(e["msg"], "_allgather_base", "cuda", "cpu"), e
    return True


@needs_cuda
@worlds(2)
def test_collective_tensors_on_different_devices_are_refused(ranks):
    assert all(ranks.run(_mixed_devices_refused))


def _ddp_on_cuda(ctx, hook):
    """DDP on CUDA modules over "ucx", against the same training over gloo (which moves CUDA
    tensors through the host): the same GPU math, so with 2 ranks the parameters must be bitwise
    equal. DDP broadcasts rank 0's parameters (each rank starts differently) and allreduces its
    buckets through the Works' futures (the comm hook chains on them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    d = dev(ctx)

    def train(group):
        torch.manual_seed(1000 + ctx.rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double().to(d)
        ddp = DDP(model, device_ids=[d.index], process_group=group, bucket_cap_mb=0.0005)
        if hook == "allreduce":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(state=group, hook=default_hooks.allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(7 + ctx.rank)
        for _ in range(5):
            x = torch.randn(12, 8, generator=g, dtype=torch.float64).to(d)
            y = torch.randn(12, 4, generator=g, dtype=torch.float64).to(d)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    mine, ref = train(None), train(ctx.ref)
    for i, (a, b) in enumerate(zip(mine, ref)):
        assert torch.equal(a, b), f"parameter {i}: max abs diff {(a - b).abs().max().item():.3g} against gloo"
    return True


@needs_cuda
@worlds(2)
@pytest.mark.parametrize("hook", ["none", "allreduce"])
def test_ddp_on_cuda_matches_gloo(ranks, hook):
    assert all(ranks.run(_ddp_on_cuda, hook, timeout=120))


def _without_cuda_transports(ctx):
    """With a UCX_TLS that leaves out UCX's CUDA transports, UCX may lose CUDA memory detection.
    If it has (memory types without "cuda"), a CUDA tensor must be refused at the op with what is
    missing and how to get it; if it has not, the op must simply work."""
    import commux

    d = dev(ctx)
    t = value(ctx.rank, 1000).to(d)
    peer = (ctx.rank + 1) % ctx.world
    types = commux.runtime_info()["memory_types"]
    if "cuda" not in types:
        e = expect_raises(lambda: dist.all_reduce(t))
        assert e["type"] == "ValueError", e
        assert mentions(e["msg"], "commux allreduce", "cuda", "cannot carry", "libucx-cu13", "UCX_TLS"), e["msg"]
        dist.barrier()  # nothing was posted
        return ("refused", types)
    works = [dist.isend(t, dst=peer, tag=3),
             dist.irecv(torch.zeros(1000, device=d), src=(ctx.rank - 1) % ctx.world, tag=3)]
    for w in works:
        w.wait()
    return ("carried", types)


@needs_cuda
@pytest.mark.oneoff
def test_cuda_tensor_with_a_ucx_tls_without_cuda_transports():
    import mp

    outs, closed = mp.run_once(_without_cuda_transports, 2, timeout=120, env={"UCX_TLS": "tcp,self"})
    for o in outs + closed:
        assert o.ok, o.describe()
    print("UCX_TLS=tcp,self:", [o.value for o in outs])


# ---------------------------------------------------------------------------------------------
# Runs everywhere: the device path's ATen operations on CPU tensors, and the device validation

def _device_ops_calls(ctx):
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return be.device_ops_calls


def _aten_suite(ctx):
    before = _device_ops_calls(ctx)
    for op, dtype in REDUCTIONS:
        for count in (1, 1001, 70_000):
            _allreduce(ctx, op, dtype, count, "cpu")
    for count in (0, 1001, 1 << 18):
        _every_collective(ctx, count, "cpu")
    return _device_ops_calls(ctx) - before


@pytest.mark.oneoff
@pytest.mark.parametrize("world", [2, 3])
def test_device_path_reductions_through_aten_on_cpu(world):
    """COMMUX_ATEN_REDUCE=1 sends CPU collectives through the same ATen DeviceOps that CUDA
    tensors use (scratch, copies and every reduction op and dtype), so its op mapping is checked
    on a machine without a GPU; the counter shows the path was taken."""
    import mp
    outs, closed = mp.run_once(_aten_suite, world, timeout=240, env={"COMMUX_ATEN_REDUCE": "1"})
    for o in outs + closed:
        assert o.ok, o.describe()
    assert all(o.value > 0 for o in outs), [o.value for o in outs]

def _meta_refused(ctx):
    """torch routes a meta tensor to its own no-op kernels, so the backend is called directly."""
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    t = torch.empty(4, device="meta")
    out = []
    for name, fn in (("send", lambda: be.send([t], (ctx.rank + 1) % ctx.world, 1)),
                     ("allreduce", lambda: be.allreduce([t]))):
        e = expect_raises(fn)
        assert e["type"] == "ValueError", (name, e)
        assert mentions(e["msg"], "commux", name, "meta", "CUDA"), (name, e["msg"])
        out.append(e["msg"])
    dist.barrier()  # nothing was posted: the group still works
    return out


@worlds(2)
def test_a_device_commux_cannot_carry_is_refused_on_every_rank(ranks):
    msgs = ranks.run(_meta_refused)
    assert len(msgs) == 2
