#!/usr/bin/env python3
"""Where a small device transfer's time goes: raw UCX beside commux, on one machine, in one run.

    python bench/experiments/device_latency.py [--device cuda:0|cpu] [--sizes 8,64K,1M]
                                               [--reps 10] [--out DIR] [--budget S]

Three parts, each a figure per size:

1. raw UCX: `ucx_perftest -t tag_lat` (the one of the libucx wheel commux loads), one-way latency
   (median), between two processes on this machine, for host memory and, on a GPU, for device
   memory (`-m cuda`, both processes on device 0);
2. commux through torch: bench/experiments/cuda_latency.py (2 ranks on --device), p2p one-way,
   blocking all_reduce (also behind 2 ms of kernel work: how late the fence sees the stream end)
   and a host all_reduce, with UCX_PROTO_INFO=y so that UCX prints which
   protocol it chose for each memory type and size range (kept in DIR/protocols.txt, its device
   memory tables printed);
3. the same with COMMUX_SPIN_US=20000: every commux wait polls instead of sleeping, so the gap
   between 2 and 3 is what sleeping and waking costs, and what remains against 1 is commux's path
   or the protocol UCX picked for it;
4. with --variant NAME:VAR=VALUE,..., one more commux run per variant (a UCX or commux setting to
   try, e.g. noipc:UCX_TLS=^cuda_ipc), in a table of its own.

Every commux result is checked (cuda_latency.py counts wrong elements). With --device cpu it runs
on host memory only (a dry run on a machine without a GPU). Writes DIR/device_latency.md (the table)
beside the raw outputs. Exit status 1 when a commux run failed or a result was wrong (a
ucx_perftest that cannot run leaves its figures out, with a note).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.lib.launch import free_port, listening, run_command  # noqa: E402
from bench.lib.sizes import parse_size  # noqa: E402


def libucx_dir():
    import libucx
    return Path(libucx.__file__).resolve().parent


def perftest(exe, env, mem, size, iters, timeout):
    """One-way latency in µs (the median) of ucx_perftest tag_lat, or an error text."""
    port = free_port()
    server = subprocess.Popen([str(exe), "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        until = time.monotonic() + 10
        while not listening(port):
            if server.poll() is not None or time.monotonic() > until:
                return None, f"the perftest server did not start: {server.stderr.read()[-300:]}"
            time.sleep(0.05)
        cmd = [exe, "127.0.0.1", "-p", port, "-t", "tag_lat", "-m", f"{mem},{mem}", "-s", size,
               "-n", iters, "-w", max(10, iters // 10)]
        done = run_command(cmd, env, timeout)
        m = re.search(r"^Final:\s+\d+\s+([\d.]+)", done.stdout, re.M)
        if done.returncode != 0 or not m:
            return None, (done.error or f"exit status {done.returncode}: "
                          f"{(done.stderr or done.stdout)[-300:].strip()}")
        return float(m.group(1)), ""
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def commux_run(device, sizes, reps, env, timeout, json_path):
    cmd = [sys.executable, str(REPO / "bench/experiments/cuda_latency.py"), "--device", device,
           "--sizes", ",".join(str(s) for s in sizes), "--reps", str(reps),
           "--timeout", str(max(30, timeout - 10)), "--json", str(json_path)]
    done = run_command(cmd, env, timeout)
    text = done.stdout + done.stderr
    if done.returncode != 0 or not json_path.exists():
        return None, text, (done.error or f"exit status {done.returncode}: {text[-400:].strip()}")
    return json.loads(json_path.read_text()), text, ""


def protocol_tables(text, memory):
    """UCX_PROTO_INFO's tables (deduplicated) whose title names `memory` memory. UCX prints each
    table's lines with one "[time] [host:pid:thread]" prefix."""
    tables, prefix, cur = [], None, []
    for line in text.splitlines() + [""]:
        m = re.match(r"^(\[[^\]]*\]\s*\[[^\]]*\])\s*([+|].*)$", line)
        if m and m.group(1) == prefix:
            cur.append(m.group(2))
            continue
        if cur:
            tables.append("\n".join(cur))
        prefix, cur = (m.group(1), [m.group(2)]) if m else (None, [])
    seen, out = set(), []
    for t in tables:
        key = re.sub(r"(ucp_context_\d+|cfg#\d+)", "", t)
        rows = [r for r in t.splitlines() if re.match(r"^\|\s*[\d.]+[KMG]?\.\.", r)]
        if re.search(rf"from {memory}\b", t) and rows and key not in seen:  # "cuda/GPU0" too
            seen.add(key)
            out.append(t)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--sizes", default="8,64K,1M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--iters", type=int, default=2000, help="ucx_perftest iterations per size")
    p.add_argument("--out", default="results/device_latency")
    p.add_argument("--budget", type=float, default=150, help="seconds for the whole run")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="one more commux run with these environment variables (repeatable), e.g. "
                        "noipc:UCX_TLS=^cuda_ipc; its p2p and all_reduce get a table of their own")
    a = p.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    left = lambda: a.budget - (time.monotonic() - start)  # noqa: E731
    errors, notes = [], []  # errors: commux's runs (exit status 1); notes: the rest
    gpu = a.device.startswith("cuda")
    mems = ["host", "cuda"] if gpu else ["host"]

    # 1. raw UCX
    ucx = libucx_dir()
    exe = ucx / "bin" / "ucx_perftest"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{ucx / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    if not gpu:
        env.setdefault("UCX_NET_DEVICES", "lo")
    raw = {}
    for mem in mems:
        for s in sizes:
            if left() < 60:
                notes.append(f"ucx_perftest {mem} {s}: skipped, the budget is spent")
                continue
            us, err = perftest(exe, env, mem, s, a.iters, timeout=30)
            raw[(mem, s)] = us
            if err:  # a missing reference figure, not a failure of commux
                notes.append(f"ucx_perftest {mem} {s} B: {err}")
    # 2 and 3. commux, sleeping allowed, then every wait polling
    runs = {}
    plan = [("default", {"UCX_PROTO_INFO": "y"}), ("spin", {"COMMUX_SPIN_US": "20000"})]
    for v in a.variant:
        name, _, assigns = v.partition(":")
        pairs = []  # a piece without "=" continues the value before it (UCX_TLS=tcp,self)
        for piece in assigns.split(","):
            if "=" in piece:
                pairs.append(piece.split("=", 1))
            elif pairs:
                pairs[-1][1] += "," + piece
            else:
                pairs = None
                break
        if not name or not pairs or name in ("default", "spin"):
            p.error(f"--variant {v!r}: expected NAME:VAR=VALUE[,VAR=VALUE]")
        plan.append((name, dict(pairs)))
    for name, extra in plan:
        limit = min(90.0, left() - 5)
        if limit < 30:
            errors.append(f"commux ({name}): skipped, the budget is spent")
            continue
        res, text, err = commux_run(a.device, sizes, a.reps, dict(env, **extra), limit,
                                    out / f"commux_{name}.json")
        (out / f"commux_{name}.log").write_text(text)
        if err:
            errors.append(f"commux ({name}): {err}")
            continue
        runs[name] = res
        if name == "default":
            tables = protocol_tables(text, "cuda" if gpu else "host")
            (out / "protocols.txt").write_text("\n\n".join(tables) + "\n")
            print(f"UCX's protocols for {'cuda' if gpu else 'host'} memory in commux's run "
                  f"({len(tables)} tables, all in {out / 'protocols.txt'}):")
            for t in tables[:4]:
                print(t)

    mem = "cuda" if gpu else "host"

    def fig(x):
        return "-" if x is None else f"{x:.1f}"

    def row_of(name, s):
        r = runs.get(name, {}).get("us", {})
        return r.get(str(s))

    lines = [f"{a.device}, µs; UCX: ucx_perftest tag_lat one-way median; commux: cuda_latency.py "
             f"median of {a.reps} on rank 0; spin: COMMUX_SPIN_US=20000",
             "", "| size | UCX host | " + ("UCX cuda | " if gpu else "") + "commux p2p | "
             "commux p2p, spin | commux p2p / UCX | all_reduce | all_reduce, spin | "
             "all_reduce behind a 2 ms kernel, beyond it | host all_reduce |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else "")]
    for s in sizes:
        d, sp = row_of("default", s) or {}, row_of("spin", s) or {}
        u = raw.get((mem, s))
        ratio = (f"{d['p2p'] / u:.1f}" if u and d.get("p2p") else "-")
        dev = f"{fig(u)} | " if gpu else ""
        lines.append(f"| {s} | {fig(raw.get(('host', s)))} | {dev}{fig(d.get('p2p'))} | "
                     f"{fig(sp.get('p2p'))} | {ratio} | {fig(d.get('allreduce'))} | "
                     f"{fig(sp.get('allreduce'))} | {fig(d.get('busy'))} | "
                     f"{fig(d.get('host allreduce'))} |")
    variants = [name for name, _ in plan[2:]]
    if variants:
        lines += ["", "| size | " + " | ".join(f"p2p, {v} | all_reduce, {v}" for v in variants) + " |",
                  "|---:|" + "---:|---:|" * len(variants)]
        for s in sizes:
            cells = []
            for v in variants:
                r = row_of(v, s) or {}
                cells += [fig(r.get("p2p")), fig(r.get("allreduce"))]
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines += [f"{name}: " + " ".join(f"{k}={v}" for k, v in extra.items()) for name, extra in plan[2:]]
    wrong = sum(r.get("wrong", 0) for r in runs.values())
    lines += ["", f"#wrong: {wrong}"] + [f"error: {e}" for e in errors] + \
        [f"note: {n}" for n in notes]
    text = "\n".join(lines)
    (out / "device_latency.md").write_text(text + "\n")
    print(text)
    return 1 if errors or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
