"""Self-tests of the multi-process runner (mp.py), on gloo: they need no commux.

They prove the promises the other tests rely on: exceptions come back with tracebacks, a hang
becomes a failure carrying every rank's Python stacks within the deadline, a dying rank is named
with its exit status, and a rank that cannot initialise is reported with the reserved exit code.
"""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import mp


def _ok(ctx, x):
    t = torch.tensor([float(ctx.rank + x)])
    dist.all_reduce(t)
    return ctx.rank, t.item(), dist.get_backend()


def _raise_on_1(ctx):
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return "fine"


def _hang_in_recv(ctx):
    if ctx.rank == 0:
        dist.recv(torch.zeros(1), src=1, tag=3)  # never sent
    return "done"


def _kill_rank_1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


@pytest.fixture(scope="module")
def gloo2():
    r = mp.Ranks(mp.RanksConfig(world=2, backend="gloo", pg_timeout_s=60)).start()
    yield r
    r.kill()
    mp._rmtree(r.dir)


def test_results_and_exceptions_come_back(gloo2):
    assert gloo2.run(_ok, 1.0) == [(0, 3.0, "gloo"), (1, 3.0, "gloo")]
    with pytest.raises(mp.DistFailure) as ei:
        gloo2.run(_raise_on_1)
    text = str(ei.value)
    assert "rank 0: ok" in text and "rank 1: raised ValueError: deliberate failure on rank 1" in text
    assert "_raise_on_1" in text  # the child's traceback
    assert not gloo2.broken
    assert gloo2.run(_ok, 0.0)[0][1] == 1.0  # still usable after an exception


def test_hang_dumps_stacks_and_fails_in_time(gloo2):
    t0 = time.monotonic()
    with pytest.raises(mp.DistTimeout) as ei:
        gloo2.run(_hang_in_recv, timeout=3)
    took = time.monotonic() - t0
    assert took < 3 + 15, took
    text = str(ei.value)
    assert "ranks [0] did not answer within 3s" in text
    assert "rank 1: ok -> 'done'" in text
    # faulthandler's dump of rank 0, pointing at the hanging line
    assert "Current thread" in text and "_hang_in_recv" in text
    assert gloo2.broken  # killed: a pool must be rebuilt after a hang


def test_dead_rank_is_named():
    r = mp.Ranks(mp.RanksConfig(world=3, backend="gloo")).start()
    try:
        with pytest.raises(mp.RankDied) as ei:
            r.run(_kill_rank_1, timeout=60)
        assert "rank 1 died (killed by SIGKILL)" in str(ei.value)
    finally:
        r.kill()
        mp._rmtree(r.dir)


def test_setup_failure_uses_reserved_exit_code():
    r = mp.Ranks(mp.RanksConfig(world=1, backend="no_such_backend"))
    with pytest.raises(mp.DistFailure) as ei:
        r.start()
    text = str(ei.value)
    assert f"exit {mp.EXIT_SETUP_FAILED}" in text and "no_such_backend" in text
    mp._rmtree(r.dir)
