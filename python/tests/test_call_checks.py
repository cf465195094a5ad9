"""Cross-rank call checks: ranks whose calls differ fail on every rank, naming both calls, instead
of pairing their messages and returning wrong results; a call rejected on one rank fails the
others' matching call at once; and the group keeps giving right results afterwards.

Before the checks: rank 1's rejected all_gather_into_tensor let rank 0's all-gather pair with
rank 1's next all_reduce (rank 0 got [1, 11] instead of [1, 2], and every later all_reduce was
off by one call on both ranks, silently); an all_reduce on one rank and a broadcast on the other
"succeeded" on the broadcasting rank with the reducer's data.
"""
import functools
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import expect_raises, group_with
from suite import BACKEND

pytestmark = [pytest.mark.ucx, pytest.mark.oneoff]

FAST = 10.0  # seconds: far below the group timeout (60 s), generous for a loaded CI machine


def _sums(me):
    """Two all_reduces whose right results are 21 and 41 (2 ranks: 10 + 11, 20 + 21)."""
    out = []
    for base in (10, 20):
        x = torch.tensor([float(base + me)])
        dist.all_reduce(x)
        out.append(x.item())
    return out


def _one(ctx, key):
    """One case of _cases and the all_reduces after it (bench/experiments/call_checks_vs_gloo.py
    runs each alone, on each backend)."""
    me = ctx.rank
    calls = {
        "rejected": lambda: dist.all_gather_into_tensor(torch.zeros(2 if me == 0 else 3),
                                                        torch.tensor([float(me + 1)])),
        "kind": lambda: (dist.all_reduce(torch.ones(1000)) if me == 0
                         else dist.broadcast(torch.ones(1000), src=0)),
        "dtype_broadcast": lambda: dist.broadcast(
            torch.ones(1000, dtype=torch.float32 if me == 0 else torch.int32), src=0),
        "dtype_allreduce": lambda: dist.all_reduce(
            torch.ones(200, dtype=torch.float32) if me == 0 else torch.ones(100, dtype=torch.float64)),
    }
    r = expect_raises(calls[key])
    r["after"] = expect_raises(lambda: r.setdefault("sums", _sums(me)))
    return r


def _cases(ctx):
    me = ctx.rank
    res = {}
    # defect 1: rank 1 rejects its all_gather_into_tensor (wrong output size), rank 0's is valid
    out = torch.zeros(2 if me == 0 else 3)
    res["rejected"] = expect_raises(lambda: dist.all_gather_into_tensor(out, torch.tensor([float(me + 1)])))
    res["after_rejected"] = _sums(me)
    # defect 2: all_reduce on rank 0, broadcast from rank 0 on rank 1, 1000 float32 each
    x = torch.ones(1000)
    res["kind"] = expect_raises(lambda: dist.all_reduce(x) if me == 0 else dist.broadcast(x, src=0))
    res["after_kind"] = _sums(me)
    # same bytes, another dtype: float32 vs int32 broadcast; 200 float32 vs 100 float64 all_reduce
    y = torch.ones(1000, dtype=torch.float32 if me == 0 else torch.int32)
    res["dtype_broadcast"] = expect_raises(lambda: dist.broadcast(y, src=0))
    # The root may have returned before rank 1 found the other dtype: rank 1's notice then
    # reaches it, and its next collective fails saying so (on both ranks). Waiting here lets the
    # notice arrive first, so that this is the call it fails.
    dist.barrier(group=ctx.ref)
    time.sleep(0.3)
    res["told_dtype_broadcast"] = expect_raises(lambda: dist.all_reduce(torch.ones(3)))
    z = torch.ones(200, dtype=torch.float32) if me == 0 else torch.ones(100, dtype=torch.float64)
    res["dtype_allreduce"] = expect_raises(lambda: dist.all_reduce(z))
    res["after_dtype"] = _sums(me)
    # AVG is a SUM then a division on each rank: AVG on one rank and SUM on the other used to
    # return 1.0 on one and 2.0 on the other, silently
    a = torch.ones(1000)
    res["avg_sum"] = expect_raises(lambda: dist.all_reduce(a, op=dist.ReduceOp.AVG if me == 0 else dist.ReduceOp.SUM))
    b = torch.ones(2000)
    res["avg_sum_rs"] = expect_raises(lambda: dist.reduce_scatter_tensor(
        torch.zeros(1000), b, op=dist.ReduceOp.SUM if me == 0 else dist.ReduceOp.AVG))
    res["after_avg"] = _sums(me)
    # PREMUL_SUM's factor is each rank's own (1.0 here, 2.0 there): not a disagreement
    c = torch.full((1000,), float(me + 1))
    res["premul_factors"] = expect_raises(lambda: dist.all_reduce(c, op=dist._make_nccl_premul_sum(1.0 + me)))
    res["premul_value"] = c[0].item()  # 1.0 * 1 + 2.0 * 2
    dist.barrier()
    return res


@functools.lru_cache(maxsize=None)
def _run():
    outs, closed = mp.run_once(_cases, 2, backend=BACKEND, pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    return [o.value for o in outs], closed


def _check_right_rank(r, rank, *words):
    assert r["raised"], f"rank {rank}: no error (a silent success)"
    assert r["type"] == "DistBackendError", f"rank {rank}: {r['type']}: {r['msg']}"
    assert r["s"] < FAST, f"rank {rank}: the error took {r['s']:.1f} s: {r['msg']}"
    for w in words:
        assert w in r["msg"], f"rank {rank}: {w!r} not in: {r['msg']}"


def test_rejected_call_fails_the_other_rank_naming_the_reason():
    v, _ = _run()
    r1 = v[1]["rejected"]
    assert r1["raised"] and r1["type"] == "ValueError", r1
    _check_right_rank(v[0]["rejected"], 0, "rank 1 rejected its call", "allgather_base", "3 Float")


@pytest.mark.parametrize("after", ["after_rejected", "after_kind", "after_dtype"])
def test_later_calls_give_right_results(after):
    v, _ = _run()
    for rank in (0, 1):
        assert v[rank][after] == [21.0, 41.0], f"rank {rank} {after}: {v[rank][after]}"


@pytest.mark.ucx_semantics  # gloo returns the average on one rank and the sum on the other
@pytest.mark.parametrize("key", ["avg_sum", "avg_sum_rs"])
def test_avg_on_one_rank_and_sum_on_another_fail_on_both(key):
    v, _ = _run()
    for rank in (0, 1):
        _check_right_rank(v[rank][key], rank, "averaged SUM")
    assert v[0]["after_avg"] == [21.0, 41.0] and v[1]["after_avg"] == [21.0, 41.0], v


@pytest.mark.ucx_semantics  # gloo has no PREMUL_SUM
def test_premul_sum_factors_may_differ_between_ranks():
    v, _ = _run()
    for rank in (0, 1):
        assert not v[rank]["premul_factors"]["raised"], v[rank]["premul_factors"]
        assert v[rank]["premul_value"] == 5.0, v[rank]


def test_collectives_of_different_kinds_fail_on_both_ranks_naming_both_calls():
    v, _ = _run()
    _check_right_rank(v[0]["kind"], 0, "rank 1 is in broadcast #", "1000 float32 from root 0",
                      "this rank is in allreduce #", "1000 float32 SUM")
    _check_right_rank(v[1]["kind"], 1, "rank 0 is in allreduce #", "1000 float32 SUM",
                      "this rank is in broadcast #")


def test_same_bytes_of_another_dtype_fail_on_both_ranks():
    v, _ = _run()
    for rank in (0, 1):
        _check_right_rank(v[rank]["dtype_allreduce"], rank, "200 float32", "100 float64")


def test_broadcast_of_another_dtype_fails_on_the_receiver():
    """The root only sends, so its broadcast may complete (its tensor is right); the receiver's
    fails instead of taking float32 bytes as int32."""
    v, _ = _run()
    _check_right_rank(v[1]["dtype_broadcast"], 1, "different call", "1000 int32 from root 0")
    r0 = v[0]["dtype_broadcast"]
    assert not r0["raised"] or "1000 int32" in r0["msg"], r0
    if not r0["raised"]:
        # The root returned: rank 1's notice fails its next collective, on both ranks, naming
        # the broadcast (before, the root was never told).
        for rank in (0, 1):
            _check_right_rank(v[rank]["told_dtype_broadcast"], rank, "rank 1 stopped call #",
                              "broadcast #", "which had finished on this rank")


def test_ranks_exit_cleanly_after_the_mismatches():
    _, closed = _run()
    bad = [o for o in closed if o.exc_type == "Hang" or o.exit_code != 0]
    assert not bad, [(o.rank, o.exit_code, o.exc_type, o.exc_msg) for o in bad]


def _freed_after_a_mismatch(ctx):
    """A mismatched all_reduce big enough for rendezvous, on tensors made unreadable right after
    it failed (as if freed), then a good all_reduce on both ranks.

    The failed call leaves one rank's rendezvous send posted (cancel() cannot take back a send
    whose announcement the peer holds). The peer's next call drops that message; it used to
    receive it in full, so UCX read the freed tensor: a segfault on both ranks.
    """
    import ctypes
    import mmap

    me, n = ctx.rank, 300_000
    page = mmap.PAGESIZE
    raw = mmap.mmap(-1, -(-n * 4 // page) * page)
    t = torch.frombuffer(raw, dtype=torch.float32, count=n)
    t.fill_(me + 1)
    r = expect_raises(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM if me == 0 else dist.ReduceOp.MAX))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(addr, len(raw), 0) == 0, ctypes.get_errno()  # PROT_NONE: reading crashes
    good = torch.full((n,), float(me + 1))
    dist.all_reduce(good)
    r["after"] = bool(torch.equal(good, torch.full((n,), 3.0)))
    return r


@pytest.mark.ucx_semantics  # gloo has no call checks
def test_a_failed_calls_freed_tensors_are_not_read():
    outs, closed = mp.run_once(_freed_after_a_mismatch, 2, backend=BACKEND, pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for rank, o in enumerate(outs):
        _check_right_rank(o.value, rank, "MAX", "SUM")
        assert o.value["after"], f"rank {rank}: the all_reduce after the failed one was wrong"


ROOT_PATTERNS = {  # world size -> (collective, each rank's root) cases; the last ones agree
    2: [("broadcast", (0, 1)), ("scatter", (0, 1)), ("reduce", (1, 0)), ("gather", (1, 0)),
        ("broadcast", (1, 1)), ("scatter", (0, 0)), ("reduce", (1, 1)), ("gather", (0, 0))],
    3: [("broadcast", (0, 1, 2)), ("broadcast", (0, 1, 1)), ("broadcast", (0, 0, 2)),
        ("scatter", (0, 1, 2)), ("scatter", (0, 2, 2)), ("reduce", (1, 2, 0)), ("gather", (2, 0, 1)),
        ("broadcast", (2, 2, 2)), ("scatter", (1, 1, 1)), ("reduce", (2, 2, 2)), ("gather", (1, 1, 1))],
}


def _disagreeing_roots(ctx):
    """Ranks that disagree on a root where no rank's wait notices: a broadcast or scatter root
    receives nothing, so each self-made root used to return its own data with no error anywhere;
    reduce and gather ranks that each name another as the root all only send, so every call
    returned and no rank held the result. Each case is followed by four all_reduces; what each of
    them raised (or that it gave the right sum) is recorded."""
    me, w = ctx.rank, ctx.world
    out = []
    for op, roots in ROOT_PATTERNS[w]:
        t = torch.full((4,), float(me))
        if op == "broadcast":
            first = expect_raises(lambda: dist.broadcast(t, src=roots[me]))
        elif op == "reduce":
            first = expect_raises(lambda: dist.reduce(t, dst=roots[me]))
        elif op == "gather":
            parts = [torch.zeros(4) for _ in range(w)] if roots[me] == me else None
            first = expect_raises(lambda: dist.gather(t, parts, dst=roots[me]))
        else:
            parts = [torch.full((4,), 10.0 * (me + 1) + j) for j in range(w)] if roots[me] == me else None
            first = expect_raises(lambda: dist.scatter(t, parts, src=roots[me]))
        after = []
        for _ in range(4):
            x = torch.ones(3)
            r = expect_raises(lambda: dist.all_reduce(x))
            right = torch.equal(x, torch.full((3,), float(w)))
            after.append(r["msg"] if r["raised"] else ("right" if right else "WRONG"))
        out.append({"first": first, "after": after, "got": t.tolist()})
    return out


@pytest.mark.ucx_semantics  # gloo returns each self-made root's own data, silently
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_the_root_are_told(world):
    outs, closed = mp.run_once(_disagreeing_roots, world, backend=BACKEND, pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for i, (op, roots) in enumerate(ROOT_PATTERNS[world]):
        agree = len(set(roots)) == 1
        for rank, o in enumerate(outs):
            case = o.value[i]
            what = f"{op} with roots {roots}, rank {rank}"
            assert not case["first"]["raised"] or not agree, f"{what}: {case['first']}"
            assert case["after"][-1] == "right", f"{what}: the last all_reduce after it: {case['after']}"
            errors = [a for a in case["after"] if a not in ("right", "WRONG")]
            assert "WRONG" not in case["after"], f"{what}: {case['after']}"
            if agree:
                assert not errors, f"{what}: an error although the ranks agree: {errors}"
            elif not case["first"]["raised"]:
                assert errors, f"{what}: no rank was told (got {case['got']}); after: {case['after']}"
                assert any(f"{op} #" in e and "differed" in e for e in errors), f"{what}: {errors}"


def _disagreement_found_after_others_finished(ctx):
    """A disagreement that only one rank sees, after the others have finished the call:

    * all_to_all_single where rank 0 sends rank 1 one element more than rank 1's output splits
      take (3 ranks: rank 2's part agrees). Rank 1's receive is truncated; ranks 0 and 2 got all
      they expected and returned.
    * a broadcast whose non-root rejects its tensor (not contiguous) before anything is posted,
      while the root has sent and returned.

    Before, the ranks that had returned were never told: their next calls succeeded, and so did
    every later one. Each case is followed by three all_reduces; what each call raised (or that
    its result was right) is recorded."""
    out = {}
    for case in ("all_to_all_single", "broadcast"):
        out[case] = [_disagree(case, ctx.rank, ctx.world)] + _after(ctx.world)
    return out


def _disagree(case, me, w, group=None):
    """One rank-disagreeing call of ``case`` on ``group``; what it raised (expect_raises)."""
    if case == "all_to_all_single":  # rank s sends 2 elements to each rank, rank 0 3 to rank 1
        ins = [2] * w
        if me == 0:
            ins[1] = 3
        x = torch.arange(sum(ins), dtype=torch.float32)
        y = torch.zeros(2 * w)
        return expect_raises(lambda: dist.all_to_all_single(y, x, output_split_sizes=[2] * w,
                                                            input_split_sizes=ins, group=group))
    if case == "broadcast":  # the non-root's tensor is a strided view, rejected before posting
        t = torch.zeros(8)
        return expect_raises(lambda: dist.broadcast(t if me == 0 else t[::2], src=0, group=group))
    if case == "roots":  # each rank names itself the root: each returns its own data
        t = torch.full((8,), float(me))
        return expect_raises(lambda: dist.broadcast(t, src=me, group=group))
    raise ValueError(case)


def _after(w):
    res = []
    for _ in range(3):
        time.sleep(0.01)  # a rank looks for notices at most once per coarse-clock tick (1-4 ms)
        x = torch.ones(3)
        r = expect_raises(lambda: dist.all_reduce(x))
        res.append(r["msg"] if r["raised"] else ("right" if torch.equal(x, torch.full((3,), float(w))) else "WRONG"))
    return res


@pytest.mark.ucx_semantics  # gloo has no call checks
@pytest.mark.parametrize("world", [2, 3])
def test_a_disagreement_found_after_others_finished_reaches_them(world):
    outs, closed = mp.run_once(_disagreement_found_after_others_finished, world, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for case in ("all_to_all_single", "broadcast"):
        for rank, o in enumerate(outs):
            first, *after = o.value[case]
            what = f"{case}, rank {rank}: {first['msg'] or 'returned'}; then {after}"
            assert "WRONG" not in after and after[-1] == "right", what
            if first["raised"]:
                assert first["s"] < FAST, what
                continue
            # It returned: one of the next two calls fails (the other rank's notice may still be
            # on its way when the first starts), saying which call went wrong and why.
            told = [i for i, a in enumerate(after) if a not in ("right", "WRONG")]
            assert told, f"{what}: this rank was never told"
            assert told[0] <= 1 and len(told) == 1, what
            assert "which had finished on this rank" in after[told[0]], what
            assert f"{'alltoall_base' if case == 'all_to_all_single' else case} #" in after[told[0]], what
        # The rank that found the disagreement failed the call itself.
        finder = 1
        assert outs[finder].value[case][0]["raised"], f"{case}: rank {finder} returned"


def _disagreement_told_at_shutdown(ctx):
    """The same two disagreements as above, and a broadcast whose ranks each name themselves the
    root, each on a group of its own that makes no later collective: the ranks that returned are
    told when the group is destroyed. Before, nothing told them: destroy_process_group returned,
    and their wrong results went unreported. The roots' case once more with abort(), which says
    it on stderr instead (and the destroy after it says nothing more). A last group, whose ranks
    agree, must shut down quietly."""
    me, w = ctx.rank, ctx.world
    out = {}
    for case in ("all_to_all_single", "broadcast", "roots", "roots_abort", "agree"):
        g = dist.new_group(list(range(w)))
        if case == "agree":
            t = torch.ones(4)
            first = expect_raises(lambda: dist.all_reduce(t, group=g))
        else:
            first = _disagree(case.removesuffix("_abort"), me, w, group=g)
        dist.barrier(group=ctx.ref)  # the finder has sent its notices
        time.sleep(0.2)  # ... and they have arrived
        if case == "roots_abort":  # abort() cannot raise: it says so on stderr
            out[case] = [first, _stderr_of(g.abort), expect_raises(lambda: dist.destroy_process_group(g))]
            continue
        out[case] = [first, expect_raises(lambda: dist.destroy_process_group(g))]
    return out


def _stderr_of(fn):
    """What ``fn`` raised (expect_raises), with what it wrote to file descriptor 2."""
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            r = expect_raises(fn)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        r["stderr"] = f.read().decode(errors="replace")
    return r


@pytest.mark.ucx_semantics  # gloo has no call checks
@pytest.mark.parametrize("world", [2, 3])
def test_a_disagreement_nobody_reported_is_raised_at_shutdown(world):
    outs, closed = mp.run_once(_disagreement_told_at_shutdown, world, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for case, op in (("all_to_all_single", "alltoall_base"), ("broadcast", "broadcast")):
        for rank, o in enumerate(outs):
            first, shut = o.value[case]
            what = f"{case}, rank {rank}: {first['msg'] or 'returned'}; then destroy: {shut}"
            if first["raised"]:  # told by its own call: nothing more to say
                assert not shut["raised"], what
                continue
            assert shut["raised"] and shut["type"] == "DistBackendError", what
            assert "which had finished on this rank" in shut["msg"], what
            assert f"{op} #" in shut["msg"] and "results are wrong" in shut["msg"], what
        assert outs[1].value[case][0]["raised"], f"{case}: rank 1, the finder, returned"
        assert not outs[0].value[case][0]["raised"], f"{case}: rank 0 did not return"
    for rank, o in enumerate(outs):  # every rank returned, with its own data, and is told now
        first, shut = o.value["roots"]
        what = f"roots, rank {rank}: {first['msg'] or 'returned'}; then destroy: {shut}"
        assert not first["raised"] and shut["raised"] and shut["type"] == "DistBackendError", what
        assert "broadcast #" in shut["msg"] and "which this rank ran as the root" in shut["msg"], what
        assert "results are wrong" in shut["msg"], what
        aborted, destroyed = o.value["roots_abort"][1:]
        what = f"roots_abort, rank {rank}: abort {aborted}; then destroy: {destroyed}"
        assert not aborted["raised"] and not destroyed["raised"], what
        assert "commux shutdown: " in aborted["stderr"], what
        assert "which this rank ran as the root" in aborted["stderr"], what
    for rank, o in enumerate(outs):
        assert not o.value["agree"][0]["raised"] and not o.value["agree"][1]["raised"], (rank, o.value["agree"])


LATE_S = 0.3  # seconds: the late ranks' delay, far past any fixed look at shutdown


def _late_disagreement_told_at_shutdown(ctx):
    """Two disagreements that rank 0 returns from at once, while the other ranks make their part
    of the call LATE_S later: a broadcast whose non-roots reject their tensor, and one whose ranks
    each name themselves the root. Rank 0 destroys its group right after returning. Before, its
    destroy looked for notices for 20 ms only and returned quietly: its peers' rejection (or their
    stray messages as roots) came later. Now it waits until every peer has shut the group down,
    and so has whatever they sent before. What each rank's call and destroy raised."""
    me, w = ctx.rank, ctx.world
    out = {}
    for case in ("broadcast", "roots"):
        g = dist.new_group(list(range(w)))
        dist.barrier(group=ctx.ref)
        if me != 0:
            time.sleep(LATE_S)
        first = _disagree(case, me, w, group=g)
        out[case] = [first, expect_raises(lambda: dist.destroy_process_group(g))]
    return out


@pytest.mark.ucx_semantics  # gloo has no call checks
@pytest.mark.parametrize("world", [2, 3])
def test_a_disagreement_found_long_after_a_rank_returned_is_raised_at_its_shutdown(world):
    outs, closed = mp.run_once(_late_disagreement_told_at_shutdown, world, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for case, said in (("broadcast", "which had finished on this rank"),
                       ("roots", "which this rank ran as the root")):
        first, shut = outs[0].value[case]
        what = f"{case}, rank 0: {first['msg'] or 'returned'}; then destroy: {shut}"
        assert not first["raised"], what
        assert shut["raised"] and shut["type"] == "DistBackendError", what
        assert "broadcast #" in shut["msg"] and said in shut["msg"], what
        assert "results are wrong" in shut["msg"], what
        for rank in range(1, world):  # the late ranks: their own call failed, or their destroy
            first, shut = outs[rank].value[case]
            assert first["raised"] or shut["raised"], (case, rank, first, shut)


def _late_notice_behind_a_running_call(ctx):
    """3 ranks. Rank 0 roots a broadcast (call #0 of a new group), returns at once, issues an
    async all_reduce (#1) and destroys the group while #1 still runs there: rank 1 rejected its
    #1 at once, so its notice for #1 is the first thing rank 0's destroy finds, and rank 2
    rejects its part of the broadcast LATE_S late, then shuts the group down. Before, rank 0's
    destroy stopped looking at the running call's notice and returned quietly, though rank 2's
    rejection of the broadcast rank 0 had returned from came soon after. (Now its destroy lets #1
    end first, which reads that notice; abort(), which does not wait, steps past it: the test
    below.) What each rank's calls, destroy and wait raised."""
    me, w = ctx.rank, ctx.world
    g = dist.new_group(list(range(w)))
    dist.barrier(group=ctx.ref)
    if me == 2:
        time.sleep(LATE_S)
    t = torch.zeros(8)
    out = {"broadcast": expect_raises(lambda: dist.broadcast(t if me != 2 else t[::2], src=0,
                                                             group=g))}
    if me == 0:
        work = dist.all_reduce(torch.ones(4), group=g, async_op=True)
        time.sleep(0.005)  # a collective thread runs it, waiting for rank 1
        out["destroy"] = expect_raises(lambda: dist.destroy_process_group(g))
        out["wait"] = expect_raises(work.wait)
    else:
        if me == 1:  # a strided tensor: rejected before anything is posted, the others told
            out["all_reduce"] = expect_raises(lambda: dist.all_reduce(torch.ones(8)[::2], group=g))
        out["destroy"] = expect_raises(lambda: dist.destroy_process_group(g))
    return out


def _behind_case(fn):
    """Runs ``fn`` (the case above or below) on 3 ranks: each rank's results, after the checks
    the cases share (ranks 0 and 1 returned from the broadcast, rank 2 rejected its part of it,
    and rank 1 its all_reduce)."""
    outs, closed = mp.run_once(fn, 3, backend=BACKEND, pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    r0, r1, r2 = (o.value for o in outs)
    assert not r0["broadcast"]["raised"] and not r1["broadcast"]["raised"], (r0, r1)
    assert r2["broadcast"]["raised"] and r1["all_reduce"]["raised"], (r1, r2)
    return r0, r1, r2


@pytest.mark.ucx_semantics
def test_a_late_notice_behind_one_for_a_call_running_at_shutdown_is_still_raised():
    r0, r1, r2 = _behind_case(_late_notice_behind_a_running_call)
    for rank, r in ((0, r0), (1, r1)):  # both returned from the broadcast rank 2 rejected
        shut = r["destroy"]
        what = f"rank {rank}: {r}"
        assert shut["raised"] and shut["type"] == "DistBackendError", what
        assert "rank 2 stopped call #0 (broadcast #0" in shut["msg"], what
        assert "which had finished on this rank" in shut["msg"], what
    assert r0["wait"]["raised"], r0  # the all_reduce rank 1 rejected fails, as it ran or at shutdown
    assert not r2["destroy"]["raised"], r2  # its own call failed, and said so


def _abort_past_a_running_calls_notice(ctx):
    """3 ranks, and abort() on rank 0, which waits for nothing, so its look meets the notices of
    calls still running. Rank 0 roots a broadcast (#0), returns, and issues an async all_reduce
    (#1). Rank 1 rejects its #1 at once and then tells rank 2 (through the reference group),
    which rejects its part of the broadcast and tells rank 0, which aborts while its #1 still
    runs (that call reads rank 1's notice itself within 25 ms; on a machine slower than that the
    look has nothing to step past). Before, the look stopped at rank 1's notice for #1 and never
    read rank 2's, behind it. What each rank's calls, abort (with its stderr) and destroy raised."""
    me, w = ctx.rank, ctx.world
    g = dist.new_group(list(range(w)))
    dist.barrier(group=ctx.ref)
    t = torch.zeros(8)
    flag = torch.zeros(1)
    out = {}
    if me == 0:
        out["broadcast"] = expect_raises(lambda: dist.broadcast(t, src=0, group=g))
        work = dist.all_reduce(torch.ones(4), group=g, async_op=True)
        dist.recv(flag, src=2, group=ctx.ref)
        time.sleep(0.002)  # rank 2's notice has arrived
        out["abort"] = _stderr_of(g.abort)
        out["wait"] = expect_raises(work.wait)
    elif me == 1:
        out["broadcast"] = expect_raises(lambda: dist.broadcast(t, src=0, group=g))
        out["all_reduce"] = expect_raises(lambda: dist.all_reduce(torch.ones(8)[::2], group=g))
        dist.send(flag, dst=2, group=ctx.ref)
    else:
        dist.recv(flag, src=1, group=ctx.ref)
        out["broadcast"] = expect_raises(lambda: dist.broadcast(t[::2], src=0, group=g))
        dist.send(flag, dst=0, group=ctx.ref)
    out["destroy"] = expect_raises(lambda: dist.destroy_process_group(g))
    return out


@pytest.mark.ucx_semantics
def test_abort_reads_a_notice_behind_one_for_a_call_still_running():
    r0, r1, r2 = _behind_case(_abort_past_a_running_calls_notice)
    aborted = r0["abort"]
    assert not aborted["raised"], r0
    assert "commux shutdown: rank 2 stopped call #0 (broadcast #0" in aborted["stderr"], r0
    assert "which had finished on this rank" in aborted["stderr"], r0
    assert r0["wait"]["raised"] and not r0["destroy"]["raised"], r0  # said once, by abort()
    assert r1["destroy"]["raised"] and "rank 2 stopped call #0" in r1["destroy"]["msg"], r1
    assert not r2["destroy"]["raised"], r2  # its own call failed, and said so


def _finder_running_at_its_shutdown(ctx):
    """2 ranks. Rank 1 issues an async all_to_all_single (#0 of a new group) and destroys the
    group at once, its call still waiting for rank 0, which makes its part LATE_S later and sends
    rank 1 one element more than rank 1's splits take. Rank 1's call finds that as it receives,
    during its destroy; rank 0 got all it expected and returned. Before, rank 1's destroy sent its
    last notice first, so rank 0, which takes a peer's last notice as the end of what it will say,
    destroyed the group quietly. What each rank's call, destroy and wait raised."""
    me = ctx.rank
    g = dist.new_group([0, 1])
    dist.barrier(group=ctx.ref)
    ins = [2, 3] if me == 0 else [2, 2]
    x = torch.arange(sum(ins), dtype=torch.float32)
    y = torch.zeros(4)
    if me == 0:
        time.sleep(LATE_S)
        first = expect_raises(lambda: dist.all_to_all_single(y, x, output_split_sizes=[2, 2],
                                                             input_split_sizes=ins, group=g))
        return {"call": first, "destroy": expect_raises(lambda: dist.destroy_process_group(g))}
    work = dist.all_to_all_single(y, x, output_split_sizes=[2, 2], input_split_sizes=ins,
                                  group=g, async_op=True)
    time.sleep(0.005)  # a collective thread runs it, waiting for rank 0
    return {"destroy": expect_raises(lambda: dist.destroy_process_group(g)),
            "wait": expect_raises(work.wait)}


@pytest.mark.ucx_semantics
def test_a_disagreement_found_by_a_call_running_at_the_finders_shutdown_is_raised():
    outs, closed = mp.run_once(_finder_running_at_its_shutdown, 2, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    r0, r1 = (o.value for o in outs)
    assert not r0["call"]["raised"], r0
    assert r1["wait"]["raised"] and "alltoall" in r1["wait"]["msg"], r1  # the finder
    shut = r0["destroy"]
    assert shut["raised"] and shut["type"] == "DistBackendError", r0
    assert "rank 1 stopped call #0" in shut["msg"], r0
    assert "which had finished on this rank" in shut["msg"], r0


def _call_after_a_peer_shut_down(ctx):
    """Rank 0 destroys its group after one all_reduce; the other ranks make a second all_reduce
    on it. What that call raised, and how long it took; then what their destroy raised."""
    me, w = ctx.rank, ctx.world
    g = dist.new_group(list(range(w)))
    t = torch.ones(4)
    dist.all_reduce(t, group=g)
    if me == 0:
        return {"destroy": expect_raises(lambda: dist.destroy_process_group(g))}
    second = expect_raises(lambda: dist.all_reduce(torch.ones(4), group=g))
    return {"second": second, "destroy": expect_raises(lambda: dist.destroy_process_group(g))}


@pytest.mark.ucx_semantics
@pytest.mark.parametrize("world", [2, 3])
def test_a_call_made_after_a_peer_shut_its_group_down_names_the_shutdown(world):
    outs, closed = mp.run_once(_call_after_a_peer_shut_down, world, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    assert not outs[0].value["destroy"]["raised"], outs[0].value
    for rank in range(1, world):
        second = outs[rank].value["second"]
        what = f"rank {rank}: {second}"
        assert second["raised"] and second["type"] == "DistBackendError", what
        assert "rank 0 shut down the process group without making this call" in second["msg"], what
        assert "allreduce #1" in second["msg"], what
        assert second["s"] < FAST, what


def _late_peer_after_a_timeout(ctx):
    """4 ranks: a reduce whose ranks disagree on the root (rank 0 names 3, the others 0) leaves
    ranks 0-2 waiting out their timeouts while rank 3 goes on to an all_gather with a tensor list
    (staged through a buffer of the backend). Rank 3's all_gather times out first, with its
    rendezvous sends still posted; a peer's receive then comes late. The staging buffer used to
    be freed when the call failed, and the transport read it after: rank 3 crashed (SIGSEGV in
    UCX's rendezvous pack). Every rank must report errors and live on. The failed calls' tensors
    are kept only while their transfers may still use them: once those have finished, the next
    collective lets them go (they used to be kept to the end of the process)."""
    import gc
    import weakref
    from datetime import timedelta
    me, w = ctx.rank, ctx.world
    g = dist.new_group(list(range(w)), timeout=timedelta(seconds=4))
    out = []
    b = torch.full((300000,), float(me), dtype=torch.float64)
    dist.broadcast(b, src=3, group=g)

    def failed_calls():  # their tensors are referenced only from here
        x = torch.full((70000,), me, dtype=torch.int32)
        out.append(expect_raises(lambda: dist.reduce(x, dst=3 if me == 0 else 0, op=dist.ReduceOp.MIN, group=g)))
        y = torch.full((70000,), me, dtype=torch.int64)
        outs = [torch.zeros_like(y) for _ in range(w)]
        out.append(expect_raises(lambda: dist.all_gather(outs, y, group=g)))
        return [weakref.ref(t) for t in (x, y, *outs)]

    watch = failed_calls()
    dist.barrier(group=ctx.ref)
    time.sleep(1.0)  # the late transfers happen, or crash, now
    dist.barrier(group=ctx.ref)
    # Rank 3's reduce returned, and no later call of g told it that the ranks named other roots:
    # destroying g does.
    destroyed = expect_raises(lambda: dist.destroy_process_group(g))
    g2 = dist.new_group(list(range(w)))
    dist.barrier(group=g2)  # its start frees what finished transfers held
    gc.collect()
    kept = sum(r() is not None for r in watch)
    dist.destroy_process_group(g2)
    return [(r["raised"], r["msg"][:200]) for r in out], kept, destroyed


@pytest.mark.ucx_semantics  # a commux staging buffer
def test_a_failed_list_calls_staging_outlives_its_posted_transfers():
    outs, closed = mp.run_once(_late_peer_after_a_timeout, 4, backend=BACKEND, pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    for o in outs:
        calls, kept, destroyed = o.value
        assert calls[1][0], f"rank {o.rank}: the all_gather returned: {calls}"
        assert kept == 0, f"rank {o.rank}: {kept} tensors of the failed calls are still kept: {calls}"
        if o.rank == 3:  # the reduce returned here
            assert destroyed["raised"] and "reduce #" in destroyed["msg"], destroyed
            assert "a sender to the root" in destroyed["msg"], destroyed
        else:  # the reduce failed here, and said so
            assert not destroyed["raised"], (o.rank, destroyed)


def _late_root_of_a_scaled_reduce(ctx, kind, schedule):
    """2 ranks: rank 0 sends a PREMUL_SUM-scaled copy of its tensor (a copy the backend makes when
    the call runs) and times out, its rendezvous send still posted, because the other rank comes
    after rank 0's timeout. That copy used to be freed with the call, and the late receive then
    made the transport read freed memory on rank 0: rank 1's reduce returned a wrong sum, with no
    error anywhere. With `schedule`, the calls are async and run as schedules (whose failure may
    unwind on another thread than the one that started them)."""
    from datetime import timedelta
    me = ctx.rank
    g = group_with({"COMMUX_SCHEDULE": "1" if schedule else "0"}, timeout=timedelta(seconds=2))
    dist.barrier(group=g)
    n = 1 << 20  # 4 MiB of float32: a rendezvous; memory that free() returns to the system
    x = torch.full((2 * n,) if kind == "reduce_scatter" else (n,), 1.0 + me)
    out = torch.zeros(n)
    scaled = dist._make_nccl_premul_sum(2.0)
    if me == 1:
        time.sleep(3.0)  # past rank 0's timeout

    def call():
        if kind == "reduce":
            w = dist.reduce(x, dst=1, op=scaled, group=g, async_op=schedule)
        else:
            w = dist.reduce_scatter_tensor(out, x, op=scaled, group=g, async_op=schedule)
        if schedule:
            w.wait()

    r = expect_raises(call)
    dist.barrier(group=ctx.ref)
    time.sleep(0.5)  # the late transfer happens, or crashes, now
    dist.barrier(group=ctx.ref)
    got = (x if kind == "reduce" else out)[:: n // 7].tolist()
    ran = g._get_backend(torch.device("cpu")).scheduled_calls
    return r["raised"], r["msg"][:300], got, ran


@pytest.mark.ucx_semantics  # a copy made by the commux backend
@pytest.mark.parametrize("schedule", [False, True], ids=["blocking", "schedule"])
@pytest.mark.parametrize("kind", ["reduce", "reduce_scatter"])
def test_a_failed_calls_own_copies_outlive_its_posted_transfers(kind, schedule):
    outs, closed = mp.run_once(_late_root_of_a_scaled_reduce, 2, kind, schedule, backend=BACKEND,
                               pg_timeout_s=60, timeout=120)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    raised, msg, _, scheduled = outs[0].value
    assert raised and "Timed out" in msg, f"rank 0: {msg or 'returned'}"
    assert bool(scheduled) == schedule, f"rank 0 ran {scheduled} calls as schedules"
    # Rank 1 came late: where its call returned, its result holds rank 0's scaled copy (2 * 1.0 +
    # 2 * 2.0). Before, it summed whatever the freed copy's memory held (4.0: silently wrong).
    raised, msg, got, _ = outs[1].value
    assert raised or got == [6.0] * len(got), f"rank 1 returned {got}"
