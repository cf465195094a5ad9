"""The correctness oracle of docs/ep-bench.md (after /work/shared/docs/ep.md), per rank.

Every check is a pure function of the routing trace and what a backend returned on one rank, and
returns a list of failure messages (empty: passed). Results are normalised by the adapters into
plain dicts (see ``NormalResult`` / ``LowLatencyResult`` below); tensors may live on any device and
are moved to the CPU here.

Dispatch, normal mode (rank-dedup layout): the received rows are decoded by their id columns and
compared with the trace: the set of (token, this rank) pairs, each exactly once, no extra rows; the
order (source rank, then token); local expert ids (expert - rank*E/R, -1 elsewhere) and weights
(bit-exact, 0 where the id is -1) per row; per-expert counts rounded up to the alignment (a Python
list); the payload bit-exact (bf16 bits; fp8 bytes and float32 scale bits).

Dispatch, low-latency mode (expert-padded layout): per local expert the count; the
(begin << 32 | count) range of every source rank (disjoint, covering [0, count), each source's
count right); every valid row decoded, its source the rank whose range holds it, src_info its
token index there, the set per (expert, source) exactly the trace's, each once; payload bit-exact
(fp8: against ll_quantize of the bf16 activations, values and scales).

Combine (both modes): the harness feeds the backend an expert-specific affine transform of the
rows it received, f_e(x) = alpha_e * x + beta_e (``expert_input_*``; a wrong routing cannot pass as
an identity round trip would), and checks the [T, H] output of each source token against the exact
sum_j w_j f_{e_j}(x_t) over the token's non-empty slots (the same number whether the weights are
applied per rank before a rank sum, or at the source): elementwise relative error, denominator
clamped at 0.02, under 8 * 2^-8 (the float32-then-one-cast reduction with bf16 inputs stays under
2 * 2^-9). Every term is positive (alpha_e <= 1/8, beta_e >= 1, w >= 3/4), so losing or doubling
one term moves the sum by more than 5%.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .routing import FP8_BLOCK, Trace, decode_ids, dequantize, ll_quantize

TOLERANCE = 8 * 2.0 ** -8
DENOM_FLOOR = 0.02
MAX_EXAMPLES = 4

# NormalResult: {"recv_x": bf16 [N, H] | (fp8 [N, H], float32 [N, H/128]),
#                "recv_topk_idx": int64 [N, k], "recv_topk_weights": float32 [N, k],
#                "counts": list[int] (E/R), "layout": None | {"num_tokens_per_rank", "num_tokens_per_expert",
#                "is_token_in_rank"}}
# LowLatencyResult: {"recv_x": bf16 [E/R, cap*R, H] | (fp8, float32 [E/R, cap*R, H/128]),
#                    "recv_count": int [E/R], "src_info": int [E/R, cap*R], "layout_range": int64 [E/R, R]}
NormalResult = dict
LowLatencyResult = dict


def _cpu(t: Any) -> Any:
    if isinstance(t, tuple):
        return tuple(_cpu(v) for v in t)
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def _few(values) -> str:
    v = list(values)
    return str(v[:MAX_EXAMPLES]) + ("..." if len(v) > MAX_EXAMPLES else "")


def alpha(e: torch.Tensor) -> torch.Tensor:
    return (2 + (e % 3)).float() / 32


def beta(e: torch.Tensor) -> torch.Tensor:
    return 1 + (e % 5).float() / 8


def _rows_value(recv_x) -> torch.Tensor:
    """float32 view of received rows (dequantised for an (fp8, scales) pair); any leading shape."""
    if isinstance(recv_x, tuple):
        q, s = recv_x
        lead = q.shape[:-1]
        return dequantize(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1])).view(*lead, q.shape[-1])
    return recv_x.float()


def _shape(what: str, t, shape, dtype) -> list[str]:
    if not isinstance(t, torch.Tensor):
        return [f"{what}: expected a tensor, got {type(t).__name__}"]
    out = []
    if tuple(t.shape) != tuple(shape):
        out.append(f"{what}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        out.append(f"{what}: dtype {t.dtype}, expected {dtype}")
    return out


def _payload_shape(what: str, recv_x, lead: tuple, H: int, fp8: bool) -> list[str]:
    if fp8:
        if not isinstance(recv_x, tuple) or len(recv_x) != 2:
            return [f"{what}: expected an (fp8, scales) pair, got {type(recv_x).__name__}"]
        return (_shape(f"{what}[0]", recv_x[0], lead + (H,), torch.float8_e4m3fn)
                + _shape(f"{what}[1]", recv_x[1], lead + (H // FP8_BLOCK,), torch.float32))
    if isinstance(recv_x, tuple):
        return [f"{what}: expected a bf16 tensor, got a tuple"]
    return _shape(what, recv_x, lead + (H,), torch.bfloat16)


def _payload_equal(got, want) -> torch.Tensor:
    """bool [n]: rows bit-identical (bf16 bits, or fp8 bytes and scale bits); all False when the
    received rows have another dtype or width (reported by the shape checks)."""
    pairs = list(zip(got, want)) if isinstance(want, tuple) and isinstance(got, tuple) else [(got, want)]
    if isinstance(want, tuple) != isinstance(got, tuple) or any(
            a.dtype != b.dtype or a.shape[1:] != b.shape[1:] for a, b in pairs):
        n = (got[0] if isinstance(got, tuple) else got).shape[0]
        return torch.zeros(n, dtype=torch.bool)
    if isinstance(want, tuple):
        return ((got[0].view(torch.uint8) == want[0].view(torch.uint8)).all(dim=1)
                & (got[1].view(torch.int32) == want[1].view(torch.int32)).all(dim=1))
    return (got.view(torch.int16) == want.view(torch.int16)).all(dim=1)


def _take(recv_x, rows):
    return tuple(v[rows] for v in recv_x) if isinstance(recv_x, tuple) else recv_x[rows]


def _set_checks(where: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """got/want: int64 global ids. Each wanted id exactly once, nothing else."""
    out = []
    gs, ws = got.tolist(), want.tolist()
    wanted = set(ws)
    counts: dict[int, int] = {}
    for g in gs:
        counts[g] = counts.get(g, 0) + 1
    missing = [g for g in ws if g not in counts]
    extra = sorted(g for g in counts if g not in wanted)
    dup = sorted(g for g, c in counts.items() if c > 1 and g in wanted)
    if missing:
        out.append(f"{where}: {len(missing)} expected row(s) missing (global tokens {_few(missing)})")
    if extra:
        out.append(f"{where}: {len(extra)} unexpected row(s) (global tokens {_few(extra)})")
    if dup:
        out.append(f"{where}: {len(dup)} token(s) received more than once ({_few(dup)})")
    return out


# ------------------------------------------------------------------------------------------------
# layout


def check_layout(trace: Trace, rank: int, layout: dict | None) -> list[str]:
    if layout is None:
        return []
    own = trace.in_rank[trace.own(rank)]
    topk = trace.topk_idx[trace.own(rank)]
    want_rank = own.sum(dim=0)
    want_expert = torch.stack([(topk == e).any(dim=1).sum() for e in range(trace.experts)]) if trace.experts else None
    out = []
    for name, want in (("num_tokens_per_rank", want_rank), ("num_tokens_per_expert", want_expert),
                       ("is_token_in_rank", own)):
        got = _cpu(layout.get(name))
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            out.append(f"layout: rank {rank}: {name} shape {getattr(got, 'shape', None)}, expected {tuple(want.shape)}")
        elif not torch.equal(got.to(want.dtype), want):
            bad = torch.nonzero(got.to(want.dtype) != want).flatten().tolist()
            out.append(f"layout: rank {rank}: {name} differs at {_few(bad)}")
    return out


# ------------------------------------------------------------------------------------------------
# normal mode


def check_normal_dispatch(trace: Trace, rank: int, res: NormalResult, precision: str,
                          alignment: int = 1) -> list[str]:
    fp8 = precision == "fp8"
    H, k, lpr = trace.hidden, trace.k, trace.lpr
    want = trace.normal_rows(rank)
    N = len(want)
    recv_x = _cpu(res["recv_x"])
    idx, w = _cpu(res["recv_topk_idx"]), _cpu(res["recv_topk_weights"])
    out = [f"dispatch: rank {rank}: {m}" for m in _payload_shape("recv_x", recv_x, (N,), H, fp8)]
    try:
        n_got = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
    except (AttributeError, IndexError, TypeError):
        return out
    out += [f"dispatch: rank {rank}: {m}" for m in _shape("recv_topk_idx", idx, (n_got, k), torch.int64)]
    out += [f"dispatch: rank {rank}: {m}" for m in _shape("recv_topk_weights", w, (n_got, k), torch.float32)]
    try:
        vals = _rows_value(recv_x)
        gids, ok = decode_ids(vals)
    except Exception as e:  # noqa: BLE001 - a malformed result is a failure, not a crash
        return out + [f"dispatch: rank {rank}: cannot read recv_x ({type(e).__name__}: {e})"]
    G = trace.world * trace.tokens
    ok &= (gids >= 0) & (gids < G)
    if not ok.all():
        bad = torch.nonzero(~ok).flatten().tolist()
        out.append(f"dispatch: rank {rank}: {len(bad)} row(s) with no valid source-token id (rows {_few(bad)})")
    out += _set_checks(f"dispatch/set: rank {rank}", gids[ok], want)
    if not out and not torch.equal(gids, want):
        first = int(torch.nonzero(gids != want).flatten()[0])
        out.append(f"dispatch/order: rank {rank}: row {first} holds global token {int(gids[first])}, expected "
                   f"{int(want[first])} (rows grouped by source rank, then token order)")
    rows = torch.nonzero(ok).flatten()
    g = gids[rows]
    if len(rows):
        ref = trace.x_fp8(g) if fp8 else trace.x_bf16(g)
        good = _payload_equal(_take(recv_x, rows), ref)
        if not good.all():
            bad = rows[~good].tolist()
            out.append(f"dispatch/payload: rank {rank}: {len(bad)} row(s) not bit-exact (rows {_few(bad)})")
    if isinstance(idx, torch.Tensor) and idx.dim() == 2 and idx.shape[0] == n_got and idx.shape[1] == k and len(rows):
        want_idx = trace.local_idx(rank, g)
        bad = rows[(idx[rows].long() != want_idx).any(dim=1)].tolist()
        if bad:
            out.append(f"dispatch/topk_idx: rank {rank}: {len(bad)} row(s) with wrong local expert ids (rows {_few(bad)})")
        if isinstance(w, torch.Tensor) and tuple(w.shape) == tuple(idx.shape):
            want_w = torch.where(want_idx >= 0, trace.weights[g], torch.zeros(()))
            bad = rows[(w[rows].float().view(torch.int32) != want_w.view(torch.int32)).any(dim=1)].tolist()
            if bad:
                out.append(f"dispatch/weights: rank {rank}: {len(bad)} row(s) with wrong weights (rows {_few(bad)})")
    counts = res.get("counts")
    want_idx_all = trace.local_idx(rank, want)
    want_counts = [int((want_idx_all == e).any(dim=1).sum()) for e in range(lpr)]
    want_counts = [-(-c // alignment) * alignment for c in want_counts]
    if not isinstance(counts, list):
        out.append(f"dispatch/counts: rank {rank}: num_recv_tokens_per_expert_list is a {type(counts).__name__}, "
                   "expected a Python list")
    elif [int(c) for c in counts] != want_counts:
        diff = [e for e in range(max(len(counts), lpr)) if e >= len(counts) or e >= lpr or int(counts[e]) != want_counts[e]]
        out.append(f"dispatch/counts: rank {rank}: per-expert counts differ at local experts {_few(diff)} "
                   f"(got {_few(counts)}, expected {_few(want_counts)})")
    out += check_layout(trace, rank, res.get("layout"))
    return out


def expert_input_normal(trace: Trace, rank: int, res: NormalResult) -> torch.Tensor:
    """The combine input y [N, H] bf16: per received row, the rank's gate-weighted sum over its
    local experts of f_e(row), from the ids and weights the backend delivered (as an MoE layer
    would), in float32, cast once."""
    recv_x = _cpu(res["recv_x"])
    idx = _cpu(res["recv_topk_idx"]).long()
    w = _cpu(res["recv_topk_weights"]).float()
    x = _rows_value(recv_x)
    N, lpr = x.shape[0], trace.lpr
    W = torch.zeros(N, lpr + 1)
    W.scatter_add_(1, torch.where(idx >= 0, idx, torch.full_like(idx, lpr)).clamp(0, lpr), w)
    W = W[:, :lpr]
    e = torch.arange(lpr) + rank * lpr
    a, b = W @ alpha(e), W @ beta(e)
    return (x * a[:, None] + b[:, None]).to(torch.bfloat16)


def check_combined_weights(trace: Trace, rank: int, got) -> list[str]:
    """Normal combine's reduced weights, when a backend returns them: the token's weight on every
    non-empty slot (each slot's expert is on exactly one rank), 0 on -1 slots."""
    if got is None:
        return []
    got = _cpu(got)
    topk = trace.topk_idx[trace.own(rank)]
    want = torch.where(topk >= 0, trace.weights[trace.own(rank)], torch.zeros(()))
    if _shape("w", got, want.shape, None):
        return [f"combine/weights: rank {rank}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    bad = torch.nonzero((got.float() != want).any(dim=1)).flatten().tolist()
    return [f"combine/weights: rank {rank}: {len(bad)} token(s) with wrong reduced weights ({_few(bad)})"] if bad else []


# ------------------------------------------------------------------------------------------------
# low-latency mode


def check_ll_dispatch(trace: Trace, rank: int, res: LowLatencyResult, precision: str, cap: int) -> list[str]:
    fp8 = precision == "fp8"
    H, lpr, R, T = trace.hidden, trace.lpr, trace.world, trace.tokens
    rows_per_expert = cap * R
    recv_x = _cpu(res["recv_x"])
    cnt, src, rng = _cpu(res["recv_count"]), _cpu(res["src_info"]), _cpu(res["layout_range"])
    out = [f"ll-dispatch: rank {rank}: {m}" for m in _payload_shape("recv_x", recv_x, (lpr, rows_per_expert), H, fp8)]
    out += [f"ll-dispatch: rank {rank}: {m}" for m in _shape("recv_count", cnt, (lpr,), None)]
    out += [f"ll-dispatch: rank {rank}: {m}" for m in _shape("src_info", src, (lpr, rows_per_expert), None)]
    out += [f"ll-dispatch: rank {rank}: {m}" for m in _shape("layout_range", rng, (lpr, R), None)]
    if out:
        return out
    vals = _rows_value(recv_x)
    rng = rng.long()
    for e in range(lpr):
        where = f"rank {rank}, local expert {e}"
        want = trace.ll_rows(rank, e)
        c = int(cnt[e])
        if c != len(want):
            out.append(f"ll-dispatch/count: {where}: recv_count {c}, expected {len(want)}")
        c = max(0, min(c, rows_per_expert))
        begins, counts = (rng[e] >> 32).tolist(), (rng[e] & 0xFFFFFFFF).tolist()
        owner = torch.full((rows_per_expert,), -1, dtype=torch.long)
        for s in range(R):
            want_s = int(((want // T) == s).sum()) if T else 0
            if counts[s] != want_s:
                out.append(f"ll-dispatch/range: {where}: source rank {s} has {counts[s]} row(s), expected {want_s}")
            b, n = begins[s], counts[s]
            if n == 0:
                continue
            if b < 0 or b + n > c:
                out.append(f"ll-dispatch/range: {where}: source rank {s} range [{b}, {b + n}) outside [0, {c})")
                continue
            if (owner[b:b + n] >= 0).any():
                out.append(f"ll-dispatch/range: {where}: ranges of source rank {s} and another overlap")
            owner[b:b + n] = s
        if (owner[:c] < 0).any():
            out.append(f"ll-dispatch/range: {where}: rows {_few(torch.nonzero(owner[:c] < 0).flatten().tolist())} "
                       "are in no source rank's range")
        if c == 0:
            continue
        gids, ok = decode_ids(vals[e, :c])
        ok &= (gids >= 0) & (gids < R * T)
        if not ok.all():
            out.append(f"ll-dispatch: {where}: {int((~ok).sum())} row(s) with no valid source-token id "
                       f"(rows {_few(torch.nonzero(~ok).flatten().tolist())})")
        out += _set_checks(f"ll-dispatch/set: {where}", gids[ok], want)
        rows = torch.nonzero(ok).flatten()
        g = gids[rows]
        s_of = owner[:c][rows]
        wrong_src = rows[(s_of >= 0) & (g // max(T, 1) != s_of)].tolist()
        if wrong_src:
            out.append(f"ll-dispatch/range: {where}: {len(wrong_src)} row(s) lie in another source rank's range "
                       f"(rows {_few(wrong_src)})")
        bad_info = rows[src[e, :c][rows].long() != g % max(T, 1)].tolist()
        if bad_info:
            out.append(f"ll-dispatch/src_info: {where}: {len(bad_info)} row(s) with a wrong source token index "
                       f"(rows {_few(bad_info)})")
        if len(rows):
            ref = ll_quantize(trace.x_bf16(g)) if fp8 else trace.x_bf16(g)
            got = tuple(v[e, :c][rows] for v in recv_x) if fp8 else recv_x[e, :c][rows]
            good = _payload_equal(got, ref)
            if not good.all():
                out.append(f"ll-dispatch/payload: {where}: {int((~good).sum())} row(s) not bit-exact "
                           f"(rows {_few(rows[~good].tolist())})")
    return out


def expert_input_ll(trace: Trace, rank: int, res: LowLatencyResult) -> torch.Tensor:
    """y [E/R, cap*R, H] bf16: f_e of every valid row of local expert e (unweighted: LL combine
    weights at the source); rows past recv_count are NaN, so a combine that reads them fails."""
    recv_x = _cpu(res["recv_x"])
    cnt = _cpu(res["recv_count"])
    q = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    lpr, rows, H = q.shape
    y = torch.full((lpr, rows, H), math.nan, dtype=torch.bfloat16)
    for e in range(lpr):
        c = max(0, min(int(cnt[e]), rows))
        if c == 0:
            continue
        part = (recv_x[0][e, :c], recv_x[1][e, :c]) if isinstance(recv_x, tuple) else recv_x[e, :c]
        x = _rows_value(part)
        ge = torch.tensor(rank * trace.lpr + e)
        y[e, :c] = (x * alpha(ge) + beta(ge)).to(torch.bfloat16)
    return y


# ------------------------------------------------------------------------------------------------
# combine (both modes)


def combine_reference(trace: Trace, rank: int, precision: str, mode: str) -> torch.Tensor:
    """float64 [T, H]: sum_j w_j f_{e_j}(x_t) over the non-empty slots of this rank's tokens."""
    sl = trace.own(rank)
    topk, w = trace.topk_idx[sl], trace.weights[sl].double()
    x = trace.x_value(torch.arange(sl.start, sl.stop), precision, mode).double()
    live = topk >= 0
    e = topk.clamp(min=0)
    a = (torch.where(live, w * alpha(e).double(), torch.zeros((), dtype=torch.float64))).sum(dim=1)
    b = (torch.where(live, w * beta(e).double(), torch.zeros((), dtype=torch.float64))).sum(dim=1)
    return x * a[:, None] + b[:, None]


def check_combine(trace: Trace, rank: int, got, precision: str, mode: str) -> tuple[list[str], float]:
    """Returns (failures, max relative error)."""
    got = _cpu(got)
    T, H = trace.tokens, trace.hidden
    msg = _shape("combined_x", got, (T, H), torch.bfloat16)
    if msg:
        return [f"combine: rank {rank}: {m}" for m in msg], math.inf
    if T == 0:
        return [], 0.0
    ref = combine_reference(trace, rank, precision, mode)
    err = (got.double() - ref).abs() / ref.abs().clamp(min=DENOM_FLOOR)
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    worst = float(err.max())
    if worst < TOLERANCE:
        return [], worst
    bad_tokens = torch.nonzero((err >= TOLERANCE).any(dim=1)).flatten()
    t, c = divmod(int(err.argmax()), H)
    return [f"combine: rank {rank}: {len(bad_tokens)} token(s) off by more than {TOLERANCE:.4f} relative "
            f"(tokens {_few(bad_tokens.tolist())}; worst {worst:.3g} at token {t} column {c}: got "
            f"{float(got[t, c])}, expected {float(ref[t, c]):.6g})"], worst


# ------------------------------------------------------------------------------------------------
# inputs


def snapshot(*tensors) -> list:
    """Copies of the inputs, taken before a backend sees them (see ``check_unchanged``)."""
    out = []
    for t in tensors:
        if isinstance(t, tuple):
            out.append(tuple(v.detach().clone() for v in t))
        else:
            out.append(t.detach().clone() if isinstance(t, torch.Tensor) else t)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def check_unchanged(rank: int, names: list[str], before: list, after: list) -> list[str]:
    out = []
    for name, b, a in zip(names, before, after):
        pairs = list(zip(b, a)) if isinstance(b, tuple) else [(b, a)]
        for bb, aa in pairs:
            if not isinstance(bb, torch.Tensor):
                continue
            if (bb.shape != aa.shape or bb.dtype != aa.dtype
                    or not torch.equal(_bytes(bb), _bytes(aa))):
                out.append(f"inputs: rank {rank}: {name} was modified by the backend")
                break
    return out
