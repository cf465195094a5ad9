"""Multi-process runner for the commux torch.distributed tests.

The parent (pytest) starts one child process per rank (a fresh interpreter running
``mp._child_main``, never fork), hands each child one end of a socketpair, and talks to it with pickled messages:

    parent -> child   ("run", call_id, module, qualname, args, kwargs, watchdog_s)
    child  -> parent  ("ok", call_id, value) | ("err", call_id, type_name, message, traceback_text)
    parent -> child   ("exit", destroy_timeout_s)      child: destroy_process_group, exit 0

Every child initialises the default group with the backend under test (``"ucx"`` unless told
otherwise) and a gloo group over the same ranks (``ctx.ref``), the reference the tests compare
against. A test function is a module-level function ``fn(ctx, *args, **kwargs)``; it runs on every
rank, and its return value (anything picklable, keep it small) comes back per rank.

Nothing here can hang a test run:
  * every call has a deadline (``timeout``); on expiry the parent sends SIGUSR1 to every child,
    whose faulthandler writes all Python thread stacks into the rank's log, then SIGKILLs the
    children's process groups and raises ``DistTimeout`` carrying those stacks;
  * a child that dies is reported with its rank, exit code (or signal) and log tail;
  * children die with the parent (PR_SET_PDEATHSIG) and have their own faulthandler watchdog
    (``dump_traceback_later``) as a backstop;
  * closing a group (``Ranks.close``) is bounded too: a rank that does not exit in time is
    dumped and killed, and reported.

Reserved child exit codes: ``EXIT_SETUP_FAILED`` (imports or init_process_group failed),
``EXIT_PARENT_GONE`` (lost the parent's connection mid-call), ``EXIT_CLOSE_FAILED``
(destroy_process_group raised). A child killed by the parent shows as ``-SIGKILL``; a child whose
own watchdog fired exits 1 after writing "Timeout (0:..)!" stacks into its log.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait as mp_wait
from typing import Any, Callable

EXIT_SETUP_FAILED = 90
EXIT_PARENT_GONE = 91
EXIT_CLOSE_FAILED = 92
RESERVED_EXITS = {
    EXIT_SETUP_FAILED: "setup failed (import or init_process_group raised)",
    EXIT_PARENT_GONE: "lost the connection to the parent",
    EXIT_CLOSE_FAILED: "destroy_process_group raised",
}

# Warnings raised while a test function runs in a rank are errors, like in pytest itself
# (pytest.ini), except this torch deprecation noise: the tests call the documented names on
# purpose (the brief and commux's interface use them), and the replacements map to the same
# backend virtuals.
CHILD_WARNING_IGNORES = [
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", FutureWarning),
]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
LOG_TAIL = 6000  # characters of a rank's log quoted in a failure


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code in RESERVED_EXITS:
        return f"exit {code} ({RESERVED_EXITS[code]})"
    return f"exit {code}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Outcome:
    """What one rank did in one call."""

    rank: int
    ok: bool = False
    value: Any = None
    exc_type: str = ""
    exc_msg: str = ""
    tb: str = ""
    replied: bool = False  # False: the rank died or hung before answering
    exit_code: int | None = None

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok -> {self.value!r}"[:2000]
        if self.replied:
            return f"rank {self.rank}: raised {self.exc_type}: {self.exc_msg}\n{self.tb}"
        return f"rank {self.rank}: no reply ({describe_exit(self.exit_code)})"


class DistFailure(AssertionError):
    """A call failed on at least one rank (exception, death, or hang). ``outcomes`` per rank."""

    def __init__(self, message: str, outcomes: list[Outcome]):
        super().__init__(message)
        self.outcomes = outcomes


class DistTimeout(DistFailure):
    pass


class RankDied(DistFailure):
    pass


# --------------------------------------------------------------------------------------------
# Parent side


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    log_path: str
    log_pos: int = 0
    ready: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def read_log(self, advance: bool = True) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_pos)
                data = f.read()
        except OSError:
            return ""
        if advance:
            self.log_pos += len(data)
        return data.decode("utf-8", "replace")


def _tail(text: str, n: int = LOG_TAIL) -> str:
    return text if len(text) <= n else "...[cut]...\n" + text[-n:]


@dataclass
class RanksConfig:
    world: int
    backend: str = "ucx"  # the backend under test (default group)
    ref_backend: str | None = "gloo"  # reference group over the same ranks; None: none
    pg_timeout_s: float = 60.0  # init_process_group(timeout=...)
    env: dict = field(default_factory=dict)  # extra environment for the children
    init: str = "file"  # "file" or "tcp"
    startup_timeout_s: float = 180.0
    python: str | None = None  # the children's interpreter (another venv's); None: this one


class Ranks:
    """``world`` child processes with an initialised default group; see the module docstring."""

    def __init__(self, cfg: RanksConfig, workdir: str | None = None):
        self.cfg = cfg
        self.world = cfg.world
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix=f"commux-ranks{cfg.world}-")
        os.makedirs(self.dir, exist_ok=True)
        self.children: list[_Child] = []
        self.broken: str | None = None  # reason; a broken Ranks refuses further calls
        self._call_id = 0
        self.start_s = 0.0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Ranks":
        t0 = time.monotonic()
        cfg = self.cfg
        if cfg.init == "file":
            store = os.path.join(self.dir, "filestore")
            if os.path.exists(store):
                os.unlink(store)
            init_method = "file://" + store
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ)
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONFAULTHANDLER"] = "1"
        env.update({k: str(v) for k, v in cfg.env.items()})
        spec = {
            "world": cfg.world,
            "backend": cfg.backend,
            "ref_backend": cfg.ref_backend,
            "pg_timeout_s": cfg.pg_timeout_s,
            "init_method": init_method,
            "dir": self.dir,
        }
        spec_path = os.path.join(self.dir, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        try:
            for rank in range(cfg.world):
                parent_sock, child_sock = socket.socketpair()
                log_path = os.path.join(self.dir, f"rank{rank}.log")
                with open(log_path, "wb"):
                    pass
                proc = subprocess.Popen(
                    [cfg.python or sys.executable, "-u", "-c", "import mp, sys; mp._child_main(sys.argv[1:])",
                     spec_path, str(rank), str(child_sock.fileno()), log_path],
                    pass_fds=[child_sock.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                    cwd=self.dir,
                    start_new_session=True,  # own process group: killpg takes its helpers too
                )
                child_sock.close()
                conn = Connection(parent_sock.detach())
                self.children.append(_Child(rank, proc, conn, log_path))
            self._await_ready(t0 + cfg.startup_timeout_s)
        except BaseException:
            self.kill()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _await_ready(self, deadline: float) -> None:
        pending = {c.conn: c for c in self.children}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail_start(
                    f"ranks {sorted(c.rank for c in pending.values())} not ready after "
                    f"{self.cfg.startup_timeout_s:.0f}s", dump=True)
            for conn in mp_wait(list(pending), timeout=min(0.5, left)):
                c = pending.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("died",)
                if msg[0] != "ready":
                    try:
                        c.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                    detail = f":\n{msg[1]}" if msg[0] == "setup_error" else ""
                    self._fail_start(f"rank {c.rank} failed to initialise (backend {self.cfg.backend!r}, "
                                     f"{describe_exit(c.proc.poll())}){detail}")
                c.ready = True
            for c in list(pending.values()):
                if not c.alive():
                    self._fail_start(f"rank {c.rank} died during startup ({describe_exit(c.proc.returncode)})")

    def _fail_start(self, why: str, dump: bool = False) -> None:
        if dump:
            self._dump_stacks()
        logs = "\n".join(f"--- rank {c.rank} log ---\n{_tail(c.read_log())}" for c in self.children)
        self.kill()
        self.broken = why
        raise DistFailure(f"starting {self.world} ranks failed: {why}\n{logs}", [])

    def _dump_stacks(self, wait_s: float = 2.0) -> None:
        sent = False
        for c in self.children:
            if c.alive():
                try:
                    os.kill(c.proc.pid, signal.SIGUSR1)
                    sent = True
                except ProcessLookupError:
                    pass
        if sent:
            time.sleep(wait_s)  # faulthandler writes from the signal handler; give it a moment

    def kill(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        c.proc.kill()
                    except ProcessLookupError:
                        pass
        for c in self.children:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            try:
                c.conn.close()
            except OSError:
                pass
        if self.broken is None:
            self.broken = "killed"
        if self._own_dir:
            _rmtree(self.dir)  # the logs that matter were quoted before the kill

    def close(self, timeout: float = 30.0, destroy_timeout: float = 20.0) -> list[Outcome]:
        """Asks every live rank to destroy_process_group and exit; bounded by ``timeout``.

        Returns per-rank outcomes (``exit_code`` set; ``ok`` False for a rank that had to be
        killed or exited non-zero); does not raise.
        """
        outs = [Outcome(c.rank) for c in self.children]
        if not self.children:
            return outs
        for c in self.children:
            if c.alive():
                try:
                    c.conn.send(("exit", destroy_timeout))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c.alive() for c in self.children):
            time.sleep(0.05)
        hung = [c for c in self.children if c.alive()]
        if hung:
            self._dump_stacks()
        logs = {c.rank: _tail(c.read_log()) for c in self.children}  # before kill() removes them
        self.kill()
        for c in self.children:
            o = outs[c.rank]
            o.exit_code = c.proc.returncode
            o.ok = c not in hung and c.proc.returncode == 0
            if c in hung:
                o.exc_type, o.exc_msg = "Hang", f"did not exit within {timeout:.0f}s of close"
            if not o.ok:
                o.tb = logs[c.rank]
        self.broken = "closed"
        return outs

    # -- calls --------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, timeout: float = 60.0, expect_dead: set[int] | frozenset = frozenset(),
            **kwargs) -> list[Any]:
        """Runs ``fn(ctx, *args, **kwargs)`` on every rank; returns the per-rank values.

        Raises ``DistFailure`` (a test failure) naming every rank that raised, died or hung.
        Ranks in ``expect_dead`` may die (their value is the Outcome); the call then continues
        to wait for the others.
        """
        outs = self.run_outcomes(fn, *args, timeout=timeout, expect_dead=expect_dead, **kwargs)
        bad = [o for o in outs if not o.ok and not (o.rank in expect_dead and not o.replied)]
        if bad:
            raise DistFailure(self._report(fn, outs, "failed"), outs)
        return [o.value if o.ok else o for o in outs]

    def run_outcomes(self, fn: Callable, *args, timeout: float = 60.0,
                     expect_dead: set[int] | frozenset = frozenset(), **kwargs) -> list[Outcome]:
        """Like ``run`` but returns per-rank outcomes for exceptions; still raises on a hang or
        an unexpected death (after which this Ranks is broken and must be rebuilt)."""
        if self.broken:
            raise DistFailure(f"ranks unusable ({self.broken})", [])
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
            raise ValueError("fn must be a module-level function of an importable module")
        self._call_id += 1
        cid = self._call_id
        msg = ("run", cid, fn.__module__, fn.__qualname__, args, kwargs, timeout + 30.0)
        data = pickle.dumps(msg)
        for c in self.children:
            c.conn.send_bytes(data)
        outs = [Outcome(c.rank) for c in self.children]
        pending = {c.conn: c for c in self.children}
        deadline = time.monotonic() + timeout
        died: list[_Child] = []
        grace_deadline = None
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            ready = mp_wait(list(pending), timeout=min(0.2, limit - now))
            gone: list[_Child] = []
            for conn in ready:
                c = pending[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    gone.append(c)  # the child closed its end: it died or is dying
                    continue
                if reply[1] != cid:
                    continue  # stale reply of an older call; cannot happen unless broken
                pending.pop(conn)
                o = outs[c.rank]
                o.replied = True
                if reply[0] == "ok":
                    o.ok, o.value = True, reply[2]
                else:
                    o.exc_type, o.exc_msg, o.tb = reply[2], reply[3], reply[4]
            for c in list(pending.values()):
                if c in gone or not c.alive():
                    pending.pop(c.conn)
                    try:
                        c.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        os.killpg(c.proc.pid, signal.SIGKILL)
                        c.proc.wait()
                    outs[c.rank].exit_code = c.proc.returncode
                    died.append(c)
                    if c.rank not in expect_dead and grace_deadline is None:
                        # give the others a few seconds to report the error they now see
                        grace_deadline = time.monotonic() + 5.0
        logs = {c.rank: c.read_log() for c in self.children}
        for c in self.children:
            if logs[c.rank].strip():
                sys.stdout.write("".join(f"[rank {c.rank}] {line}\n" for line in logs[c.rank].splitlines()))
        unexpected = [c for c in died if c.rank not in expect_dead]
        if pending or unexpected:
            hung = sorted(c.rank for c in pending.values())
            if pending:
                self._dump_stacks()
                for c in self.children:
                    logs[c.rank] += c.read_log()
            self.kill()
            self.broken = f"call {fn.__qualname__} hung or lost a rank"
            for c in self.children:
                outs[c.rank].exit_code = c.proc.returncode if outs[c.rank].exit_code is None else outs[c.rank].exit_code
            what = []
            if hung and unexpected:
                what.append(f"ranks {hung} did not answer within 5s of the death")
            elif hung:
                what.append(f"ranks {hung} did not answer within {timeout:.0f}s")
            if unexpected:
                what.append("; ".join(f"rank {c.rank} died ({describe_exit(c.proc.returncode)})" for c in unexpected))
            text = self._report(fn, outs, ", ".join(what))
            text += "\n" + "\n".join(
                f"--- rank {r} log (stack dumps on hang) ---\n{_tail(logs[r])}"
                for r in sorted(logs) if logs[r].strip())
            cls = RankDied if unexpected else DistTimeout
            raise cls(text, outs)
        for c in died:
            outs[c.rank].exit_code = c.proc.returncode
        return outs

    def _report(self, fn: Callable, outs: list[Outcome], what: str) -> str:
        head = f"{fn.__qualname__} on {self.world} ranks (backend {self.cfg.backend!r}): {what}"
        return head + "\n" + "\n".join(o.describe() for o in outs)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def run_once(fn: Callable, world: int, *args, timeout: float = 60.0, close_timeout: float = 30.0,
             expect_dead: set[int] | frozenset = frozenset(), **cfg_kwargs) -> tuple[list[Outcome], list[Outcome]]:
    """One-off: starts ``world`` fresh ranks, runs ``fn`` once, closes them.

    Returns (call outcomes, close outcomes). Raises DistFailure on a hang or an unexpected death.
    """
    ranks = Ranks(RanksConfig(world=world, **cfg_kwargs)).start()
    try:
        outs = ranks.run_outcomes(fn, *args, timeout=timeout, expect_dead=expect_dead)
    except BaseException:
        ranks.kill()
        _rmtree(ranks.dir)
        raise
    closed = ranks.close(timeout=close_timeout)
    return outs, closed


# --------------------------------------------------------------------------------------------
# Child side


_SOFT_FAILURES: list[str] = []


def soft_fail(message: str) -> None:
    """Records a failed check in a rank without stopping the test function, so that every rank
    still makes the same sequence of calls (a raise in the middle of a loop of collectives would
    leave the other ranks hanging in the next one). The call then fails with all of them."""
    _SOFT_FAILURES.append(message)


@dataclass
class ExitAfterReply:
    """Return this from a test function to make the rank exit right after replying ``value``:
    ``mode="destroy"``: destroy_process_group() (if still initialised), then exit 0;
    ``mode="natural"``: no destroy; sys.exit(0), so the interpreter finalises normally."""

    value: Any = None
    mode: str = "destroy"


class Ctx:
    """Passed to every test function in a child."""

    def __init__(self, rank: int, world: int, backend: str, ref, workdir: str):
        self.rank = rank
        self.world = world
        self.backend = backend  # backend of the default group (under test)
        self.ref = ref  # reference gloo group over all ranks (None if not requested)
        self.dir = workdir  # a directory shared by all ranks of this group
        self.cache: dict = {}  # survives across calls in a pooled child (e.g. subgroups)

    def __repr__(self) -> str:
        return f"Ctx(rank={self.rank}, world={self.world}, backend={self.backend!r})"


def _set_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child_main(argv: list[str]) -> None:
    spec_path, rank, fd, log_path = argv[0], int(argv[1]), int(argv[2]), argv[3]
    _set_pdeathsig()
    log = open(log_path, "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    conn = Connection(fd)
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    world = spec["world"]
    if os.getppid() == 1:
        os._exit(EXIT_PARENT_GONE)
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        backend = spec["backend"]
        if backend in ("ucx", "commux"):
            import commux

            commux.register()
        dist.init_process_group(backend=backend, init_method=spec["init_method"], rank=rank,
                                world_size=world, timeout=timedelta(seconds=spec["pg_timeout_s"]))
        ref = None
        if spec["ref_backend"]:
            ref = dist.new_group(backend=spec["ref_backend"])
        ctx = Ctx(rank, world, backend, ref, spec["dir"])
    except BaseException:
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        try:
            conn.send(("setup_error", tb))
        except OSError:
            pass
        os._exit(EXIT_SETUP_FAILED)
    conn.send(("ready", os.getpid()))
    import importlib

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(EXIT_PARENT_GONE)
        if msg[0] == "exit":
            _exit_now(msg[1])
        _, cid, modname, qualname, args, kwargs, watchdog = msg
        faulthandler.dump_traceback_later(watchdog, exit=True)
        _SOFT_FAILURES.clear()
        try:
            obj: Any = importlib.import_module(modname)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for pattern, category in CHILD_WARNING_IGNORES:
                    warnings.filterwarnings("ignore", message=pattern, category=category)
                value = obj(ctx, *args, **kwargs)
            exit_mode = None
            if isinstance(value, ExitAfterReply):
                value, exit_mode = value.value, value.mode
            if _SOFT_FAILURES:
                n = len(_SOFT_FAILURES)
                text = f"{n} check(s) failed:\n" + "\n".join(_SOFT_FAILURES)
                reply = ("err", cid, "AssertionError", text, "")  # the messages say where; no traceback
            else:
                reply = ("ok", cid, value)
            try:
                data = pickle.dumps(reply)
            except Exception as e:  # noqa: BLE001
                data = pickle.dumps(("err", cid, "PicklingError", f"result not picklable: {e}", ""))
        except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit
            exit_mode = None
            msg_ = str(e)
            if _SOFT_FAILURES:
                msg_ = "after failed check(s):\n" + "\n".join(_SOFT_FAILURES) + f"\n{type(e).__name__}: {msg_}"
            data = pickle.dumps(("err", cid, type(e).__name__, msg_, traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send_bytes(data)
        except OSError:
            os._exit(EXIT_PARENT_GONE)
        if exit_mode == "natural":
            conn.close()
            faulthandler.dump_traceback_later(40, exit=True)  # a finaliser that hangs: stacks, exit 1
            sys.exit(0)
        if exit_mode == "destroy":
            _exit_now(30.0)


def _exit_now(destroy_timeout: float) -> None:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(destroy_timeout + 10, exit=True)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_CLOSE_FAILED)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

