"""The hang report (src/c10d/flight_recorder.hpp) and Ctrl-C in a blocked wait, each on fresh ranks
(one-off spawns): both leave the group with work that never completes.

  * Hang report: of 3 ranks, rank 2 skips one all_reduce and then stays in Python; ranks 0 and 1
    time out, and their error names rank 2 and what it last issued and completed, and says that
    0 and 1 are waiting. With COMMUX_TRACE_DUMP every rank writes its record as JSON (rank 2 when
    asked), and SIGUSR1 writes it again.
  * Ctrl-C: SIGINT during a blocking recv, an irecv's Work.wait(), an all_reduce and a barrier that
    never complete raises KeyboardInterrupt long before the 60 s group timeout; the interrupted
    receives are cancelled (a later message goes to the next receive).
"""
import json
import os
import re
import signal
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import expect_raises, touch, wait_file
from suite import BACKEND

pytestmark = [pytest.mark.ucx, pytest.mark.ucx_semantics, pytest.mark.oneoff]

HANG_PG_TIMEOUT = 3


def _skip_one_allreduce(ctx):
    x = torch.ones(4)
    dist.all_reduce(x)  # every rank
    if ctx.rank == 2:
        # Skips the next all_reduce and stays in Python (not in commux) until the others reported.
        got = all(wait_file(os.path.join(ctx.dir, f"reported{r}"), timeout=60) for r in (0, 1))
        return {"skipped": True, "saw_reports": got}
    r = expect_raises(lambda: dist.all_reduce(x))
    touch(os.path.join(ctx.dir, f"reported{ctx.rank}"))
    if ctx.rank == 0:
        # SIGUSR1 rewrites this rank's dump (the handler chains to the harness's faulthandler).
        path = os.path.join(os.environ["COMMUX_TRACE_DUMP"], "commux_trace_0.json")
        before = os.stat(path).st_mtime_ns if os.path.exists(path) else 0
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 20
        reason = None
        while time.monotonic() < deadline:
            try:
                with open(path, encoding="utf-8") as f:
                    reason = json.load(f)["reason"]
                if reason == "SIGUSR1":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        r["sigusr1_reason"] = reason
        r["dumped_before_signal"] = before != 0
    return r


@pytest.fixture(scope="module")
def hang_run():
    dump_dir = tempfile.mkdtemp(prefix="commux-trace-")
    outs, closed = mp.run_once(_skip_one_allreduce, 3, backend=BACKEND, pg_timeout_s=HANG_PG_TIMEOUT, timeout=90,
                               env={"COMMUX_TRACE_DUMP": dump_dir + "/"})
    dumps = {}
    for r in range(3):
        try:
            with open(os.path.join(dump_dir, f"commux_trace_{r}.json"), encoding="utf-8") as f:
                dumps[r] = json.load(f)
        except (OSError, ValueError) as e:
            dumps[r] = e
    return outs, closed, dumps


def _describe(outs):
    return "\n".join(o.describe() for o in outs)


def test_timeout_names_the_rank_that_skipped_the_call(hang_run):
    outs, _, _ = hang_run
    assert all(o.ok for o in outs), _describe(outs)
    assert outs[2].value == {"skipped": True, "saw_reports": True}, _describe(outs)
    for o in outs[:2]:
        r = o.value
        assert r["raised"], f"rank {o.rank}: the all_reduce rank 2 skipped returned"
        msg = r["msg"]
        assert "Timed out" in msg, msg
        # How long the collective ran, not the last slice of its wait ("Timed out after 3 ms")
        took = re.search(r"Timed out after (\d+) ms", msg)
        assert took and int(took.group(1)) >= HANG_PG_TIMEOUT * 1000 * 0.9, msg
        m = re.search(r"rank 2 has not reached this call: it last issued and completed allreduce #(\d+)", msg)
        assert m, f"rank {o.rank}: the error does not say what rank 2 last did: {msg}"
        late = int(m.group(1))
        assert f"ranks 0,1 are waiting in allreduce #{late + 1}" in msg, msg
        assert f"Hang report (group '0', allreduce #{late + 1}, from rank {o.rank})" in msg, msg


def _roots_of_their_own(ctx):
    """Each rank reduces to itself (then, on a fresh slate, the ranks reduce to root 0 with sizes
    that differ): every rank receives and none sends, so the call waits out the timeout."""
    me = ctx.rank
    r = {"root": expect_raises(lambda: dist.reduce(torch.ones(4), dst=me))}
    r["size"] = expect_raises(lambda: dist.reduce(torch.ones(4 + me), dst=0))
    return r


def test_the_report_says_the_waiting_ranks_disagree_on_the_root():
    outs, _ = mp.run_once(_roots_of_their_own, 2, backend=BACKEND, pg_timeout_s=HANG_PG_TIMEOUT, timeout=90)
    assert all(o.ok for o in outs), _describe(outs)
    for o in outs:
        msg = o.value["root"]["msg"]
        assert "ranks 0,1 are waiting in reduce #0, but their calls differ in root" in msg, msg
        assert "rank 0: 16 bytes, root 0; rank 1: 16 bytes, root 1" in msg, msg
    # Sizes that differ are caught by the call checks at once where a message pairs (rank 1's
    # arrives at root 0 with another fingerprint), so no hang report is needed there.
    r0 = outs[0].value["size"]
    assert r0["raised"] and "Hang report" not in r0["msg"] and r0["s"] < HANG_PG_TIMEOUT, r0


def test_every_rank_dumps_its_record(hang_run):
    outs, _, dumps = hang_run
    problems = []
    for r, d in dumps.items():
        if isinstance(d, Exception):
            problems.append(f"rank {r}: no dump: {d}")
            continue
        default = [g for g in d["groups"] if g["group"] == "0"]
        if d["rank"] != r or len(default) != 1:
            problems.append(f"rank {r}: dump of rank {d['rank']} with groups {[g['group'] for g in d['groups']]}")
            continue
        entries = default[0]["entries"]
        states = [(e["op"], e["state"]) for e in entries]
        want = [("allreduce", "completed")] + ([] if r == 2 else [("allreduce", "timed_out")])
        if states != want:
            problems.append(f"rank {r}: entries {states}, want {want}")
        # Wall-clock microseconds, in order, and near the time the dump was written (the entries
        # are read from the steady clock and shifted to the wall clock).
        elif not all(
            0 < e["issued_us"] <= e["started_us"] <= e["finished_us"] <= d["written_us"]
            and d["written_us"] - e["issued_us"] < 600_000_000
            for e in entries
        ):
            problems.append(f"rank {r}: times {entries}, written at {d['written_us']}")
    assert not problems, "\n".join(problems)
    assert dumps[2]["reason"].startswith("asked by a rank"), dumps[2]["reason"]
    r0 = outs[0].value
    assert r0["dumped_before_signal"] and r0["sigusr1_reason"] == "SIGUSR1", r0


def test_ranks_exit_after_the_hang_report(hang_run):
    _, closed, _ = hang_run
    bad = [o for o in closed if o.exc_type == "Hang" or o.exit_code != 0]
    assert not bad, "\n".join(o.describe() for o in bad)


# ---------------------------------------------------------------------------------------------
# Ctrl-C

INT_PG_TIMEOUT = 60


def _interrupted(fn):
    """Runs ``fn`` with a SIGINT sent to this process 0.35 s later; returns what it raised and how
    long after the signal."""
    sent = {}

    def fire():
        sent["t"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.35, fire)  # off the 0.1 s poll grid
    t0 = time.monotonic()
    timer.start()
    try:
        fn()
        out = {"raised": "nothing"}
    except KeyboardInterrupt:
        out = {"raised": "KeyboardInterrupt"}
    except Exception as e:  # noqa: BLE001
        out = {"raised": f"{type(e).__name__}: {e}"}
    timer.join()
    out["after_signal_s"] = time.monotonic() - sent.get("t", t0)
    return out


def _ctrl_c(ctx):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if ctx.rank == 1:
        wait_file(os.path.join(ctx.dir, "interrupted_p2p"), timeout=60)
        dist.send(torch.full((8,), 7.0), dst=0, tag=7)
        wait_file(os.path.join(ctx.dir, "done0"), timeout=60)
        return None
    out = {
        "recv": _interrupted(lambda: dist.recv(torch.zeros(8), src=1, tag=7)),
        "irecv_wait": _interrupted(lambda: dist.irecv(torch.zeros(8), src=1, tag=7).wait()),
    }
    # The interrupted receives were cancelled: rank 1's one message goes to this receive.
    touch(os.path.join(ctx.dir, "interrupted_p2p"))
    y = torch.zeros(8)
    out["next_recv"] = expect_raises(lambda: dist.irecv(y, src=1, tag=7).wait(timeout=timedelta(seconds=30)))
    out["next_recv_value"] = y.tolist()
    # Rank 1 makes no collective call: these never complete.
    out["all_reduce"] = _interrupted(lambda: dist.all_reduce(torch.ones(4)))
    out["barrier"] = _interrupted(lambda: dist.barrier())
    touch(os.path.join(ctx.dir, "done0"))
    return out


def test_ctrl_c_interrupts_a_blocked_wait():
    outs, closed = mp.run_once(_ctrl_c, 2, backend=BACKEND, pg_timeout_s=INT_PG_TIMEOUT, timeout=90)
    assert all(o.ok for o in outs), _describe(outs)
    r = outs[0].value
    for case in ("recv", "irecv_wait", "all_reduce", "barrier"):
        # Well inside the 60 s group timeout (commux polls every 0.1 s; the bound leaves room for
        # a loaded machine).
        assert r[case]["raised"] == "KeyboardInterrupt" and r[case]["after_signal_s"] < 15, (case, r[case])
    assert not r["next_recv"]["raised"] and r["next_recv_value"] == [7.0] * 8, r
    bad = [o for o in closed if o.exc_type == "Hang" or o.exit_code != 0]
    assert not bad, "\n".join(o.describe() for o in bad)


def _ctrl_c_stops_the_call(ctx):
    """Ctrl-C in a blocking all_reduce, which runs on the caller's thread, stops that call on every
    rank: rank 0 is interrupted while rank 1 has not joined yet; when rank 1 joins, its call fails
    at once saying rank 0 stopped it (never pairing with rank 0's next call), and the next
    all_reduce is right on both."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out = {}
    # 16 MiB: several steps, so rank 1 cannot finish from what rank 0 sent before it stopped (a
    # small call can, and then its result is right).
    x = torch.ones(4 << 20)
    if ctx.rank == 0:
        out["all_reduce"] = _interrupted(lambda: dist.all_reduce(x))
        touch(os.path.join(ctx.dir, "stopped"))
    else:
        wait_file(os.path.join(ctx.dir, "stopped"), timeout=60)
        t0 = time.monotonic()
        out["all_reduce"] = expect_raises(lambda: dist.all_reduce(x))
        out["failed_after_s"] = time.monotonic() - t0
    y = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(y)
    out["next"] = y.tolist()
    return out


def test_ctrl_c_in_a_collective_stops_it_on_every_rank():
    outs, closed = mp.run_once(_ctrl_c_stops_the_call, 2, backend=BACKEND, pg_timeout_s=INT_PG_TIMEOUT,
                               timeout=90)
    assert all(o.ok for o in outs), _describe(outs)
    r0, r1 = outs[0].value, outs[1].value
    assert r0["all_reduce"]["raised"] == "KeyboardInterrupt" and r0["all_reduce"]["after_signal_s"] < 15, r0
    e = r1["all_reduce"]
    assert e["raised"] and e["type"] == "DistBackendError" and "stopped the call" in e["msg"], r1
    assert "rank 0" in e["msg"] and r1["failed_after_s"] < 15, r1
    assert r0["next"] == [3.0] * 5 and r1["next"] == [3.0] * 5, (r0, r1)
    bad = [o for o in closed if o.exc_type == "Hang" or o.exit_code != 0]
    assert not bad, "\n".join(o.describe() for o in bad)
