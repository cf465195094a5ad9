"""Backend adapters: one interface, declared capabilities, honest "unsupported" reasons.

An adapter is constructed on every rank of a launch (the same call everywhere: constructors may be
collective) and turns the harness's ``Inputs`` into the normalised results oracle.py checks:

    d = adapter.dispatch(inp)             # normal: NormalResult + "handle"; low-latency: LowLatencyResult + "handle"
    x = adapter.dispatch_cached(inp, d)   # normal mode, layout from d["handle"]; None: not offered
    out, weights = adapter.combine(y, d, inp)
    adapter.close()

Capabilities are declared per class (``CAPS``); ``unsupported_reason`` (parent side, from the
environment probe) turns a case the adapter cannot run into a reason instead of a result.
Adding a backend: docs/ep-bench.md, "Adding a backend adapter".

Backends:
  commux-ep   commux.ep.Buffer (DeepEP's legacy Buffer API) on the default "ucx" group
  commux-ep-gloo  the same Buffer on the gloo group (its all_to_all_single path)
  a2a-ucx     the torchtitan-style path on the "ucx" group: rows permuted by destination rank, one
              all_to_all_single of the counts, one of the rows and one of the metadata (uneven
              splits); combine = the reverse all_to_all_single and an index_add in float32
  a2a-gloo    the same on a gloo group over the same ranks
  deepep      deep_ep.Buffer (NVSHMEM; CUDA only) on an NCCL group, when deep_ep imports
  uccl-ep     uccl.ep.Buffer (DeepEP's API over a GPU-to-CPU proxy), when uccl.ep imports
  a2a-even-ucx  not an EP backend: one all_to_all_single (even split, "ucx") moving the logical
              bytes of the normal-mode dispatch; the yardstick of "dispatch / one all_to_all_single"
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("normal", "low-latency")
PRECISIONS = ("bf16", "fp8")
MEMTYPES = ("cpu", "cuda")
REFERENCE_MODE = "reference"


@dataclass(frozen=True)
class ModeCaps:
    layout: str                       # "rank-dedup" (one row per (token, rank)) | "expert-padded" ([E/R, cap*R, H])
    combine: str                      # "unweighted-rank-sum" | "weighted-at-source"
    dtypes: tuple = ("bf16",)


RANK_DEDUP = ModeCaps("rank-dedup", "unweighted-rank-sum", ("bf16", "fp8"))
EXPERT_PADDED = ModeCaps("expert-padded", "weighted-at-source", ("bf16", "fp8"))


@dataclass(frozen=True)
class Capabilities:
    modes: dict                       # mode -> ModeCaps
    memtypes: tuple = ("cpu",)
    group: str = "ucx"                # "ucx" (the default group), "gloo" (ctx.ref) or "nccl"
    module: str | None = None         # a Python module that must import
    cached_layout: bool = False       # dispatch(x, handle=...) offered
    notes: tuple = field(default_factory=tuple)

    def describe(self) -> dict:
        return {"modes": {m: vars(c) | {"dtypes": list(c.dtypes)} for m, c in self.modes.items()},
                "memtypes": list(self.memtypes), "group": self.group, "module": self.module,
                "cached_layout": self.cached_layout}


@dataclass
class Inputs:
    x: object                         # bf16 [T, H] | (fp8 [T, H], float32 [T, H/128])
    topk_idx: torch.Tensor            # int64 [T, k]
    topk_weights: torch.Tensor        # float32 [T, k]
    num_experts: int
    precision: str
    cap: int = 0                      # low-latency num_max_dispatch_tokens_per_rank
    alignment: int = 1


def _group(ctx, kind: str):
    import torch.distributed as dist

    if kind == "ucx":
        return dist.group.WORLD
    if kind == "gloo":
        return ctx.ref
    if kind == "nccl":
        key = ("ep-bench", "nccl-group")
        if key not in ctx.cache:
            ctx.cache[key] = dist.new_group(backend="nccl")
        return ctx.cache[key]
    raise ValueError(kind)


class Adapter:
    name = ""
    CAPS = Capabilities(modes={})

    def __init__(self, ctx, mode: str, device: torch.device, experts: int):
        self.ctx, self.mode, self.device, self.experts = ctx, mode, device, experts
        self.group = _group(ctx, self.CAPS.group)

    def dispatch(self, inp: Inputs) -> dict:
        raise NotImplementedError

    def dispatch_cached(self, inp: Inputs, d: dict):
        return None

    def combine(self, y: torch.Tensor, d: dict, inp: Inputs):
        raise NotImplementedError

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------
# the torchtitan-style all_to_all_single path (rank arithmetic first, apart from communication)


def a2a_plan(topk_idx: torch.Tensor, lpr: int, world: int):
    """(perm [S], send_counts [R], local ids [S, k]): the rows a rank sends, ordered by
    destination rank then token (so a receiver gets them by source rank, then token), how many
    go to each rank, and each row's top-k translated to the destination's local ids."""
    T, k = topk_idx.shape
    live = topk_idx >= 0
    dest = torch.where(live, topk_idx // lpr, torch.full_like(topk_idx, -1))
    hits = torch.zeros(T, world, dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, dest.clamp(min=0), live.to(torch.int32))
    d, t = torch.nonzero(hits.t() > 0, as_tuple=True)
    counts = torch.bincount(d, minlength=world)
    local = torch.where(dest[t] == d[:, None], topk_idx[t] - d[:, None] * lpr, torch.full_like(topk_idx[t], -1))
    return t, counts, local


def pack_meta(local: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor, scales: torch.Tensor | None):
    """int32 [S, 2k + 1 (+ H/128)]: local ids, weight bits (0 where the id is -1), source token
    index, (fp8 scale bits): one all_to_all_single carries all of it."""
    w = torch.where(local >= 0, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    parts = [local.to(torch.int32), w.contiguous().view(torch.int32), perm[:, None].to(torch.int32)]
    if scales is not None:
        parts.append(scales.contiguous().view(torch.int32))
    return torch.cat(parts, dim=1)


def unpack_meta(meta: torch.Tensor, k: int, fp8: bool):
    local = meta[:, :k].long()
    w = meta[:, k:2 * k].contiguous().view(torch.float32)
    src = meta[:, 2 * k].long()
    scales = meta[:, 2 * k + 1:].contiguous().view(torch.float32) if fp8 else None
    return local, w, src, scales


def counts_per_expert(local: torch.Tensor, lpr: int, alignment: int) -> list:
    c = torch.bincount(local[local >= 0].flatten().cpu(), minlength=lpr).tolist()
    return [-(-v // alignment) * alignment for v in c]


class A2AUcx(Adapter):
    name = "a2a-ucx"
    CAPS = Capabilities(modes={"normal": RANK_DEDUP}, memtypes=("cpu", "cuda"), group="ucx",
                        notes=("fp8 rows travel as bytes (uint8 view), scales in the metadata",))

    def _a2a(self, out, inp, out_splits, in_splits):
        import torch.distributed as dist

        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def dispatch(self, inp: Inputs) -> dict:
        world = self.ctx.world
        lpr = self.experts // world
        k = inp.topk_idx.shape[1]
        fp8 = inp.precision == "fp8"
        perm, counts, local = a2a_plan(inp.topk_idx, lpr, world)
        recv_counts = torch.empty_like(counts)
        self._a2a(recv_counts, counts, None, None)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
        n = sum(recv_splits)
        if fp8:
            q, s = inp.x
            rows, scales = q.view(torch.uint8)[perm], s[perm]
        else:
            rows, scales = inp.x[perm], None
        meta = pack_meta(local, inp.topk_weights[perm], perm, scales)
        recv_rows = torch.empty((n, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        recv_meta = torch.empty((n, meta.shape[1]), dtype=meta.dtype, device=meta.device)
        self._a2a(recv_rows, rows, recv_splits, send_splits)
        self._a2a(recv_meta, meta, recv_splits, send_splits)
        r_local, r_w, r_src, r_scales = unpack_meta(recv_meta, k, fp8)
        recv_x = (recv_rows.view(torch.float8_e4m3fn), r_scales) if fp8 else recv_rows
        return {"recv_x": recv_x, "recv_topk_idx": r_local, "recv_topk_weights": r_w,
                "counts": counts_per_expert(r_local, lpr, inp.alignment), "layout": None,
                "handle": (perm, send_splits, recv_splits, inp.topk_idx.shape[0])}

    def combine(self, y: torch.Tensor, d: dict, inp: Inputs):
        perm, send_splits, recv_splits, T = d["handle"]
        back = torch.empty((sum(send_splits), y.shape[1]), dtype=y.dtype, device=y.device)
        self._a2a(back, y, send_splits, recv_splits)
        out = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, perm, back.float())
        return out.to(y.dtype), None


class A2AGloo(A2AUcx):
    name = "a2a-gloo"
    CAPS = Capabilities(modes={"normal": RANK_DEDUP}, memtypes=("cpu",), group="gloo",
                        notes=A2AUcx.CAPS.notes)


# ------------------------------------------------------------------------------------------------
# DeepEP's legacy Buffer API (commux.ep, deep_ep, uccl.ep)


class DeepEPApi(Adapter):
    """Any implementation of DeepEP's legacy ``Buffer``: ``make_buffer`` is the only difference."""

    def __init__(self, ctx, mode, device, experts):
        super().__init__(ctx, mode, device, experts)
        self.buf = self.make_buffer(low_latency=(mode == "low-latency"))

    def make_buffer(self, low_latency: bool):
        raise NotImplementedError

    def dispatch(self, inp: Inputs) -> dict:
        if self.mode == "normal":
            ntr, ntrr, nte, itir, _ = self.buf.get_dispatch_layout(inp.topk_idx, inp.num_experts)
            kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itir, num_tokens_per_expert=nte,
                      topk_idx=inp.topk_idx, topk_weights=inp.topk_weights, expert_alignment=inp.alignment)
            if ntrr is not None:
                kw["num_tokens_per_rdma_rank"] = ntrr
            recv_x, ridx, rw, counts, handle, _ = self.buf.dispatch(inp.x, **kw)
            return {"recv_x": recv_x, "recv_topk_idx": ridx, "recv_topk_weights": rw, "counts": counts,
                    "layout": {"num_tokens_per_rank": ntr, "num_tokens_per_expert": nte, "is_token_in_rank": itir},
                    "handle": handle}
        recv_x, recv_count, handle, _, _hook = self.buf.low_latency_dispatch(
            inp.x, inp.topk_idx, inp.cap, inp.num_experts, use_fp8=(inp.precision == "fp8"))
        return {"recv_x": recv_x, "recv_count": recv_count, "src_info": handle[0], "layout_range": handle[1],
                "handle": handle}

    def dispatch_cached(self, inp: Inputs, d: dict):
        if self.mode != "normal":
            return None
        return self.buf.dispatch(inp.x, handle=d["handle"])[0]

    def combine(self, y, d, inp):
        if self.mode == "normal":
            out, weights, _ = self.buf.combine(y, d["handle"], topk_weights=d["recv_topk_weights"])
            return out, weights
        out, _, _ = self.buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, d["handle"])
        return out, None

    def close(self) -> None:
        destroy = getattr(self.buf, "destroy", None)
        if destroy is not None:
            destroy()


class CommuxEp(DeepEPApi):
    name = "commux-ep"
    CAPS = Capabilities(modes={"normal": RANK_DEDUP, "low-latency": EXPERT_PADDED}, memtypes=("cpu", "cuda"),
                        group="ucx", module="commux.ep", cached_layout=True)

    def make_buffer(self, low_latency):
        from commux.ep import Buffer

        return Buffer(self.group, low_latency_mode=True) if low_latency else Buffer(self.group)


class CommuxEpGloo(CommuxEp):
    """commux.ep.Buffer on the gloo group: the same Buffer code over all_to_all_single, which
    separates what the transport costs from what the Buffer's own work costs."""
    name = "commux-ep-gloo"
    CAPS = Capabilities(modes=CommuxEp.CAPS.modes, memtypes=("cpu",), group="gloo", module="commux.ep",
                        cached_layout=True)


class DeepEP(DeepEPApi):
    name = "deepep"
    CAPS = Capabilities(modes={"normal": RANK_DEDUP, "low-latency": EXPERT_PADDED}, memtypes=("cuda",),
                        group="nccl", module="deep_ep", cached_layout=True,
                        notes=("not exercised on the development machine (no GPU, no deep_ep)",))
    NVL_BYTES = 1 << 30
    LL_MAX_TOKENS = 128
    HIDDEN = 7168

    def _module(self):
        import deep_ep

        return deep_ep

    def make_buffer(self, low_latency):
        m = self._module()
        if low_latency:
            rdma = m.Buffer.get_low_latency_rdma_size_hint(self.LL_MAX_TOKENS, self.HIDDEN, self.ctx.world, self.experts)
            return m.Buffer(self.group, 0, rdma, low_latency_mode=True,
                            num_qps_per_rank=max(1, self.experts // self.ctx.world))
        return m.Buffer(self.group, self.NVL_BYTES, 0)


class UcclEp(DeepEP):
    name = "uccl-ep"
    CAPS = Capabilities(modes=DeepEP.CAPS.modes, memtypes=("cuda",), group="nccl", module="uccl.ep",
                        cached_layout=True, notes=DeepEP.CAPS.notes)

    def _module(self):
        from uccl import ep

        return ep


ADAPTERS = {a.name: a for a in (CommuxEp, CommuxEpGloo, A2AUcx, A2AGloo, DeepEP, UcclEp)}
REFERENCE = "a2a-even-ucx"
REFERENCE_CAPS = Capabilities(modes={REFERENCE_MODE: ModeCaps("even-split", "none", ("bf16",))},
                              memtypes=("cpu", "cuda"), group="ucx")
ALL_BACKENDS = tuple(ADAPTERS) + (REFERENCE,)


def caps_of(backend: str) -> Capabilities:
    return REFERENCE_CAPS if backend == REFERENCE else ADAPTERS[backend].CAPS


def unsupported_reason(backend: str, mode: str, precision: str, memtype: str, env: dict) -> str | None:
    """Why a case cannot run here (None: runnable). ``env`` is run.probe_environment()'s dict."""
    caps = caps_of(backend)
    if caps.group == "ucx" and not env["commux"]["ok"]:
        return "backend-not-installed"
    if caps.module and not env["modules"].get(caps.module, {}).get("ok"):
        return "backend-not-installed"
    if mode not in caps.modes:
        return f"mode-not-offered:{mode}"
    if precision not in caps.modes[mode].dtypes:
        return f"dtype-not-offered:{precision}"
    if memtype not in caps.memtypes:
        return f"memtype-not-offered:{memtype}"
    if memtype == "cuda":
        if not env["cuda"]["available"]:
            return "no-accelerator"
        if caps.group == "ucx" and "cuda" not in env["commux"].get("memory_types", []):
            return "ucx-lacks-memtype:cuda"
    return None
