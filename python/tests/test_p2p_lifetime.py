"""Lifetime of point-to-point Works: what a timed-out Work leaves posted, and how long the backend
keeps a finished Work's tensors.

* A p2p Work whose wait(timeout) expires is cancelled: it never receives a later message, so the
  next receive on the same tag gets the next message (not the one after it).
* The backend keeps a Work's tensors only while the operation is in flight: once it has finished
  and the user dropped the Work (and the tensor), the memory is freed -- not only when a later p2p
  operation is posted on the group.
"""
import gc
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import make
from suite import worlds

pytestmark = [pytest.mark.ucx, pytest.mark.ucx_semantics]


# ---------------------------------------------------------------------------------------------
def _timed_out_recv_is_cancelled(ctx):
    """Rank 0 waits 1 s for a tag-5 message that comes only later; rank 1 then sends A and B on
    tag 5. The timed-out receive must not take A: the next two receives get A, then B."""
    tag, n = 5, 1001
    a, b = make(1, n, "float32", salt="life:A"), make(1, n, "float32", salt="life:B")
    problems = []
    if ctx.rank == 0:
        old = torch.zeros(n)
        w = dist.irecv(old, src=1, tag=tag)
        try:
            w.wait(timeout=timedelta(seconds=1))
            problems.append("irecv(...).wait(timeout=1s) returned with nothing sent")
        except RuntimeError as e:
            msg = str(e)
            if "was cancelled" not in msg:
                problems.append(f"the timeout error does not say the receive was cancelled: {msg!r}")
        dist.barrier(group=ctx.ref)  # only now does rank 1 send
        got = []
        for name in ("A", "B"):
            t = torch.zeros(n)
            try:
                dist.irecv(t, src=1, tag=tag).wait(timeout=timedelta(seconds=5))
                got.append(t)
            except RuntimeError as e:
                problems.append(f"the receive meant for {name} got nothing: {e}")
        if got:
            if torch.equal(got[0], b):
                problems.append("the first receive after the timed-out one got B: the timed-out "
                                "receive took A")
            elif not torch.equal(got[0], a):
                problems.append("the first receive after the timed-out one got neither A nor B")
        if len(got) == 2 and not torch.equal(got[1], b):
            problems.append("the second receive after the timed-out one did not get B")
        if not torch.equal(old, torch.zeros(n)):
            problems.append("the timed-out receive's buffer was written after it timed out")
        if not w.is_completed():
            problems.append("the timed-out (cancelled) receive reports is_completed() == False")
    elif ctx.rank == 1:
        dist.barrier(group=ctx.ref)
        dist.send(a, dst=0, tag=tag)
        dist.send(b, dst=0, tag=tag)
    else:
        dist.barrier(group=ctx.ref)
    dist.barrier(group=ctx.ref)
    assert not problems, f"rank {ctx.rank}: " + "; ".join(problems)
    return True


@worlds(2)
def test_timed_out_recv_is_cancelled_and_steals_nothing(ranks, ws):
    ranks.run(_timed_out_recv_is_cancelled, timeout=60)


# ---------------------------------------------------------------------------------------------
SIZE = 64 << 20  # float32 elements: 256 MiB


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _finished_p2p_frees_tensors(ctx, blocking):
    """Rank 0 sends 256 MiB to rank 1 (isend/irecv + wait, or send/recv). After both drop the
    tensor and the Work, nothing of the backend may hold it: the tensor's Python object dies (a
    C++ owner would keep it alive) and the resident memory goes back near where it was."""
    gc.collect()
    dist.barrier(group=ctx.ref)
    base = _rss_kib()
    ref = None
    if ctx.rank in (0, 1):
        t = torch.full((SIZE,), 3.0) if ctx.rank == 0 else torch.zeros(SIZE)
        if blocking:
            (dist.send(t, dst=1, tag=21) if ctx.rank == 0 else dist.recv(t, src=0, tag=21))
        else:
            w = dist.isend(t, dst=1, tag=21) if ctx.rank == 0 else dist.irecv(t, src=0, tag=21)
            w.wait(timeout=timedelta(seconds=30))
            del w
        if ctx.rank == 1:
            assert t[0].item() == 3.0 and t[-1].item() == 3.0, "the received tensor is wrong"
        ref = weakref.ref(t)
        del t
    gc.collect()
    dist.barrier()  # on the group under test: a collective, not a p2p post
    dist.barrier(group=ctx.ref)
    if ref is not None:
        assert ref() is None, (f"rank {ctx.rank}: the finished {'send' if ctx.rank == 0 else 'recv'}'s "
                               "tensor is still referenced after the Work and the tensor were dropped")
    grown = (_rss_kib() - base) // 1024
    assert grown < 64, f"rank {ctx.rank}: resident memory still {grown} MiB above the baseline"
    return True


@worlds(2)
@pytest.mark.parametrize("blocking", [False, True], ids=["isend_irecv", "send_recv"])
def test_finished_p2p_releases_its_tensors(ranks, ws, blocking):
    ranks.run(_finished_p2p_frees_tensors, blocking, timeout=60)
