"""python -m commux.selftest [--nprocs N]: a checked run of commux on this machine, in a few seconds.

Starts N local ranks (default 2) on the backend "ucx" and runs, each result compared with the value
every rank can compute by itself:

  * tagged point-to-point: every rank sends to every other rank on two tags, receives posted in the
    opposite order (matching is on (sender, tag), not on posting order);
  * receive-from-any: rank 0 receives one message from each other rank without naming the sender,
    and checks that the sender reported is the one whose data arrived;
  * the collectives: all_reduce (SUM, MAX), broadcast, all_gather, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, reduce, gather, scatter, barrier;
  * one-way latency and bandwidth between ranks 0 and 1 at a few sizes (ping-pong through
    torch.distributed, so Python's overhead is included);

and reports the transport UCX chose between the ranks (from commux's own INFO log, COMMUX_DEBUG),
then explains in plain words what it found wrong: UCX reaching a local rank over TCP instead of
shared memory (and why), a UCX_TLS that leaves out the copy transport this machine's GPU tensors
need, more ranks than cores. Exit status: 0 every check passed; 1 a check failed, a rank failed or
hung; 2 a usage error.

The ranks' commux log goes to files of their own (COMMUX_DEBUG=INFO, or TRACE if you set it, with
COMMUX_DEBUG_FILE in a temporary directory); --keep keeps them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SIZES = (8, 4096, 65536, 1 << 20, 8 << 20)  # bytes, for latency and bandwidth
SHARED_MEMORY_TLS = ("posix", "sysv", "xpmem", "cma", "knem")
LANES = re.compile(r"\[rank (\d+)\] commux INFO group \S+ peer (\d+)( \(this host\))?: lanes (.*)$")


# ------------------------------------------------------------------------------------------------
# One rank

class Checks:
    """The checks of one rank: each is (name, ok, detail); a failure does not stop the others
    unless it leaves the ranks out of step (a collective that raised)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.results: list[dict] = []

    def run(self, name: str, fn) -> bool:
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            ok = True
        except AssertionError as e:
            ok, detail = False, f"wrong result: {e}"
        except Exception as e:  # noqa: BLE001 -- reported as the check's failure
            ok, detail = False, f"{type(e).__name__}: {e}".strip()
        self.results.append({"name": name, "ok": ok, "detail": detail,
                             "ms": (time.perf_counter() - t0) * 1e3})
        return ok


def _expect(what: str, got, want) -> None:
    import torch

    if not torch.equal(got, want):
        diff = (got != want).nonzero()
        first = diff[0].tolist() if len(diff) else "?"
        raise AssertionError(f"{what}: {len(diff)} of {want.numel()} elements differ, first at "
                             f"{first}: got {got.flatten()[0:4].tolist()}..., expected "
                             f"{want.flatten()[0:4].tolist()}...")


def _data(rank: int, n: int, dtype=None, salt: int = 0):
    """Rank `rank`'s integer-valued data: exact in any reduction order."""
    import torch

    x = (torch.arange(n, dtype=torch.int64) * 7 + rank * 131 + salt) % 61 - 30
    return x.to(dtype or torch.float32)


def _p2p(ws: int, me: int) -> str:
    import torch.distributed as dist

    n = 1000
    works, bufs = [], {}
    # Receives for tag 2 before tag 1; sends tag 1 first: the order of posting does not matter.
    for tag in (2, 1):
        for peer in range(ws):
            if peer != me:
                bufs[peer, tag] = _data(-1, n) * 0
                works.append(dist.irecv(bufs[peer, tag], src=peer, tag=tag))
    for tag in (1, 2):
        for peer in range(ws):
            if peer != me:
                works.append(dist.isend(_data(me, n, salt=tag), dst=peer, tag=tag))
    for w in works:
        w.wait()
    for (peer, tag), b in bufs.items():
        _expect(f"message from rank {peer} with tag {tag}", b, _data(peer, n, salt=tag))
    return f"{len(works)} messages on 2 tags, receives posted out of order"


def _any_source(ws: int, me: int) -> str:
    import torch.distributed as dist

    n = 257
    if me != 0:
        dist.send(_data(me, n, salt=9), dst=0, tag=9)
        return "sent to rank 0"
    seen = []
    for _ in range(ws - 1):
        buf = _data(0, n) * 0
        src = dist.recv(buf, tag=9)  # no src: from any rank
        _expect(f"message reported as from rank {src}", buf, _data(src, n, salt=9))
        seen.append(src)
    if sorted(seen) != list(range(1, ws)):
        raise AssertionError(f"senders reported {sorted(seen)}, expected each of 1..{ws - 1} once")
    return f"senders reported in arrival order {seen}"


def _collectives(ws: int, me: int, fault: str | None) -> list[tuple[str, object]]:
    import torch
    import torch.distributed as dist

    def allreduce_sum():
        x = _data(me, 4099)
        if fault == "allreduce" and me == ws - 1:
            x[7] += 1  # --inject-fault: the last rank contributes one wrong element
        dist.all_reduce(x)
        _expect("all_reduce SUM", x, sum(_data(r, 4099) for r in range(ws)))

    def allreduce_max():
        x = _data(me, 1 << 18, torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        want = _data(0, 1 << 18, torch.int64)
        for r in range(1, ws):
            want = torch.maximum(want, _data(r, 1 << 18, torch.int64))
        _expect("all_reduce MAX (2 MiB int64)", x, want)

    def broadcast():
        root = ws - 1
        x = _data(root, 3333) if me == root else torch.zeros(3333)
        dist.broadcast(x, src=root)
        _expect(f"broadcast from rank {root}", x, _data(root, 3333))

    def all_gather():
        out = [torch.zeros(100) for _ in range(ws)]
        dist.all_gather(out, _data(me, 100))
        for r in range(ws):
            _expect(f"all_gather part of rank {r}", out[r], _data(r, 100))

    def all_gather_into_tensor():
        out = torch.zeros(ws * 513)
        dist.all_gather_into_tensor(out, _data(me, 513))
        _expect("all_gather_into_tensor", out, torch.cat([_data(r, 513) for r in range(ws)]))

    def reduce_scatter_tensor():
        out = torch.zeros(65)
        dist.reduce_scatter_tensor(out, _data(me, 65 * ws))
        want = sum(_data(r, 65 * ws) for r in range(ws))[me * 65:(me + 1) * 65]
        _expect("reduce_scatter_tensor", out, want)

    def all_to_all_single():
        out = torch.zeros(ws * 17)
        dist.all_to_all_single(out, _data(me, ws * 17))
        want = torch.cat([_data(r, ws * 17)[me * 17:(me + 1) * 17] for r in range(ws)])
        _expect("all_to_all_single", out, want)

    def reduce():
        x = _data(me, 999)
        dist.reduce(x, dst=0)
        if me == 0:
            _expect("reduce to rank 0", x, sum(_data(r, 999) for r in range(ws)))

    def gather():
        out = [torch.zeros(31) for _ in range(ws)] if me == 0 else None
        dist.gather(_data(me, 31), out, dst=0)
        if me == 0:
            for r in range(ws):
                _expect(f"gather part of rank {r}", out[r], _data(r, 31))

    def scatter():
        parts = [_data(r, 29, salt=5) for r in range(ws)] if me == 0 else None
        out = torch.zeros(29)
        dist.scatter(out, parts, src=0)
        _expect("scatter", out, _data(me, 29, salt=5))

    def barrier():
        dist.barrier()

    return [("all_reduce SUM", allreduce_sum), ("all_reduce MAX", allreduce_max),
            ("broadcast", broadcast), ("all_gather", all_gather),
            ("all_gather_into_tensor", all_gather_into_tensor),
            ("reduce_scatter_tensor", reduce_scatter_tensor),
            ("all_to_all_single", all_to_all_single), ("reduce", reduce), ("gather", gather),
            ("scatter", scatter), ("barrier", barrier)]


def _pingpong(me: int, sizes) -> list[dict]:
    """Ranks 0 and 1: round trips per size; one-way latency = round trip / 2."""
    import torch
    import torch.distributed as dist

    out = []
    peer = 1 - me
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)
        iters = max(4, min(200, (8 << 20) // max(size, 1)))
        for i in range(iters + 3):  # three round trips of warm-up
            if i == 3:
                t0 = time.perf_counter()
            if me == 0:
                dist.send(buf, dst=peer, tag=77)
                dist.recv(buf, src=peer, tag=77)
            else:
                dist.recv(buf, src=peer, tag=77)
                dist.send(buf, dst=peer, tag=77)
        one_way = (time.perf_counter() - t0) / iters / 2
        out.append({"bytes": size, "iters": iters, "us": one_way * 1e6,
                    "gbps": size / one_way / 1e9})
    return out


def worker(args) -> int:
    rank, ws = args.worker_rank, args.nprocs
    result = {"rank": rank, "checks": [], "pingpong": [], "fatal": ""}
    path = os.path.join(args.dir, f"result{rank}.json")
    try:
        import datetime

        import torch
        import torch.distributed as dist

        import commux

        torch.set_num_threads(1)
        commux.register()
        dist.init_process_group("ucx", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=ws, timeout=datetime.timedelta(seconds=args.timeout))
        checks = Checks(rank)
        fault = args.inject_fault
        if ws > 1:
            checks.run("tagged point-to-point", lambda: _p2p(ws, rank))
            checks.run("receive from any source", lambda: _any_source(ws, rank))
        for name, fn in _collectives(ws, rank, fault):
            if not checks.run(name, fn) and "wrong result" not in checks.results[-1]["detail"]:
                break  # a collective that raised may leave the ranks out of step: stop here
        result["checks"] = checks.results
        if ws > 1 and all(c["ok"] for c in checks.results):
            if rank < 2:
                result["pingpong"] = _pingpong(rank, SIZES)
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported by the parent
        result["fatal"] = traceback.format_exc()
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return EXIT_OK if not result["fatal"] and all(c["ok"] for c in result["checks"]) else EXIT_FAILED


# ------------------------------------------------------------------------------------------------
# The parent: start the ranks, collect, diagnose

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text if len(text) <= n else "...\n" + text[-n:]


def _start(args, tmp: str, port: int) -> list[subprocess.Popen]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    from commux import _C

    if _C.settings()["COMMUX_DEBUG"]["text"].upper() != "TRACE":  # the ranks log at least INFO
        env["COMMUX_DEBUG"] = "INFO"
    env["COMMUX_DEBUG_FILE"] = os.path.join(tmp, "commux.%p.log")
    procs = []
    for r in range(args.nprocs):
        cmd = [sys.executable, "-m", "commux.selftest", "--nprocs", str(args.nprocs),
               "--timeout", str(args.timeout), "--worker-rank", str(r), "--dir", tmp,
               "--port", str(port)]
        if args.inject_fault:
            cmd += ["--inject-fault", args.inject_fault]
        with open(os.path.join(tmp, f"rank{r}.out"), "wb") as out:
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    return procs


def _wait(procs, deadline: float) -> list[str]:
    """Waits for every rank; kills them all at the deadline. Returns the ranks' fates."""
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in hung:
        try:
            os.killpg(procs[r].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()
    return ["hung (killed at the deadline)" if r in hung else
            "ok" if p.returncode == 0 else
            f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
            for r, p in enumerate(procs)]


def _lanes(tmp: str) -> tuple[dict, list[str]]:
    """{(rank, peer): (same_host, lanes)} and the WARN lines, from the ranks' commux logs."""
    lanes, warns = {}, []
    for name in sorted(os.listdir(tmp)):
        if not (name.startswith("commux.") and name.endswith(".log")):
            continue
        with open(os.path.join(tmp, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                m = LANES.search(line.rstrip("\n"))
                if m:
                    lanes.setdefault((int(m[1]), int(m[2])), (bool(m[3]), m[4]))
                elif " commux WARN " in line:
                    warns.append(line.rstrip("\n"))
    return lanes, warns


def _kind(lanes: str) -> str:
    """What carries the messages: the transport of the lanes that carry active messages ("am"),
    else of any lane; "shared memory", "TCP" or the transports' names."""
    parts = re.findall(r"(\w+)/[^\s,()]+(?: \(([^)]*)\))?", lanes)
    am = {tl for tl, uses in parts if "am" in [u.strip() for u in uses.split(",")]}
    tls = am or {tl for tl, _ in parts}
    if tls & set(SHARED_MEMORY_TLS):
        return "shared memory"
    if "tcp" in tls:
        return "TCP"
    return ", ".join(sorted(tls)) or "unknown"


def _why_tcp(info: dict) -> list[str]:
    """Plain words for UCX reaching a local rank over TCP."""
    why = []
    tls = os.environ.get("UCX_TLS")
    have = set(info.get("transports", []))
    if tls:
        names = [t.strip() for t in tls.split(",")]
        if names and names[0].startswith("^"):  # a deny list
            denied = [t.lstrip("^") for t in names if t.lstrip("^") in SHARED_MEMORY_TLS + ("sm", "shm")]
            if denied:
                why.append(f"UCX_TLS={tls} excludes {', '.join(denied)}")
        elif not [t for t in names if t in SHARED_MEMORY_TLS + ("sm", "shm", "all")]:
            why.append(f"UCX_TLS={tls} is an allow list without a shared-memory transport (add sm, "
                       "or unset UCX_TLS and let UCX choose)")
    if not have & set(SHARED_MEMORY_TLS):
        why.append(f"this UCX offers no shared-memory transport (it has {', '.join(sorted(have))})")
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        if free < (64 << 20):
            why.append(f"/dev/shm has only {free >> 20} MiB free (a container's default 64 MiB is "
                       "often too small; docker run --shm-size=1g or --ipc=host)")
    except OSError:
        why.append("/dev/shm is missing: UCX's posix shared memory needs it")
    if not why:
        why.append("the ranks may not share an IPC namespace (containers started separately); "
                   "run `UCX_LOG_LEVEL=info python -m commux.selftest` to see UCX's reasons")
    return why


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _fmt_bytes(b: int) -> str:
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << k:
            return f"{b >> k} {unit}"
    return f"{b} B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m commux.selftest",
                                description="A checked local run of commux with a diagnosis.")
    p.add_argument("--nprocs", type=int, default=2, help="local ranks to start (default 2)")
    p.add_argument("--timeout", type=int, default=60,
                   help="seconds before a stuck run is killed and reported (default 60)")
    p.add_argument("--keep", action="store_true", help="keep the ranks' logs (printed path)")
    p.add_argument("--inject-fault", choices=["allreduce"], default=None,
                   help="make one rank contribute a wrong value, to see a failing check reported")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.nprocs <= 64:
        p.error("--nprocs must be between 1 and 64")
    if args.timeout < 1:
        p.error("--timeout must be >= 1")
    if args.worker_rank is not None:
        return worker(args)

    t_start = time.monotonic()
    import torch

    import commux

    info = commux.runtime_info()
    print(f"commux selftest: commux {commux.__version__}, torch {torch.__version__} "
          f"(commux built against {commux._BUILT_WITH_TORCH}), UCX {info['ucx_version']}, "
          f"python {sys.version.split()[0]}")
    print(f"  {args.nprocs} local rank{'s' if args.nprocs > 1 else ''} on backend 'ucx'; "
          f"UCX transports here: {', '.join(info['transports']) or '(none)'}")
    tmp = tempfile.mkdtemp(prefix="commux-selftest-")
    procs = _start(args, tmp, _free_port())
    fates = _wait(procs, time.monotonic() + args.timeout + 15)
    results = {}
    for r in range(args.nprocs):
        try:
            with open(os.path.join(tmp, f"result{r}.json")) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            results[r] = None
    failed = False

    # The checks, rank by rank folded into one line per check.
    names = []
    for res in results.values():
        for c in (res or {}).get("checks", []):
            if c["name"] not in names:
                names.append(c["name"])
    print("checks:")
    for name in names:
        per = {r: next((c for c in res["checks"] if c["name"] == name), None)
               for r, res in results.items() if res}
        bad = {r: c for r, c in per.items() if c is None or not c["ok"]}
        if bad:
            failed = True
            print(f"  FAIL  {name}")
            for r, c in bad.items():
                print(f"        rank {r}: {c['detail'] if c else 'not run'}")
        else:
            detail = per.get(0, {}).get("detail") if per.get(0) else ""
            print(f"  ok    {name}" + (f" ({detail})" if detail else ""))
    for r in range(args.nprocs):
        res = results[r]
        if fates[r] != "ok" or res is None or res["fatal"]:
            if res is not None and not res["fatal"] and fates[r].startswith("exit 1"):
                continue  # a failed check, reported above
            failed = True
            print(f"  FAIL  rank {r}: {fates[r]}")
            text = (res or {}).get("fatal") or _tail(os.path.join(tmp, f"rank{r}.out"))
            print("        " + "\n        ".join(text.strip().splitlines()[-12:]))

    # Latency and bandwidth.
    pp = (results.get(0) or {}).get("pingpong") or []
    if pp:
        print("latency and bandwidth, rank 0 <-> rank 1 (ping-pong through torch.distributed):")
        for m in pp:
            print(f"  {_fmt_bytes(m['bytes']):>8}  one-way {m['us']:10.1f} us  "
                  f"{m['gbps']:8.3f} GB/s  ({m['iters']} round trips)")

    # Transports.
    lanes, warns = _lanes(tmp)
    problems = []
    if lanes:
        print("transport UCX chose between the ranks:")
        for (r, peer), (same_host, text) in sorted(lanes.items()):
            if r < peer:
                print(f"  rank {r} <-> rank {peer}: {_kind(text)} ({text})")
        tcp_local = [(r, q) for (r, q), (same, t) in lanes.items() if same and _kind(t) != "shared memory"]
        if tcp_local:
            problems.append("UCX reaches ranks on this host without shared memory ("
                            + ", ".join(f"{r}->{q}" for r, q in sorted(tcp_local)[:4])
                            + "), which is much slower than it could be. Likely: "
                            + "; ".join(_why_tcp(info)) + ".")
    elif args.nprocs > 1 and not failed:
        print("transport UCX chose between the ranks: not reported (no INFO lines in the ranks' log)")

    # The copy transport a GPU tensor needs.
    choice = commux.transport_choice()
    if choice["accelerator"] != "none":
        print(f"accelerator {choice['accelerator']}: copy transports "
              f"{', '.join(choice['transports']) or '(none in this UCX)'}")
    for w in choice["warnings"]:
        problems.append(w[len("commux: "):] if w.startswith("commux: ") else w)

    # Cores.
    cores = _cores()
    if args.nprocs > cores:
        problems.append(f"{args.nprocs} ranks share {cores} core{'s' if cores > 1 else ''}: each "
                        "rank has a progress thread, so oversubscribed ranks take turns and "
                        "latencies above are inflated (commux's waits yield the CPU then: "
                        "COMMUX_YIELD); use at most one rank per core for figures that count")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores:
        problems.append(f"the machine is busy (load average {load:.1f} on {cores} cores): "
                        "timings above are not representative")
    for w in warns[:6]:
        problems.append("a rank logged: " + w.split(" commux WARN ", 1)[-1])

    if problems:
        print("what to look at:")
        for pr in problems:
            print(f"  - {pr}")
    took = time.monotonic() - t_start
    if args.keep:
        print(f"logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"commux selftest: {'FAILED' if failed else 'PASSED'} in {took:.1f} s")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
