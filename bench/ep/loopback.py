"""Every rank of one EP exchange in one process, without communication: the correct results the
oracle's tests start from (python/tests/test_ep_bench.py), so worlds of 1..N ranks and token counts
0, 1, odd, large are checked cheaply (and errors injected into them, see inject.py).

Normal mode reuses the adapters' rank arithmetic (``a2a_plan``/``pack_meta``), with lists standing
in for all_to_all_single; low-latency mode fills the padded [E/R, cap*R, H] buffers directly, each
source's rows contiguous and in token order. Combines follow the contract: normal sums the ranks'
rows per token in float32 and casts once; low-latency weights at the source.
"""
from __future__ import annotations

import torch

from .adapters import a2a_plan, counts_per_expert, pack_meta, unpack_meta
from .routing import Trace, ll_quantize


def inputs(trace: Trace, rank: int, precision: str, mode: str):
    """(x, topk_idx, topk_weights) of one rank, as the harness builds them."""
    sl = trace.own(rank)
    g = torch.arange(sl.start, sl.stop)
    x = trace.x_fp8(g) if (precision == "fp8" and mode == "normal") else trace.x_bf16(g)
    return x, trace.topk_idx[sl].clone(), trace.weights[sl].clone()


def normal_dispatch(trace: Trace, precision: str, alignment: int = 1) -> list[dict]:
    R, k, lpr = trace.world, trace.k, trace.lpr
    fp8 = precision == "fp8"
    sent = []   # per source: (rows per dest, meta per dest, perm, counts)
    for s in range(R):
        x, topk, w = inputs(trace, s, precision, "normal")
        perm, counts, local = a2a_plan(topk, lpr, R)
        rows, scales = (x[0].view(torch.uint8)[perm], x[1][perm]) if fp8 else (x[perm], None)
        meta = pack_meta(local, w[perm], perm, scales)
        sent.append((list(rows.split(counts.tolist())), list(meta.split(counts.tolist())), perm, counts.tolist()))
    out = []
    for r in range(R):
        rows = torch.cat([sent[s][0][r] for s in range(R)]) if R else None
        meta = torch.cat([sent[s][1][r] for s in range(R)])
        local, w, _src, scales = unpack_meta(meta, k, fp8)
        recv_x = (rows.view(torch.float8_e4m3fn), scales) if fp8 else rows
        lay_topk = trace.topk_idx[trace.own(r)]
        layout = {"num_tokens_per_rank": trace.in_rank[trace.own(r)].sum(dim=0),
                  "num_tokens_per_expert": torch.stack([(lay_topk == e).any(dim=1).sum() for e in range(trace.experts)]),
                  "is_token_in_rank": trace.in_rank[trace.own(r)].clone()}
        out.append({"recv_x": recv_x, "recv_topk_idx": local, "recv_topk_weights": w,
                    "counts": counts_per_expert(local, lpr, alignment), "layout": layout,
                    "handle": {"recv_from": [sent[s][3][r] for s in range(R)]}})
    # the combine needs every source's perm and splits
    for r in range(R):
        out[r]["handle"]["sources"] = [(sent[s][2], sent[s][3]) for s in range(R)]
    return out


def normal_combine(trace: Trace, ys: list[torch.Tensor], results: list[dict]) -> list[torch.Tensor]:
    """ys[r]: [N_r, H] bf16, one row per row rank r received. Returns per source rank [T, H] bf16."""
    R, T, H = trace.world, trace.tokens, trace.hidden
    pieces = [list(ys[r].split(results[r]["handle"]["recv_from"])) for r in range(R)]  # pieces[r][s]
    out = []
    for s in range(R):
        perm, counts = results[0]["handle"]["sources"][s]
        back = torch.cat([pieces[r][s] for r in range(R)]) if R else torch.zeros(0, H)
        acc = torch.zeros(T, H, dtype=torch.float32)
        acc.index_add_(0, perm, back.float())
        out.append(acc.to(torch.bfloat16))
    return out


def combined_weights(trace: Trace, results: list[dict]) -> list[torch.Tensor]:
    """What a normal combine returns as reduced weights: per token and slot, the sum over ranks."""
    R, k = trace.world, trace.k
    out = []
    for s in range(R):
        perm, counts = results[0]["handle"]["sources"][s]
        acc = torch.zeros(trace.tokens, k)
        for r in range(R):
            off = sum(results[r]["handle"]["recv_from"][:s])
            w = results[r]["recv_topk_weights"][off:off + results[r]["handle"]["recv_from"][s]]
            idx = perm[sum(counts[:r]):sum(counts[:r + 1])]
            acc.index_add_(0, idx, w)
        out.append(acc)
    return out


def ll_dispatch(trace: Trace, precision: str, cap: int) -> list[dict]:
    R, T, H, lpr = trace.world, trace.tokens, trace.hidden, trace.lpr
    fp8 = precision == "fp8"
    rows = cap * R
    out = []
    for r in range(R):
        x = torch.zeros(lpr, rows, H, dtype=torch.bfloat16)
        q = torch.zeros(lpr, rows, H, dtype=torch.float8_e4m3fn)
        sc = torch.zeros(lpr, rows, H // 128)
        src_info = torch.full((lpr, rows), -1, dtype=torch.int32)
        rng = torch.zeros(lpr, R, dtype=torch.int64)
        count = torch.zeros(lpr, dtype=torch.int32)
        for e in range(lpr):
            gids = trace.ll_rows(r, e)
            begin = 0
            for s in range(R):
                g = gids[(gids // max(T, 1)) == s] if T else gids[:0]
                n = len(g)
                if n:
                    xb = trace.x_bf16(g)
                    if fp8:
                        qq, ss = ll_quantize(xb)
                        q[e, begin:begin + n], sc[e, begin:begin + n] = qq, ss
                    else:
                        x[e, begin:begin + n] = xb
                    src_info[e, begin:begin + n] = (g % T).to(torch.int32)
                rng[e, s] = (begin << 32) | n
                begin += n
            count[e] = begin
        out.append({"recv_x": (q, sc) if fp8 else x, "recv_count": count, "src_info": src_info, "layout_range": rng})
    return out


def ll_combine(trace: Trace, ys: list[torch.Tensor], results: list[dict],
               weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Weighted at the source: out[t] = sum_j w[t, j] * y(row of (t, e_j)), float32, one cast.
    ``weights`` [G, k] overrides the trace's (to inject a wrong weight)."""
    R, T, H, lpr = trace.world, trace.tokens, trace.hidden, trace.lpr
    w_all = trace.weights if weights is None else weights
    where = {}   # (global token, expert) -> (rank, local expert, row)
    for r in range(R):
        res = results[r]
        for e in range(lpr):
            for i in range(int(res["recv_count"][e])):
                s = next(s for s in range(R) if (int(res["layout_range"][e, s]) >> 32) <= i
                         < (int(res["layout_range"][e, s]) >> 32) + (int(res["layout_range"][e, s]) & 0xFFFFFFFF))
                where[(s * T + int(res["src_info"][e, i]), r * lpr + e)] = (r, e, i)
    out = []
    for s in range(R):
        acc = torch.zeros(T, H)
        for t in range(T):
            g = s * T + t
            for j in range(trace.k):
                ex = int(trace.topk_idx[g, j])
                if ex < 0:
                    continue
                r, e, i = where[(g, ex)]
                acc[t] += w_all[g, j] * ys[r][e, i].float()
        out.append(acc.to(torch.bfloat16))
    return out
