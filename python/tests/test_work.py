"""Work objects (futures, waits, completion polling) and concurrent subgroups."""
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import check_equal, expect_raises, group_with, make
from suite import worlds

pytestmark = pytest.mark.ucx


def _flat(value):
    """A future's value as a flat list of tensors (backends nest allgather outputs differently)."""
    if isinstance(value, torch.Tensor):
        return [value]
    out = []
    for v in value:
        out.extend(_flat(v))
    return out


def _futures(ctx):
    W, me = ctx.world, ctx.rank
    tri = float(W * (W + 1) // 2)
    res = {}
    for group, name in ((None, "test"), (ctx.ref, "gloo")):
        x = torch.full((1001,), float(me + 1))
        work = dist.all_reduce(x, async_op=True, group=group)
        val = work.get_future().wait()
        assert isinstance(val, list) and len(val) == 1, f"{name}: all_reduce future value {val!r}"
        check_equal(f"{name}: all_reduce future value", val[0], torch.full((1001,), tri))
        check_equal(f"{name}: all_reduce tensor after the future", x, torch.full((1001,), tri))

        b = make(0, 333, "float32", salt="fb") if me == 0 else torch.zeros(333)
        val = dist.broadcast(b, src=0, async_op=True, group=group).get_future().wait()
        assert len(_flat(val)) == 1, f"{name}: broadcast future value {val!r}"
        check_equal(f"{name}: broadcast future value", _flat(val)[0], make(0, 333, "float32", salt="fb"))

        outs = [torch.zeros(17) for _ in range(W)]
        val = dist.all_gather(outs, torch.full((17,), float(me)), async_op=True, group=group).get_future().wait()
        flat = _flat(val)
        assert len(flat) == W, f"{name}: all_gather future value has {len(flat)} tensors, want {W}"
        for r in range(W):
            check_equal(f"{name}: all_gather future value [{r}]", flat[r], torch.full((17,), float(r)))
            check_equal(f"{name}: all_gather output [{r}]", outs[r], torch.full((17,), float(r)))

        # chained like a DDP comm hook
        y = torch.full((5,), 1.0)
        fut = dist.all_reduce(y, async_op=True, group=group).get_future().then(lambda f: f.value()[0] * 2)
        check_equal(f"{name}: then() chain", fut.wait(), torch.full((5,), 2.0 * W))

        # wait(timeout) on an op that completes: returns True, is_completed() afterwards
        z = torch.ones(3)
        w = dist.all_reduce(z, async_op=True, group=group)
        ok = w.wait(timeout=timedelta(seconds=30))
        assert ok is True, f"{name}: wait(timeout) returned {ok!r}"
        assert w.is_completed(), f"{name}: is_completed() False after wait()"

        # the future asked for only after the Work completed (commux makes it then, settled)
        v = torch.full((7,), float(me + 1))
        w = dist.all_reduce(v, async_op=True, group=group)
        w.wait()
        fut = w.get_future()
        assert fut.done(), f"{name}: a finished Work's future is not done"
        check_equal(f"{name}: future asked for after wait()", fut.wait()[0], torch.full((7,), tri))
        assert w.get_future().wait()[0] is fut.wait()[0], f"{name}: a second get_future() differs"
        res[name] = "ok"
    return res


@worlds()
def test_futures_and_wait(ranks, ws):
    assert ranks.run(_futures, timeout=30) == [{"test": "ok", "gloo": "ok"}] * ws


def _failed_future(ctx):
    """A collective that fails (rank 0 all-reduces, rank 1 broadcasts: the call check fails both)
    carries its error in the future asked for after the failure, as in one asked for before it."""
    me = ctx.rank
    out = {}
    for when in ("before", "after"):
        x = torch.ones(1000)
        w = dist.all_reduce(x, async_op=True) if me == 0 else dist.broadcast(x, src=0, async_op=True)
        fut = w.get_future() if when == "before" else None
        waited = expect_raises(w.wait)
        if fut is None:
            fut = w.get_future()
        got = expect_raises(fut.wait)
        out[when] = (waited["raised"], got["raised"], got["msg"][:300])
        y = torch.full((3,), float(me + 1))
        dist.all_reduce(y)  # the group goes on
        check_equal(f"all_reduce after the failed call ({when})", y, torch.full((3,), 3.0))
    return out


@worlds(2)
def test_future_of_a_failed_collective_carries_its_error(ranks, ws):
    for me, res in enumerate(ranks.run(_failed_future, timeout=60)):
        for when, (waited, raised, msg) in res.items():
            assert waited, f"rank {me}: wait() of the mismatched call did not raise ({when})"
            assert raised, f"rank {me}: the future asked for {when} the failure did not fail"
            assert "all_reduce" in msg.lower() or "allreduce" in msg.lower(), (
                f"rank {me}: the future's error ({when}) does not name the call: {msg}")


def _is_completed(ctx, poll_only):
    """is_completed() answers at once while the op is pending. With ``poll_only`` the ops are then
    driven to completion by polling is_completed() alone, never calling wait() before it is True
    (the `while not work.is_completed(): do_other_work()` pattern)."""
    W, me = ctx.world, ctx.rank
    out = {}

    def finish(w, what):
        if poll_only:
            deadline = time.monotonic() + 15
            while not w.is_completed():
                if time.monotonic() > deadline:
                    mp.soft_fail(f"{what}: is_completed() still False after 15s of polling without "
                                 "wait(): polling does not drive progress")
                    break
                time.sleep(0.001)
        w.wait()
        if not w.is_completed():
            mp.soft_fail(f"{what}: is_completed() False after wait()")

    if me == 0:
        buf = torch.zeros(1000)
        w = dist.irecv(buf, src=1, tag=42)
        t0 = time.monotonic()
        flags = [w.is_completed() for _ in range(200)]
        took = time.monotonic() - t0
        if any(flags):
            mp.soft_fail("irecv reported complete before the peer sent anything")
        if took >= 1.0:
            mp.soft_fail(f"200 is_completed() calls took {took:.2f}s: it blocks")
        out["pending_polls_s"] = took
        dist.barrier(group=ctx.ref)  # now rank 1 sends
        finish(w, "irecv")
        check_equal("irecv payload", buf, make(1, 1000, "float32", salt="ic"))
    elif me == 1:
        dist.barrier(group=ctx.ref)
        dist.send(make(1, 1000, "float32", salt="ic"), dst=0, tag=42)
    else:
        dist.barrier(group=ctx.ref)

    # a collective that cannot finish while the last rank sleeps
    x = torch.ones(64)
    if me == W - 1:
        time.sleep(0.5)
    w = dist.all_reduce(x, async_op=True)
    if me == 0:
        t0 = time.monotonic()
        c = w.is_completed()
        took = time.monotonic() - t0
        if took >= 0.2:
            mp.soft_fail(f"is_completed() on a pending all_reduce took {took:.2f}s")
        if c:
            mp.soft_fail("all_reduce reported complete while a rank had not joined")
    finish(w, "all_reduce")
    check_equal("all_reduce after polling", x, torch.full((64,), float(W)))
    return out


@worlds(2, 3)
def test_is_completed_never_blocks(ranks, ws):
    ranks.run(_is_completed, False, timeout=40)


@pytest.mark.ucx_semantics  # gloo's recv Work only completes inside wait()
@worlds(2)
def test_polling_is_completed_drives_progress(ranks, ws):
    ranks.run(_is_completed, True, timeout=60)


# ---------------------------------------------------------------------------------------------
def _subgroups(ctx):
    """Groups [0,1], [2,3], overlapping [1,2] and a second all-rank group, used at once with async
    collectives and p2p on the same tag: no cross-talk."""
    me = ctx.rank
    if "sub" not in ctx.cache:
        ctx.cache["sub"] = {
            "g01": dist.new_group([0, 1]), "g23": dist.new_group([2, 3]),
            "g12": dist.new_group([1, 2]), "gall": dist.new_group([0, 1, 2, 3]),
        }
    g = ctx.cache["sub"]
    member = {"g01": me in (0, 1), "g23": me in (2, 3), "g12": me in (1, 2), "gall": True}
    base = {"g01": 10.0, "g23": 100.0, "g12": 1000.0, "gall": 10000.0}
    ranks_of = {"g01": [0, 1], "g23": [2, 3], "g12": [1, 2], "gall": [0, 1, 2, 3]}
    works, checks = [], []
    # collectives on every group I belong to, all in flight together
    for name in ("g12", "gall", "g01", "g23"):
        if not member[name]:
            continue
        x = torch.full((1001,), base[name] * (me + 1))
        works.append(dist.all_reduce(x, group=g[name], async_op=True))
        checks.append((f"all_reduce on {name}", x,
                       torch.full((1001,), base[name] * sum(r + 1 for r in ranks_of[name]))))
        outs = [torch.zeros(7) for _ in ranks_of[name]]
        works.append(dist.all_gather(outs, torch.full((7,), base[name] + me), group=g[name], async_op=True))
        for i, r in enumerate(ranks_of[name]):
            checks.append((f"all_gather on {name} from {r}", outs[i], torch.full((7,), base[name] + r)))
    # p2p, tag 5 everywhere; 1 -> 2 on both g12 and gall (same pair, same tag, different groups)
    sends = [("g01", 0, 1), ("g23", 3, 2), ("g12", 1, 2), ("gall", 1, 2), ("g12", 2, 1), ("gall", 0, 3)]
    recv_posts = []
    for name, src, dst in sends:
        if me == dst:
            recv_posts.append((name, src))
    for name, src in reversed(recv_posts):  # receiver posts in the opposite order
        buf = torch.zeros(513)
        works.append(dist.irecv(buf, src=src, group=g[name], tag=5))
        checks.append((f"p2p {src}->{me} on {name}", buf, make(src, 513, "float32", salt=f"sub{name}")))
    for name, src, dst in sends:
        if me == src:
            works.append(dist.isend(make(src, 513, "float32", salt=f"sub{name}"), dst=dst, group=g[name], tag=5))
    for w in works:
        w.wait()
    for what, got, want in checks:
        check_equal(what, got, want)
    return len(checks)


@worlds(4)
@pytest.mark.parametrize("rep", [1, 2])
def test_concurrent_subgroups(ranks, ws, rep):
    ranks.run(_subgroups, timeout=60)


# ---------------------------------------------------------------------------------------------
def _many_in_flight(ctx):
    """Many async collectives of different kinds and sizes in flight at once on one group, waited
    in reverse order: each lands in its own output."""
    W, me = ctx.world, ctx.rank
    works, checks = [], []
    for i in range(12):
        n = [1, 1001, 70_000][i % 3]
        x = torch.full((n,), float(me + i))
        works.append(dist.all_reduce(x, async_op=True))
        checks.append((f"all_reduce #{i}", x, torch.full((n,), float(sum(r + i for r in range(W))))))
        root = i % W
        b = torch.full((n,), float(100 + i)) if me == root else torch.zeros(n)
        works.append(dist.broadcast(b, src=root, async_op=True))
        checks.append((f"broadcast #{i} from {root}", b, torch.full((n,), float(100 + i))))
        o = torch.zeros(W * 3)
        works.append(dist.all_gather_into_tensor(o, torch.full((3,), float(me * 10 + i)), async_op=True))
        checks.append((f"all_gather_into_tensor #{i}", o,
                       torch.tensor([float(r * 10 + i) for r in range(W) for _ in range(3)])))
    for w in reversed(works):
        w.wait()
    for what, got, want in checks:
        check_equal(what, got, want)
    return len(checks)


@worlds()
def test_many_async_collectives_in_flight(ranks, ws):
    ranks.run(_many_in_flight, timeout=60)


def _schedule_futures_two_at_once(ctx):
    """Bursts of 8 async all_reduces of 256 KiB, issued back to back and their futures waited in
    turn (DDP's buckets), on a group whose collectives run as schedules two at once
    (COMMUX_SCHEDULE=1, COMMUX_INFLIGHT=2; so do smaller ones under auto, whose byte window lets
    two of 32 KiB run together) and whose timeout is 20 s. Nobody resumes these schedules but
    the group's pool threads: one runs the earliest to its end, and a second one, which only
    yielded while another thread ran the earliest, left the later ones unresumed; a peer
    waiting in the later one for this rank left both ranks waiting until the timeout (in each
    of 9 runs on the development VM: 6 of a loop like this one, after 27 to 273 bursts, and 3
    of this test). Every result is checked."""
    W, me = ctx.world, ctx.rank
    g = group_with({"COMMUX_SCHEDULE": "1", "COMMUX_INFLIGHT": "2"}, timeout=timedelta(seconds=20))
    xs = [torch.empty(65536) for _ in range(8)]
    for it in range(1000):
        for i, x in enumerate(xs):
            x.fill_(float(me + i + it))
        works = [dist.all_reduce(x, async_op=True, group=g) for x in xs]
        for w in works:
            w.get_future().wait()
        for i, x in enumerate(xs):
            want = float(sum(r + i + it for r in range(W)))
            if not bool((x == want).all()):
                check_equal(f"burst {it} all_reduce #{i}", x, torch.full_like(x, want))
    return 1000


@worlds(2)
def test_schedule_futures_two_at_once_never_deadlock(ranks, ws):
    ranks.run(_schedule_futures_two_at_once, timeout=120)


def _random_waits(ctx):
    """Async collectives with blocking ones between them, each rank waiting for the async ones in
    its own random order (a wait may run the collective and every one queued before it on the
    waiting thread, or find it running or done on the group's thread), on the default group and
    on one that runs up to four at once (COMMUX_INFLIGHT=4): every output is right."""
    import random

    W, me = ctx.world, ctx.rank
    rng = random.Random(1000 * ctx.world + me)
    n_checks = 0
    g4 = _group_with("COMMUX_INFLIGHT", "4")  # up to four at once, whatever auto gives here
    for rnd in range(8):
        group = None if rnd % 2 == 0 else g4
        works, checks = [], []
        for i in range(10):
            n = [1, 64, 5000][(rnd + i) % 3]  # equal on every rank
            x = torch.full((n,), float(me + i))
            works.append(dist.all_reduce(x, async_op=True, group=group))
            checks.append((f"round {rnd} async all_reduce #{i}", x,
                           torch.full((n,), float(sum(r + i for r in range(W))))))
            if i % 4 == 3:
                root = (rnd + i) % W
                b = torch.full((9,), float(i)) if me == root else torch.zeros(9)
                dist.broadcast(b, src=root, group=group)  # blocking, among async ones
                checks.append((f"round {rnd} blocking broadcast #{i}", b, torch.full((9,), float(i))))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
        order = list(range(len(works)))
        rng.shuffle(order)
        for k in order:
            works[k].wait()
        for what, got, want in checks:
            check_equal(what, got, want)
        n_checks += len(checks)
    return n_checks


@worlds()
def test_async_collectives_waited_in_random_order_per_rank(ranks, ws):
    ranks.run(_random_waits, timeout=60)


# ---------------------------------------------------------------------------------------------
def _async_with_p2p(ctx):
    """An async collective and blocking point-to-point in either order, on every rank: in round i
    rank r issues its all_reduce (async_op=True) before its send/recv when (r + i) is even, after
    them otherwise, so some ranks sit in a blocking recv or send while their peer's collective is
    issued but not complete. A backend that ran the collective on the caller's thread until the
    others joined would deadlock here (the test's timeout)."""
    W, me = ctx.world, ctx.rank
    peer = me ^ 1
    n = 2049
    for i in range(8):
        x = torch.full((n,), float(me + i))
        sent = make(me, 300 + i, "float32", salt=f"ap{i}")
        got = torch.zeros(300 + i)

        def p2p():
            if peer >= W:
                return
            if me < peer:
                dist.send(sent, dst=peer, tag=i)
                dist.recv(got, src=peer, tag=i)
            else:
                dist.recv(got, src=peer, tag=i)
                dist.send(sent, dst=peer, tag=i)

        if (me + i) % 2 == 0:
            work = dist.all_reduce(x, async_op=True)
            p2p()
        else:
            p2p()
            work = dist.all_reduce(x, async_op=True)
        work.wait()
        check_equal(f"round {i}: all_reduce", x, torch.full((n,), float(sum(r + i for r in range(W)))))
        if peer < W:
            check_equal(f"round {i}: recv from {peer}", got, make(peer, 300 + i, "float32", salt=f"ap{i}"))
    return 8


@worlds(2, 3, 4)
def test_async_collective_with_p2p_in_both_orders(ranks, ws):
    ranks.run(_async_with_p2p, timeout=60)


# ---------------------------------------------------------------------------------------------
def _shutdown_in_flight(ctx):
    """A group shut down while collectives are in flight on it: rank 0 issues five async
    collectives on a new group (up to three at once) that no other rank joins, then destroys the
    group. Every Work fails within seconds with an error saying the group was shut down (by rank 0,
    or before that by a peer that destroyed it without joining: never a hang, never a success),
    and the default group goes on giving right results."""
    W, me = ctx.world, ctx.rank
    g = _group_with("COMMUX_INFLIGHT", "3")  # three running, two queued
    dist.barrier(group=ctx.ref)
    works = []
    if me == 0:
        for i in range(4):
            works.append((f"all_reduce #{i}", dist.all_reduce(torch.ones(1000 + i), async_op=True, group=g)))
        works.append(("broadcast", dist.broadcast(torch.ones(77), src=0, async_op=True, group=g)))
        time.sleep(0.2)  # the first three are running (COMMUX_INFLIGHT=3), the rest queued
    t0 = time.monotonic()
    dist.destroy_process_group(g)
    for what, w in works:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 -- any error type, as long as it says why
            assert "shut down" in str(e), f"{what}: {e}"
        else:
            mp.soft_fail(f"{what} succeeded on a group that was shut down with no peer in it")
    took = time.monotonic() - t0
    assert took < 15, f"shutting down with collectives in flight took {took:.1f} s"
    dist.barrier(group=ctx.ref)
    x = torch.full((5,), float(me))
    dist.all_reduce(x)
    check_equal("all_reduce on the default group afterwards", x, torch.full((5,), float(W * (W - 1) // 2)))
    return len(works)


@pytest.mark.ucx_semantics  # the error text
@worlds(2, 3)
def test_shutdown_with_collectives_in_flight(ranks, ws):
    ranks.run(_shutdown_in_flight, timeout=60)


# ---------------------------------------------------------------------------------------------
def _background(ctx):
    """Operations progress while the caller computes: a 16 MiB isend/irecv (rendezvous, several
    round trips inside UCX) and a 16 MiB async all_reduce are posted, then every rank sleeps without
    touching them. Right after the sleep, ONE is_completed() call must already be True. (That call
    drives at most one progress step itself, which cannot finish a rendezvous transfer.)"""
    W, me = ctx.world, ctx.rank
    n = 4 << 20  # float32 elements: 16 MiB
    peer = me ^ 1
    works = []
    if peer < W:
        out = make(me, n, "float32", salt="bg")
        inp = torch.zeros(n)
        works.append(("irecv", dist.irecv(inp, src=peer, tag=77)))
        works.append(("isend", dist.isend(out, dst=peer, tag=77)))
    x = torch.full((n,), float(me + 1))
    works.append(("all_reduce", dist.all_reduce(x, async_op=True)))
    time.sleep(2.0)  # "compute": no wait(), no polling
    late = [what for what, w in works if not w.is_completed()]
    if late:
        mp.soft_fail(f"not complete after 2 s of computing without waiting: {late}")
    for _, w in works:
        w.wait()
    if peer < W:
        check_equal("16 MiB irecv payload", inp, make(peer, n, "float32", salt="bg"))
    check_equal("16 MiB all_reduce", x, torch.full((n,), float(W * (W + 1) // 2)))
    return len(works)


@pytest.mark.ucx_semantics  # gloo drives its p2p only inside wait()
@worlds(2, 3)
def test_operations_progress_while_caller_computes(ranks, ws):
    ranks.run(_background, timeout=60)


# ---------------------------------------------------------------------------------------------
def _p2p_futures(ctx):
    """A p2p Work's future resolves to its tensor: asked for while the receive is still pending
    (the peer sends only after a barrier), and asked for after completion."""
    me = ctx.rank
    if me == 0:
        buf = torch.zeros(4097)
        w = dist.irecv(buf, src=1, tag=9)
        fut = w.get_future()  # pending: completed later by commux's watcher
        dist.barrier(group=ctx.ref)
        val = fut.wait()
        assert isinstance(val, list) and len(val) == 1, f"irecv future value {val!r}"
        check_equal("irecv future value", val[0], make(1, 4097, "float32", salt="pf"))
        check_equal("irecv buffer", buf, make(1, 4097, "float32", salt="pf"))
        w2 = dist.irecv(buf, src=1, tag=10)
        w2.wait()
        check_equal("future after completion", w2.get_future().wait()[0], make(1, 4097, "float32", salt="pg"))
    elif me == 1:
        dist.barrier(group=ctx.ref)
        w = dist.isend(make(1, 4097, "float32", salt="pf"), dst=0, tag=9)
        w.get_future().wait()
        dist.send(make(1, 4097, "float32", salt="pg"), dst=0, tag=10)
    else:
        dist.barrier(group=ctx.ref)
    return True


@pytest.mark.ucx_semantics
@worlds(2, 3)
def test_p2p_futures(ranks, ws):
    ranks.run(_p2p_futures, timeout=30)


# ---------------------------------------------------------------------------------------------
def _backend(group=None):
    g = group if group is not None else dist.distributed_c10d._get_default_group()
    return g._get_backend(torch.device("cpu"))


def _group_with(var, value, **more):
    """A new group of every rank created with the environment variable `var` set to `value`,
    and each of `more` (name=value) too (their previous values, e.g. ones the whole run set, come
    back afterwards)."""
    return group_with({var: value, **more})


def _caller_runs(ctx):
    """COMMUX_CALLER_RUNS (on by default): a blocking collective with nothing of its group queued
    before it runs on the calling thread (torch may get a completed Work back), so every one of
    them counts in caller_ran_calls; async ones run where they are waited for or on the group's
    thread, in issue order either way. A group created with COMMUX_CALLER_RUNS=0 runs none on the
    caller. Every result is checked."""
    W, me = ctx.world, ctx.rank
    tri = float(W * (W + 1) // 2)
    be = _backend()
    before = be.caller_ran_calls
    for i in range(40):
        x = torch.full((33 + i,), float(me + 1))
        dist.all_reduce(x)
        check_equal(f"blocking all_reduce #{i}", x, torch.full((33 + i,), tri))
        dist.barrier()
    blocking = be.caller_ran_calls - before
    # Async ones issued back to back, waited in issue order and in reverse, with blocking ones
    # between them: each lands in its own output.
    works, checks = [], []
    for i in range(6):
        x = torch.full((100 + i,), float(me + i))
        works.append(dist.all_reduce(x, async_op=True))
        checks.append((f"async all_reduce #{i}", x, torch.full((100 + i,), float(sum(r + i for r in range(W))))))
        if i == 2:
            y = torch.full((7,), float(me))
            dist.all_reduce(y)  # queued behind the async ones (or run here once they are done)
            checks.append(("blocking all_reduce among async ones", y, torch.full((7,), float(W * (W - 1) // 2))))
    for w in works[:3]:
        w.wait()
    for w in reversed(works[3:]):
        w.wait()
    for what, got, want in checks:
        check_equal(what, got, want)
    g = _group_with("COMMUX_CALLER_RUNS", "0")
    off = _backend(g)
    for i in range(10):
        x = torch.full((5,), float(me + 1))
        dist.all_reduce(x, group=g)
        check_equal(f"all_reduce #{i} with COMMUX_CALLER_RUNS=0", x, torch.full((5,), tri))
    return {"blocking": blocking, "off": off.caller_ran_calls}


@pytest.mark.ucx_semantics  # commux's counter
@worlds(2, 3)
def test_blocking_collectives_run_on_the_calling_thread(ranks, ws):
    for r in ranks.run(_caller_runs, timeout=60):
        assert r["blocking"] == 80, r  # 40 all_reduces and 40 barriers
        assert r["off"] == 0, r


def _schedules(ctx):
    """COMMUX_SCHEDULE=1 (off by default): an async CPU collective that may start at once starts on
    the calling thread as a schedule, and is resumed by whichever thread waits (or the group's
    thread): 8 async all_reduces on distinct tensors, with tagged p2p to both neighbours issued
    before them in one round and after them in the other, waited in a random order per rank.
    Each counts in scheduled_calls; a group created with COMMUX_SCHEDULE=0 starts none. Every
    result is checked."""
    import random
    W, me = ctx.world, ctx.rank
    right, left = (me + 1) % W, (me - 1) % W
    g = _group_with("COMMUX_SCHEDULE", "1")
    be = _backend(g)
    rng = random.Random(1000 + me)
    before = be.scheduled_calls
    for rnd, p2p_first in enumerate((True, False)):
        works, checks = [], []

        def p2p():
            out = torch.full((17,), float(me * 10 + rnd))
            got = torch.zeros(17)
            works.append(dist.isend(out, right, tag=40 + rnd, group=g))
            works.append(dist.irecv(got, left, tag=40 + rnd, group=g))
            checks.append((f"round {rnd}: recv from {left}", got, torch.full((17,), float(left * 10 + rnd))))

        if p2p_first:
            p2p()
        for i in range(8):
            x = torch.full((64 + 100 * i,), float(me + i + rnd))
            works.append(dist.all_reduce(x, async_op=True, group=g))
            checks.append((f"round {rnd}: async all_reduce #{i}", x,
                           torch.full((64 + 100 * i,), float(sum(r + i + rnd for r in range(W))))))
        if not p2p_first:
            p2p()
        rng.shuffle(works)
        for w in works:
            w.wait()
        for what, got, want in checks:
            check_equal(what, got, want)
    started = be.scheduled_calls - before
    g0 = _group_with("COMMUX_SCHEDULE", "0")
    off = _backend(g0)
    for i in range(4):
        x = torch.full((5,), float(me + 1))
        dist.all_reduce(x, group=g0, async_op=True).wait()
        check_equal(f"all_reduce #{i} with COMMUX_SCHEDULE=0", x, torch.full((5,), float(W * (W + 1) // 2)))
    return {"started": started, "off": off.scheduled_calls}


@pytest.mark.ucx_semantics  # commux's counter
@worlds(2, 3, 4)
def test_async_collectives_run_as_schedules_beside_p2p(ranks, ws):
    for r in ranks.run(_schedules, timeout=60):
        assert r["started"] == 16, r  # every async all_reduce of both rounds
        assert r["off"] == 0, r


def _future_callback_waits_for_another(ctx):
    """Two async all_reduces that nobody waits for through Work.wait(); the first one's future has
    a callback that waits for the second one's future. A callback runs on the thread that
    completes the future (a pool thread, never the core's progress thread), and that thread must
    not be the only one that could complete the second: with the pool threads running the
    collectives one at a time (COMMUX_INFLIGHT=1, auto where ranks outnumber cores), with
    schedules resumed by the progress thread (COMMUX_SCHEDULE=1) and with schedules run to their
    end by pool threads (COMMUX_PROGRESS_RESUMES=0). Each hung before its fix. Results are
    checked."""
    W, me = ctx.world, ctx.rank
    variants = {
        "inflight=1": ("COMMUX_INFLIGHT", "1", {"COMMUX_SCHEDULE": "0"}),
        "schedule": ("COMMUX_SCHEDULE", "1", {"COMMUX_PROGRESS_RESUMES": "1"}),
        "schedule, progress_resumes=0": ("COMMUX_SCHEDULE", "1", {"COMMUX_PROGRESS_RESUMES": "0"}),
    }
    started = {}
    for label, (var, value, more) in variants.items():
        g = _group_with(var, value, **more)
        be = _backend(g)
        before = be.scheduled_calls
        for i in range(4):
            n = 10 + 5000 * i
            x = torch.full((n,), float(me + 1))
            y = torch.full((n,), float(me + 2))
            wa = dist.all_reduce(x, async_op=True, group=g)
            wb = dist.all_reduce(y, async_op=True, group=g)
            fb = wb.get_future()

            def both(fa, fb=fb):
                fb.wait()
                return fa.value()[0] + fb.value()[0]

            got = wa.get_future().then(both).wait()
            want = float(W * (W + 1) // 2 + W * (W + 3) // 2)
            check_equal(f"{label}, round {i}: the callback's sum of two all_reduces of {n}", got,
                        torch.full((n,), want))
        started[label] = be.scheduled_calls - before
    return started


@pytest.mark.ucx_semantics  # commux's threads and counters
@worlds(2, 3)
def test_a_future_callback_may_wait_for_another_async_collective(ranks, ws):
    for r in ranks.run(_future_callback_waits_for_another, timeout=90):
        assert r == {"inflight=1": 0, "schedule": 8, "schedule, progress_resumes=0": 8}, r


def _thread_name(tid):
    """The thread's name, "" if it has ended since it was listed (an idle pool thread retires)."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _callback_threads(ctx):
    """Async all_reduces whose futures' callbacks record the thread they run on, with the schedules
    resumed by the core's progress thread (which hands such futures to a pool thread) and by pool
    threads; rank 0 issues early, so its callbacks run on a commux thread. Returns the names of
    the non-main threads the callbacks ran on, and how many threads are named commux-progress."""
    import threading
    W, me = ctx.world, ctx.rank
    names = set()
    for resumes in ("1", "0"):
        g = _group_with("COMMUX_SCHEDULE", "1", COMMUX_PROGRESS_RESUMES=resumes)
        for i in range(3):
            x = torch.full((1000,), float(me + i))
            dist.barrier()
            if me != 0:
                time.sleep(0.2)
            ran_on = []
            fut = dist.all_reduce(x, async_op=True, group=g).get_future()
            fut.then(lambda f: ran_on.append(threading.get_native_id())).wait()
            check_equal(f"all_reduce #{i} (progress resumes {resumes})", x,
                        torch.full((1000,), float(sum(r + i for r in range(W)))))
            names.update(_thread_name(t) for t in ran_on if t != threading.get_native_id())
    progress = sum(_thread_name(t) == "commux-progress" for t in os.listdir("/proc/self/task"))
    return {"callback threads": sorted(names), "progress threads": progress}


@pytest.mark.ucx_semantics  # commux's threads
@worlds(2)
def test_future_callbacks_run_on_threads_named_commux_pool(ranks, ws):
    """A pool thread started from the core's progress thread (to complete a future the progress
    thread finished) took that thread's name: top -H, perf and this test saw two or more
    "commux-progress" threads, and callbacks seemingly on the progress thread, which never runs
    user code. The pool threads are named commux-pool."""
    r0 = ranks.run(_callback_threads, timeout=60)[0]
    assert r0 == {"callback threads": ["commux-pool"], "progress threads": 1}, r0


def _pool_threads():
    return sum(_thread_name(t) == "commux-pool" for t in os.listdir("/proc/self/task"))


def _pool_after_a_burst(ctx):
    """Bursts of 8 async all_reduces waited through their futures (the pool grows to what they
    need at once), then 1.5 s of one at a time, every 5 ms: how many pool threads are alive after
    the bursts and after the calls one at a time. Results are checked."""
    W, me = ctx.world, ctx.rank
    xs = [torch.empty(1024) for _ in range(8)]

    def check(what, i, x):
        check_equal(what, x, torch.full((1024,), float(sum(r + i for r in range(W)))))

    for _ in range(200):
        for i, x in enumerate(xs):
            x.fill_(float(me + i))
        futs = [dist.all_reduce(x, async_op=True).get_future() for x in xs]
        for i, f in enumerate(futs):
            f.wait()
            check(f"all_reduce #{i} of a burst", i, xs[i])
    after_bursts = _pool_threads()
    end = time.monotonic() + 1.5
    while True:
        stop = torch.tensor([float(time.monotonic() >= end)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, async_op=True).get_future().wait()
        if stop.item() > 0:
            break
        xs[0].fill_(float(me))
        dist.all_reduce(xs[0], async_op=True).get_future().wait()
        check("all_reduce one at a time", 0, xs[0])
        time.sleep(0.005)
    return {"after bursts": after_bursts, "after one at a time": _pool_threads()}


@pytest.mark.ucx_semantics  # commux's threads
@worlds(2)
def test_pool_threads_beyond_what_the_work_needs_retire(ranks, ws):
    """The pool handed work to any idle thread (a condition variable's notify_one), and started
    another thread whenever the notified ones had not run yet: the bursts left 5-22 threads per
    rank, which then took turns at the single calls, so none stayed idle the 500 ms that retires
    a thread, and all 5-22 were still alive at the end. It now hands work to the thread that went
    idle last: 5-6 after the bursts, 2 at the end."""
    for r in ranks.run(_pool_after_a_burst, timeout=90):
        assert r["after one at a time"] <= 3, r


def _blocked_cpu(ctx):
    """An async all_reduce that waits 1.5 s for a late rank, waited for at once (a waiter resumes
    the schedule) and polled with is_completed() (the pool thread resumes it): rank 0's process
    CPU time over that time, as a share of one core, for each. Results are checked."""
    import resource

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    W, me = ctx.world, ctx.rank
    g = _group_with("COMMUX_SCHEDULE", "1")
    out = {}
    for mode in ("wait", "poll"):
        x = torch.full((1000,), float(me + 1))
        dist.barrier()
        if me != 0:
            time.sleep(1.5)
        c0, t0 = cpu_s(), time.monotonic()
        w = dist.all_reduce(x, async_op=True, group=g)
        if mode == "poll":
            while not w.is_completed():
                time.sleep(0.01)
        w.wait()
        out[mode] = (cpu_s() - c0) / (time.monotonic() - t0)
        check_equal(f"all_reduce waited ({mode})", x, torch.full((1000,), float(W * (W + 1) // 2)))
    return out


@pytest.mark.ucx_semantics  # commux's threads
@worlds(2)
def test_async_collective_blocked_for_a_late_rank_uses_little_cpu(ranks, ws):
    """Issue 14 asks for under 5% of a core; the bound leaves room for a loaded CI machine. Before
    waits on schedules slept only after a spin at each 1 ms slice, this took 27% (wait) and 33%
    (poll) of a core (bench/experiments/blocked_cpu.py --mode wait|poll measures it beside gloo)."""
    r0 = ranks.run(_blocked_cpu, timeout=60)[0]
    assert r0["wait"] < 0.10, r0
    assert r0["poll"] < 0.10, r0


# ---------------------------------------------------------------------------------------------
def _inflight_round(ctx, be, issue, late=0.4):
    """Runs `issue()` (which issues async collectives and returns their Works) on every rank while
    the last rank starts `late` seconds after the others, so that on the early ranks the first
    collective is still waiting for it while the rest are issued; waits for them all. Returns how
    many of them started beside another collective of the group (concurrent_calls)."""
    dist.barrier()
    if ctx.rank == ctx.world - 1:
        time.sleep(late)
    before = be.concurrent_calls
    for w in issue():
        w.wait()
    return be.concurrent_calls - before


def _inflight(ctx):
    """COMMUX_INFLIGHT: collectives of one group with disjoint tensors run beside each other; one
    whose tensors overlap a running one's waits for it (so the results are those of issue order),
    and a barrier runs alone. auto is 2 where the process has CPUs to spare beyond the ranks on this
    host, else 1. Every result is checked."""
    W, me = ctx.world, ctx.rank
    tri = float(W * (W + 1) // 2)
    out = {"auto": _backend().inflight, "cpus": len(os.sched_getaffinity(0))}
    g2 = _group_with("COMMUX_INFLIGHT", "2")
    be = _backend(g2)
    out["two"] = be.inflight

    def all_reduce(t):
        return dist.all_reduce(t, async_op=True, group=g2)

    xs = [torch.full((1000 + i,), float(me + i)) for i in range(4)]
    out["disjoint"] = _inflight_round(ctx, be, lambda: [all_reduce(x) for x in xs])
    for i, x in enumerate(xs):
        check_equal(f"disjoint all_reduce #{i}", x, torch.full((1000 + i,), float(sum(r + i for r in range(W)))))

    # One tensor four times: each sums the previous one's result.
    y = torch.full((1000,), float(me + 1))
    out["same"] = _inflight_round(ctx, be, lambda: [all_reduce(y) for _ in range(4)])
    check_equal("four all_reduces of one tensor", y, torch.full((1000,), tri * W ** 3))

    # Overlapping views wait; halves of one tensor do not.
    z = torch.full((1000,), float(me + 1))
    out["overlap"] = _inflight_round(ctx, be, lambda: [
        all_reduce(z[0:600]), all_reduce(z[400:1000]), all_reduce(z[550:560])])
    want = torch.full((1000,), tri)
    want[400:600] = tri * W
    want[550:560] *= W
    check_equal("all_reduces of overlapping views", z, want)
    h = torch.full((1000,), float(me + 1))
    out["halves"] = _inflight_round(ctx, be, lambda: [all_reduce(h[0:500]), all_reduce(h[500:1000])])
    check_equal("all_reduces of two halves", h, torch.full((1000,), tri))

    # allgather into `g`, then an all_reduce of what it gathered: the second reads the first's output.
    g = torch.zeros(W * 50)
    src = torch.full((50,), float(me + 1))
    out["chain"] = _inflight_round(ctx, be, lambda: [
        dist.all_gather_into_tensor(g, src, async_op=True, group=g2), all_reduce(g)])
    check_equal("all_reduce of an all_gather's output",
                g, torch.cat([torch.full((50,), float(W * (r + 1))) for r in range(W)]))

    # A barrier starts when everything before it has finished, and nothing starts beside it.
    a, b = torch.full((10,), float(me)), torch.full((10,), float(me))
    out["barrier"] = _inflight_round(ctx, be, lambda: [
        all_reduce(a), dist.barrier(async_op=True, group=g2), all_reduce(b)])
    for what, t in (("all_reduce before a barrier", a), ("all_reduce after a barrier", b)):
        check_equal(what, t, torch.full((10,), float(W * (W - 1) // 2)))

    g1 = _group_with("COMMUX_INFLIGHT", "1")
    ws_ = [torch.full((100,), float(me)) for _ in range(4)]
    out["inflight1"] = _inflight_round(ctx, _backend(g1), lambda: [
        dist.all_reduce(w, async_op=True, group=g1) for w in ws_])
    for i, w in enumerate(ws_):
        check_equal(f"all_reduce #{i} with COMMUX_INFLIGHT=1", w, torch.full((100,), float(W * (W - 1) // 2)))
    return out


@pytest.mark.ucx_semantics  # commux's counter
@worlds(2, 3, 4)
def test_collectives_of_one_group_run_beside_each_other(ranks, ws):
    results = ranks.run(_inflight, timeout=90)
    for rank, r in enumerate(results):
        forced = os.environ.get("COMMUX_INFLIGHT")  # a whole run with it set (tests its effect)
        want = int(forced) if forced else (1 if len(results) >= r["cpus"] else 2)
        assert r["auto"] == want, (rank, r)
        assert r["two"] == 2, (rank, r)
        for key in ("same", "overlap", "chain", "barrier", "inflight1"):
            assert r[key] == 0, (rank, key, r)
        if rank < len(results) - 1:  # an early rank: its first collective waited for the late one
            assert r["disjoint"] >= 1, (rank, r)
            assert r["halves"] >= 1, (rank, r)


def _schedule_window(ctx):
    """COMMUX_SCHEDULE=1 under COMMUX_INFLIGHT=auto: an async CPU collective starts as a schedule
    beside running ones only while their bytes and its own come to at most 64 KiB. While the first
    of 8 async all_reduces waits for a late rank, the other 7 start beside it when each moves
    4 KiB, and none does when each moves 64 KiB (with the 512 KiB window before, all 8 ran at
    once, which took longer than one at a time through torch: docs/torch-backend.md). Every result
    is checked."""
    W, me = ctx.world, ctx.rank
    g = _group_with("COMMUX_SCHEDULE", "1", COMMUX_INFLIGHT="auto")
    be = _backend(g)
    out = {}
    for kib in (4, 64):
        xs = [torch.full((kib * 256,), float(me + i)) for i in range(8)]
        out[kib] = _inflight_round(
            ctx, be, lambda: [dist.all_reduce(x, async_op=True, group=g) for x in xs])
        for i, x in enumerate(xs):
            want = torch.full((kib * 256,), float(sum(r + i for r in range(W))))
            check_equal(f"all_reduce #{i} of {kib} KiB", x, want)
    return out


@pytest.mark.ucx_semantics  # commux's counter
@worlds(2, 3)
def test_schedules_in_flight_together_move_at_most_64_kib(ranks, ws):
    results = ranks.run(_schedule_window, timeout=60)
    for rank, r in enumerate(results):
        assert r[64] == 0, (rank, r)
        if rank < len(results) - 1:  # an early rank: its first collective waited for the late one
            assert r[4] == 7, (rank, r)


def _blocking_results(ctx):
    """A blocking call's Work (asyncOp false: torch's Python waits for it and drops it) holds its
    outputs weakly once its caller ran it: result() and get_future() report the caller's tensors
    while the caller holds them, and a ValueError naming the call once it has freed them (the
    future fails with it, every time it is asked for; the Work does not keep the tensor alive);
    an async call's Work keeps its outputs itself."""
    import gc
    import weakref
    W, me = ctx.world, ctx.rank
    tri = float(W * (W + 1) // 2)
    pg = dist.distributed_c10d._get_default_group()
    out = {}

    def opts(async_op):
        o = dist.AllreduceOptions()
        o.asyncOp = async_op
        return o

    t = torch.full((5,), float(me + 1))
    w = pg.allreduce([t], opts(False))
    # (Work.exception() has no Python conversion on torch 2.11: not asked.)
    out["state"] = [w.is_completed(), w.is_success()]
    w.wait()
    r = w.result()
    out["same"] = len(r) == 1 and r[0].data_ptr() == t.data_ptr()
    check_equal("blocking all_reduce: result()", r[0], torch.full((5,), tri))
    check_equal("blocking all_reduce: its future", w.get_future().wait()[0], torch.full((5,), tri))
    del r

    t = torch.full((6,), float(me + 1))
    ref = weakref.ref(t)
    w = pg.allreduce([t], opts(False))
    w.wait()
    check_equal("blocking all_reduce", t, torch.full((6,), tri))
    del t
    gc.collect()
    out["freed"] = ref() is None
    out["result"] = expect_raises(w.result)
    out["future"] = expect_raises(lambda: w.get_future().wait())
    out["future_again"] = expect_raises(lambda: w.get_future().wait())  # settled, not left pending

    w = pg.allreduce([torch.full((7,), float(me + 1))], opts(True))  # the Work's tensor only
    w.wait()
    check_equal("async all_reduce: result() of a tensor only the Work holds", w.result()[0],
                torch.full((7,), tri))
    check_equal("async all_reduce: its future", w.get_future().wait()[0], torch.full((7,), tri))

    # A blocking call that fails (the ranks disagree on the size) returns a finished Work that
    # reports the failure (pg.allreduce: torch's Python would wait and raise at once).
    w = pg.allreduce([torch.ones(4 + me)], opts(False))
    out["failed_state"] = [w.is_completed(), w.is_success()]
    out["failed_wait"] = expect_raises(w.wait)
    out["failed_future"] = expect_raises(lambda: w.get_future().wait())
    x = torch.full((3,), float(me + 1))
    dist.all_reduce(x)
    check_equal("blocking all_reduce after a failed one", x, torch.full((3,), tri))
    return out


@pytest.mark.ucx_semantics  # commux's Work (Gloo's keeps its outputs)
@worlds(2)
def test_a_blocking_calls_work_holds_its_outputs_weakly(ranks, ws):
    for rank, r in enumerate(ranks.run(_blocking_results, timeout=60)):
        assert r["same"], (rank, r)
        assert r["state"] == [True, True], (rank, "completed, succeeded", r)
        assert r["freed"], (rank, "the finished blocking call's Work kept its tensor alive", r)
        assert r["failed_state"] == [True, False], (rank, "completed, failed", r)
        for what in ("failed_wait", "failed_future"):
            got = r[what]
            assert got["raised"] and got["runtime_or_value"], (rank, what, got)
            assert "allreduce" in got["msg"] and "4" in got["msg"] and "5" in got["msg"], (rank, what, got)
        for what in ("result", "future", "future_again"):
            got = r[what]
            assert got["raised"] and got["type"] == "ValueError", (rank, what, got)
            assert "allreduce" in got["msg"] and "freed" in got["msg"], (rank, what, got)
