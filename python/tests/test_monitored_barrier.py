"""monitored_barrier (Gloo's semantics and wording), the "Timed out" of a timed-out barrier and
user errors without C++ stack traces.

torch's dist.monitored_barrier() refuses every backend but gloo, so the tests call the group's own
method (``pg.monitored_barrier(timeout, wait_all_ranks)``), the path torch's function takes for
gloo. Each scenario runs on a fresh group, since a rank that skips the call leaves that group out
of step; the same scenario on a fresh gloo group is the reference.
"""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import expect_raises, touch, wait_file
from suite import BACKEND

pytestmark = [pytest.mark.ucx, pytest.mark.oneoff]

MB_TIMEOUT = timedelta(seconds=1)
PG_TIMEOUT = 8  # the groups' timeout: the arrived ranks of a failed barrier must not need it
BARRIER_TIMEOUT = 3
STACK_MARKERS = ("Exception raised from", "frame #")


def _file_barrier(ctx, name):
    """Waits (bounded) until every rank got here, without any process group."""
    touch(os.path.join(ctx.dir, f"{name}.{ctx.rank}"))
    for r in range(ctx.world):
        wait_file(os.path.join(ctx.dir, f"{name}.{r}"), 60)


def _skip_scenario(ctx, group, skip, wait_all, name):
    """Every rank but those in ``skip`` calls group.monitored_barrier; the skipping ranks stay
    alive and silent meanwhile. The next scenario starts when every rank is done with this one."""
    out = None
    if ctx.rank not in skip:
        out = expect_raises(lambda: group.monitored_barrier(MB_TIMEOUT, wait_all_ranks=wait_all))
    _file_barrier(ctx, name)
    return out


def _monitored(ctx):
    world = list(range(ctx.world))
    pg_timeout = timedelta(seconds=PG_TIMEOUT)
    # Every rank creates the same groups in the same order.
    ok = dist.new_group(world, timeout=pg_timeout)
    first = dist.new_group(world, timeout=pg_timeout)
    every = dist.new_group(world, timeout=pg_timeout)
    first_ref = dist.new_group(world, timeout=pg_timeout, backend="gloo")
    every_ref = dist.new_group(world, timeout=pg_timeout, backend="gloo")
    timed = dist.new_group(world, timeout=timedelta(seconds=BARRIER_TIMEOUT))
    timed_wait = dist.new_group(world, timeout=timedelta(seconds=BARRIER_TIMEOUT))
    out = {}
    # All ranks arrive: it passes, twice, around a collective, and with wait_all_ranks.
    ok.monitored_barrier(timedelta(seconds=30))
    t = torch.ones(4) * ctx.rank
    dist.all_reduce(t, group=ok)
    ok.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
    out["sum"] = t.tolist()
    # Rank 1 skips (and, with wait_all_ranks, rank 3 too).
    out["first"] = _skip_scenario(ctx, first, {1}, False, "first")
    out["every"] = _skip_scenario(ctx, every, {1, 3}, True, "every")
    out["first_ref"] = _skip_scenario(ctx, first_ref, {1}, False, "first_ref")
    out["every_ref"] = _skip_scenario(ctx, every_ref, {1, 3}, True, "every_ref")
    # A barrier rank 1 never joins times out on rank 0.
    flag = os.path.join(ctx.dir, "timed")
    if ctx.rank == 1:
        wait_file(flag, 60)
    elif ctx.rank == 0:
        try:
            out["barrier"] = expect_raises(lambda: dist.barrier(group=timed))
            # Work.wait(timeout) shorter than the group's: the Work's own timeout
            work = dist.barrier(group=timed_wait, async_op=True)
            out["wait"] = expect_raises(lambda: work.wait(timeout=timedelta(seconds=1)))
        finally:
            touch(flag)
    return out


@pytest.fixture(scope="module")
def monitored_run():
    outs, closed = mp.run_once(_monitored, 4, backend=BACKEND, pg_timeout_s=PG_TIMEOUT, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    return [o.value for o in outs]


def test_monitored_barrier_passes_when_all_arrive(monitored_run):
    for r, v in enumerate(monitored_run):
        assert v["sum"] == [6.0] * 4, f"rank {r}: the all_reduce between two monitored barriers gave {v['sum']}"


@pytest.mark.parametrize("ref", [False, True], ids=["backend", "gloo"])
def test_rank_zero_names_the_first_missing_rank(monitored_run, ref):
    r = monitored_run[0]["first_ref" if ref else "first"]
    assert r["raised"], "rank 0's monitored_barrier returned although rank 1 never called it"
    assert r["runtime_or_value"] and r["type"] != "ValueError", f"{r['type']}: {r['msg']}"
    assert "[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms" in r["msg"], r["msg"]
    # within about the timeout: not the group's
    assert 0.9 <= r["s"] < PG_TIMEOUT - 2, f"raised after {r['s']:.1f}s: {r['msg']}"


@pytest.mark.parametrize("ref", [False, True], ids=["backend", "gloo"])
def test_wait_all_ranks_names_every_missing_rank(monitored_run, ref):
    r = monitored_run[0]["every_ref" if ref else "every"]
    assert r["raised"], "rank 0's monitored_barrier returned although ranks 1 and 3 never called it"
    assert "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms" in r["msg"], r["msg"]
    assert 0.9 <= r["s"] < PG_TIMEOUT - 2, f"raised after {r['s']:.1f}s: {r['msg']}"


@pytest.mark.parametrize("case", ["first", "every"])
def test_arrived_ranks_fail_too(monitored_run, case):
    """The ranks that arrived learn from rank 0 that the barrier failed (Gloo's wording), before
    the group's timeout (gloo makes them wait for it)."""
    arrived = [2, 3] if case == "first" else [2]
    for rank in arrived:
        for key in (case, case + "_ref"):
            r = monitored_run[rank][key]
            assert r["raised"], f"rank {rank} passed a monitored_barrier that rank 0 failed ({key})"
            want = (f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                    "waiting for send/recv from rank 0")
            assert want in r["msg"], f"rank {rank} ({key}): {r['msg']}"
        r = monitored_run[rank][case]
        if BACKEND != "gloo":
            assert r["s"] < PG_TIMEOUT - 2, f"rank {rank} raised after {r['s']:.1f}s: {r['msg']}"


@pytest.mark.parametrize("key", ["barrier", "wait"])
def test_timed_out_barrier_says_timed_out(monitored_run, key):
    """torch's test_barrier_timeout_full_group matches " (Timed out|closed|timeout) "."""
    r = monitored_run[0][key]
    assert r["raised"], f"a barrier the other ranks never joined returned ({key})"
    assert " Timed out " in r["msg"] or (BACKEND == "gloo" and key == "wait"), r["msg"]


@pytest.mark.parametrize("key", ["first", "every", "barrier", "wait"])
def test_errors_carry_no_cpp_stack_trace(monitored_run, key):
    msg = monitored_run[0][key]["msg"]
    assert not any(m in msg for m in STACK_MARKERS), msg


def test_init_timeout_has_no_cpp_stack_trace():
    """A rank whose peers never join: the store lookup times out with a message, not a backtrace."""
    import commux

    store = dist.HashStore()
    with pytest.raises(dist.DistBackendError) as info:
        commux.ProcessGroupUCX(store, 0, 2, timedelta(milliseconds=500))
    msg = str(info.value)
    assert "commux init" in msg and "Timed out" in msg, msg
    assert not any(m in msg for m in STACK_MARKERS), msg
