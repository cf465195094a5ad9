"""python -m commux.selftest as a user runs it, and the debug log (COMMUX_DEBUG) its ranks write:
a clean run passes and reports the transport; a setting that breaks a collective, a wrong value and
a UCX_TLS without shared memory are each reported in plain words, a failure with exit status 1.
Three runs of a few seconds each (the self-test starts its own ranks)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from suite import uses_commux

pytestmark = [pytest.mark.ucx, pytest.mark.oneoff,
              pytest.mark.skipif(not uses_commux(), reason="the self-test runs commux's backend")]


def selftest(*args, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("COMMUX_", "UCX_TLS"))}
    full.update(UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"), OMP_NUM_THREADS="1")
    full.update(env)
    return subprocess.run([sys.executable, "-m", "commux.selftest", *args], capture_output=True,
                          text=True, timeout=150, env=full)


def _out(r):
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"


def test_a_clean_run_passes_and_its_ranks_log_info_and_trace(tmp_path):
    r = selftest("--nprocs", "2", "--keep", COMMUX_DEBUG="TRACE")
    assert r.returncode == 0, _out(r)
    out = r.stdout
    assert f"torch {torch.__version__}" in out, _out(r)
    for check in ("tagged point-to-point", "receive from any source", "all_reduce SUM", "broadcast",
                  "all_to_all_single", "scatter", "barrier"):
        assert re.search(rf"^  ok    {re.escape(check)}", out, re.M), f"{check}:\n{_out(r)}"
    assert "FAIL" not in out and out.rstrip().splitlines()[-1].startswith("commux selftest: PASSED")
    for size in ("8 B", "64 KiB", "8 MiB"):
        assert re.search(rf"^\s+{size}  one-way\s+[\d.]+ us\s+[\d.]+ GB/s", out, re.M), _out(r)
    # Two ranks on one host over loopback: UCX picks shared memory.
    assert re.search(r"rank 0 <-> rank 1: shared memory \(\S+/", out), _out(r)

    # The ranks' debug log (kept): host:pid [rank R] prefix, INFO and TRACE content.
    logdir = re.search(r"^logs kept in (\S+)$", out, re.M)[1]
    try:
        logs = [os.path.join(logdir, f) for f in os.listdir(logdir) if f.startswith("commux.")]
        assert len(logs) == 2, logs
        host = socket.gethostname()
        for path in logs:
            pid = int(path.rsplit(".", 2)[-2])
            with open(path) as f:
                lines = f.read().splitlines()
            rank = int(re.match(rf"{re.escape(host)}:{pid} \[rank (\d)\] commux ", lines[0])[1])
            assert all(ln.startswith(f"{host}:{pid} [rank ") for ln in lines), lines[:3]
            text = "\n".join(lines)
            assert re.search(r"commux INFO group \d+: rank \d of 2, UCX \d+\.\d+.*, transports .*"
                             r", memory types host", text), text[:2000]
            assert re.search(rf"commux INFO group \d+: peer {1 - rank} \(this host\): lanes \S+/", text)
            assert "commux INFO torch backend 'ucx': process group '0' is commux group" in text
            # The algorithm of each (collective, world size, size class): once, at first use.
            choice = re.findall(r"commux INFO allreduce on 2 ranks, \[16 KiB, 32 KiB\): (\S+) "
                                r"\(chosen by the selector\)", text)
            assert len(choice) == 1, text[:3000]
            # TRACE: the tagged p2p of the self-test, posted and completed with tag and bytes.
            assert re.search(rf"TRACE post send to peer {1 - rank}, tag 2, 4000 bytes, group", text)
            assert re.search(rf"TRACE done recv from peer {1 - rank}, tag 1, 4000 bytes, group .*: "
                             rf"4000 bytes moved from {1 - rank}$", text, re.M), text[-2000:]
    finally:
        subprocess.run(["rm", "-rf", logdir], check=False)


def test_the_event_fd_mode_keeps_shared_memory_between_local_ranks():
    # UCX's wakeup feature (COMMUX_WAKEUP=on) keeps its shared-memory transports: their FIFOs
    # signal an armed receiver. (The self-test used to blame it for TCP between local ranks.)
    r = selftest("--nprocs", "2", COMMUX_WAKEUP="on")
    assert r.returncode == 0, _out(r)
    assert re.search(r"rank 0 <-> rank 1: shared memory \(\S+/", r.stdout), _out(r)


def test_a_setting_that_breaks_a_collective_fails_and_tcp_between_local_ranks_is_explained():
    r = selftest("--nprocs", "2", COMMUX_ALGO_ALLREDUCE="nope", UCX_TLS="tcp", COMMUX_WAKEUP="on")
    assert r.returncode == 1, _out(r)
    out = r.stdout
    assert re.search(r"^  FAIL  all_reduce SUM\n\s+rank 0: .*unknown allreduce algorithm 'nope'", out, re.M), \
        _out(r)
    assert re.search(r"^  ok    tagged point-to-point", out, re.M), _out(r)  # the checks before it ran
    assert "rank 0 <-> rank 1: TCP (tcp/" in out, _out(r)
    assert "without shared memory" in out and "UCX_TLS=tcp is an allow list without a shared-memory " \
        "transport" in out, _out(r)
    assert "COMMUX_WAKEUP" not in out, _out(r)  # not a reason: shared memory stays with it
    # The ranks' own WARN (COMMUX_DEBUG is INFO in the self-test's ranks) is quoted.
    assert "a rank logged: group 0: peer 1 is on this host but UCX reaches it without shared memory" in out, \
        _out(r)
    assert out.rstrip().splitlines()[-1].startswith("commux selftest: FAILED")


def test_a_wrong_value_fails_the_check_on_every_rank():
    cores = len(os.sched_getaffinity(0))
    r = selftest("--nprocs", "3", "--inject-fault", "allreduce")
    assert r.returncode == 1, _out(r)
    m = re.search(r"^  FAIL  all_reduce SUM\n((?:\s+rank \d: .*\n)+)", r.stdout, re.M)
    assert m, _out(r)
    assert len(re.findall(r"rank \d: wrong result: all_reduce SUM: 1 of 4099 elements differ, first at "
                          r"\[7\]", m[1])) == 3, _out(r)
    assert re.search(r"^  ok    broadcast", r.stdout, re.M), _out(r)  # a wrong value stops nothing
    if cores < 3:
        assert f"3 ranks share {cores} core" in r.stdout, _out(r)


def test_usage_errors_exit_2(capsys):
    from commux import selftest as st

    with pytest.raises(SystemExit) as e:
        st.main(["--nprocs", "0"])
    assert e.value.code == 2 and "--nprocs must be between 1 and 64" in capsys.readouterr().err
