"""Errors injected into a correct result, to show the oracle catches each (the tests, and
``--inject KIND`` of the harness, which corrupts one backend's result on one rank before the
oracle sees it: the case must come out invalid and the run's exit status non-zero).

Kinds (dispatch results, both modes unless said):
  drop-row        normal: the first received row removed; low-latency: the last row of the
                  first non-empty expert dropped (recv_count and its source's range shortened)
  swap-rows       normal: the first two received rows exchanged (order); low-latency: two rows of
                  different sources, or of two experts, exchanged (range / set)
  wrong-weight    normal: one received weight off by 1/32; low-latency: see ``wrong_weight_ll``
  flip-bit        the lowest bit of one payload value (a non-id column) flipped
  wrong-local-id  normal: one local expert id changed to another; low-latency: a row moved to
                  another local expert
  combine-scale   (combine outputs) one token's output off by 1/16 of itself
"""
from __future__ import annotations

import torch

KINDS = ("drop-row", "swap-rows", "wrong-weight", "flip-bit", "wrong-local-id")
COMBINE_KINDS = ("combine-scale",)
PAYLOAD_COLUMN = 40  # past the id columns


def _clone(v):
    if isinstance(v, tuple):
        return tuple(_clone(t) for t in v)
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return {k: _clone(t) for k, t in v.items()}
    return v


class NotApplicable(ValueError):
    """The result is too small for this kind (e.g. swapping rows of a rank that received one)."""


def inject(res: dict, kind: str, mode: str) -> dict:
    """A corrupted copy of ``res`` (the input is left alone)."""
    res = _clone(res)
    if mode == "normal":
        _normal(res, kind)
    else:
        _ll(res, kind)
    return res


def _rows(x, sel):
    return tuple(t[sel] for t in x) if isinstance(x, tuple) else x[sel]


def _normal(res: dict, kind: str) -> None:
    x, idx, w = res["recv_x"], res["recv_topk_idx"], res["recv_topk_weights"]
    n = idx.shape[0]
    if n == 0:
        raise NotApplicable("no rows received")
    if kind == "drop-row":
        keep = torch.arange(1, n)
        res["recv_x"], res["recv_topk_idx"], res["recv_topk_weights"] = _rows(x, keep), idx[keep], w[keep]
    elif kind == "swap-rows":
        if n < 2:
            raise NotApplicable("fewer than two rows")
        p = torch.arange(n)
        p[0], p[1] = 1, 0
        res["recv_x"], res["recv_topk_idx"], res["recv_topk_weights"] = _rows(x, p), idx[p], w[p]
    elif kind == "wrong-weight":
        i, j = (idx >= 0).nonzero()[0].tolist()
        w[i, j] += 1.0 / 32
    elif kind == "flip-bit":
        q = x[0] if isinstance(x, tuple) else x
        v = q.view(torch.uint8 if q.element_size() == 1 else torch.int16)
        v[0, PAYLOAD_COLUMN] ^= 1
    elif kind == "wrong-local-id":
        i, j = (idx >= 0).nonzero()[0].tolist()
        taken = set(idx[i].tolist())
        free = [e for e in range(len(res["counts"])) if e not in taken]
        idx[i, j] = free[0] if free else -1
    else:
        raise ValueError(f"unknown injection {kind!r}")


def _ll(res: dict, kind: str) -> None:
    x, cnt, src, rng = res["recv_x"], res["recv_count"], res["src_info"], res["layout_range"]
    lpr, R = rng.shape
    busy = [e for e in range(lpr) if int(cnt[e]) > 0]
    if not busy:
        raise NotApplicable("no rows received")
    e = busy[0]
    planes = list(x) if isinstance(x, tuple) else [x]
    if kind == "drop-row":
        last = int(cnt[e]) - 1
        cnt[e] -= 1
        for s in range(R):
            b, c = int(rng[e, s]) >> 32, int(rng[e, s]) & 0xFFFFFFFF
            if c and b + c - 1 == last:
                rng[e, s] = (b << 32) | (c - 1)
    elif kind in ("swap-rows", "wrong-local-id"):
        a, b = _two_rows(res, e, across_experts=(kind == "wrong-local-id"))
        for p in planes + [src]:
            tmp = p[a].clone()
            p[a] = p[b]
            p[b] = tmp
    elif kind == "flip-bit":
        q = planes[0]
        v = q.view(torch.uint8 if q.element_size() == 1 else torch.int16)
        v[e, 0, PAYLOAD_COLUMN] ^= 1
    elif kind == "wrong-weight":
        raise NotApplicable("low-latency dispatch carries no weights (use wrong_weight_ll on the combine)")
    else:
        raise ValueError(f"unknown injection {kind!r}")


def _two_rows(res, e, across_experts: bool):
    """Index pairs ((expert, row), (expert, row)) to exchange."""
    cnt, rng = res["recv_count"], res["layout_range"]
    lpr, R = rng.shape
    if not across_experts:
        owners = []
        for s in range(R):
            b, c = int(rng[e, s]) >> 32, int(rng[e, s]) & 0xFFFFFFFF
            if c:
                owners.append(b)
        if len(owners) >= 2:
            return (e, owners[0]), (e, owners[1])
    q = res["recv_x"][0] if isinstance(res["recv_x"], tuple) else res["recv_x"]
    for f in range(lpr):
        for i in range(int(cnt[f]) if f != e else 0):
            if not torch.equal(q[f, i].view(torch.uint8), q[e, 0].view(torch.uint8)):
                return (e, 0), (f, i)
    raise NotApplicable("no second expert with another token's row")


def wrong_weight_ll(weights: torch.Tensor) -> torch.Tensor:
    """A copy of the [G, k] gate weights with the first non-empty slot of token 0 off by 1/4."""
    w = weights.clone()
    w[0, 0] += 0.25
    return w


def inject_combine(out: torch.Tensor, kind: str) -> torch.Tensor:
    if kind != "combine-scale":
        raise ValueError(f"unknown combine injection {kind!r}")
    out = out.detach().cpu().clone()
    if out.shape[0] == 0:
        raise NotApplicable("no tokens")
    out[0] = (out[0].float() * (1 + 1 / 16)).to(out.dtype)
    return out
