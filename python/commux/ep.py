"""commux.ep: expert-parallel dispatch and combine with DeepEP's legacy ``Buffer`` API.

Code written for DeepEP (or UCCL-EP, which copies its API) moves over by changing the import::

    from commux.ep import Buffer          # instead of: from deep_ep import Buffer
    buf = Buffer(group)                    # Buffer(group, low_latency_mode=True) for the LL calls
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    y, y_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

How it travels. On a group whose backend is commux ("ucx"/"commux"), every call is one sparse
all-to-all on the calling thread (``ProcessGroupUCX.exchange_bytes``): first a fixed-size header to
every rank (what this rank is calling, its sizes, how many bytes it sends that rank, or why it
rejected the call), then one message per destination that carries all of that destination's rows
with their metadata (source row, expert ids, weights, fp8 scales), packed row by row. The messages
use internal tags drawn from the group's collective sequence, so they can never match the user's
own point-to-point traffic, a collective, or another Buffer's exchange. On any other backend
(gloo) the same two steps run over ``all_to_all_single`` with uneven splits, so the two can be
compared on one API.

Errors. Every rank validates its own call and sends the verdict in its header, so bad input on one
rank fails the call on every rank, promptly, never a hang: the rank with the bad input raises
``ValueError`` naming the problem; the others raise ``DistBackendError`` naming that rank and its
reason. Arguments that must agree across ranks (hidden size, dtype, top-k, number of experts,
Buffer, low-latency capacity) are compared in the headers and a difference fails on every rank.

Arguments accepted for DeepEP compatibility and ignored (commux sizes its messages per call and
completes each call before it returns): ``num_nvl_bytes``, ``num_rdma_bytes``,
``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``config``,
``previous_event``, ``async_finish``, ``allocate_on_comm_stream``, ``num_tokens_per_rdma_rank``,
``round_scale=False``, ``zero_copy``, ``cumulative_local_expert_recv_stats`` (updated),
``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` (left as they are).
Refused with a clear error: ``enable_shrink=True`` (rank masking), ``comm=`` without a group
(an mpi4py communicator), ``use_ue8m0=True``, ``use_logfmt=True``, ``bias`` in combine.
Events are ``None`` on CPU; on a GPU an ``EventOverlap`` that is already complete (the work was
ordered on the current stream). ``return_recv_hook=True`` returns a hook that does nothing (the
data has arrived when the call returns).
"""
from __future__ import annotations

import itertools
import threading
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["Buffer", "EventOverlap", "Config"]

_MAGIC = 0x434D58455001  # "CMXEP" + wire version 1
# Header row (int64), one per destination rank.
_H_MAGIC, _H_KIND, _H_STATUS, _H_BUFFER, _H_CALL, _H_HIDDEN, _H_DTYPE, _H_TOPK, _H_EXPERTS, \
    _H_ROWS, _H_BYTES, _H_STRIDE, _H_CAP, _H_TOKENS, _H_LAYOUT = range(15)
_H_TEXT = 16          # the rejection reason, UTF-8, from here to the end of the row
_H_LEN = 16 + 32      # 48 int64 = 384 bytes a destination
_TEXT_BYTES = (_H_LEN - _H_TEXT) * 8

_KINDS = {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine"}
_DTYPES = {0: "none", 1: "bfloat16", 2: "float8_e4m3fn with float32 scales"}
# Fields every rank of a call must agree on, with the words an error uses for them.
_MUST_AGREE = [(_H_KIND, "call"), (_H_BUFFER, "Buffer"), (_H_CALL, "call number on the Buffer"),
               (_H_HIDDEN, "hidden size"), (_H_DTYPE, "dtype"), (_H_TOPK, "top-k"),
               (_H_EXPERTS, "number of experts"), (_H_STRIDE, "row layout"),
               (_H_CAP, "num_max_dispatch_tokens_per_rank"),
               (_H_LAYOUT, "handle (the dispatch call it comes from)")]

_FP8_BLOCK = 128
_FP8_MAX = 448.0
_UCX_BACKENDS = ("ucx", "commux")


class Config:
    """DeepEP's performance-tuning config, accepted and ignored (commux has no SM or chunk knobs)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class EventOverlap:
    """DeepEP's event wrapper. commux completes every call before it returns, ordered on the
    current stream, so there is nothing left to wait for."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.wait(torch.cuda.current_stream())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


class _Handle(tuple):
    """A tuple in DeepEP's shape (so code that unpacks it keeps working) that also carries what
    commux's combine needs and which Buffer made it."""

    def __new__(cls, items, **state):
        h = super().__new__(cls, items)
        h.__dict__.update(state)
        return h


class _Rejected(Exception):
    """This rank's own input is bad: the reason goes into its headers, then ValueError."""


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Layout:
    """Byte layout of one packed row: named fields at 4-byte-aligned offsets."""

    def __init__(self, fields: List[Tuple[str, int]]):
        self.offsets = {}
        o = 0
        for name, nbytes in fields:
            self.offsets[name] = (o, nbytes)
            o = _pad(o + nbytes, 4)
        self.stride = _pad(max(o, 4), 16)

    def pack(self, rows: int, parts: dict, like: torch.Tensor) -> torch.Tensor:
        out = torch.empty((rows, self.stride), dtype=torch.uint8, device=like.device)
        for name, t in parts.items():
            o, n = self.offsets[name]
            if n:
                t = t.reshape(rows, n // t.element_size())
                if t.numel() and t.stride(-1) != 1:  # (a size-1 dim counts as contiguous anyway)
                    t = t.clone(memory_format=torch.contiguous_format)
                out[:, o:o + n] = t.contiguous().view(torch.uint8)
        return out

    def field(self, rows: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
        o, n = self.offsets[name]
        return rows[:, o:o + n].contiguous().view(dtype)


class _Ucx:
    """commux's own sparse all-to-all (one message per destination, internal tags)."""

    def __init__(self, pg):
        self.pg = pg

    def exchange(self, op, send, send_bytes, recv_bytes, timeout_ms):
        return self.pg._exchange_bytes(op, send, send_bytes, recv_bytes, timeout_ms)


class _AllToAll:
    """Any other backend: the same exchange as one all_to_all_single with uneven splits."""

    def __init__(self, group):
        self.group = group

    def exchange(self, op, send, send_bytes, recv_bytes, timeout_ms):
        out = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(out, send, output_split_sizes=recv_bytes,
                               input_split_sizes=send_bytes, group=self.group)
        return out


_ids_lock = threading.Lock()
_next_ids: dict = {}  # group -> the next Buffer id (ranks create their Buffers in the same order)


def _backend_error(msg: str) -> Exception:
    cls = getattr(dist, "DistBackendError", RuntimeError)
    return cls(msg)


def _quantize_fp8(x: torch.Tensor, round_scale: bool):
    """bf16 [T, H] -> (float8_e4m3fn [T, H], float32 scales [T, H/128]): per 128-column block,
    scale = max(|x|, 1e-4) / 448 (rounded up to a power of two with round_scale)."""
    t, h = x.shape
    blocks = x.float().view(t, h // _FP8_BLOCK, _FP8_BLOCK)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-4) / _FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale.unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


class Buffer:
    """DeepEP's legacy ``Buffer`` over commux (see the module docstring).

    ``max_tokens_per_rank`` (a commux addition) is how many tokens one rank may dispatch in one
    normal-mode call; a call with more fails on every rank. ``timeout`` (seconds; a commux
    addition) bounds each call; the default is the group's timeout.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 max_tokens_per_rank: int = 4096, timeout: Optional[float] = None) -> None:
        if group is None and comm is not None:
            raise ValueError("commux.ep.Buffer: an mpi4py communicator (comm=) is not supported; "
                             "pass a torch.distributed process group")
        if enable_shrink:
            raise ValueError("commux.ep.Buffer: enable_shrink=True (masking ranks) is not supported")
        if not dist.is_initialized():
            raise RuntimeError("commux.ep.Buffer: torch.distributed is not initialized "
                               "(call dist.init_process_group first)")
        if max_tokens_per_rank < 0:
            raise ValueError(f"commux.ep.Buffer: max_tokens_per_rank={max_tokens_per_rank} is negative")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.max_tokens_per_rank = max_tokens_per_rank
        self._timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        self.backend = dist.get_backend(self.group)
        if self.backend in _UCX_BACKENDS:
            self._transport = _Ucx(self.group._get_backend(torch.device("cpu")))
        else:
            self._transport = _AllToAll(self.group)
        with _ids_lock:
            self._id = _next_ids.get(self.group, 0)
            _next_ids[self.group] = self._id + 1
        self._calls = itertools.count()
        self._destroyed = False

    # --- DeepEP's static helpers --------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        return 0  # commux allocates per call

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: every low-latency call writes fresh tensors."""

    def destroy(self) -> None:
        """Releases the Buffer; later calls on it fail (on every rank)."""
        self._destroyed = True

    # --- layout (local: no communication) ------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """num_tokens_per_rank [R] int32, None (one node), num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event."""
        try:
            idx = self._check_topk(topk_idx, num_experts)
        except _Rejected as e:
            raise ValueError(f"commux ep get_dispatch_layout: {e}") from None
        in_rank = self._in_rank(idx, num_experts)
        per_expert = torch.bincount(idx[idx >= 0], minlength=num_experts).to(torch.int32)
        return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank, self._event(idx)

    # --- normal mode -----------------------------------------------------------------------------
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, num_experts: Optional[int] = None):
        """Sends every token once to each rank that holds one of its experts. Returns recv_x (a
        tensor, or (fp8, scales) for fp8 input), recv_topk_idx (local expert ids, -1 elsewhere),
        recv_topk_weights (0 where the id is -1), num_recv_tokens_per_expert_list, handle, event.
        With a cached ``handle`` (no top-k arguments) only recv_x comes back (the rest None)."""
        op = "ep dispatch"
        R, me = self.group_size, self.rank
        call = self._call()
        hdr = self._header(1, call)
        try:
            self._check_live()
            xv, scales = self._check_x(x)
            T, H = xv.shape
            hdr[_H_HIDDEN], hdr[_H_TOKENS] = H, T
            hdr[_H_DTYPE] = 2 if scales is not None else 1
            if T > self.max_tokens_per_rank:
                raise _Rejected(f"{T} tokens, but the Buffer was sized for max_tokens_per_rank="
                                f"{self.max_tokens_per_rank} (Buffer(..., max_tokens_per_rank=N))")
            if num_worst_tokens < 0 or expert_alignment < 1:
                raise _Rejected(f"num_worst_tokens={num_worst_tokens} / expert_alignment="
                                f"{expert_alignment} out of range")
            if handle is not None:
                if topk_idx is not None or topk_weights is not None:
                    raise _Rejected("a cached handle takes no topk_idx / topk_weights (its layout is fixed)")
                h = self._check_handle(handle, "normal")
                if T != h._tokens:
                    raise _Rejected(f"x has {T} tokens, the handle's dispatch had {h._tokens}")
                k, E, weights = h._topk, h._experts, False
                order, counts = h._order, h._send_counts
                hdr[_H_LAYOUT] = h._call
            else:
                if topk_idx is None:
                    raise _Rejected("needs topk_idx (or a cached handle)")
                if num_experts is None:
                    if num_tokens_per_expert is None:
                        raise _Rejected("needs num_tokens_per_expert (get_dispatch_layout's third "
                                        "result; it gives the number of experts) or num_experts=")
                    num_experts = int(num_tokens_per_expert.numel())
                idx = self._check_topk(topk_idx, num_experts, tokens=T)
                k, E = idx.shape[1], num_experts
                weights = topk_weights is not None
                if weights:
                    self._check_2d(topk_weights, T, k, (torch.float32,), "topk_weights")
                in_rank = self._in_rank(idx, E)
                self._check_given_layout(idx, in_rank, E, is_token_in_rank, num_tokens_per_rank,
                                         num_tokens_per_expert)
                order = in_rank.t().nonzero()[:, 1]  # tokens by destination rank, then token
                counts = in_rank.sum(0).tolist()
                hdr[_H_LAYOUT] = call
            layout = self._row_layout(H, scales is not None, 0 if handle is not None else k, weights)
            hdr[_H_TOPK], hdr[_H_EXPERTS], hdr[_H_STRIDE] = k, E, layout.stride
            parts = {"x": xv}
            if scales is not None:
                parts["scales"] = scales
            if handle is None:
                parts["idx"] = idx.to(torch.int32)
                if weights:
                    parts["w"] = topk_weights
                parts["src"] = torch.arange(T, dtype=torch.int32, device=xv.device)
            rows = layout.pack(T, parts, xv).index_select(0, order)
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            self._reject(op, hdr, e)
        peers = self._exchange_headers(op, hdr, counts, layout.stride)
        recv_counts = [p[_H_ROWS] for p in peers]
        N = sum(recv_counts)
        rrows = self._exchange_rows(op, layout, rows, counts, recv_counts)
        # What only this rank can see fails here, after the exchange, so no peer is left waiting.
        if handle is not None and recv_counts != handle._recv_counts:
            raise _backend_error(f"commux {op} (rank {me} of {R}): the cached handle expects "
                                 f"{handle._recv_counts} rows from the ranks, they sent {recv_counts}")
        if num_worst_tokens and N > num_worst_tokens:
            raise ValueError(f"commux {op} (rank {me} of {R}): {N} rows arrived, more than "
                             f"num_worst_tokens={num_worst_tokens}")
        recv_x = layout.field(rrows, "x", xv.dtype)
        if scales is not None:
            recv_x = (recv_x, layout.field(rrows, "scales", torch.float32))
        if num_worst_tokens:
            recv_x = self._pad_rows(recv_x, num_worst_tokens)
        if handle is not None:
            return recv_x, None, None, None, None, self._event(xv)

        epr = E // R
        gid = layout.field(rrows, "idx", torch.int32).to(torch.int64)
        local = torch.where((gid >= me * epr) & (gid < (me + 1) * epr), gid - me * epr,
                            torch.full_like(gid, -1))
        recv_w = None
        if weights:
            recv_w = layout.field(rrows, "w", torch.float32).masked_fill(local < 0, 0.0)
        src_idx = layout.field(rrows, "src", torch.int32).view(-1)
        if num_worst_tokens:
            per_expert_list = []  # as DeepEP: no counts (no host sync) with num_worst_tokens
            local = self._pad_rows(local, num_worst_tokens, fill=-1)
            if recv_w is not None:
                recv_w = self._pad_rows(recv_w, num_worst_tokens)
        else:
            per_expert = torch.bincount(local[local >= 0], minlength=epr).tolist()
            per_expert_list = [_pad(c, expert_alignment) for c in per_expert]
        prefix = torch.tensor(list(itertools.accumulate(recv_counts)), dtype=torch.int32)
        new = _Handle((prefix, None, None, src_idx, in_rank, None), _buffer=self._id, _mode="normal",
                      _call=call, _order=order, _send_counts=counts, _recv_counts=recv_counts,
                      _tokens=T, _topk=k, _experts=E)
        return recv_x, local, recv_w, per_expert_list, new, self._event(xv)

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sends every received row's result back to its source and sums, per original token, over
        the ranks it went to (no weights), in float32 with one cast. Returns combined_x [T, H],
        combined_topk_weights (the sum of the ranks' topk_weights, or None) and the event."""
        op = "ep combine"
        hdr = self._header(2, self._call())
        try:
            self._check_live()
            if bias is not None:
                raise _Rejected("bias is not supported (add it to the result)")
            h = self._check_handle(handle, "normal")
            hdr[_H_LAYOUT] = h._call
            N = sum(h._recv_counts)
            self._check_2d(x, N, None, (torch.bfloat16,), "x")
            H = x.shape[1]
            if topk_weights is not None:
                self._check_2d(topk_weights, N, h._topk, (torch.float32,), "topk_weights")
            layout = _Layout([("x", 2 * H), ("w", 4 * h._topk if topk_weights is not None else 0)])
            hdr[_H_HIDDEN], hdr[_H_DTYPE], hdr[_H_TOPK], hdr[_H_EXPERTS] = H, 1, h._topk, h._experts
            hdr[_H_STRIDE], hdr[_H_TOKENS] = layout.stride, N
            parts = {"x": x}
            if topk_weights is not None:
                parts["w"] = topk_weights
            rows = layout.pack(N, parts, x)
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            self._reject(op, hdr, e)
        self._exchange_headers(op, hdr, h._recv_counts, layout.stride)
        back = self._exchange_rows(op, layout, rows, h._recv_counts, h._send_counts)
        acc = torch.zeros((h._tokens, H), dtype=torch.float32, device=x.device)
        acc.index_add_(0, h._order, layout.field(back, "x", torch.bfloat16).float())
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.zeros((h._tokens, h._topk), dtype=torch.float32, device=x.device)
            combined_w.index_add_(0, h._order, layout.field(back, "w", torch.float32))
        return acc.to(torch.bfloat16), combined_w, self._event(x)

    # --- low-latency mode ------------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """One row per (token, expert) assignment, into [E/R, cap*R, H] per local expert (rows
        0..recv_count[e]-1 valid, by source rank then token; the rest is not written). Returns
        recv_x (bf16, or (fp8, scales) with use_fp8), recv_count [E/R] int32, handle, event, hook.
        handle[0] (src_info, [E/R, cap*R] int32) holds each row's source token (-1 where none),
        handle[1] (layout_range, [E/R, R] int64) (begin << 32) | count per (expert, source rank)."""
        op = "ep low_latency_dispatch"
        R, me = self.group_size, self.rank
        cap = num_max_dispatch_tokens_per_rank
        call = self._call()
        hdr = self._header(3, call)
        hdr[_H_CAP], hdr[_H_LAYOUT] = cap, call
        try:
            self._check_live()
            if not self.low_latency_mode:
                raise _Rejected("needs Buffer(group, low_latency_mode=True)")
            if use_ue8m0:
                raise _Rejected("use_ue8m0=True (packed UE8M0 scales) is not supported")
            self._check_2d(x, None, None, (torch.bfloat16,), "x")
            T, H = x.shape
            if cap < 0 or T > cap:
                raise _Rejected(f"{T} tokens, more than num_max_dispatch_tokens_per_rank={cap}")
            if use_fp8 and H % _FP8_BLOCK:
                raise _Rejected(f"use_fp8 needs a hidden size that is a multiple of {_FP8_BLOCK}, got {H}")
            idx = self._check_topk(topk_idx, num_experts, tokens=T)
            k, E = idx.shape[1], num_experts
            layout = _Layout([("x", H if use_fp8 else 2 * H),
                              ("scales", 4 * (H // _FP8_BLOCK) if use_fp8 else 0),
                              ("src", 4), ("expert", 4)])
            hdr[_H_HIDDEN], hdr[_H_TOKENS], hdr[_H_DTYPE] = H, T, 2 if use_fp8 else 1
            hdr[_H_TOPK], hdr[_H_EXPERTS], hdr[_H_STRIDE] = k, E, layout.stride
            epr = E // R
            sel = (idx >= 0).nonzero()  # (token, slot), by token then slot
            expert = idx[sel[:, 0], sel[:, 1]]
            by_dest = torch.argsort(expert // epr, stable=True)
            sel, expert = sel[by_dest], expert[by_dest]  # by destination rank, then token, then slot
            counts = torch.bincount(expert // epr, minlength=R).tolist()
            tok = sel[:, 0]
            if use_fp8:
                q, s = _quantize_fp8(x, round_scale)
                parts = {"x": q[tok], "scales": s[tok]}
            else:
                parts = {"x": x[tok]}
            parts["src"] = tok.to(torch.int32)
            parts["expert"] = expert.to(torch.int32)
            rows = layout.pack(tok.numel(), parts, x)
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            self._reject(op, hdr, e)
        peers = self._exchange_headers(op, hdr, counts, layout.stride)
        recv_counts = [p[_H_ROWS] for p in peers]
        N = sum(recv_counts)
        rrows = self._exchange_rows(op, layout, rows, counts, recv_counts)
        dev = x.device
        e_local = layout.field(rrows, "expert", torch.int32).view(-1).to(torch.int64) - me * epr
        src_rank = torch.repeat_interleave(torch.arange(R, device=dev),
                                           torch.tensor(recv_counts, device=dev))
        # Each expert's rows from the start, in arrival order (by source rank, then token).
        recv_count = torch.bincount(e_local, minlength=epr)
        by_e = torch.argsort(e_local, stable=True)
        pos = torch.empty_like(e_local)
        pos[by_e] = torch.arange(N, device=dev) - (torch.cumsum(recv_count, 0) - recv_count)[e_local[by_e]]
        dt = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        recv_x = torch.empty((epr, cap * R, H), dtype=dt, device=dev)
        recv_x[e_local, pos] = layout.field(rrows, "x", dt)
        if use_fp8:
            recv_s = torch.empty((epr, cap * R, H // _FP8_BLOCK), dtype=torch.float32, device=dev)
            recv_s[e_local, pos] = layout.field(rrows, "scales", torch.float32)
            recv_x = (recv_x, recv_s)
        src_info = torch.full((epr, cap * R), -1, dtype=torch.int32, device=dev)
        src_info[e_local, pos] = layout.field(rrows, "src", torch.int32).view(-1)
        per = torch.zeros((epr, R), dtype=torch.int64, device=dev)
        per.index_put_((e_local, src_rank), torch.ones_like(e_local), accumulate=True)
        layout_range = ((torch.cumsum(per, 1) - per) << 32) | per
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        handle = _Handle((src_info, layout_range, cap, H, E), _buffer=self._id, _mode="low_latency",
                         _call=call, _sel=sel, _send_counts=counts, _recv_counts=recv_counts,
                         _tokens=T, _topk=k, _experts=E, _e_local=e_local, _pos=pos)
        hook = (lambda: None) if return_recv_hook else None
        return recv_x, recv_count.to(torch.int32), handle, self._event(x), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Sends every expert's row back to its source, which sums them weighted by topk_weights
        (float32, one cast). Returns combined_x [T, H] bf16, event, hook."""
        op = "ep low_latency_combine"
        R = self.group_size
        hdr = self._header(4, self._call())
        try:
            self._check_live()
            if use_logfmt:
                raise _Rejected("use_logfmt=True is not supported")
            h = self._check_handle(handle, "low_latency")
            E, cap = h._experts, handle[2]
            hdr[_H_CAP], hdr[_H_LAYOUT] = cap, h._call
            self._check_3d(x, (E // R, cap * R), "x")
            H = x.shape[2]
            self._check_2d(topk_idx, h._tokens, h._topk, None, "topk_idx")
            self._check_2d(topk_weights, h._tokens, h._topk, (torch.float32,), "topk_weights")
            if out is not None:
                self._check_2d(out, h._tokens, H, (torch.bfloat16,), "out")
            layout = _Layout([("x", 2 * H)])
            hdr[_H_HIDDEN], hdr[_H_DTYPE], hdr[_H_TOPK], hdr[_H_EXPERTS] = H, 1, h._topk, E
            hdr[_H_STRIDE], hdr[_H_TOKENS] = layout.stride, h._tokens
            rows = layout.pack(h._e_local.numel(), {"x": x[h._e_local, h._pos]}, x)
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            self._reject(op, hdr, e)
        self._exchange_headers(op, hdr, h._recv_counts, layout.stride)
        back = self._exchange_rows(op, layout, rows, h._recv_counts, h._send_counts)
        sel = h._sel
        w = topk_weights[sel[:, 0], sel[:, 1]].unsqueeze(1)
        acc = torch.zeros((h._tokens, H), dtype=torch.float32, device=x.device)
        acc.index_add_(0, sel[:, 0], layout.field(back, "x", torch.bfloat16).float() * w)
        combined = acc.to(torch.bfloat16)
        if out is not None:
            combined = out.copy_(combined)
        hook = (lambda: None) if return_recv_hook else None
        return combined, self._event(x), hook

    def get_next_low_latency_combine_buffer(self, handle):
        """A fresh [E/R, cap*R, H] bf16 tensor to write the combine's input into."""
        h = self._check_handle(handle, "low_latency", local=True,
                               op="ep get_next_low_latency_combine_buffer")
        return torch.empty((h._experts // self.group_size, handle[2] * self.group_size, handle[3]),
                           dtype=torch.bfloat16, device=handle[0].device)

    # --- internals ---------------------------------------------------------------------------------
    def _call(self) -> int:
        return next(self._calls)

    def _header(self, kind: int, call: int) -> List[int]:
        hdr = [0] * _H_TEXT
        hdr[_H_MAGIC], hdr[_H_KIND], hdr[_H_BUFFER], hdr[_H_CALL] = _MAGIC, kind, self._id, call
        hdr[_H_LAYOUT] = -1
        return hdr

    def _reject(self, op: str, hdr: List[int], e: BaseException) -> None:
        """Tells every rank that this call failed here before anything was sent (so none waits
        for it), then raises: ValueError for bad input, the exception itself for anything else."""
        hdr[_H_STATUS] = 1
        reason = str(e) if isinstance(e, _Rejected) else f"{type(e).__name__}: {e}"
        try:
            self._exchange_headers(op, hdr, [0] * self.group_size, 0, reason=reason)
        except Exception:  # noqa: BLE001  (this rank's own reason is the error to report)
            pass
        if not isinstance(e, _Rejected):
            raise e
        raise ValueError(f"commux {op} (rank {self.rank} of {self.group_size}): {e}") from None

    def _exchange_headers(self, op, hdr, counts, stride, reason: str = ""):
        """Sends each rank its header row (this call, its sizes, the rows for that rank, or why
        this rank rejected the call) and checks every rank's: its status, and that it makes the
        same call. Returns the rows received (lists of ints), one per rank."""
        R, me = self.group_size, self.rank
        rows = torch.zeros((R, _H_LEN), dtype=torch.int64)
        rows[:, :_H_TEXT] = torch.tensor(hdr, dtype=torch.int64)
        rows[:, _H_ROWS] = torch.tensor(counts, dtype=torch.int64)
        rows[:, _H_BYTES] = rows[:, _H_ROWS] * stride
        if reason:
            text = reason.encode()[:_TEXT_BYTES]
            rows.view(torch.uint8).view(R, _H_LEN * 8)[:, _H_TEXT * 8:_H_TEXT * 8 + len(text)] = \
                torch.frombuffer(bytearray(text), dtype=torch.uint8)
        nbytes = [_H_LEN * 8] * R
        got = self._transport.exchange(op, rows.view(-1).view(torch.uint8), nbytes, nbytes,
                                       self._timeout_ms).view(torch.int64).view(R, _H_LEN)
        peers = got[:, :_H_TEXT].tolist()
        if hdr[_H_STATUS]:
            return peers
        for p, row in enumerate(peers):
            if p == me:
                continue
            if row[_H_MAGIC] != _MAGIC:
                raise _backend_error(f"commux {op} (rank {me} of {R}): rank {p} is not in an ep call "
                                     "(its message is not an ep header): does every rank make the "
                                     "same calls in the same order?")
            if row[_H_STATUS]:
                why = bytes(got[p, _H_TEXT:].view(torch.uint8).tolist()).rstrip(b"\0")
                raise _backend_error(f"commux {op} (rank {me} of {R}): rank {p} rejected its "
                                     f"{_KINDS.get(row[_H_KIND], 'call')}: {why.decode(errors='replace')}")
        for p, row in enumerate(peers):
            for field, words in _MUST_AGREE:
                if row[field] != hdr[field]:
                    mine, theirs = hdr[field], row[field]
                    names = _KINDS if field == _H_KIND else _DTYPES if field == _H_DTYPE else {}
                    raise ValueError(f"commux {op} (rank {me} of {R}): the {words} differs across "
                                     f"ranks: this rank has {names.get(mine, mine)}, rank {p} has "
                                     f"{names.get(theirs, theirs)}")
        return peers

    def _exchange_rows(self, op, layout, rows, send_counts, recv_counts):
        """The data step: rows (grouped by destination, send_counts of them each) out, and what
        every rank sent here back as [sum(recv_counts), stride] bytes, grouped by source rank."""
        s = layout.stride
        got = self._transport.exchange(op, rows.view(-1), [c * s for c in send_counts],
                                       [c * s for c in recv_counts], self._timeout_ms)
        return got.view(-1, s)

    def _check_live(self):
        if self._destroyed:
            raise _Rejected("the Buffer has been destroyed")

    def _check_handle(self, handle, mode, local=False, op=""):
        if not isinstance(handle, _Handle) or "_mode" not in handle.__dict__:
            why = "the handle is not one a commux.ep Buffer returned"
        elif handle._buffer != self._id:
            why = f"the handle comes from another Buffer (#{handle._buffer}; this is #{self._id})"
        elif handle._mode != mode:
            why = (f"the handle is from a {handle._mode.replace('_', '-')} dispatch, this call "
                   f"needs a {mode.replace('_', '-')} one")
        else:
            return handle
        if local:
            raise ValueError(f"commux {op}: {why}")
        raise _Rejected(why)

    def _check_x(self, x):
        if isinstance(x, tuple):
            if len(x) != 2:
                raise _Rejected("x as a tuple must be (x_fp8, scales)")
            xv, scales = x
            self._check_2d(xv, None, None, (torch.float8_e4m3fn,), "x[0]")
            if xv.shape[1] % _FP8_BLOCK:
                raise _Rejected(f"fp8 x needs a hidden size that is a multiple of {_FP8_BLOCK}, "
                                f"got {xv.shape[1]}")
            self._check_2d(scales, xv.shape[0], xv.shape[1] // _FP8_BLOCK, (torch.float32,),
                           "x[1] (scales)")
            if scales.device != xv.device:
                raise _Rejected(f"scales are on {scales.device}, x on {xv.device}")
            return xv.contiguous(), scales.contiguous()
        self._check_2d(x, None, None, (torch.bfloat16,), "x")
        return x.contiguous(), None

    @staticmethod
    def _check_2d(t, rows, cols, dtypes, what):
        if not isinstance(t, torch.Tensor):
            raise _Rejected(f"{what} must be a tensor, got {type(t).__name__}")
        if t.dim() != 2 or (rows is not None and t.shape[0] != rows) or (
                cols is not None and t.shape[1] != cols):
            want = f"[{'any' if rows is None else rows}, {'any' if cols is None else cols}]"
            raise _Rejected(f"{what} has shape {list(t.shape)}, expected {want}")
        if dtypes is not None and t.dtype not in dtypes:
            raise _Rejected(f"{what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")

    @staticmethod
    def _check_3d(t, lead, what):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[:2]) != lead:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise _Rejected(f"{what} must be [{lead[0]}, {lead[1]}, hidden], got {shape}")
        if t.dtype != torch.bfloat16:
            raise _Rejected(f"{what} must be torch.bfloat16, got {t.dtype}")

    def _check_topk(self, topk_idx, num_experts, tokens=None):
        R = self.group_size
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
            raise _Rejected(f"num_experts={num_experts!r} must be a positive int")
        if num_experts % R:
            raise _Rejected(f"num_experts={num_experts} is not a multiple of the group size {R}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise _Rejected("topk_idx must be a 2-D [tokens, k] integer tensor")
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool or topk_idx.is_complex():
            raise _Rejected(f"topk_idx must be an integer tensor, got {topk_idx.dtype}")
        if tokens is not None and topk_idx.shape[0] != tokens:
            raise _Rejected(f"topk_idx has {topk_idx.shape[0]} rows, x has {tokens} tokens")
        idx = topk_idx.to(torch.int64)
        if idx.numel():
            bad = (idx < -1) | (idx >= num_experts)
            if bool(bad.any()):
                t, j = bad.nonzero()[0].tolist()
                raise _Rejected(f"top-k id {int(idx[t, j])} of token {t} (slot {j}) is outside "
                                f"[-1, {num_experts})")
            if idx.shape[1] > 1:
                s = idx.sort(dim=1).values
                dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
                if bool(dup.any()):
                    t = int(dup.any(1).nonzero()[0])
                    raise _Rejected(f"token {t} names expert {int(s[t, 1:][dup[t]][0])} twice in its top-k")
        return idx

    @staticmethod
    def _check_given_layout(idx, in_rank, E, is_token_in_rank, num_tokens_per_rank,
                            num_tokens_per_expert):
        """A layout the caller passed (get_dispatch_layout's) must be the one topk_idx gives."""
        given = [("is_token_in_rank", is_token_in_rank, lambda: in_rank),
                 ("num_tokens_per_rank", num_tokens_per_rank, lambda: in_rank.sum(0)),
                 ("num_tokens_per_expert", num_tokens_per_expert,
                  lambda: torch.bincount(idx[idx >= 0], minlength=E))]
        for name, t, ours in given:
            if t is None:
                continue
            want = ours()
            if t.shape != want.shape or not torch.equal(t.to(device=want.device, dtype=want.dtype), want):
                raise _Rejected(f"{name} does not match topk_idx (pass get_dispatch_layout's result)")

    def _in_rank(self, idx, num_experts):
        R = self.group_size
        dest = torch.where(idx >= 0, idx // (num_experts // R), torch.full_like(idx, R))
        m = torch.zeros((idx.shape[0], R + 1), dtype=torch.bool, device=idx.device)
        m.scatter_(1, dest, True)
        return m[:, :R]

    @staticmethod
    def _row_layout(H, fp8, k, weights):
        return _Layout([("x", H if fp8 else 2 * H), ("scales", 4 * (H // _FP8_BLOCK) if fp8 else 0),
                        ("idx", 4 * k), ("w", 4 * k if weights else 0), ("src", 4)])

    @staticmethod
    def _pad_rows(t, n, fill=0):
        if isinstance(t, tuple):
            return tuple(Buffer._pad_rows(u, n, fill) for u in t)
        return torch.cat([t, t.new_full((n - t.shape[0],) + tuple(t.shape[1:]), fill)])

    @staticmethod
    def _event(t):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return EventOverlap()
        return None

    def __repr__(self):
        return (f"commux.ep.Buffer(#{self._id}, rank {self.rank} of {self.group_size}, backend "
                f"{self.backend!r}, low_latency_mode={self.low_latency_mode})")
