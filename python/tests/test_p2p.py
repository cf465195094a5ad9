"""Point-to-point: send/recv, isend/irecv, any-source receives, batch_isend_irecv, tag matching.

Payloads are deterministic per (sender, receiver, tag), so every receive is checked exactly; where
it adds something, the same exchange over the gloo reference group must give the same bytes.
"""
import random

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import DTYPES, check_equal, make
from suite import BACKEND, worlds

pytestmark = pytest.mark.ucx

P2P_WORLDS = (2, 3, 4)
COUNTS = [0, 1, 1001, 1 << 20]  # 1<<20 float32 = 4 MiB: beyond eager, rendezvous


def payload(src: int, dst: int, tag: int, count: int, dtype: str = "float32") -> torch.Tensor:
    return make(src, count, dtype, salt=f"p2p:{dst}:{tag}")


# ---------------------------------------------------------------------------------------------
def _send_recv_pairs(ctx, count, dtype, group_name):
    """Every ordered pair (a, b) in turn: a sends, b receives (blocking; deadlock-free order)."""
    group = ctx.ref if group_name == "ref" else None
    n = 0
    for a in range(ctx.world):
        for b in range(ctx.world):
            if a == b:
                continue
            tag = 100 + a * 10 + b
            if ctx.rank == a:
                dist.send(payload(a, b, tag, count, dtype), dst=b, tag=tag, group=group)
            elif ctx.rank == b:
                out = torch.full((count,), True if dtype == "bool" else 7, dtype=DTYPES[dtype])
                dist.recv(out, src=a, tag=tag, group=group)
                check_equal(f"recv {a}->{b} tag {tag} ({dtype}, {count})", out, payload(a, b, tag, count, dtype))
                n += 1
    return n


@worlds(*P2P_WORLDS)
@pytest.mark.parametrize("count", COUNTS)
def test_send_recv(ranks, ws, count):
    got = ranks.run(_send_recv_pairs, count, "float32", "test")
    assert got == [ws - 1] * ws


@worlds(2, 3)
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "int8", "int64", "uint8", "bool", "complex64"])
def test_send_recv_dtypes(ranks, ws, dtype):
    ranks.run(_send_recv_pairs, 1001, dtype, "test")


@worlds(2)
def test_send_recv_reference_gloo(ranks, ws):
    """The same exchange over the gloo reference group (sanity of the reference itself)."""
    ranks.run(_send_recv_pairs, 1001, "float32", "ref")


# ---------------------------------------------------------------------------------------------
def _isend_irecv_all(ctx, count):
    """Every rank posts irecv from and isend to every other rank at once, then waits all."""
    recvs, works = {}, []
    for peer in range(ctx.world):
        if peer == ctx.rank:
            continue
        buf = torch.full((count,), -1.0)
        recvs[peer] = buf
        works.append(dist.irecv(buf, src=peer, tag=5))
    for peer in range(ctx.world):
        if peer != ctx.rank:
            works.append(dist.isend(payload(ctx.rank, peer, 5, count), dst=peer, tag=5))
    for w in works:
        w.wait()
    for peer, buf in recvs.items():
        check_equal(f"irecv from {peer}", buf, payload(peer, ctx.rank, 5, count))
    return len(recvs)


@worlds(*P2P_WORLDS)
@pytest.mark.parametrize("count", COUNTS)
def test_isend_irecv(ranks, ws, count):
    assert ranks.run(_isend_irecv_all, count) == [ws - 1] * ws


# ---------------------------------------------------------------------------------------------
def _recv_any_source(ctx):
    """Rank 0 receives one message from every other rank with src=None; the sender is reported.

    Round 1: dist.recv(src=None) returns the sender. Round 2: dist.irecv(src=None) work reports
    it through Work.source_rank() / _source_rank() after wait().
    """
    out = {}
    count = 257
    for rnd, tag in ((1, 11), (2, 12)):
        if ctx.rank == 0:
            seen = []
            for _ in range(ctx.world - 1):
                buf = torch.zeros(count)
                if rnd == 1:
                    src = dist.recv(buf, src=None, tag=tag)
                else:
                    w = dist.irecv(buf, src=None, tag=tag)
                    w.wait()
                    src = w._source_rank()
                    if hasattr(w, "source_rank") and w.source_rank() != src:
                        mp.soft_fail(f"Work.source_rank() {w.source_rank()} != _source_rank() {src}")
                if not (isinstance(src, int) and 1 <= src < ctx.world):
                    mp.soft_fail(f"round {rnd}: sender reported as {src!r}")
                else:
                    check_equal(f"round {rnd}: payload of the reported sender {src}", buf, payload(src, 0, tag, count))
                seen.append(src)
            if sorted(seen) != list(range(1, ctx.world)):
                mp.soft_fail(f"round {rnd}: senders reported {seen}, want each of 1..{ctx.world - 1} once")
            out[rnd] = sorted(seen)
        else:
            dist.send(payload(ctx.rank, 0, tag, count), dst=0, tag=tag)
    return out


@worlds(*P2P_WORLDS)
def test_recv_any_source(ranks, ws):
    got = ranks.run(_recv_any_source)
    assert got[0] == {1: list(range(1, ws)), 2: list(range(1, ws))}


# ---------------------------------------------------------------------------------------------
RING_SIZES = [1, 0, 1001, 70_000]  # 70k float32 = 280 KB > 256 KiB eager limit


def _batch_ring(ctx, group_name):
    """batch_isend_irecv: a ring in both directions, several tensors (tags) per peer."""
    group = ctx.ref if group_name == "ref" else None
    me, n = ctx.rank, ctx.world
    right, left = (me + 1) % n, (me - 1) % n
    ops, recv_bufs = [], []
    for k, size in enumerate(RING_SIZES):
        ops.append(dist.P2POp(dist.isend, payload(me, right, 10 + k, size), right, group=group, tag=10 + k))
        ops.append(dist.P2POp(dist.isend, payload(me, left, 20 + k, size), left, group=group, tag=20 + k))
        a = torch.full((size,), -1.0)
        b = torch.full((size,), -1.0)
        ops.append(dist.P2POp(dist.irecv, a, left, group=group, tag=10 + k))
        ops.append(dist.P2POp(dist.irecv, b, right, group=group, tag=20 + k))
        recv_bufs.append((a, left, 10 + k, size))
        recv_bufs.append((b, right, 20 + k, size))
    reqs = dist.batch_isend_irecv(ops)
    for r in reqs:
        r.wait()
    for buf, src, tag, size in recv_bufs:
        check_equal(f"batch ring recv from {src} tag {tag} size {size}", buf, payload(src, me, tag, size))
    return len(recv_bufs)


@worlds(*P2P_WORLDS)
def test_batch_isend_irecv_ring(ranks, ws):
    assert ranks.run(_batch_ring, "test") == [2 * len(RING_SIZES)] * ws


@worlds(3)
def test_batch_isend_irecv_ring_reference_gloo(ranks, ws):
    ranks.run(_batch_ring, "ref")


# ---------------------------------------------------------------------------------------------
def _out_of_order_tags(ctx, seed):
    """16 tagged isend/irecv per peer, posted in a per-rank shuffled order, waited in another."""
    me = ctx.rank
    rng = random.Random(seed * 1000 + me)

    def size(src, dst, tag):
        return 100_000 if tag in (3, 11) else tag * 37 + src + dst  # two rendezvous-sized per pair

    ops = [("send", p, t) for p in range(ctx.world) if p != me for t in range(16)]
    ops += [("recv", p, t) for p in range(ctx.world) if p != me for t in range(16)]
    rng.shuffle(ops)
    works, bufs = [], []
    for kind, peer, tag in ops:
        if kind == "send":
            works.append(dist.isend(payload(me, peer, tag, size(me, peer, tag), "int32"), dst=peer, tag=tag))
        else:
            buf = torch.full((size(peer, me, tag),), -1, dtype=torch.int32)
            bufs.append((buf, peer, tag))
            works.append(dist.irecv(buf, src=peer, tag=tag))
    order = list(range(len(works)))
    rng.shuffle(order)
    for i in order:
        works[i].wait()
    for buf, peer, tag in bufs:
        check_equal(f"tag {tag} from {peer}", buf, payload(peer, me, tag, size(peer, me, tag), "int32"))
    return len(bufs)


@worlds(*P2P_WORLDS)
@pytest.mark.parametrize("seed", [1, 2])
def test_out_of_order_tags(ranks, ws, seed):
    assert ranks.run(_out_of_order_tags, seed) == [16 * (ws - 1)] * ws


def _tags_swapped(ctx):
    """Rank 0 sends A (tag 1) then B (tag 2) to rank 1, which posts tag 2 first: each lands right.

    Same sizes, so a receive matched to the wrong tag could not be noticed by a size error.
    Also for a blocking send of small (eager) messages, and for one (sender, tag) carrying two
    messages, which must match in posting order.
    """
    if ctx.rank not in (0, 1):
        return None
    n = 513
    A, B, C = (make(0, n, "float32", salt=s) for s in "ABC")
    if ctx.rank == 0:
        w = [dist.isend(A, dst=1, tag=1), dist.isend(B, dst=1, tag=2)]
        for x in w:
            x.wait()
        dist.send(A, dst=1, tag=31)
        dist.send(B, dst=1, tag=32)
        w = [dist.isend(A, dst=1, tag=40), dist.isend(C, dst=1, tag=40), dist.isend(B, dst=1, tag=41)]
        for x in w:
            x.wait()
        return "sent"
    y1, y2 = torch.zeros(n), torch.zeros(n)
    r2 = dist.irecv(y2, src=0, tag=2)
    r1 = dist.irecv(y1, src=0, tag=1)
    r2.wait()
    r1.wait()
    check_equal("tag 1 (posted second)", y1, A)
    check_equal("tag 2 (posted first)", y2, B)
    z1, z2 = torch.zeros(n), torch.zeros(n)
    r = dist.irecv(z2, src=0, tag=32)
    dist.recv(z1, src=0, tag=31)
    r.wait()
    check_equal("blocking tag 31", z1, A)
    check_equal("tag 32", z2, B)
    u1, u2, u3 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    ws_ = [dist.irecv(u3, src=0, tag=41), dist.irecv(u1, src=0, tag=40), dist.irecv(u2, src=0, tag=40)]
    for x in ws_:
        x.wait()
    check_equal("first message on tag 40", u1, A)
    check_equal("second message on tag 40", u2, C)
    check_equal("tag 41", u3, B)
    return "ok"


@worlds(2, 4)
def test_tags_honoured_exactly(ranks, ws):
    assert ranks.run(_tags_swapped)[:2] == ["sent", "ok"]


# ---------------------------------------------------------------------------------------------
def _dropped_isend(ctx):
    """isend of a temporary tensor whose Work is dropped at once: the backend must keep the tensor
    alive until the send completes (the receiver checks the bytes; the sender scribbles over freed
    memory meanwhile)."""
    import gc

    n = 300_000  # 1.2 MB: rendezvous, so the data is read after isend() returns
    if ctx.rank == 0:
        for tag in range(3):
            dist.isend(payload(0, 1, 60 + tag, n), dst=1, tag=60 + tag)  # Work and tensor dropped
        gc.collect()
        junk = [torch.full((n,), -5.0) for _ in range(8)]  # likely reuses the freed blocks
        dist.barrier(group=ctx.ref)
        del junk
    elif ctx.rank == 1:
        dist.barrier(group=ctx.ref)
        for tag in range(3):
            buf = torch.zeros(n)
            dist.recv(buf, src=0, tag=60 + tag)
            check_equal(f"dropped isend tag {60 + tag}", buf, payload(0, 1, 60 + tag, n))
    else:
        dist.barrier(group=ctx.ref)
    dist.barrier(group=ctx.ref)


@pytest.mark.ucx_semantics  # gloo cancels a send whose Work is dropped: the receiver waits forever
@worlds(2)
def test_isend_work_dropped_keeps_tensor_alive(ranks, ws):
    ranks.run(_dropped_isend)


# ---------------------------------------------------------------------------------------------
def _p2p_suite(ctx):
    """The p2p checks above, in one call, for a one-off group started with commux settings."""
    import os

    out = {"env": {k: os.environ.get(k) for k in ("COMMUX_GROUP", "COMMUX_COALESCE")}}
    out["batch_ring"] = _batch_ring(ctx, "test")
    out["ooo"] = _out_of_order_tags(ctx, 3)
    out["any_source"] = _recv_any_source(ctx)
    out["swapped"] = _tags_swapped(ctx)
    out["isend_irecv"] = _isend_irecv_all(ctx, 70_000)
    return out


@pytest.mark.oneoff
@pytest.mark.ucx_semantics  # commux's runtime settings (interface.md); meaningless for gloo
@pytest.mark.parametrize("setting", ["COMMUX_GROUP", "COMMUX_COALESCE"])
def test_p2p_with_commux_settings(setting):
    """COMMUX_GROUP=1 (the coalescing window behind batch_isend_irecv) and COMMUX_COALESCE=1
    (multi-buffer messages as one UCX message), set on every rank."""
    outs, closed = mp.run_once(_p2p_suite, 3, backend=BACKEND, timeout=90, env={setting: "1"})
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    assert outs[0].value["env"][setting] == "1"
    assert all(o.ok for o in closed), "\n".join(o.describe() for o in closed)


# ---------------------------------------------------------------------------------------------
def _mismatched_sizes(ctx):
    """Rank 1 sends messages of the wrong size to rank 0, which must hear of each one.

    torch cannot report how many bytes a receive got, so a shorter message fails the receive (the
    tensor would otherwise keep stale elements with nothing said), and a longer one fails as UCX
    truncates it. Every way of observing the outcome sees the failure; the sender's side succeeds
    (its message was taken). The group works afterwards.
    """
    from helpers import expect_raises
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    out = {}
    if ctx.rank == 1:
        for tag, n in ((21, 8), (22, 8), (23, 8), (24, 8), (25, 32)):
            dist.send(torch.arange(n, dtype=torch.float32), dst=0, tag=tag)
        be.send([torch.arange(4, dtype=torch.float32), torch.arange(8, dtype=torch.float32)], 0, 26).wait()
        dist.send(torch.arange(16, dtype=torch.float32), dst=0, tag=27)
        return out
    fill = lambda: torch.full((16,), -1.0)  # noqa: E731
    out["recv"] = expect_raises(lambda: dist.recv(fill(), src=1, tag=21))
    out["irecv.wait"] = expect_raises(lambda: dist.irecv(fill(), src=1, tag=22).wait())
    out["future"] = expect_raises(lambda: dist.irecv(fill(), src=1, tag=23).get_future().wait())
    out["any source"] = expect_raises(lambda: dist.recv(fill(), src=None, tag=24))
    out["longer"] = expect_raises(lambda: dist.recv(fill(), src=1, tag=25))
    a, b = torch.full((8,), -1.0), torch.full((8,), -1.0)
    w = be.recv([a, b], 1, 26)
    out["two tensors"] = expect_raises(w.wait)
    out["two tensors: is_success"] = w.is_success()
    out["two tensors: future"] = expect_raises(lambda: w.get_future().wait())
    good = fill()
    dist.recv(good, src=1, tag=27)
    out["after"] = torch.equal(good, torch.arange(16, dtype=torch.float32))
    return out


@pytest.mark.ucx_semantics  # gloo fills a tensor partly from a shorter message and says nothing
@worlds(2)
def test_a_receive_of_the_wrong_size_fails(ranks, ws):
    from helpers import mentions
    got = ranks.run(_mismatched_sizes)[0]
    for case in ("recv", "irecv.wait", "future", "any source"):
        r = got[case]
        assert r["raised"], f"{case}: a 32-byte message into a 64-byte tensor raised nothing"
        assert mentions(r["msg"], "rank 1", "32 bytes", "64 bytes", "group"), f"{case}: {r['msg']}"
        assert "tag 2" in r["msg"], f"{case}: {r['msg']}"
    assert got["longer"]["raised"] and mentions(got["longer"]["msg"], "128", "64"), got["longer"]
    r = got["two tensors"]
    assert r["raised"], "pg.recv([a, b]) with a short first part raised nothing"
    assert mentions(r["msg"], "48 bytes", "64 bytes", "32 + 32"), r["msg"]
    assert got["two tensors: is_success"] is False
    assert "48 bytes" in got["two tensors: future"]["msg"], got["two tensors: future"]
    assert got["after"], "a receive of the right size after the failures got the wrong bytes"


# ---------------------------------------------------------------------------------------------
def _messages_there_first(ctx):
    """Rank 1 sends, then both ranks pass a barrier: its message follows rank 1's on the same
    connection, so rank 0's receives find theirs there already and take them inside the call."""
    from helpers import expect_raises
    out = {}
    if ctx.rank == 1:
        for tag, n, first in ((41, 8, 0), (42, 8, 100), (42, 8, 200), (43, 4, 0)):
            dist.send(torch.arange(first, first + n, dtype=torch.float32), dst=0, tag=tag)
        dist.barrier()
        dist.barrier()
        return out
    dist.barrier()
    t = torch.full((8,), -1.0)
    w = dist.irecv(t, src=1, tag=41)
    out["completed at return"] = w.is_completed()
    w.wait()
    out["source"] = w._source_rank()
    out["data"] = torch.equal(t, torch.arange(8, dtype=torch.float32))
    a, b = torch.full((8,), -1.0), torch.full((8,), -1.0)
    wa, wb = dist.irecv(a, src=1, tag=42), dist.irecv(b, src=1, tag=42)
    wb.wait()
    wa.wait()
    out["same tag in order"] = (torch.equal(a, torch.arange(100, 108, dtype=torch.float32))
                                and torch.equal(b, torch.arange(200, 208, dtype=torch.float32)))
    short = dist.irecv(torch.full((8,), -1.0), src=1, tag=43)
    out["short: is_completed"] = short.is_completed()
    out["short"] = expect_raises(short.wait)
    dist.barrier()
    return out


@pytest.mark.ucx_semantics  # when a receive completes is the backend's; gloo's may complete later
@worlds(2)
def test_a_receive_of_a_message_there_completes_in_the_call(ranks, ws):
    from helpers import mentions
    got = ranks.run(_messages_there_first)[0]
    assert got["completed at return"], "irecv of a message that was there returned an unfinished Work"
    assert got["source"] == 1
    assert got["data"], "irecv of a message that was there got the wrong bytes"
    assert got["same tag in order"], "two same-tag messages taken inside the call were swapped"
    assert got["short: is_completed"]
    r = got["short"]
    assert r["raised"], "a 16-byte message into a 32-byte tensor, there already, raised nothing"
    assert mentions(r["msg"], "rank 1", "16 bytes", "32 bytes", "tag 43", "group"), r["msg"]
