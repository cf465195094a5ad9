"""Starting things: spawned torch ranks (launch_ranks) and commands (run_command), both with a
deadline, so a benchmark that hangs ends with a message instead of holding the machine."""
import faulthandler
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpirun(np):
    """Open MPI's command line for `np` ranks on this machine (loopback, shared memory)."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
            "--mca", "pml", "ob1", "--mca", "btl", "self,vader", "-np", str(np)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_groups():
    """torch.distributed in this process alone, with one thread: a "ucx" group of one rank (the
    default group) and one of the no-op reference backend (torch's own cost per call), for what a
    call costs with no peer or transport in the way. Returns {"ucx": group, "noop": group}."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from bench.suites.coll import register_noop
    torch.set_num_threads(1)
    register_noop()
    dist.init_process_group("ucx", rank=0, world_size=1)
    return {"ucx": dist.group.WORLD, "noop": dist.new_group(backend="noop")}


def listening(port):
    """True when something listens on TCP `port` (read from /proc, without connecting)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


# ------------------------------------------------------------------------------------------------
# Commands

class Finished(NamedTuple):
    """What run_command saw: returncode None when the command did not finish (error says why)."""
    returncode: object
    stdout: str
    stderr: str
    seconds: float
    error: str = ""
    timed_out: bool = False


def run_command(cmd, env, timeout):
    """Runs cmd (output captured as text) until it exits or `timeout` seconds pass."""
    start = time.monotonic()
    try:
        p = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return Finished(None, "", "", time.monotonic() - start,
                        f"no result after {timeout} s", timed_out=True)
    except OSError as e:
        return Finished(None, "", "", time.monotonic() - start, f"cannot run {cmd[0]}: {e}")
    return Finished(p.returncode, p.stdout, p.stderr, time.monotonic() - start)


# ------------------------------------------------------------------------------------------------
# Spawned torch ranks

def rank_entry(rank, world, port, worker, job, out_dir):
    """A spawned rank: environment, watchdog, worker(job) -> out_dir/rank<r>.json (or .err)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    for k, v in job.get("env", {}).items():  # None: unset
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    # The interpreter has started: a PYTHONPATH given here (an A/B of two installed builds) goes to
    # the front of sys.path as well, before the worker imports commux.
    if job.get("env", {}).get("PYTHONPATH"):
        sys.path[0:0] = job["env"]["PYTHONPATH"].split(os.pathsep)
    faulthandler.dump_traceback_later(max(10, job["launch_timeout_s"] - 15), exit=True)
    out = Path(out_dir)
    try:
        import warnings
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamings
        warnings.filterwarnings("ignore", category=UserWarning)
        result = worker(job)
    except Exception:  # noqa: BLE001 -- record exactly what failed, on which rank
        text = traceback.format_exc()
        print(f"bench rank {rank}: error:\n{text}", file=sys.stderr, flush=True)
        (out / f"rank{rank}.err").write_text(text)
        sys.exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_groups()
    sys.exit(0)


def end_groups():
    """Destroys the process groups a worker left, before the interpreter ends: a gloo worker
    thread that let go of the last tensor during Python's finalization took ranks down
    ("terminate called without an active exception", in ProcessGroupGloo's runLoop)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch_ranks(world, worker, job, timeout_s, what):
    """Spawns `world` ranks running worker(job) (torch.multiprocessing, spawn; MASTER_ADDR
    127.0.0.1 and a free port; job["env"] sets or, with None, unsets variables in the ranks);
    kills them all at the deadline, or 15 s after one failed. `worker` must be importable by name
    (a module-level function). Returns ({rank: result}, [error texts])."""
    import torch.multiprocessing as mp
    job = dict(job, launch_timeout_s=timeout_s)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        port = free_port()
        procs = [ctx.Process(target=rank_entry, args=(r, world, port, worker, job, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while any(p.exitcode is None for p in procs):
            time.sleep(0.05)
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now  # the others get a moment to report their own errors
            if now > deadline or (failed_at is not None and now > failed_at + 15):
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                for p in procs:
                    p.join()
                break
        results, errors = {}, []
        for r, p in enumerate(procs):
            path, err = Path(tmp) / f"rank{r}.json", Path(tmp) / f"rank{r}.err"
            if path.exists():
                results[r] = json.loads(path.read_text())
            elif err.exists():
                errors.append(f"{what}, rank {r}: {err.read_text().strip()}")
            else:
                errors.append(f"{what}, rank {r}: exit status {p.exitcode}, no result "
                              f"(killed at the {timeout_s} s deadline?)")
    return results, errors


def build_dir(parser, text):
    """A command line's OLD: a directory holding another build's commux package (made with
    `pip install --no-deps --no-build-isolation --target OLD .`), resolved; `parser` names a
    directory that holds none."""
    if not text or not (Path(text) / "commux" / "__init__.py").is_file():
        parser.error(f"OLD: {text!r} holds no commux package (pip install --target OLD .)")
    return str(Path(text).resolve())


def alternate_builds(args, builds, launches, timeout_s, what):
    """Runs the command `args` (a script's one-launch form, whose last line of output is a JSON
    object naming the commux package it loaded as "package") `launches` times per build, in the
    order of `builds`, then reversed, and so on, so that a drift of the machine during the run
    falls on every build alike. A build is None (the installed package) or a directory holding
    another build's package (`pip install --no-deps --no-build-isolation --target DIR .`), put
    at the front of the launch's PYTHONPATH. Returns {build: [each launch's JSON object]}; raises
    RuntimeError (naming the build and the launch) for a launch that failed or loaded a package
    other than its build's."""
    runs = {b: [] for b in builds}
    for k in range(launches):
        for b in (builds if k % 2 == 0 else builds[::-1]):
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            if b is not None:
                env["PYTHONPATH"] = str(b)
            name = b or "the installed build"
            done = subprocess.run(args, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
            if done.returncode != 0:
                sys.stderr.write(done.stdout + done.stderr)
                raise RuntimeError(f"{what}: launch {k + 1} of {name} failed")
            res = json.loads(done.stdout.strip().splitlines()[-1])
            loaded = Path(res["package"]).parent
            if (b is not None and loaded != Path(b).resolve()) or (
                    b is None and any(o is not None and loaded == Path(o).resolve()
                                      for o in builds)):
                raise RuntimeError(f"{what}: launch {k + 1} of {name} loaded {res['package']}")
            runs[b].append(res)
    return runs
