"""COMMUX_GROUP=1: the sends and receives of a coalescing window are deferred to endCoalescing.

Checked on 2 fresh ranks with the setting in their environment (it is read when a group is
created): nothing of the window reaches the peer before the window ends, a Work of the window
cannot be waited on before then (a clear error instead of a hang), the window's Work and future
cover every op, and a peer that does not defer talks to one that does (wire-compatible).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import mp
from suite import BACKEND

pytestmark = [pytest.mark.oneoff, pytest.mark.ucx_semantics]
CPU = torch.device("cpu")


def _deferred_until_end(ctx):
    group = dist.group.WORLD
    me, peer = ctx.rank, 1 - ctx.rank
    out = {}
    if me == 0:
        group._start_coalescing(CPU)
        x = torch.arange(16, dtype=torch.float32)
        w = dist.isend(x, 1, tag=7)
        try:
            w.wait()
            out["wait_in_window"] = "no error"
        except ValueError as e:
            out["wait_in_window"] = str(e)
        dist.barrier(group=ctx.ref)  # the peer's receive is posted; ours is not yet
        dist.barrier(group=ctx.ref)  # the peer has looked at its receive
        work = group._end_coalescing(CPU)
        work.wait()
    else:
        y = torch.zeros(16)
        r = dist.irecv(y, 0, tag=7)
        dist.barrier(group=ctx.ref)
        time.sleep(0.3)  # an eager 64-byte message would long have arrived
        out["completed_before_end"] = r.is_completed()
        dist.barrier(group=ctx.ref)
        r.wait()
        out["got"] = y.tolist()
    del peer
    return out


def test_window_ops_are_posted_at_end_coalescing():
    outs, closed = mp.run_once(_deferred_until_end, 2, backend=BACKEND, timeout=60,
                               env={"COMMUX_GROUP": "1"})
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    assert "endCoalescing" in outs[0].value["wait_in_window"], outs[0].value
    assert "commux send" in outs[0].value["wait_in_window"], outs[0].value
    assert outs[1].value["completed_before_end"] is False
    assert outs[1].value["got"] == list(range(16))
    assert all(o.ok for o in closed), "\n".join(o.describe() for o in closed)


def _exchange_in_window(ctx, rounds, defer):
    """Both ranks: a window of V sends and V receives per round (the halo pattern), receives
    issued after the sends; the window's future holds every output. The setting is read when a
    group is created, so each rank sets its own before creating a new group."""
    import os

    os.environ["COMMUX_GROUP"] = defer[ctx.rank]
    group = dist.new_group(backend=BACKEND)
    os.environ.pop("COMMUX_GROUP")
    me, peer = ctx.rank, 1 - ctx.rank
    for k in range(rounds):
        n = 1 + 37 * k
        group._start_coalescing(CPU)
        sends = [torch.full((n,), float(100 * me + v + k)) for v in range(4)]
        recvs = [torch.zeros(n) for _ in range(4)]
        for v in range(4):
            dist.isend(sends[v], peer, group=group, tag=v)
        for v in reversed(range(4)):
            dist.irecv(recvs[v], peer, group=group, tag=v)
        work = group._end_coalescing(CPU)
        fut = work.get_future()
        work.wait()
        assert len(fut.wait()) == 8
        for v in range(4):
            if not torch.equal(recvs[v], torch.full((n,), float(100 * peer + v + k))):
                mp.soft_fail(f"round {k} tag {v}: got {recvs[v][:4].tolist()}")
    dist.destroy_process_group(group)
    return rounds


@pytest.mark.parametrize("defer", [("1", "1"), ("1", "0")], ids=["both", "rank0-only"])
def test_window_exchange_matches(defer):
    """Only rank 0 defers in the second case: deferral does not change the wire format."""
    outs, closed = mp.run_once(_exchange_in_window, 2, 20, defer, backend=BACKEND, timeout=60)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    assert [o.value for o in outs] == [20, 20]
    assert all(o.ok for o in closed), "\n".join(o.describe() for o in closed)
