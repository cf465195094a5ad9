"""Deterministic routing traces and exact activations (pure functions; no communication).

Every value comes from one keyed counter hash, splitmix64 chained over (seed, stream, words...):

    h = mix(seed); h = mix(h ^ stream); for w in words: h = mix(h ^ w)

so any rank computes the same routing for any global token without talking to the others, and the
parent can recompute what a rank should have received. Streams (the second word) keep the uses
apart: ROUTE (expert of (token, slot, attempt)), EMPTY (a -1 slot), WEIGHT, ACT (bf16 lattice),
FP8 (e4m3 lattice), SCALE (fp8 scales), REF (the all_to_all_single reference payload).

Global token id: g = source_rank * tokens + t (t the row in the source's x).

Activations (bf16, exact): column c < 32 carries bit c of g as +1 (set) / -1 (clear), so a
receiver can tell who sent each row; the other columns are ((h % 17) - 8) / 64. fp8 inputs of
normal mode: the e4m3 values are +-1 (id bits) and integers -8..8 (exact in e4m3), the scales
2^-(4 + h % 4) (exact), so the dequantised value q * scale is exact in float32 and bf16. Low-latency
fp8 is quantised by the backend from the bf16 activations; ``ll_quantize`` recomputes it bit-exactly
(per 128-column block: amax = max|x| clamped to >= 1e-4, scale = amax / 448, q = x / scale in e4m3).

Gate weights are (24 + h % 9) / 32 in [0.75, 1] (exact in float32), also on -1 slots (a backend must
ignore them there). With the positive expert transform of oracle.py every combine term is positive
and at least 5% of a token's sum, so a lost or doubled contribution is always visible.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np
import torch

ROUTE, EMPTY, WEIGHT, ACT, FP8, SCALE, REF = 1, 2, 3, 4, 5, 6, 7
ID_BITS = 32          # columns carrying the global token id
FP8_BLOCK = 128       # columns per fp8 scale
FP8_MAX = 448.0       # largest finite float8_e4m3fn
AMAX_MIN = 1e-4

_U = np.uint64


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + _U(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


def keyed(seed: int, stream: int, *words) -> np.ndarray:
    """splitmix64 chained over (seed, stream, *words); words are ints or integer arrays that
    broadcast together. Returns a uint64 array (at least 1-d)."""
    with np.errstate(over="ignore"):
        h = _mix(np.atleast_1d(np.asarray(seed & 0xFFFFFFFFFFFFFFFF, dtype=_U)))
        h = _mix(h ^ _U(stream))
        for w in words:
            h = _mix(h ^ np.atleast_1d(np.asarray(w)).astype(_U))
    return h


@dataclass(frozen=True)
class RoutingSpec:
    world: int
    tokens: int          # per rank
    experts: int
    hidden: int
    topk: int
    seed: int = 1
    empty: float = 0.0   # probability of a -1 slot

    def __post_init__(self):
        if self.experts % self.world:
            raise ValueError(f"experts {self.experts} not divisible by world {self.world}")
        if not 0 < self.topk <= self.experts:
            raise ValueError(f"topk {self.topk} not in 1..experts")
        if self.hidden % FP8_BLOCK or self.hidden < ID_BITS:
            raise ValueError(f"hidden {self.hidden} must be a multiple of {FP8_BLOCK}")


class Trace:
    """The routing of every global token of one (world, tokens, experts, topk, seed) point."""

    def __init__(self, spec: RoutingSpec):
        self.spec = spec
        s = spec
        self.world, self.tokens, self.experts, self.hidden, self.k = s.world, s.tokens, s.experts, s.hidden, s.topk
        self.lpr = s.experts // s.world          # local experts per rank
        G = s.world * s.tokens
        g = np.arange(G, dtype=np.int64)
        idx = np.full((G, s.topk), -1, dtype=np.int64)
        for j in range(s.topk):
            cand = (keyed(s.seed, ROUTE, g, j, 0) % _U(s.experts)).astype(np.int64) if G else np.zeros(0, np.int64)
            for attempt in range(1, 10_000):
                clash = (idx[:, :j] == cand[:, None]).any(axis=1) if j else np.zeros(G, bool)
                if not clash.any():
                    break
                redraw = (keyed(s.seed, ROUTE, g, j, attempt) % _U(s.experts)).astype(np.int64)
                cand = np.where(clash, redraw, cand)
            idx[:, j] = cand
        if s.empty > 0 and G:
            u = (keyed(s.seed, EMPTY, g[:, None], np.arange(s.topk)[None, :]) >> _U(11)).astype(np.float64) / 2.0 ** 53
            idx[u < s.empty] = -1
        w = (24 + (keyed(s.seed, WEIGHT, g[:, None], np.arange(s.topk)[None, :]) % _U(9)).astype(np.int64)) / 32.0
        self.topk_idx = torch.from_numpy(idx.reshape(G, s.topk))
        self.weights = torch.from_numpy(w.reshape(G, s.topk).astype(np.float32))
        h = hashlib.sha256(json.dumps(asdict(s), sort_keys=True).encode())
        h.update(idx.tobytes())
        h.update(self.weights.numpy().tobytes())
        self.digest = h.hexdigest()

    # -- routing facts --------------------------------------------------------------------------
    def own(self, rank: int) -> slice:
        return slice(rank * self.tokens, (rank + 1) * self.tokens)

    @cached_property
    def dest_rank(self) -> torch.Tensor:
        """[G, k]: the rank holding each slot's expert, -1 for an empty slot."""
        return torch.where(self.topk_idx >= 0, self.topk_idx // self.lpr, torch.full_like(self.topk_idx, -1))

    @cached_property
    def in_rank(self) -> torch.Tensor:
        """[G, R] bool: token g goes to rank d."""
        G = self.world * self.tokens
        m = torch.zeros(G, self.world, dtype=torch.bool)
        d = self.dest_rank
        for j in range(self.k):
            ok = d[:, j] >= 0
            m[torch.nonzero(ok).flatten(), d[ok, j]] = True
        return m

    def local_idx(self, rank: int, gids: torch.Tensor) -> torch.Tensor:
        """[n, k]: the local expert ids on ``rank`` of the tokens ``gids``, -1 elsewhere."""
        t = self.topk_idx[gids]
        return torch.where(self.dest_rank[gids] == rank, t - rank * self.lpr, torch.full_like(t, -1))

    def normal_rows(self, rank: int) -> torch.Tensor:
        """The global ids a rank receives in normal mode, in the specified order: by source rank,
        then token (which is the order of g)."""
        return torch.nonzero(self.in_rank[:, rank]).flatten()

    def ll_rows(self, rank: int, local_expert: int) -> torch.Tensor:
        """The global ids routed to one local expert of ``rank`` (low-latency: per assignment)."""
        e = rank * self.lpr + local_expert
        return torch.nonzero((self.topk_idx == e).any(dim=1)).flatten()

    @cached_property
    def rank_copies(self) -> int:
        """(token, destination rank) pairs over all ranks: what normal dispatch moves."""
        return int(self.in_rank.sum())

    @cached_property
    def expert_copies(self) -> int:
        """(token, expert) assignments over all ranks: what low-latency dispatch moves."""
        return int((self.topk_idx >= 0).sum())

    def rank_copies_from(self, rank: int) -> int:
        return int(self.in_rank[self.own(rank)].sum())

    # -- activations ----------------------------------------------------------------------------
    def _id_columns(self, gids: torch.Tensor) -> torch.Tensor:
        bits = (gids[:, None] >> torch.arange(ID_BITS)[None, :]) & 1
        return bits.float() * 2 - 1

    @cached_property
    def _bf16_table(self) -> torch.Tensor:
        return self._gen_bf16(torch.arange(self.world * self.tokens))

    @cached_property
    def _fp8_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gen_fp8(torch.arange(self.world * self.tokens))

    def x_bf16(self, gids: torch.Tensor) -> torch.Tensor:
        """[n, H] bf16 activations of the global tokens ``gids`` (exact)."""
        return self._bf16_table[gids]

    def x_fp8(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [n, H] float8_e4m3fn, scales [n, H/128] float32), all exact (normal-mode fp8 input)."""
        q, s = self._fp8_table
        return q[gids], s[gids]

    def _gen_bf16(self, gids: torch.Tensor) -> torch.Tensor:
        n, H = len(gids), self.hidden
        cols = np.arange(H)
        h = keyed(self.spec.seed, ACT, gids.numpy()[:, None], cols[None, :]) if n else np.zeros((0, H), _U)
        v = torch.from_numpy(((h % _U(17)).astype(np.int64) - 8).reshape(n, H).astype(np.float32) / 64.0)
        v[:, :ID_BITS] = self._id_columns(gids)
        return v.to(torch.bfloat16)

    def _gen_fp8(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, H, B = len(gids), self.hidden, self.hidden // FP8_BLOCK
        g = gids.numpy()[:, None]
        h = keyed(self.spec.seed, FP8, g, np.arange(H)[None, :]) if n else np.zeros((0, H), _U)
        q = torch.from_numpy(((h % _U(17)).astype(np.int64) - 8).reshape(n, H).astype(np.float32))
        q[:, :ID_BITS] = self._id_columns(gids)
        hs = keyed(self.spec.seed, SCALE, g, np.arange(B)[None, :]) if n else np.zeros((0, B), _U)
        s = torch.from_numpy(np.ldexp(1.0, -(4 + (hs % _U(4)).astype(np.int64))).reshape(n, B).astype(np.float32))
        return q.to(torch.float8_e4m3fn), s

    def x_value(self, gids: torch.Tensor, precision: str, mode: str) -> torch.Tensor:
        """float32 [n, H]: the value an expert sees for these tokens (the dequantised fp8 where fp8)."""
        if precision == "bf16":
            return self.x_bf16(gids).float()
        if mode == "normal":
            return dequantize(*self.x_fp8(gids))
        return dequantize(*ll_quantize(self.x_bf16(gids)))


def ll_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's per-128-column e4m3 quantisation of bf16 ``x`` [n, H], bit-exact."""
    n, H = x.shape
    xb = x.float().view(n, H // FP8_BLOCK, FP8_BLOCK)
    amax = xb.abs().amax(dim=-1).clamp(min=AMAX_MIN) if n else torch.zeros(0, H // FP8_BLOCK)
    scale = amax / FP8_MAX
    q = (xb / scale[..., None]).to(torch.float8_e4m3fn).view(n, H)
    return q, scale


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, H = q.shape
    return (q.float().view(n, H // FP8_BLOCK, FP8_BLOCK) * s.float()[..., None]).view(n, H)


def decode_ids(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gids int64 [n], ok bool [n]) from the sign of the first 32 columns of float rows [n, H];
    ok is False for a row whose id columns are zero, NaN or inf (not a row the harness sent)."""
    head = rows[:, :ID_BITS].float()
    ok = (torch.isfinite(head) & (head != 0)).all(dim=1)
    bits = (head > 0).long()
    gids = (bits << torch.arange(ID_BITS)[None, :]).sum(dim=1)
    return gids, ok


def logical_bytes(trace: Trace, precision: str) -> dict:
    """Logical bytes of one dispatch and one combine over all ranks, from the routing trace
    ((token, destination rank) copies x H x bytes per value, + fp8 scales; combine in bf16).
    Not link bandwidth: a backend may move more (padding, metadata) or less (local copies)."""
    H = trace.hidden
    row = H * (1 if precision == "fp8" else 2) + (H // FP8_BLOCK * 4 if precision == "fp8" else 0)
    return {
        "basis": "(token, destination rank) copies x hidden x bytes per value (+ fp8 scales)",
        "rank_copies": trace.rank_copies,
        "expert_copies": trace.expert_copies,
        "dispatch": trace.rank_copies * row,
        "combine": trace.rank_copies * H * 2,
        "dispatch_per_rank_max": max((trace.rank_copies_from(r) for r in range(trace.world)), default=0) * row,
    }
