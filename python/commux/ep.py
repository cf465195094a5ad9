"""commux.ep: expert-parallel dispatch and combine with DeepEP's legacy ``Buffer`` API.

Code written for DeepEP (or UCCL-EP, which copies its API) moves over by changing the import::

    from commux.ep import Buffer          # instead of: from deep_ep import Buffer
    buf = Buffer(group)                    # Buffer(group, low_latency_mode=True) for the LL calls
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    y, y_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

How it travels. Every call is a sparse all-to-all in two steps, on the calling thread. First a
fixed-size header to every rank: which call this is, its sizes, how many rows follow, or why this
rank rejected the call. Then one message per destination that carries all of its rows, in lanes:
the payload rows (which land directly in ``recv_x``; in combine the expert output is sent as it
is) and, where there is any, a lane of per-row metadata packed together (source row, expert ids,
weights, fp8 scales). Both sides know every size from the headers, so every receive is posted for
exactly what arrives. On a group whose backend is commux ("ucx"/"commux") that is
``ProcessGroupUCX._exchange_lanes``, with an internal tag drawn from the group's collective
sequence: it can never match the user's own point-to-point traffic, a collective, or another
Buffer's call. On any other backend (gloo) each lane is one ``all_to_all_single`` with uneven
splits, so the two can be compared on one API. Routing, packing, unpacking and the combine's sums
are C++ loops on CPU tensors and ATen operations on device tensors (``src/c10d/ep_kernels.cpp``).

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

from . import _C

__all__ = ["Buffer", "EventOverlap", "Config"]

_MAGIC = 0x434D58455002  # "CMXEP" + wire version 2 (2: the parts field, _H_PARTS)
# Header row (int64), one per destination rank.
_H_MAGIC, _H_KIND, _H_STATUS, _H_BUFFER, _H_CALL, _H_HIDDEN, _H_DTYPE, _H_TOPK, _H_EXPERTS, \
    _H_ROWS, _H_BYTES, _H_STRIDE, _H_CAP, _H_TOKENS, _H_LAYOUT, _H_PARTS = range(16)
_H_TEXT = 16          # the rejection reason, UTF-8, from here to the end of the row
_H_LEN = 16 + 32      # 48 int64 = 384 bytes a destination

_KINDS = {1: "dispatch", 2: "combine", 3: "low_latency_dispatch", 4: "low_latency_combine"}
_DTYPES = {0: "none", 1: "bfloat16", 2: "float8_e4m3fn with float32 scales"}
# Fields every rank of a call must agree on, with the words an error uses for them.
_MUST_AGREE = [(_H_KIND, "call"), (_H_BUFFER, "Buffer"), (_H_CALL, "call number on the Buffer"),
               (_H_HIDDEN, "hidden size"), (_H_DTYPE, "dtype"), (_H_TOPK, "top-k"),
               (_H_EXPERTS, "number of experts"), (_H_STRIDE, "row layout"),
               (_H_CAP, "capacity (max_tokens_per_rank / num_max_dispatch_tokens_per_rank)"),
               (_H_LAYOUT, "handle (the dispatch call it comes from)"),
               (_H_PARTS, "set of parts sent (topk_weights or fp8 given on some ranks only?)")]
# The parts a call sends (_H_PARTS, a bit each): the lanes and the per-row metadata fields. Two
# calls may agree on every size and row stride and still differ in these (k=1 with and without
# topk_weights: 16-byte rows either way), and each side would read the other's rows wrongly.
_PART_BITS = {"x": 1, "scales": 2, "idx": 4, "w": 8, "src": 16, "expert": 32, "topk_weights": 64}
_PART_NAMES = {"x": "x", "scales": "fp8 scales", "idx": "topk_idx", "w": "topk_weights",
               "src": "source rows", "expert": "expert ids", "topk_weights": "topk_weights"}


def _parts_text(bits):
    return "{" + ", ".join(_PART_NAMES[n] for n, b in _PART_BITS.items() if bits & b) + "}"

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

    def offset(self, name):
        return self.offsets[name][0]


_HDR_BYTES = _H_LEN * 8


class _Ucx:
    """commux's own sparse all-to-all (one message per destination, internal tags)."""

    def __init__(self, pg):
        self.pg = pg

    def exchange_lanes(self, op, sends, send_bytes, recvs, offsets, caps, timeout_ms):
        return self.pg._exchange_lanes(op, sends, send_bytes, recvs, offsets, caps, timeout_ms)

    def headers(self, op, fields, reason, counts, stride, timeout_ms):
        """Step 1: (header fields of every rank, their reasons, bytes received from each)."""
        return self.pg._ep_header_step(op, fields, reason, _H_LEN, _H_ROWS, _H_BYTES, counts, stride,
                                       timeout_ms)


class _AllToAll:
    """Any other backend: each lane as one all_to_all_single with uneven splits (the sizes are
    known to both sides, as on the commux path)."""

    def __init__(self, group):
        self.group = group

    def exchange_lanes(self, op, sends, send_bytes, recvs, offsets, caps, timeout_ms):
        for send, sb, recv, off, cap in zip(sends, send_bytes, recvs, offsets, caps):
            out = recv[off[0]:off[0] + sum(cap)] if cap else recv[:0]
            dist.all_to_all_single(out, send, output_split_sizes=list(cap), input_split_sizes=list(sb),
                                   group=self.group)
        return [sum(c[p] for c in caps) for p in range(len(caps[0]))]

    def headers(self, op, fields, reason, counts, stride, timeout_ms):
        R = len(counts)
        hb = [_HDR_BYTES] * R
        offsets = list(range(0, R * _HDR_BYTES, _HDR_BYTES))
        got_heads = torch.empty(R * _HDR_BYTES, dtype=torch.uint8)
        heads = _C._ep_make_headers(fields, reason, _H_LEN, _H_ROWS, _H_BYTES, counts, stride).view(-1)
        got = self.exchange_lanes(op, [heads], [hb], [got_heads], [offsets], [hb], timeout_ms)
        peers, reasons = _C._ep_read_headers(got_heads, offsets, got, _HDR_BYTES, _H_TEXT)
        return peers, reasons, got


# COMMUX_EP_ATEN=1: pack and unpack host tensors with the device path's ATen operations, so the
# code that serves GPU tensors is exercised on a machine without one (a check, not a speed-up).
_C._ep_set_aten_on_host(_C.settings()["COMMUX_EP_ATEN"]["value"])

_ids_lock = threading.Lock()
_next_ids: dict = {}  # id(group) -> the next Buffer id (ranks create their Buffers in the same order)


def _backend_error(msg: str) -> Exception:
    cls = getattr(dist, "DistBackendError", RuntimeError)
    return cls(msg)


def _quantize_fp8(x: torch.Tensor, round_scale: bool):
    """bf16 [T, H] -> (float8_e4m3fn [T, H], float32 scales [T, H/128]): per 128-column block,
    scale = max(|x|, 1e-4) / 448 (rounded up to a power of two with round_scale)."""
    t, h = x.shape
    blocks = x.float().view(t, h // _FP8_BLOCK, _FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    # The same bits on every device: a divisor of the dividend's shape, because a CUDA tensor
    # divided by a Python number is multiplied by its reciprocal (an ulp off the quotient the CPU
    # computes), and the power of two from frexp rather than log2, whose last bit varies.
    scale = amax / torch.full_like(amax, _FP8_MAX)
    if round_scale:
        m, e = torch.frexp(scale)  # scale = m * 2**e, 0.5 <= m < 1: the next power of two is 2**e
        scale = torch.ldexp(torch.ones_like(scale), torch.where(m == 0.5, e - 1, e))
    q = (blocks / scale.unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


class _Call:
    """One call: its header fields, the rows for each rank, and the two steps that move them.

    Step 1 sends every rank a header (this call, its sizes, the rows that follow, or why this
    rank rejected the call) and checks every rank's. Step 2 moves the rows in lanes (the payload
    in one, the metadata packed row by row in another, ...), one multi-buffer message per rank,
    with every size known to both sides. A lane can land directly in a result tensor."""

    def __init__(self, buf: "Buffer", op: str, kind: int):
        self.buf, self.op = buf, op
        self.number = buf._next_call()
        self.hdr = [0] * _H_TEXT
        self.hdr[_H_MAGIC], self.hdr[_H_KIND] = _MAGIC, kind
        self.hdr[_H_BUFFER], self.hdr[_H_CALL], self.hdr[_H_LAYOUT] = buf._id, self.number, -1
        self.device = torch.device("cpu")
        self.lanes = []

    def lane(self, rows: torch.Tensor, row_bytes: int, name: str = "x"):
        """A lane of the message: rows ([S, ...], grouped by destination rank as self.counts)."""
        self.hdr[_H_PARTS] |= _PART_BITS[name]
        self.lanes.append((rows.reshape(-1).view(torch.uint8) if rows.numel() else
                           torch.empty(0, dtype=torch.uint8, device=rows.device), row_bytes))

    def meta(self, layout, parts, index=None, row_parts=()):
        """A lane of small per-row fields packed at layout's offsets (parts indexed by `index`,
        row_parts already in row order)."""
        names = [n for n in parts if layout.offsets[n][1]]
        rnames = [n for n, _ in row_parts if layout.offsets[n][1]]
        rows = dict(row_parts)
        for n in names + rnames:
            self.hdr[_H_PARTS] |= _PART_BITS[n]
        self.layout = layout
        packed = _C._ep_pack([parts[n] for n in names], [layout.offset(n) for n in names], index,
                             [rows[n] for n in rnames], [layout.offset(n) for n in rnames],
                             self.counts, layout.stride)
        self.lanes.append((packed, layout.stride))

    def reject(self, e: BaseException):
        """Tells every rank that this call failed here before anything was sent (so none waits
        for it), then raises: ValueError for bad input, the exception itself for anything else."""
        buf, R = self.buf, self.buf.group_size
        self.hdr[_H_STATUS] = 1
        reason = str(e) if isinstance(e, _Rejected) else f"{type(e).__name__}: {e}"
        try:
            buf._transport.headers(self.op, self.hdr, reason, [0] * R, 0, buf._timeout_ms)
        except Exception:  # noqa: BLE001  (this rank's own reason is the error to report)
            pass
        if not isinstance(e, _Rejected):
            raise e
        raise ValueError(f"commux {self.op} (rank {buf.rank} of {R}): {e}") from None

    def exchange(self, outputs=()):
        """Both steps. outputs[l], where given, makes lane l's rows land in a new tensor:
        outputs[l](rows received) returns it (flat bytes are taken from it); other lanes land in
        the Buffer's kept receive memory. Returns ([lane tensors], rows from each rank)."""
        buf, R = self.buf, self.buf.group_size
        peers, reasons, got = self._guarded(buf._transport.headers, self.op, self.hdr, "", self.counts,
                                            self.hdr[_H_STRIDE], buf._timeout_ms)
        rows = self._check(peers, reasons, got)
        N = sum(rows)
        sends, send_bytes, recvs, recv_offsets, caps, results = [], [], [], [], [], []
        for lane, (data, rb) in enumerate(self.lanes):
            need = [r * rb for r in rows]
            make = outputs[lane] if lane < len(outputs) else None
            if make is not None:
                res = make(N)
                flat = res.reshape(-1).view(torch.uint8) if res.numel() else \
                    torch.empty(0, dtype=torch.uint8, device=self.device)
            else:
                flat = res = buf._slots(lane, N * rb, self.device)
            sends.append(data)
            send_bytes.append([c * rb for c in self.counts])
            recvs.append(flat)
            recv_offsets.append(list(itertools.accumulate([0] + need[:-1])))
            caps.append(need)
            results.append(res)
        got = self._guarded(buf._transport.exchange_lanes, self.op, sends, send_bytes, recvs,
                            recv_offsets, caps, buf._timeout_ms)
        for p in range(R):
            if got[p] != sum(c[p] for c in caps):
                raise _backend_error(f"commux {self.op} (rank {buf.rank} of {R}): rank {p} sent "
                                     f"{got[p]} bytes where its header announced {sum(c[p] for c in caps)}")
        return results, rows

    def _guarded(self, step, *args):
        """Runs one step; after a failure the kept receive memory may still be written by a
        cancelled request (the backend keeps it alive), so it is never reused."""
        try:
            return step(*args)
        except BaseException:
            self.buf._kept.clear()
            raise

    def _check(self, peers, reasons, got):
        """Every rank's header: rejected calls, cut-short messages, another call, disagreements."""
        R, me = self.buf.group_size, self.buf.rank
        who = f"commux {self.op} (rank {me} of {R})"
        for p, row in enumerate(peers):
            if p != me and got[p] >= 0 and row[_H_STATUS] and row[_H_MAGIC] == _MAGIC:
                why = reasons[p].decode(errors="replace")
                raise _backend_error(f"{who}: rank {p} rejected its {_KINDS.get(row[_H_KIND], 'call')}: {why}")
        for p, row in enumerate(peers):
            if got[p] != _HDR_BYTES or row[_H_MAGIC] != _MAGIC:
                raise _backend_error(f"{who}: rank {p}'s message is not an ep call's header: does "
                                     "every rank make the same calls on the group in the same order?")
        agreed = [self.hdr[f] for f, _ in _MUST_AGREE]
        for p, row in enumerate(peers):
            if [row[f] for f, _ in _MUST_AGREE] == agreed:
                continue
            for field, words in _MUST_AGREE:
                if row[field] != self.hdr[field]:
                    mine, theirs = self.hdr[field], row[field]
                    if field == _H_PARTS:
                        mine, theirs = _parts_text(mine), _parts_text(theirs)
                    names = _KINDS if field == _H_KIND else _DTYPES if field == _H_DTYPE else {}
                    raise ValueError(f"{who}: the {words} differs across ranks: this rank has "
                                     f"{names.get(mine, mine)}, rank {p} has {names.get(theirs, theirs)}")
        return [row[_H_ROWS] for row in peers]

    def fields(self, recv, rows, names):
        """The named fields of the metadata lane's received rows, as [N, bytes] uint8 tensors."""
        lay = self.layout
        return _C._ep_unpack(recv, list(itertools.accumulate([0] + [r * lay.stride for r in rows[:-1]])),
                             rows, lay.stride, [lay.offset(n) for n in names],
                             [lay.offsets[n][1] for n in names])


class Buffer:
    """DeepEP's legacy ``Buffer`` over commux (see the module docstring).

    ``max_tokens_per_rank`` (a commux addition; every rank must pass the same) is how many tokens
    one rank may dispatch in one normal-mode call, the counterpart of DeepEP's buffer sizes; a
    call with more fails on every rank. Receive memory is sized per call from the headers and
    kept across calls. ``timeout`` (seconds; a commux addition) bounds each call; the default is
    the group's timeout.
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
        if self.rank < 0:
            raise ValueError("commux.ep.Buffer: this process is not a member of the group")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.max_tokens_per_rank = max_tokens_per_rank
        self._timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000))
        self.backend = dist.get_backend(self.group)
        pg = self.group._get_backend(torch.device("cpu")) if self.backend in _UCX_BACKENDS else None
        # (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend; the wrapped one has the exchange.)
        pg = pg if hasattr(pg, "_exchange_lanes") else getattr(pg, "wrapped_pg", None)
        if hasattr(pg, "_exchange_lanes"):
            self._transport = _Ucx(pg)
        else:
            self._transport = _AllToAll(self.group)
        with _ids_lock:
            self._id = _next_ids.get(id(self.group), 0)
            _next_ids[id(self.group)] = self._id + 1
        self._calls = itertools.count()
        self._kept: dict = {}
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
        return 0  # commux sizes its receive slots itself

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: every low-latency call writes fresh tensors."""

    def destroy(self) -> None:
        """Releases the Buffer's memory; later calls on it fail (on every rank)."""
        self._destroyed = True
        self._kept.clear()

    # --- layout (local: no communication) ------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """num_tokens_per_rank [R] int32, None (one node), num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event."""
        if isinstance(num_experts, bool) or not isinstance(num_experts, int):
            raise ValueError(f"commux ep get_dispatch_layout: num_experts={num_experts!r} must be an int")
        err, counts, _, _, _, in_rank, per_expert = _C._ep_route(topk_idx, num_experts, self.group_size, False)
        if err:
            raise ValueError(f"commux ep get_dispatch_layout: {err}")
        dev = topk_idx.device
        return (torch.tensor(counts, dtype=torch.int32, device=dev), None, per_expert.to(dev),
                in_rank.to(dev), self._event(topk_idx))

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
        R, me = self.group_size, self.rank
        c = _Call(self, "ep dispatch", 1)
        hdr = c.hdr
        try:
            self._check_live()
            xv, scales = self._check_x(x)
            T, H = xv.shape
            c.device = xv.device
            hdr[_H_HIDDEN], hdr[_H_TOKENS], hdr[_H_CAP] = H, T, self.max_tokens_per_rank
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
                k, E, weights, order, counts = h._topk, h._experts, False, h._order, h._send_counts
                hdr[_H_LAYOUT] = h._call
            else:
                if topk_idx is None:
                    raise _Rejected("needs topk_idx (or a cached handle)")
                if num_experts is None:
                    if num_tokens_per_expert is None:
                        raise _Rejected("needs num_tokens_per_expert (get_dispatch_layout's third "
                                        "result; it gives the number of experts) or num_experts=")
                    num_experts = int(num_tokens_per_expert.numel())
                E = num_experts
                if isinstance(E, bool) or not isinstance(E, int):
                    raise _Rejected(f"num_experts={E!r} must be an int")
                self._check_topk_shape(topk_idx, xv)
                err, counts, order, _, _, in_rank, per_expert = _C._ep_route(topk_idx, E, R, False)
                if err:
                    raise _Rejected(err)
                k = topk_idx.shape[1]
                weights = topk_weights is not None
                if weights:
                    self._check_2d(topk_weights, T, k, (torch.float32,), "topk_weights")
                self._check_given_layout(in_rank, per_expert, counts, is_token_in_rank,
                                         num_tokens_per_rank, num_tokens_per_expert)
                hdr[_H_LAYOUT] = c.number
            hdr[_H_TOPK], hdr[_H_EXPERTS] = k, E
            cached = handle is not None
            c.counts = counts
            # Lane 0: the payload, rows by destination (it lands in recv_x itself); lane 1 (when
            # there is metadata): scales, expert ids, weights and source rows, packed per row.
            xb = xv.view(torch.uint8)
            c.lane(xb.index_select(0, order if xb.device.type == "cpu" else order.to(xb.device)), xb.shape[1])
            names = (["scales"] if scales is not None else []) + ([] if cached else ["idx", "src"]) + (
                ["w"] if weights and not cached else [])
            if names:
                parts = {"scales": scales} if scales is not None else {}
                if not cached:
                    parts["idx"] = topk_idx.to(torch.int32)
                    if weights:
                        parts["w"] = topk_weights
                c.meta(self._meta_layout(H, scales is not None, 0 if cached else k, weights and not cached),
                       parts, order, () if cached else (("src", order.to(torch.int32)),))
            hdr[_H_STRIDE] = c.layout.stride if names else 0
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            c.reject(e)
        lanes, recv_counts = c.exchange([lambda n: torch.empty((n, H), dtype=xv.dtype, device=xv.device)])
        N = sum(recv_counts)
        f = dict(zip(names, c.fields(lanes[1], recv_counts, names))) if names else {}
        # What only this rank can see fails here, after the exchange, so no rank is left waiting.
        if cached and recv_counts != handle._recv_counts:
            raise _backend_error(f"commux ep dispatch (rank {me} of {R}): the cached handle expects "
                                 f"{handle._recv_counts} rows from the ranks, they sent {recv_counts}")
        if num_worst_tokens and N > num_worst_tokens:
            raise ValueError(f"commux ep dispatch (rank {me} of {R}): {N} rows arrived, more than "
                             f"num_worst_tokens={num_worst_tokens}")
        recv_x = lanes[0]
        if scales is not None:
            recv_x = (recv_x, f["scales"].view(torch.float32))
        if num_worst_tokens:
            recv_x = self._pad_rows(recv_x, num_worst_tokens)
        if cached:
            return recv_x, None, None, None, None, self._event(xv)

        epr = E // R
        recv_w = f["w"].view(torch.float32) if weights else None  # (zeroed where not local)
        local, per_expert_list = _C._ep_local_ids(f["idx"].view(torch.int32), recv_w, me * epr, epr,
                                                  expert_alignment)
        src_idx = f["src"].view(torch.int32).view(-1)
        if num_worst_tokens:
            per_expert_list = []  # as DeepEP: no counts (no host sync) with num_worst_tokens
            local = self._pad_rows(local, num_worst_tokens, fill=-1)
            if recv_w is not None:
                recv_w = self._pad_rows(recv_w, num_worst_tokens)
        prefix = torch.tensor(list(itertools.accumulate(recv_counts)), dtype=torch.int32)
        new = _Handle((prefix, None, None, src_idx, in_rank, None), _buffer=self._id, _mode="normal",
                      _call=c.number, _order=order, _send_counts=counts, _recv_counts=recv_counts,
                      _tokens=T, _topk=k, _experts=E)
        return recv_x, local, recv_w, per_expert_list, new, self._event(xv)

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias=None, config=None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sends every received row's result back to its source and sums, per original token, over
        the ranks it went to (no weights), in float32 with one cast. Returns combined_x [T, H],
        combined_topk_weights (the sum of the ranks' topk_weights, or None) and the event."""
        c = _Call(self, "ep combine", 2)
        hdr = c.hdr
        try:
            self._check_live()
            if bias is not None:
                raise _Rejected("bias is not supported (add it to the result)")
            h = self._check_handle(handle, "normal")
            hdr[_H_LAYOUT] = h._call
            N = sum(h._recv_counts)
            self._check_2d(x, N, None, (torch.bfloat16,), "x")
            c.device = x.device
            H = x.shape[1]
            if topk_weights is not None:
                self._check_2d(topk_weights, N, h._topk, (torch.float32,), "topk_weights")
            hdr[_H_HIDDEN], hdr[_H_DTYPE], hdr[_H_TOPK], hdr[_H_EXPERTS] = H, 1, h._topk, h._experts
            hdr[_H_TOKENS], hdr[_H_STRIDE] = N, 2 * H
            # The rows go back as they are (grouped by source rank: the order they came in).
            c.counts = h._recv_counts
            c.lane(x.contiguous(), 2 * H)
            if topk_weights is not None:
                c.lane(topk_weights.contiguous(), 4 * h._topk, "topk_weights")
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            c.reject(e)
        lanes, _ = c.exchange()
        back_w = lanes[1].view(torch.float32).view(-1, h._topk) if topk_weights is not None else None
        combined, combined_w = _C._ep_combine_sum(lanes[0].view(torch.bfloat16).view(-1, H), back_w,
                                                  h._order, h._tokens)
        return combined, combined_w, self._event(x)

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
        R, me = self.group_size, self.rank
        cap = num_max_dispatch_tokens_per_rank
        c = _Call(self, "ep low_latency_dispatch", 3)
        hdr = c.hdr
        hdr[_H_CAP], hdr[_H_LAYOUT] = cap, c.number
        try:
            self._check_live()
            if not self.low_latency_mode:
                raise _Rejected("needs Buffer(group, low_latency_mode=True)")
            if use_ue8m0:
                raise _Rejected("use_ue8m0=True (packed UE8M0 scales) is not supported")
            self._check_2d(x, None, None, (torch.bfloat16,), "x")
            c.device = x.device
            T, H = x.shape
            if cap < 0 or T > cap:
                raise _Rejected(f"{T} tokens, more than num_max_dispatch_tokens_per_rank={cap}")
            if use_fp8 and H % _FP8_BLOCK:
                raise _Rejected(f"use_fp8 needs a hidden size that is a multiple of {_FP8_BLOCK}, got {H}")
            if isinstance(num_experts, bool) or not isinstance(num_experts, int):
                raise _Rejected(f"num_experts={num_experts!r} must be an int")
            self._check_topk_shape(topk_idx, x)
            E = num_experts
            err, counts, tok, slot, expert, _, _ = _C._ep_route(topk_idx, E, R, True)
            if err:
                raise _Rejected(err)
            k = topk_idx.shape[1]
            hdr[_H_HIDDEN], hdr[_H_TOKENS], hdr[_H_DTYPE] = H, T, 2 if use_fp8 else 1
            hdr[_H_TOPK], hdr[_H_EXPERTS] = k, E
            c.counts = counts
            parts = {}
            if use_fp8:
                q, parts["scales"] = _quantize_fp8(x, round_scale)
            xb = (q if use_fp8 else x).view(torch.uint8)
            c.lane(xb.index_select(0, tok if xb.device.type == "cpu" else tok.to(xb.device)), xb.shape[1])
            layout = _Layout([("scales", 4 * (H // _FP8_BLOCK) if use_fp8 else 0), ("src", 4), ("expert", 4)])
            c.meta(layout, parts, tok, (("src", tok.to(torch.int32)), ("expert", expert)))
            hdr[_H_STRIDE] = layout.stride
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            c.reject(e)
        epr = E // R
        lanes, recv_counts = c.exchange()
        names = (["scales"] if use_fp8 else []) + ["src", "expert"]
        f = dict(zip(names, c.fields(lanes[1], recv_counts, names)))
        N = sum(recv_counts)
        # Each expert's rows from the start, in arrival order (by source rank, then token).
        payload = [lanes[0].view(N, H * (1 if use_fp8 else 2))] + ([f["scales"]] if use_fp8 else [])
        placed, src_info, recv_count, layout_range, gather = _C._ep_ll_place(
            payload, f["expert"].view(torch.int32).view(-1), f["src"].view(torch.int32).view(-1),
            recv_counts, me * epr, epr, cap * R)
        dt = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        recv_x = placed[0].view(dt)
        if use_fp8:
            recv_x = (recv_x, placed[1].view(torch.float32))
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count.to(cumulative_local_expert_recv_stats.dtype)
        handle = _Handle((src_info, layout_range, cap, H, E), _buffer=self._id, _mode="low_latency",
                         _call=c.number, _tok=tok, _slot=slot, _send_counts=counts,
                         _recv_counts=recv_counts, _tokens=T, _topk=k, _experts=E, _gather=gather,
                         _topk_idx=topk_idx.to(device="cpu", dtype=torch.int64))
        hook = (lambda: None) if return_recv_hook else None
        return recv_x, recv_count.to(torch.int32), handle, self._event(x), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Sends every expert's row back to its source, which sums them weighted by topk_weights
        (float32, one cast). Returns combined_x [T, H] bf16, event, hook."""
        R = self.group_size
        c = _Call(self, "ep low_latency_combine", 4)
        hdr = c.hdr
        try:
            self._check_live()
            if use_logfmt:
                raise _Rejected("use_logfmt=True is not supported")
            h = self._check_handle(handle, "low_latency")
            E, cap = h._experts, handle[2]
            hdr[_H_CAP], hdr[_H_LAYOUT] = cap, h._call
            self._check_3d(x, (E // R, cap * R), "x")
            c.device = x.device
            H = x.shape[2]
            self._check_2d(topk_idx, h._tokens, h._topk, None, "topk_idx")
            if not torch.equal(topk_idx.to(device="cpu", dtype=torch.int64), h._topk_idx):
                # The rows come back in the dispatch's (token, slot) order: weights taken for
                # another routing would be applied to the wrong rows, silently.
                raise _Rejected("topk_idx is not the one the handle's low_latency_dispatch routed")
            self._check_2d(topk_weights, h._tokens, h._topk, (torch.float32,), "topk_weights")
            if out is not None:
                self._check_2d(out, h._tokens, H, (torch.bfloat16,), "out")
            hdr[_H_HIDDEN], hdr[_H_DTYPE], hdr[_H_TOPK], hdr[_H_EXPERTS] = H, 1, h._topk, E
            hdr[_H_TOKENS], hdr[_H_STRIDE] = h._tokens, 2 * H
            c.counts = h._recv_counts
            rows = x.reshape(-1, H)
            c.lane(rows.index_select(0, h._gather if rows.device.type == "cpu" else h._gather.to(rows.device)),
                   2 * H)
        except Exception as e:  # noqa: BLE001  (told to every rank, then raised here)
            c.reject(e)
        (back,), _ = c.exchange()
        dev = x.device
        tok = h._tok if dev.type == "cpu" else h._tok.to(dev)
        slot = h._slot if dev.type == "cpu" else h._slot.to(dev)
        w = topk_weights[tok, slot].unsqueeze(1)
        acc = torch.zeros((h._tokens, H), dtype=torch.float32, device=dev)
        acc.index_add_(0, tok, back.view(torch.bfloat16).view(-1, H).float() * w)
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
    def _next_call(self) -> int:
        return next(self._calls)

    def _slots(self, lane, nbytes: int, device: torch.device) -> torch.Tensor:
        """Receive memory of one lane. On the host it is kept across calls (its pages stay mapped)
        and grown as needed; what a call returns is always copied out of it (or computed from it),
        and that reading is done when the call returns. On a device the reading is queued on the
        current stream, which the next call may not share, so each call takes fresh memory from
        the caching allocator instead."""
        if device.type != "cpu":
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)[:nbytes]
        b = self._kept.get((lane, device))
        if b is None or b.numel() < nbytes:
            b = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self._kept[(lane, device)] = b
        return b[:nbytes]

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
            return xv, scales
        self._check_2d(x, None, None, (torch.bfloat16,), "x")
        return x, None

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

    @staticmethod
    def _check_topk_shape(topk_idx, x):
        if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2:
            if topk_idx.shape[0] != x.shape[0]:
                raise _Rejected(f"topk_idx has {topk_idx.shape[0]} rows, x has {x.shape[0]} tokens")
            if topk_idx.device != x.device:
                raise _Rejected(f"topk_idx is on {topk_idx.device}, x on {x.device}")

    @staticmethod
    def _check_given_layout(in_rank, per_expert, counts, is_token_in_rank, num_tokens_per_rank,
                            num_tokens_per_expert):
        """A layout the caller passed (get_dispatch_layout's) must be the one topk_idx gives."""
        given = [("is_token_in_rank", is_token_in_rank, lambda: in_rank),
                 ("num_tokens_per_rank", num_tokens_per_rank, lambda: torch.tensor(counts)),
                 ("num_tokens_per_expert", num_tokens_per_expert, lambda: per_expert)]
        for name, t, ours in given:
            if t is None:
                continue
            want = ours()
            if not isinstance(t, torch.Tensor) or t.shape != want.shape or not torch.equal(
                    t.to(device="cpu", dtype=want.dtype), want):
                raise _Rejected(f"{name} does not match topk_idx (pass get_dispatch_layout's result)")

    @staticmethod
    def _meta_layout(H, fp8, k, weights):
        return _Layout([("scales", 4 * (H // _FP8_BLOCK) if fp8 else 0), ("idx", 4 * k),
                        ("w", 4 * k if weights else 0), ("src", 4 if k else 0)])

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
