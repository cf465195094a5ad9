"""Point-to-point benchmark session: commux against raw UCX (ucx_perftest), MPI and memcpy.

    python3 bench/run_bench.py [BUILD_DIR] [--quick] [--rounds N] [--env NAME=VALUE ...]
                               [--settle SEC] [--out DIR]

BUILD_DIR (default build/ under the repository) holds bench/commux_bench and, when MPI was found,
bench/mpi_pingpong. One session runs, for each round: the CPU placement indicator, memcpy, commux
ping-pong, commux stream, ucx_perftest tag_lat and tag_bw (the perftest of the UCX commux links),
and MPI ping-pong. The VM's vCPU placement flips between fast and slow, so the whole set runs
--rounds times (default 3) and each size reports the median over rounds. Each round first waits
(up to --settle seconds) for other processes to leave the CPUs idle, and records how much CPU
they took during the round. Every run has UCX_NET_DEVICES=lo; --env settings go to the commux
runs only (to compare UCX settings).

Writes results.json and table.md to --out (default results/p2p/ under the repository) and prints
the table. Exit status 1 when a run failed or any byte arrived wrong; a missed performance target
is reported, not a failure.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib import REPO, checks, report
from bench.lib.launch import MPI_ENV, free_port, listening, mpirun, run_command
from bench.lib.machine import cpu_seconds, other_load, placement_text, wait_for_idle
from bench.lib.probe import read_cmake_cache, source_version
from bench.lib.sizes import size_name

SIZES = [8, 64, 512, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 4 << 10, 64 << 10, 1 << 20]
BASE_ENV = {"UCX_NET_DEVICES": "lo"}
RUN_TIMEOUT_S = 300
# ucx_perftest iterations follow commux_bench's plan (native/bench_common.c): 32 MiB per
# repetition, 4 .. 2000 iterations (an eighth with --quick); it runs PERFTEST_REPS times that after
# one as warm-up.
# Its typical latency is a median over iterations, so it needs fewer than commux's 9 repetitions.
REP_BYTES, MIN_ITERS, MAX_ITERS, PERFTEST_REPS = 32 << 20, 4, 2000, 3


# ------------------------------------------------------------------------------------------------
# Running things

class Session:
    """Paths, environments and the log shared by every run."""

    def __init__(self, args):
        self.build = Path(args.build_dir).resolve()
        self.quick = args.quick
        self.sizes = QUICK_SIZES if args.quick else SIZES
        self.commux_env = dict(pair.split("=", 1) for pair in args.env)
        self.settle_s = args.settle
        self.log = []
        self.errors = []
        self.perftest, self.perftest_env = find_perftest(self.build)
        self.version = source_version()
        if self.perftest is None:
            self.fail("no ucx_perftest found: the UCX columns stay empty")

    def env(self, extra=None):
        return {**os.environ, **BASE_ENV, **(extra or {})}

    def run(self, name, cmd, env, timeout=RUN_TIMEOUT_S):
        """Runs cmd; returns (returncode, stdout) and logs both; None when it could not finish."""
        p = run_command(cmd, env, timeout)
        if p.returncode is None:
            where = f" ({' '.join(map(str, cmd))})" if p.timed_out else ""
            self.fail(f"{name}: {p.error}{where}")
            return None
        self.log.append(f"$ {' '.join(map(str, cmd))}   # {name}, rc {p.returncode}, "
                        f"{p.seconds:.1f} s\n{p.stderr}{p.stdout[-2000:]}")
        return p.returncode, p.stdout

    def fail(self, message):
        print(f"run_bench: {message}", file=sys.stderr)
        self.errors.append(message)

    def run_json(self, name, cmd, env):
        """Runs a program that writes bench_common JSON (--json FILE); returns it, or None."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            result = self.run(name, cmd + self.size_flags() + ["--json", str(out)], env)
            if result is None:
                return None
            rc = result[0]
            if rc not in (0, 1) or not out.exists():  # 1: ran, but some bytes were wrong
                self.fail(f"{name}: exit status {rc} (see run.log)")
                return None
            return json.loads(out.read_text())

    def size_flags(self):
        flags = ["--sizes", ",".join(map(str, self.sizes))]
        return flags + (["--quick"] if self.quick else [])


def find_perftest(build):
    """The ucx_perftest of the UCX commux links, and the environment it needs."""
    cache = read_cmake_cache(build)
    prefix = Path(cache.get("COMMUX_UCX_PREFIX", "/usr"))
    if cache.get("COMMUX_UCX_PROVIDER_RESOLVED") == "wheel":
        return prefix / "bin" / "ucx_perftest", {"LD_LIBRARY_PATH": str(prefix / "lib")}
    local = prefix / "bin" / "ucx_perftest"
    found = local if local.exists() else shutil.which("ucx_perftest")
    return (Path(found) if found else None), {}


def iterations(session, size):
    divisor = 8 if session.quick else 1
    iters = max(MIN_ITERS, min(REP_BYTES // divisor // size, MAX_ITERS // divisor))
    return iters, iters * PERFTEST_REPS


# ------------------------------------------------------------------------------------------------
# The peers

def commux_bench(session, mode):
    cmd = [str(session.build / "bench" / "commux_bench"), "--mode", mode]
    env = session.env(session.commux_env if mode in ("pingpong", "stream") else None)
    if mode == "placement":
        result = session.run_json(mode, cmd, env)
        return result["rows"][0]["time_us_median"] * 1e3 if result else None
    return session.run_json(f"commux {mode}", cmd, env)


def mpi_pingpong(session):
    binary = session.build / "bench" / "mpi_pingpong"
    if not binary.exists() or shutil.which("mpirun") is None:
        return None
    return session.run_json("mpi_pingpong", mpirun(2) + [str(binary)], session.env(MPI_ENV))


def parse_final(text):
    """ucx_perftest's 'Final:' line: iterations, typical/avg/overall latency (usec),
    avg/overall bandwidth (MB/s, i.e. MiB/s), avg/overall message rate."""
    for line in text.splitlines():
        if line.startswith("Final:"):
            v = [float(x) for x in line.split()[1:]]
            return {"lat_us": v[1], "lat_avg_us": v[3], "gbps": v[5] * (1 << 20) / 1e9}
    return None


def perftest(session, test, size):
    if session.perftest is None:
        return None
    iters, total = iterations(session, size)
    port = free_port()
    env = session.env(session.perftest_env)
    server = subprocess.Popen([str(session.perftest), "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not listening(port) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        cmd = [str(session.perftest), "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
               "-n", str(total), "-w", str(iters)]
        result = session.run(f"ucx_perftest {test} {size}", cmd, env)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    final = parse_final(result[1]) if result and result[0] == 0 else None
    if final is None and result is not None:
        session.fail(f"ucx_perftest {test} -s {size}: no 'Final:' line (see run.log)")
    return final


# ------------------------------------------------------------------------------------------------
# Rounds and medians

def rows_by_size(result, key):
    return {r["size"]: r[key] for r in result["rows"]} if result else {}


def wrong_bytes(*results):
    return sum(r["wrong"] for res in results if res for r in res["rows"])


def one_round(session, index):
    idle = wait_for_idle(session.settle_s)
    print(f"run_bench: round {index + 1} (CPUs {idle:.0%} busy before)", file=sys.stderr)
    start, cpu_before = time.monotonic(), cpu_seconds()
    placement = [commux_bench(session, "placement")]
    memcpy = commux_bench(session, "memcpy")
    pingpong = commux_bench(session, "pingpong")
    stream = commux_bench(session, "stream")
    lat = {s: perftest(session, "tag_lat", s) for s in session.sizes}
    bw = {s: perftest(session, "tag_bw", s) for s in session.sizes}
    mpi = mpi_pingpong(session)
    placement.append(commux_bench(session, "placement"))
    return {
        "placement_ns": placement,
        "load": other_load(cpu_before, cpu_seconds(), time.monotonic() - start),
        "info": pingpong["info"] if pingpong else {},
        "mpi_info": mpi["info"] if mpi else {},
        "wrong": wrong_bytes(memcpy, pingpong, stream, mpi),
        "series": {
            "commux_us": rows_by_size(pingpong, "time_us_median"),
            "commux_gbps": rows_by_size(pingpong, "gbps"),
            "stream_gbps": rows_by_size(stream, "gbps"),
            "memcpy_gbps": rows_by_size(memcpy, "gbps"),
            "mpi_us": rows_by_size(mpi, "time_us_median"),
            "ucx_us": {s: v["lat_us"] for s, v in lat.items() if v},
            "ucx_avg_us": {s: v["lat_avg_us"] for s, v in lat.items() if v},
            "ucx_gbps": {s: v["gbps"] for s, v in bw.items() if v},
        },
    }


def medians(rounds):
    """{series: {size: median over the rounds that measured it}}."""
    out = {}
    for r in rounds:
        for name, values in r["series"].items():
            for size, v in values.items():
                out.setdefault(name, {}).setdefault(size, []).append(v)
    return {name: {s: statistics.median(v) for s, v in by_size.items()}
            for name, by_size in out.items()}


# ------------------------------------------------------------------------------------------------
# Targets and the report

def targets(m):
    def at(series, size):
        return m.get(series, {}).get(size)

    ucx8, mpi64k, copy64m = at("ucx_us", 8), at("mpi_us", 64 << 10), at("memcpy_gbps", 64 << 20)
    le, ge = (lambda a, b: a <= b), (lambda a, b: a >= b)
    return [
        checks.target("8 B latency <= ucx_perftest + 0.3 us", at("commux_us", 8),
              ucx8 + 0.3 if ucx8 is not None else None, le,
              "commux {have:.3f} us, limit {limit:.3f} us"),
        checks.target("64 KiB latency <= 1.3 x MPI", at("commux_us", 64 << 10),
              1.3 * mpi64k if mpi64k is not None else None, le,
              "commux {have:.2f} us, limit {limit:.2f} us"),
        checks.target("64 MiB stream bandwidth >= 0.8 x memcpy", at("stream_gbps", 64 << 20),
              0.8 * copy64m if copy64m is not None else None, ge,
              "commux {have:.2f} GB/s, limit {limit:.2f} GB/s"),
        checks.target("64 MiB ping-pong bandwidth >= 0.8 x memcpy", at("commux_gbps", 64 << 20),
              0.8 * copy64m if copy64m is not None else None, ge,
              "commux {have:.2f} GB/s, limit {limit:.2f} GB/s"),
    ]


def table(sizes, m):
    head = ["size", "commux one-way µs", "ucx_perftest µs", "MPI µs", "commux/UCX", "commux/MPI",
            "commux stream GB/s", "memcpy GB/s", "commux/memcpy", "ucx_perftest GB/s"]
    lines = report.header(head)
    for s in sizes:
        g = {name: m.get(name, {}).get(s) for name in m}
        fmt, ratio = report.fmt, report.ratio
        cells = [size_name(s), fmt(g.get("commux_us")), fmt(g.get("ucx_us")), fmt(g.get("mpi_us")),
                 fmt(ratio(g.get("commux_us"), g.get("ucx_us")), 2),
                 fmt(ratio(g.get("commux_us"), g.get("mpi_us")), 2),
                 fmt(g.get("stream_gbps")), fmt(g.get("memcpy_gbps")),
                 fmt(ratio(g.get("stream_gbps"), g.get("memcpy_gbps")), 2),
                 fmt(g.get("ucx_gbps"))]
        lines.append(report.row(cells))
    return "\n".join(lines)


def markdown(session, rounds, m, verdicts):
    info = next((r["info"] for r in rounds if r["info"]), {})
    mpi = next((r["mpi_info"] for r in rounds if r["mpi_info"]), {})
    env = " ".join(f"{k}={v}" for k, v in session.commux_env.items()) or "(none)"
    out = [
        "# commux point-to-point benchmark", "",
        f"- commux sources: {session.version}, build {session.build}",
        f"- UCX (commux): {info.get('ucx_version', '?')}, transports {info.get('transports', '?')}",
        f"- ucx_perftest: {session.perftest}",
        f"- MPI: {mpi.get('mpi_library', 'not run').splitlines()[0]}",
        f"- all runs: {' '.join(f'{k}={v}' for k, v in BASE_ENV.items())}; commux runs also: {env}",
        f"- {len(rounds)} round(s), medians over rounds; placement (CPU 0<->1 handoff, before -> "
        f"after): {placement_text(rounds)}",
        "- µs columns: one-way latency (half the round trip); ucx_perftest's is its typical "
        "(median) latency. GB/s columns: streaming bandwidth (commux stream, ucx_perftest "
        "tag_bw)", "",
        table(session.sizes, m), "", "## Targets", "",
    ]
    out += [f"- **{c['status']}**: {c['target']}" + (f" ({c['text']})" if "text" in c else "")
            for c in verdicts]
    wrong = sum(r["wrong"] for r in rounds)
    out += ["", f"Correctness: {wrong} wrong bytes."]
    out += [f"Failure: {e}" for e in session.errors]
    return "\n".join(out) + "\n"


def write_results(out_dir, session, rounds, m, verdicts, md):
    data = {"sources": session.version, "build": str(session.build), "sizes": session.sizes,
            "commux_env": session.commux_env, "base_env": BASE_ENV,
            "perftest": str(session.perftest), "rounds": rounds, "medians": m,
            "targets": verdicts, "errors": session.errors}
    report.write(out_dir, data, md, "\n".join(session.log))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("build_dir", nargs="?", default=str(REPO / "build"))
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations (smoke test)")
    p.add_argument("--rounds", type=int, help="rounds of all peers (default 3, 1 with --quick)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for the commux runs (repeatable)")
    p.add_argument("--settle", type=float, default=60, metavar="SEC",
                   help="before each round, wait up to SEC for other processes to go idle")
    p.add_argument("--out", default=str(REPO / "results" / "p2p"), help="output directory")
    args = p.parse_args(argv)
    bad = [e for e in args.env if "=" not in e]
    if bad:
        p.error(f"--env wants NAME=VALUE, got {bad[0]}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    return args


def main(argv):
    args = parse_args(argv)
    session = Session(args)
    if not (session.build / "bench" / "commux_bench").exists():
        print(f"run_bench: no bench/commux_bench in {session.build}", file=sys.stderr)
        return 1
    rounds = [one_round(session, i) for i in range(args.rounds)]
    m = medians(rounds)
    verdicts = targets(m)
    md = markdown(session, rounds, m, verdicts)
    write_results(Path(args.out), session, rounds, m, verdicts, md)
    print(md)
    return 1 if session.errors or any(r["wrong"] for r in rounds) else 0

