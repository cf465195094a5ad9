"""commux.ep.Buffer (DeepEP's legacy API) against a reference written from DeepEP's semantics.

Every rank builds every rank's inputs from seeds, so each can compute exactly what it must
receive. The reference follows the documented semantics independently of commux.ep's code:
normal dispatch = one row per (token, destination rank), grouped by source rank then token, local
expert ids (-1 elsewhere), weights (0 where -1); normal combine = per token the float32 sum over
its destination ranks (in rank order) of their rows, cast once; low-latency dispatch = one row per
(token, expert) into [E/R, cap*R, H] by source rank then token; low-latency combine = per token
the float32 sum of weight x row over its slots, cast once. Results must be bitwise equal.

Each case runs on the default group (backend under test, commux's own exchange) and on the gloo
group (the all_to_all_single path of the same Buffer). Bad input must fail on every rank, never
hang, and leave the group usable.
"""
import pytest
import torch
import torch.distributed as dist

from helpers import expect_raises, mentions
from suite import worlds

pytestmark = pytest.mark.ucx

FAST = 60
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn

# Where the tensors live and which code path packs them: "cpu" (host loops), "aten" (host tensors
# through the device path's ATen operations: COMMUX_EP_ATEN), "cuda" (a GPU; skipped without one).
PATHS = ["cpu", "aten", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


class on_path:
    """Runs a rank's body on one path: the device to put inputs on, and the ATen switch."""

    def __init__(self, ctx, path):
        self.path = path
        self.device = (torch.device("cuda", ctx.rank % torch.cuda.device_count()) if path == "cuda"
                       else torch.device("cpu"))

    def __enter__(self):
        from commux import _C
        if self.path == "cuda":
            torch.cuda.set_device(self.device)
        _C._ep_set_aten_on_host(self.path == "aten")
        return self

    def __exit__(self, *exc):
        from commux import _C
        _C._ep_set_aten_on_host(False)
        return False

    def put(self, *ts):
        out = tuple(t.to(self.device) if isinstance(t, torch.Tensor) else
                    tuple(u.to(self.device) for u in t) if isinstance(t, tuple) else t for t in ts)
        return out if len(out) > 1 else out[0]


def cpu(t):
    if isinstance(t, tuple):
        return tuple(cpu(u) for u in t)
    return t.cpu() if isinstance(t, torch.Tensor) else t


# --- inputs and the reference ----------------------------------------------------------------
def inputs(rank, T, H, E, k, seed, empty_slots=True, only_experts=None):
    """x [T, H] bf16 (exact: small integers / 64), topk_idx [T, k] (distinct, some -1), weights."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = (torch.randint(-96, 96, (T, H), generator=g).float() / 64).to(BF16)
    scores = torch.rand(T, E, generator=g)
    if only_experts is not None:
        allowed = torch.zeros(E, dtype=torch.bool)
        allowed[list(only_experts)] = True
        scores[:, ~allowed] = -1.0
    idx = scores.topk(k, dim=1).indices
    if only_experts is not None:
        idx = torch.where(scores.gather(1, idx) >= 0, idx, torch.full_like(idx, -1))
    if empty_slots and T:
        drop = torch.rand(T, k, generator=g) < 0.2
        idx = idx.masked_fill(drop, -1)
    w = torch.rand(T, k, generator=g)
    return x, idx, w


def quantize(x):
    t, h = x.shape
    b = x.float().view(t, h // 128, 128)
    s = b.abs().amax(2).clamp(min=1e-4) / 448.0
    return (b / s.unsqueeze(2)).view(t, h).to(FP8), s


def ref_dispatch(all_in, me, R, E):
    epr = E // R
    xs, ids, ws, srcs = [], [], [], []
    for src, (x, idx, w) in enumerate(all_in):
        for t in range(x.shape[0]):
            if ((idx[t] >= me * epr) & (idx[t] < (me + 1) * epr)).any():
                loc = torch.where((idx[t] >= me * epr) & (idx[t] < (me + 1) * epr), idx[t] - me * epr,
                                  torch.full_like(idx[t], -1))
                xs.append(x[t])
                ids.append(loc)
                ws.append(torch.where(loc >= 0, w[t], torch.zeros_like(w[t])))
                srcs.append(t)
    k = all_in[0][1].shape[1]
    H = all_in[0][0].shape[1]
    if not xs:
        return (torch.empty(0, H, dtype=BF16), torch.empty(0, k, dtype=torch.int64),
                torch.empty(0, k), [0] * epr, [])
    ids = torch.stack(ids)
    counts = [int((ids == e).sum()) for e in range(epr)]
    return torch.stack(xs), ids, torch.stack(ws), counts, srcs


def expert_transform(rows, rank):
    """A rank-specific exact transform of the received rows (so a misrouted row cannot pass)."""
    return (rows.float() * (rank + 2) - 1).to(BF16)


def ref_combine(x, idx, R, E):
    """Per token: sum over its destination ranks (ascending) of expert_transform(x[t], rank)."""
    epr = E // R
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for r in range(R):
            if ((idx[t] >= r * epr) & (idx[t] < (r + 1) * epr)).any():
                out[t] += expert_transform(x[t:t + 1], r).float()[0]
    return out.to(BF16)


def ll_scale(e_global):
    return float(e_global % 5 + 1)


def ref_ll_combine(x, idx, w, R, E):
    """Per token: sum over its slots, ordered by destination rank then slot, of w x row, where the
    expert's row is x[t] * ll_scale(expert) (exact in bf16)."""
    epr = E // R
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for r in range(R):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                if e >= 0 and e // epr == r:
                    row = (x[t].float() * ll_scale(e)).to(BF16).float()
                    out[t] += row * w[t, j]
    return out.to(BF16)


def groups(ctx):
    return [("default", dist.group.WORLD), ("gloo", ctx.ref)]


def check(what, got, want):
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{what}: {got.dtype} {list(got.shape)} vs expected {want.dtype} {list(want.shape)}"
        g = got.view(torch.uint8) if got.dtype == FP8 else got
        w = want.view(torch.uint8) if want.dtype == FP8 else want
        if not torch.equal(g, w):
            bad = (g != w).reshape(g.shape[0], -1).any(1).nonzero()[:5, 0].tolist() if g.dim() else []
            raise AssertionError(f"{what}: differs from the reference in rows {bad}")
    else:
        assert got == want, f"{what}: {got} vs expected {want}"


# --- normal mode ----------------------------------------------------------------------------------
def _normal(ctx, T, fp8, E, k, seed, only_experts=None, path="cpu"):
    with on_path(ctx, path) as on:
        _normal_body(ctx, on, T, fp8, E, k, seed, only_experts)


def _normal_body(ctx, on, T, fp8, E, k, seed, only_experts):
    from commux.ep import Buffer
    R, me, H = ctx.world, ctx.rank, 256
    all_in = [inputs(r, T, H, E, k, seed, only_experts=only_experts) for r in range(R)]
    x, idx, w = all_in[me]
    want_x, want_idx, want_w, want_counts, want_src = ref_dispatch(all_in, me, R, E)
    for name, g in groups(ctx):
        if on.path == "cuda" and name == "gloo":
            continue  # gloo has no all_to_all on CUDA tensors
        buf = Buffer(g)
        d_idx, d_w = on.put(idx, w)
        n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(d_idx, E)
        assert n_rdma is None and (ev is None) == (on.path != "cuda")
        n_rank, n_exp, in_rank = cpu((n_rank, n_exp, in_rank))
        check(f"{name}: num_tokens_per_rank", n_rank,
              torch.tensor([int(((idx >= r * (E // R)) & (idx < (r + 1) * (E // R))).any(1).sum())
                            for r in range(R)], dtype=torch.int32))
        xin = on.put(quantize(x) if fp8 else x)
        rx, ridx, rw, counts, handle, ev = buf.dispatch(
            xin, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_exp,
            topk_idx=d_idx, topk_weights=d_w)
        rx, ridx, rw = cpu((rx, ridx, rw))
        if fp8:
            qx, qs = quantize(want_x) if want_x.shape[0] else (want_x.to(FP8), torch.empty(0, H // 128))
            check(f"{name}: fp8 recv_x", rx[0], qx)
            check(f"{name}: fp8 scales", rx[1], qs)
        else:
            check(f"{name}: recv_x", rx, want_x)
        check(f"{name}: recv_topk_idx", ridx, want_idx)
        check(f"{name}: recv_topk_weights", rw, want_w)
        check(f"{name}: num_recv_tokens_per_expert_list", counts, want_counts)
        check(f"{name}: handle source rows", handle[3].tolist(), want_src)
        # combine on an expert-specific transform of what arrived (bf16)
        y = expert_transform(want_x, me)
        cx, cw, ev = cpu(buf.combine(on.put(y), handle, topk_weights=on.put(rw)))
        check(f"{name}: combined_x", cx, ref_combine(x, idx, R, E))
        check(f"{name}: combined_topk_weights", cw, torch.where(idx >= 0, w, torch.zeros_like(w)))
        # a cached handle: the same layout, no top-k arguments
        rx2, *rest = buf.dispatch(xin, handle=handle)
        rx2 = cpu(rx2)
        assert rest[:4] == [None, None, None, None]
        check(f"{name}: cached dispatch", rx2[0] if fp8 else rx2, rx[0] if fp8 else rx)
        buf.destroy()


@worlds(1, 2, 3, 4)
@pytest.mark.parametrize("T", [0, 1, 13, 64])
def test_normal_bf16(ranks, ws, T):
    ranks.run(_normal, T, False, 8 * ws, 4, seed=T, timeout=FAST)


@worlds(2, 3)
@pytest.mark.parametrize("T", [0, 5, 32])
def test_normal_fp8(ranks, ws, T):
    ranks.run(_normal, T, True, 4 * ws, 3, seed=100 + T, timeout=FAST)


@worlds(2, 3)
@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [0, 9])
def test_normal_device_path(ranks, ws, T, fp8, path):
    """The device path (ATen on GPU tensors; also on host tensors with COMMUX_EP_ATEN)."""
    ranks.run(_normal, T, fp8, 4 * ws, 3, seed=400 + T, path=path, timeout=FAST)


@worlds(2, 3)
def test_ranks_that_receive_nothing(ranks, ws):
    """Every token goes to rank 0's experts: the other ranks receive nothing and send to one."""
    ranks.run(_normal, 9, False, 4 * ws, 2, seed=7, only_experts=range(4), timeout=FAST)


def _alignment_and_worst(ctx):
    from commux.ep import Buffer
    R, me, H, E, k = ctx.world, ctx.rank, 128, 4 * ctx.world, 2
    all_in = [inputs(r, 11, H, E, k, seed=3) for r in range(R)]
    x, idx, w = all_in[me]
    want_x, want_idx, _, want_counts, _ = ref_dispatch(all_in, me, R, E)
    buf = Buffer()
    _, _, n_exp, _, _ = buf.get_dispatch_layout(idx, E)
    _, _, _, counts, _, _ = buf.dispatch(x, num_tokens_per_expert=n_exp, topk_idx=idx, expert_alignment=8)
    check("expert_alignment=8", counts, [(c + 7) // 8 * 8 for c in want_counts])
    worst = 11 * R
    rx, ridx, rw, counts, handle, _ = buf.dispatch(x, num_tokens_per_expert=n_exp, topk_idx=idx,
                                                   topk_weights=w, num_worst_tokens=worst)
    n = want_x.shape[0]
    assert rx.shape[0] == worst and counts == []
    check("num_worst_tokens rows", rx[:n], want_x)
    check("num_worst_tokens ids", ridx[:n], want_idx)
    assert bool((ridx[n:] == -1).all()), "padding rows must carry -1 ids"


@worlds(2, 3)
def test_alignment_and_worst_tokens(ranks, ws):
    ranks.run(_alignment_and_worst, timeout=FAST)


# --- low-latency mode -------------------------------------------------------------------------------
def _low_latency(ctx, T, fp8, E, k, cap, seed, path="cpu"):
    with on_path(ctx, path) as on:
        _low_latency_body(ctx, on, T, fp8, E, k, cap, seed)


def _low_latency_body(ctx, on, T, fp8, E, k, cap, seed):
    from commux.ep import Buffer
    R, me, H = ctx.world, ctx.rank, 256
    epr = E // R
    all_in = [inputs(r, T, H, E, k, seed) for r in range(R)]
    x, idx, w = all_in[me]
    for name, g in groups(ctx):
        if on.path == "cuda" and name == "gloo":
            continue  # gloo has no all_to_all on CUDA tensors
        buf = Buffer(g, low_latency_mode=True)
        stats = on.put(torch.zeros(epr, dtype=torch.int32))
        d_x, d_idx, d_w = on.put(x, idx, w)
        rx, count, handle, ev, hook = buf.low_latency_dispatch(
            d_x, d_idx, cap, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, return_recv_hook=True)
        hook()
        assert (ev is None) == (on.path != "cuda")
        rx, count, stats = cpu((rx, count, stats))
        xs = rx[0] if fp8 else rx
        assert list(xs.shape) == [epr, cap * R, H], f"{name}: recv_x shape {list(xs.shape)}"
        src_info, layout_range, hcap, hH, hE = handle
        src_info, layout_range = cpu((src_info, layout_range))
        assert (hcap, hH, hE) == (cap, H, E)
        for e in range(epr):
            ge = me * epr + e
            rows, srcs, per_src = [], [], []
            for s, (xs_s, idx_s, _) in enumerate(all_in):
                mine = [t for t in range(T) if bool((idx_s[t] == ge).any())]
                per_src.append(len(mine))
                rows += [xs_s[t] for t in mine]
                srcs += mine
            n = len(rows)
            assert int(count[e]) == n, f"{name}: recv_count[{e}] = {int(count[e])}, expected {n}"
            if n:
                want = torch.stack(rows)
                if fp8:
                    q, s = quantize(want)
                    check(f"{name}: LL fp8 expert {e}", rx[0][e, :n], q)
                    check(f"{name}: LL scales expert {e}", rx[1][e, :n], s)
                else:
                    check(f"{name}: LL expert {e}", rx[e, :n], want)
            check(f"{name}: src_info expert {e}", src_info[e, :n].tolist(), srcs)
            begins = [sum(per_src[:s]) for s in range(R)]
            check(f"{name}: layout_range expert {e}", layout_range[e].tolist(),
                  [(b << 32) | c for b, c in zip(begins, per_src)])
        assert torch.equal(stats, count), f"{name}: cumulative_local_expert_recv_stats"
        # every expert scales its rows by its own factor; combine weights at the source
        y = torch.zeros(epr, cap * R, H, dtype=BF16)
        for e in range(epr):
            n = int(count[e])
            src_x = torch.stack([all_in[s][0][t] for s in range(R) for t in range(T)
                                 if bool((all_in[s][1][t] == me * epr + e).any())]) if n else None
            if n:
                y[e, :n] = (src_x.float() * ll_scale(me * epr + e)).to(BF16)
        out, ev, hook = buf.low_latency_combine(on.put(y), d_idx, d_w, handle)
        check(f"{name}: LL combined", cpu(out), ref_ll_combine(x, idx, w, R, E))
        buf.destroy()


@worlds(1, 2, 3, 4)
@pytest.mark.parametrize("T", [0, 3, 32])
def test_low_latency_bf16(ranks, ws, T):
    ranks.run(_low_latency, T, False, 4 * ws, 3, cap=32, seed=200 + T, timeout=FAST)


@worlds(2, 3)
@pytest.mark.parametrize("T", [1, 16])
def test_low_latency_fp8(ranks, ws, T):
    ranks.run(_low_latency, T, True, 2 * ws, 2, cap=16, seed=300 + T, timeout=FAST)


@worlds(2, 3)
@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_device_path(ranks, ws, fp8, path):
    ranks.run(_low_latency, 7, fp8, 2 * ws, 2, cap=8, seed=500, path=path, timeout=FAST)


# --- isolation from other traffic ------------------------------------------------------------------
def _isolation(ctx):
    """A user irecv posted on every peer's tag before the calls, two Buffers interleaved, and a
    collective in flight: each message reaches only its own receive."""
    from commux.ep import Buffer
    R, me, H, E = ctx.world, ctx.rank, 128, 2 * ctx.world
    peer = (me + 1) % R
    src = (me - 1) % R
    tags = [0, 1, 2, 5, 1 << 20, (1 << 31) - 1]
    got = {t: torch.full((H,), -1.0) for t in tags}
    reqs = [dist.irecv(got[t], src=src, tag=t) for t in tags]
    pending = dist.all_reduce(torch.ones(1000), async_op=True)
    a, b = Buffer(), Buffer()
    all_in = [inputs(r, 6, H, E, 2, seed=11) for r in range(R)]
    x, idx, w = all_in[me]
    ra = a.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    rb = b.dispatch(x * 2, topk_idx=idx, topk_weights=w, num_experts=E)
    want_x = ref_dispatch(all_in, me, R, E)[0]
    check("Buffer a", ra[0], want_x)
    check("Buffer b", rb[0], want_x * 2)
    ya = a.combine(expert_transform(want_x, me), ra[4])[0]
    check("Buffer a combine", ya, ref_combine(x, idx, R, E))
    sends = [dist.isend(torch.full((H,), float(t % 1000)), dst=peer, tag=t) for t in tags]
    for r in reqs + sends:
        r.wait()
    pending.wait()
    for t in tags:
        assert bool((got[t] == float(t % 1000)).all()), f"user message on tag {t} was disturbed"


@worlds(2, 3)
def test_no_crosstalk_with_user_tags_collectives_or_other_buffers(ranks, ws):
    ranks.run(_isolation, timeout=FAST)


# --- bad input: an error on every rank, then the group still works ------------------------------------
def _bad(ctx, case):
    from commux.ep import Buffer
    R, me, H, E, k = ctx.world, ctx.rank, 128, 4 * ctx.world, 2
    x, idx, w = inputs(me, 5, H, E, k, seed=5)
    buf = Buffer(max_tokens_per_rank=8)
    culprit = R - 1
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=E)
    call = lambda: buf.dispatch(x, **kw)  # noqa: E731
    if case == "experts_not_multiple":
        kw["num_experts"] = E + 1 if me == culprit else E
    elif case == "hidden_differs":
        if me == culprit:
            x = torch.zeros(5, 2 * H, dtype=BF16)
    elif case == "dtype_differs":
        if me == culprit:
            x = quantize(x)
    elif case == "id_out_of_range":
        if me == culprit:
            kw["topk_idx"] = idx.clone().fill_(-1)
            kw["topk_idx"][2, 1] = E
    elif case == "id_repeated":
        if me == culprit:
            kw["topk_idx"] = idx.clone()
            kw["topk_idx"][3] = torch.tensor([1, 1])
    elif case == "too_many_tokens":
        if me == culprit:
            x = torch.zeros(9, H, dtype=BF16)
            kw.update(topk_idx=torch.zeros(9, k, dtype=torch.int64).fill_(-1), topk_weights=None)
    elif case == "foreign_handle":
        other = Buffer()
        h_other = other.dispatch(x, **kw)[4]
        h_mine = buf.dispatch(x, **kw)[4]
        y = torch.zeros(len(h_mine[3]), H, dtype=BF16)
        call = lambda: buf.combine(y, h_other if me == culprit else h_mine)  # noqa: E731
    elif case == "low_latency_without_mode":
        call = lambda: buf.low_latency_dispatch(x, idx, 8, E)  # noqa: E731
    elif case == "destroyed":
        if me == culprit:
            buf.destroy()
    elif case == "weights_on_some_ranks":
        # k=1: 16-byte metadata rows with and without weights, so only the parts field tells them
        # apart (before, both calls returned, each reading the other's rows wrongly)
        kw.update(topk_idx=idx[:, :1].contiguous(), topk_weights=None if me == culprit else w[:, :1].contiguous())
    elif case == "combine_weights_on_some_ranks":
        # (before: the rank without weights returned, the others waited out the timeout)
        rx, _, rw, _, h, _ = buf.dispatch(x, **kw)
        call = lambda: buf.combine(rx, h, topk_weights=None if me == culprit else rw)  # noqa: E731
    elif case == "ll_combine_other_topk":
        ll = Buffer(low_latency_mode=True)
        h = ll.low_latency_dispatch(x, idx, 8, E, use_fp8=False)[2]
        other = idx.roll(1, dims=1) if me == culprit else idx  # the same experts, other slots
        y = torch.zeros(E // R, 8 * R, H, dtype=BF16)
        call = lambda: ll.low_latency_combine(y, other, w, h)  # noqa: E731
    res = expect_raises(call)
    # the group and a fresh Buffer still work afterwards, with the right result
    all_in = [inputs(r, 5, H, E, k, seed=6) for r in range(R)]
    ok = Buffer().dispatch(all_in[me][0], topk_idx=all_in[me][1], num_experts=E)[0]
    check("dispatch after the error", ok, ref_dispatch(all_in, me, R, E)[0])
    dist.barrier()
    res["culprit"] = me == culprit
    return res


BAD_CASES = {
    "experts_not_multiple": ("num_experts", "multiple"),
    "hidden_differs": ("hidden",),
    "dtype_differs": ("dtype",),
    "id_out_of_range": ("top-k id", "outside"),
    "id_repeated": ("twice",),
    "too_many_tokens": ("max_tokens_per_rank",),
    "foreign_handle": ("another Buffer",),
    "low_latency_without_mode": ("low_latency_mode=True",),
    "destroyed": ("destroyed",),
    "ll_combine_other_topk": ("topk_idx", "routed"),
    "weights_on_some_ranks": ("set of parts sent", "{x, topk_idx, source rows}",
                              "{x, topk_idx, topk_weights, source rows}"),
    "combine_weights_on_some_ranks": ("set of parts sent", "{x}", "{x, topk_weights}"),
}


@worlds(2, 3)
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_fails_on_every_rank(ranks, ws, case):
    results = ranks.run(_bad, case, timeout=FAST)
    words = BAD_CASES[case]
    for r, res in enumerate(results):
        assert res["raised"], f"rank {r} did not raise for {case}"
        assert res["s"] < 10, f"rank {r} took {res['s']:.1f} s to fail ({case}): a wait, not a check"
        assert mentions(res["msg"], "commux ep"), f"rank {r}: the error does not name the op: {res['msg']}"
        if res["culprit"] or case in ("hidden_differs", "dtype_differs"):
            assert res["type"] == "ValueError", f"rank {r}: {res['type']}: {res['msg']}"
        assert mentions(res["msg"], *words), f"rank {r}: {res['msg']!r} does not say {words}"
        if not res["culprit"] and case not in ("hidden_differs", "dtype_differs", "low_latency_without_mode"):
            assert mentions(res["msg"], f"rank {ws - 1}"), f"rank {r}: does not name the culprit: {res['msg']}"


def _local_layout_errors(ctx):
    from commux.ep import Buffer
    buf = Buffer()
    E = 4 * ctx.world
    bad = torch.tensor([[0, E]])
    r1 = expect_raises(lambda: buf.get_dispatch_layout(bad, E))
    r2 = expect_raises(lambda: Buffer(enable_shrink=True))
    return r1, r2


@worlds(2)
def test_local_errors(ranks, ws):
    for r1, r2 in ranks.run(_local_layout_errors, timeout=FAST):
        assert r1["type"] == "ValueError" and mentions(r1["msg"], "get_dispatch_layout", "outside")
        assert r2["type"] == "ValueError" and mentions(r2["msg"], "enable_shrink")


def _lane_bounds(ctx):
    # An offset plus a capacity near 2^63 wrapped around to a negative sum, which passed the
    # check against the receive buffer's size: a peer's bytes would have landed 2^62 bytes away.
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    W, huge = ctx.world, 3 << 61
    send, recv = torch.zeros(0, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    return expect_raises(lambda: pg._exchange_lanes(
        "ep_lanes", [send], [[0] * W], [recv], [[huge] + [0] * (W - 1)], [[huge] + [8] * (W - 1)], 5000))


@worlds(2)
def test_lane_sizes_beyond_the_buffer_are_refused(ranks, ws):
    for r in ranks.run(_lane_bounds, timeout=FAST):
        assert r["type"] == "ValueError", f"{r['type']}: {r['msg']}"
        assert mentions(r["msg"], "commux ep_lanes", "recv_capacity[0] is 6917529027641081856",
                        "beyond the buffer's 16 bytes"), r["msg"]


def _lanes_with_empty_parts(ctx):
    # Rank 0 sends rank 1 8 bytes in lane 1 and nothing in lane 0; rank 1 gives both lanes an
    # 8-byte slot. Every lane travels as its own part, empty ones too, so the bytes land in lane
    # 1's slot. (Before, empty parts were left out on each side by its own sizes: rank 0's lane 1
    # landed in lane 0's slot, and rank 1 then waited for a second part that never came.)
    pg = dist.group.WORLD._get_backend(torch.device("cpu"))
    me, empty = ctx.rank, torch.zeros(0, dtype=torch.uint8)
    if me == 0:
        data = torch.arange(1, 9, dtype=torch.uint8)
        got = pg._exchange_lanes("ep_lanes", [empty, data], [[0, 0], [0, 8]],
                                 [empty, empty], [[0, 0], [0, 0]], [[0, 0], [0, 0]], 5000)
        return list(got), None, None
    slots = [torch.full((8,), 0xEE, dtype=torch.uint8) for _ in range(2)]
    got = pg._exchange_lanes("ep_lanes", [empty, empty], [[0, 0], [0, 0]],
                             slots, [[0, 0], [0, 0]], [[8, 0], [8, 0]], 5000)
    return list(got), slots[0].tolist(), slots[1].tolist()


@worlds(2)
def test_lanes_with_empty_parts_land_in_their_own_slots(ranks, ws):
    (got0, _, _), (got1, lane0, lane1) = ranks.run(_lanes_with_empty_parts, timeout=FAST)
    assert got0 == [0, 0]
    assert got1 == [8, 0], got1  # 8 of the 16 bytes of capacity: the caller judges that
    assert lane0 == [0xEE] * 8, f"lane 0's slot was written: {lane0}"
    assert lane1 == list(range(1, 9)), lane1


def _under_detail_wrapper(ctx):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend; the Buffer must still use commux's own
    exchange (the wrapped backend), with the right result."""
    from commux.ep import Buffer, _Ucx
    R, me, H, E = ctx.world, ctx.rank, 128, 4 * ctx.world
    buf = Buffer()
    all_in = [inputs(r, 6, H, E, 2, seed=21) for r in range(R)]
    rx = buf.dispatch(all_in[me][0], topk_idx=all_in[me][1], num_experts=E)[0]
    check("dispatch under the DETAIL wrapper", rx, ref_dispatch(all_in, me, R, E)[0])
    return type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__, isinstance(buf._transport, _Ucx)


@pytest.mark.oneoff
def test_buffer_under_torch_distributed_debug_detail():
    import mp
    outs, _ = mp.run_once(_under_detail_wrapper, 2, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    for o in outs:
        assert o.ok, f"rank {o.rank}: {o.exc_type}: {o.exc_msg}\n{o.tb}"
        backend, own = o.value
        assert backend != "ProcessGroupUCX", f"the backend was not wrapped ({backend}): the test proves nothing"
        assert own, "the Buffer fell back to all_to_all_single under the wrapper"


def test_pack_moves_host_row_fields_to_the_device_of_the_token_fields():
    """On a GPU, dispatch packs per-token fields (on the tokens' device) with per-row fields that
    the route computed on the host (source rows, expert ids). Every normal-mode dispatch on CUDA
    and every fp8 low-latency one failed with "the parts must be on one device" until the host
    fields were moved. The meta device stands in for a second device here: the packed rows must
    be on the token fields' device with every row's bytes, and token fields on two devices must
    still be refused."""
    from commux import _C
    T, counts, stride = 3, [2, 2], 16
    idx = torch.zeros(T, 2, dtype=torch.int32, device="meta")
    w = torch.zeros(T, 2, dtype=torch.float32, device="meta")
    order = torch.tensor([0, 2, 1, 2])
    packed = _C._ep_pack([idx, w], [0, 8], order, [order.to(torch.int32)], [12], counts, stride)
    assert packed.device.type == "meta" and packed.numel() == sum(counts) * stride
    with pytest.raises(ValueError, match="per-token parts must be on one device"):
        _C._ep_pack([idx, torch.zeros(T, 2)], [0, 8], order, [], [], counts, stride)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_scales_are_the_same_bits_on_every_device(device, round_scale):
    """Low-latency fp8 scales are max(|x|, 1e-4) / 448 per 128-column block, correctly rounded
    (float64 then float32 is: 53 >= 2 * 24 + 2 bits), or with round_scale the power of two at or
    above it. On CUDA the scales were an ulp off for most blocks (a tensor divided by a Python
    number is multiplied by its reciprocal there), so GPU results differed from the CPU's."""
    from commux.ep import _quantize_fp8
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 1024, generator=g) * torch.rand(64, 1, generator=g) * 30).to(BF16)
    x[0, :128] = 0  # the 1e-4 floor
    x[1, :128] = 448 * 2.0 ** -3  # a power of two exactly: round_scale keeps it
    q, s = _quantize_fp8(x.to(device), round_scale)
    amax = x.float().view(64, 8, 128).abs().amax(2).clamp(min=1e-4)
    want = (amax.double() / 448).float()
    if round_scale:
        want = torch.exp2(torch.ceil(torch.log2(want.double()))).float()
    assert torch.equal(s.cpu(), want), f"scales differ in {int((s.cpu() != want).sum())} of {want.numel()} blocks"
    wq = (x.float().view(64, 8, 128) / want.unsqueeze(2)).view(64, 1024).to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), wq.view(torch.uint8))
