"""pytest plumbing for the commux torch.distributed tests.

Backend under test: ``COMMUX_TEST_BACKEND`` (default ``ucx``; ``commux`` or ``gloo`` also accepted).
With ``ucx``/``commux`` the package must import: tests marked ``ucx`` FAIL when it does not,
unless ``COMMUX_TESTS_ALLOW_MISSING=1`` (then they are skipped). ``COMMUX_TEST_BACKEND=gloo`` runs
the whole suite against gloo, to develop the harness without commux.

Rank pools: ``ranks`` (a handle, per test) runs functions on a pool of ``ws`` processes; pools are
kept per world size for the session and rebuilt after a hang, a death, or a
backend error (see ``RanksHandle._isolate``). Tests are parametrised over ``ws`` with session scope
(``suite.worlds``) so pytest groups them by world size. Circuit breakers: see ``Pools``.

Per-call timeout: ``--dist-timeout`` (seconds, default ``COMMUX_TEST_TIMEOUT`` or 60).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import mp
from suite import ALLOW_MISSING, BACKEND, uses_commux

if BACKEND not in ("ucx", "commux", "gloo"):
    raise pytest.UsageError(f"COMMUX_TEST_BACKEND={BACKEND!r}: expected ucx, commux or gloo")

MARKERS = {
    "ucx": "needs the commux backend: fails when commux cannot be imported "
           "(skipped instead with COMMUX_TESTS_ALLOW_MISSING=1)",
    "ucx_semantics": "checks behaviour promised by commux beyond gloo's (error texts, AVG...): "
                     "skipped when COMMUX_TEST_BACKEND=gloo",
    "oneoff": "starts its own fresh ranks (kills ranks, needs a fresh group, or launches torchrun)",
    "soak": "a long loop of mixed operations that checks resident memory stays flat (1 minute)",
}


# ------------------------------------------------------------------------------------------------
# commux availability (probed once, in a subprocess so a crashing import cannot take pytest down)

_probe: dict | None = None


def commux_probe() -> dict:
    global _probe
    if _probe is None:
        code = (
            "import commux, torch.distributed as dist\n"
            "commux.register(); commux.register()\n"
            "print('FILE', commux.__file__)\n"
            "print('PREFERRED', commux.preferred_backend())\n"
        )
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo")))
            out = p.stdout + p.stderr
            ok = p.returncode == 0
        except subprocess.TimeoutExpired as e:
            ok, out = False, f"`import commux` timed out after 120s: {e}"
        info = {"ok": ok, "output": out.strip()}
        for line in p.stdout.splitlines() if ok else []:
            key, _, val = line.partition(" ")
            info[key.lower()] = val
        _probe = info
    return _probe


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_addoption(parser):
    parser.addoption("--dist-timeout", type=float, default=float(os.environ.get("COMMUX_TEST_TIMEOUT", "60")),
                     help="per-call deadline of multi-rank test functions, seconds (default 60)")


def pytest_report_header(config):
    lines = [f"commux tests: backend under test = {BACKEND!r}, per-call timeout = "
             f"{config.getoption('--dist-timeout'):.0f}s, UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', 'lo')}"]
    if uses_commux():
        p = commux_probe()
        if p["ok"]:
            lines.append(f"commux: {p.get('file')} (preferred_backend() = {p.get('preferred')!r})")
        else:
            last = p["output"].splitlines()[-1] if p["output"] else "?"
            lines.append(f"commux: NOT importable ({last}); tests marked 'ucx' will "
                         + ("be skipped (COMMUX_TESTS_ALLOW_MISSING=1)" if ALLOW_MISSING else "FAIL"))
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if item.get_closest_marker("ucx_semantics") and BACKEND == "gloo":
        pytest.skip("checks commux-specific behaviour; backend under test is gloo")
    if item.get_closest_marker("ucx") and uses_commux():
        p = commux_probe()
        if not p["ok"]:
            msg = f"commux cannot be imported, so backend {BACKEND!r} is unavailable:\n{p['output'][-3000:]}"
            if ALLOW_MISSING:
                pytest.skip("COMMUX_TESTS_ALLOW_MISSING=1: " + msg.splitlines()[0])
            pytest.fail(msg, pytrace=False)


# ------------------------------------------------------------------------------------------------
# pools of ranks


MAX_HANGS = int(os.environ.get("COMMUX_TEST_MAX_HANGS", "8"))


class Pools:
    """Rank pools by world size, with two circuit breakers so that a backend that cannot start,
    or that hangs everywhere, fails the suite in minutes instead of hours: a world size whose pool
    failed to start twice is not started again (its tests fail at once, quoting the error), and
    after MAX_HANGS calls that hung or lost a rank (COMMUX_TEST_MAX_HANGS, default 8) the remaining
    pooled tests fail at once. Both fail (never skip) the tests they stop."""

    MAX_ALIVE = 4  # every world size stays up: idle ranks cost ~250 MB each and no CPU

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.alive: dict[int, mp.Ranks] = {}
        self.order: list[int] = []
        self.close_problems: list[str] = []
        self.started = 0
        self.start_failures: dict[int, list[str]] = {}
        self.hangs: list[str] = []

    def get(self, ws: int) -> mp.Ranks:
        if len(self.start_failures.get(ws, [])) >= 2:
            raise mp.DistFailure(f"not run: the {ws}-rank pool failed to start twice; the last error:\n"
                                 f"{self.start_failures[ws][-1]}", [])
        if len(self.hangs) >= MAX_HANGS:
            raise mp.DistFailure(f"not run: {len(self.hangs)} calls already hung or lost a rank in this session "
                                 f"(COMMUX_TEST_MAX_HANGS={MAX_HANGS}): " + "; ".join(self.hangs), [])
        r = self.alive.get(ws)
        if r is not None and not r.broken:
            self.order.remove(ws)
            self.order.append(ws)
            return r
        if r is not None:  # broken: already killed
            self.alive.pop(ws)
            self.order.remove(ws)
        while len(self.alive) >= self.MAX_ALIVE:
            self._close(self.order.pop(0))
        r = mp.Ranks(mp.RanksConfig(world=ws, backend=BACKEND, pg_timeout_s=max(self.timeout, 30.0)))
        self.started += 1
        try:
            r.start()
        except mp.DistFailure as e:
            self.start_failures.setdefault(ws, []).append(str(e))
            raise
        self.alive[ws] = r
        self.order.append(ws)
        return r

    def _close(self, ws: int) -> None:
        r = self.alive.pop(ws)
        if r.broken:  # already killed after a failure (reported by that test)
            return
        for o in r.close(timeout=30.0):
            if not o.ok:
                self.close_problems.append(
                    f"closing the {ws}-rank pool: rank {o.rank} {mp.describe_exit(o.exit_code)} "
                    f"{o.exc_type} {o.exc_msg}\n{o.tb}")

    def close_all(self) -> None:
        for ws in list(self.alive):
            self._close(ws)
        self.order.clear()


_pools: Pools | None = None


@pytest.fixture(scope="session")
def pools(request):
    global _pools
    _pools = Pools(request.config.getoption("--dist-timeout"))
    yield _pools
    _pools.close_all()


class RanksHandle:
    """What a test gets as ``ranks``: ``ranks.run(fn, *args, timeout=...)`` on ``ws`` pooled ranks."""

    def __init__(self, pools: Pools, ws: int):
        self.pools, self.ws = pools, ws

    def run(self, fn, *args, timeout: float | None = None, **kwargs):
        try:
            return self.pools.get(self.ws).run(fn, *args, timeout=timeout or self.pools.timeout, **kwargs)
        except mp.DistFailure as e:
            bad = [o for o in e.outcomes if not o.ok]
            if BACKEND == "gloo" and bad and all(o.exc_type == "GlooLacks" for o in bad):
                pytest.skip(bad[0].exc_msg)
            if isinstance(e, (mp.DistTimeout, mp.RankDied)):
                self.pools.hangs.append(f"{fn.__qualname__}{args!r} on {self.ws} ranks")
            self._isolate(e)
            raise

    def _isolate(self, e: "mp.DistFailure") -> None:
        """After a failed call, keep the pool only when every rank answered and the failures are
        the tests' own checks (AssertionError: the ops themselves completed everywhere). A backend
        error may have left operations pending on some ranks: the pool is then killed, and the
        next test gets a fresh one, so one failure cannot cascade into the following tests."""
        r = self.pools.alive.get(self.ws)
        if r is None or r.broken:
            return
        clean = all(o.replied and (o.ok or o.exc_type == "AssertionError") for o in e.outcomes)
        if not clean:
            r.kill()
            r.broken = "a call failed with a backend error: rebuilt for isolation"

    def run_outcomes(self, fn, *args, timeout: float | None = None, **kwargs):
        return self.pools.get(self.ws).run_outcomes(fn, *args, timeout=timeout or self.pools.timeout, **kwargs)


@pytest.fixture
def ranks(pools, ws):
    return RanksHandle(pools, ws)


@pytest.fixture
def dist_timeout(request) -> float:
    return request.config.getoption("--dist-timeout")


def pytest_sessionfinish(session, exitstatus):
    if _pools is not None:
        _pools.close_all()
        if _pools.close_problems and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _pools is None:
        return
    terminalreporter.write_line(
        f"commux tests: backend {BACKEND!r}; {_pools.started} rank pools started; "
        f"{len(_pools.hangs)} pooled calls hung or lost a rank"
        + (f": {'; '.join(_pools.hangs)}" if _pools.hangs else ""))
    if _pools.close_problems:
        terminalreporter.section("rank pools that did not close cleanly (destroy_process_group / exit)", red=True)
        for p in _pools.close_problems:
            terminalreporter.write_line(p)
