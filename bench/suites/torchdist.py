"""torch.distributed benchmark session: the "ucx" backend (commux) against "gloo", in one run.

    python bench/torch_bench.py [--quick] [--rounds N] [--ranks LIST] [--backends LIST]
                                [--settle SEC] [--build DIR] [--out DIR]

Each round starts its own ranks (torch.multiprocessing, spawn; MASTER_ADDR 127.0.0.1, a free port),
with every backend in the same launch: the default group on the first backend of --backends, a
dist.new_group(backend=...) for each other one. Inside a launch the backends are interleaved per
size (the order alternates with the size and the round), so a change of the VM's CPU placement
hits all of them; each size reports the median over rounds of the per-round median.

  send/recv  2 ranks, ping-pong with blocking dist.send / dist.recv: rank 0 sends a uint8 tensor,
             rank 1 receives it and sends the same buffer back. Time = half the round trip.
             The payload is (base + iteration) mod 256 (base: a period-251 ramp), so a message
             that was not delivered, delivered twice, shifted or torn shows up: rank 0 compares
             the echo byte for byte with what it sent.
  allreduce  dist.all_reduce(SUM) of float32, integer-valued: rank r in iteration i contributes
             base + r + i (base: a period-1021 ramp); the sum is exact in any order, and every
             rank compares the result element by element with the expected one.
Preparing the payload and checking the result are outside the timed section of every iteration.
#wrong counts wrong bytes (send/recv) and wrong elements (allreduce) over all ranks and rounds.

--ranks lists the world sizes for allreduce (default 2; e.g. 2,4); send/recv always runs in the
2-rank launch. 4 ranks on this 2-core VM are oversubscribed: fine for correctness, not for
absolute figures. Before each round the script waits (up to --settle seconds) for other processes
to leave the CPUs idle, and records the CPU placement (build/bench/commux_bench --mode placement,
when built) and the CPU time other processes took, as bench/run_bench.py does. UCX_NET_DEVICES=lo
unless set.

Writes results.json and table.md to --out (default results/torch/) and prints the table. Exit
status 1 when a run failed or any result was wrong; a missed performance target is reported, not
a failure.
"""
import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.lib import REPO, checks, probe, report
from bench.lib.launch import launch_ranks
from bench.lib.machine import cpu_seconds, other_load, placement_ns, placement_text, wait_for_idle
from bench.lib.sizes import size_name
PP_SIZES = [8, 64, 1 << 10, 8 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]
AR_SIZES = [4 << 10, 1 << 20, 64 << 20]
QUICK_PP_SIZES = [8, 64 << 10, 1 << 20]
QUICK_AR_SIZES = [4 << 10, 1 << 20]
DEFAULT_BACKENDS = "ucx,gloo"
# Timed iterations per measurement: REP_BYTES of payload, MIN_ITERS .. MAX_ITERS (an eighth with
# --quick), plus a tenth (at least 2) as warm-up.
REP_BYTES, MIN_ITERS, MAX_ITERS = 64 << 20, 8, 3000
LAUNCH_TIMEOUT_S = 600
TARGET_RATIO_8B = 0.3  # 8 B send/recv: ucx at most 0.3 x gloo's time


def iterations(size, quick):
    divisor = 8 if quick else 1
    iters = max(MIN_ITERS // (2 if quick else 1), min(REP_BYTES // size, MAX_ITERS) // divisor)
    return iters, max(2, iters // 10)


# ------------------------------------------------------------------------------------------------
# Inside a rank

def fast_backend():
    """The portable pattern: commux's backend when commux is installed, else None."""
    try:
        from commux import preferred_backend
    except ImportError:
        return None
    return preferred_backend()


def pingpong(group, rank, size, iters, warmup):
    """Rank 0 <-> 1. Returns (one-way µs per timed iteration, wrong bytes) on rank 0."""
    n_total = warmup + iters
    if rank == 1:
        buf = torch.zeros(size, dtype=torch.uint8)
        for _ in range(n_total):
            dist.recv(buf, group=group, group_src=0)
            dist.send(buf, group=group, group_dst=0)
        return [], 0
    sbuf = (torch.arange(size, dtype=torch.int64) % 251).to(torch.uint8)
    rbuf = torch.empty(size, dtype=torch.uint8)
    times, wrong = [], 0
    clock = time.perf_counter
    for i in range(n_total):
        sbuf.add_(1)  # (base + i + 1) mod 256: differs from the previous iteration in every byte
        rbuf.fill_(0)  # what arrives must be written by this receive
        t0 = clock()
        dist.send(sbuf, group=group, group_dst=1)
        dist.recv(rbuf, group=group, group_src=1)
        t1 = clock()
        if not torch.equal(rbuf, sbuf):
            wrong += int((rbuf != sbuf).sum())
        if i >= warmup:
            times.append((t1 - t0) / 2 * 1e6)
    return times, wrong


def allreduce(group, rank, world, size, iters, warmup):
    """All ranks. Returns (µs per timed iteration on this rank, wrong elements on this rank)."""
    count = size // 4
    base = (torch.arange(count, dtype=torch.int64) % 1021).to(torch.float32)
    expected_base = base * world
    x = torch.empty(count, dtype=torch.float32)
    times, wrong = [], 0
    clock = time.perf_counter
    for i in range(warmup + iters):
        x.copy_(base)
        x.add_(rank + i)
        t0 = clock()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        t1 = clock()
        x.sub_(world * i + world * (world - 1) // 2)  # exact: integers below 2^24
        if not torch.equal(x, expected_base):
            wrong += int((x != expected_base).sum())
        if i >= warmup:
            times.append((t1 - t0) * 1e6)
    return times, wrong


def run_rank(job):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    backends = job["backends"]
    if any(b in ("ucx", "commux") for b in backends):
        fast_backend()  # registration is per process
    timeout = datetime.timedelta(seconds=job["op_timeout_s"])
    dist.init_process_group(backend=backends[0], init_method="env://", timeout=timeout)
    groups = {backends[0]: dist.group.WORLD}
    for b in backends[1:]:
        groups[b] = dist.new_group(backend=b, timeout=timeout)
    result = {"rank": rank, "world": world, "series": {}, "wrong": {}, "iters": {}}

    def measure(op, sizes, fn):
        for k, size in enumerate(sizes):
            order = backends if (job["round"] + k) % 2 == 0 else backends[::-1]
            iters, warmup = iterations(size, job["quick"])
            for b in order:
                times, wrong = fn(groups[b], size, iters, warmup)
                key = f"{op}/{b}"
                if times:
                    result["series"].setdefault(key, {})[size] = {
                        "median_us": statistics.median(times), "mean_us": statistics.fmean(times),
                        "min_us": min(times)}
                result["wrong"].setdefault(key, {})[size] = wrong
                result["iters"][f"{op}/{size}"] = [iters, warmup]

    if job["pingpong"]:
        if world < 2:
            raise ValueError("send/recv needs 2 ranks")
        measure("sendrecv", job["pp_sizes"],
                lambda g, s, n, w: pingpong(g, rank, s, n, w) if rank < 2 else ([], 0))
    measure(f"allreduce{world}", job["ar_sizes"],
            lambda g, s, n, w: allreduce(g, rank, world, s, n, w))
    # The last collective: no rank tears down while another still talks to it.
    dist.barrier(group=groups["gloo"] if "gloo" in groups else None)
    dist.destroy_process_group()
    return result


# ------------------------------------------------------------------------------------------------
# The parent: rounds, launches, medians, the report

def launch(world, job):
    """Runs one launch of `world` ranks with bench.lib's launcher (deadline, kill 15 s after a
    rank fails, per-rank results or error texts); returns ({rank: result}, [error texts])."""
    return launch_ranks(world, run_rank, job, LAUNCH_TIMEOUT_S, f"{world}-rank launch")


def one_round(args, index, backends):
    idle = wait_for_idle(args.settle)
    print(f"torch_bench: round {index + 1} (CPUs {idle:.0%} busy before)", file=sys.stderr,
          flush=True)
    start, cpu_before = time.monotonic(), cpu_seconds()
    placement = [placement_ns(args.build)]
    base_job = {"backends": backends, "round": index, "quick": args.quick,
                "op_timeout_s": args.op_timeout,
                "pp_sizes": QUICK_PP_SIZES if args.quick else PP_SIZES,
                "ar_sizes": QUICK_AR_SIZES if args.quick else AR_SIZES}
    series, wrong, iters, errors = {}, {}, {}, []
    worlds = sorted(set([2] + args.ranks))
    for world in worlds:
        job = dict(base_job, pingpong=world == 2)
        if world not in args.ranks:
            job["ar_sizes"] = []
        results, errs = launch(world, job)
        errors += errs
        for r, res in sorted(results.items()):
            for key, by_size in res["wrong"].items():
                for size, w in by_size.items():
                    wrong.setdefault(key, {}).setdefault(int(size), 0)
                    wrong[key][int(size)] += w
            if r == 0:
                for key, by_size in res["series"].items():
                    series[key] = {int(s): v for s, v in by_size.items()}
                iters.update(res["iters"])
    placement.append(placement_ns(args.build))
    return {"placement_ns": placement,
            "load": other_load(cpu_before, cpu_seconds(), time.monotonic() - start),
            "series": series, "wrong": wrong, "iters": iters, "errors": errors}


def medians(rounds):
    """{op/backend: {size: median over rounds of the per-round median µs}}."""
    acc = {}
    for r in rounds:
        for key, by_size in r["series"].items():
            for size, v in by_size.items():
                acc.setdefault(key, {}).setdefault(size, []).append(v["median_us"])
    return {key: {s: statistics.median(v) for s, v in by_size.items()}
            for key, by_size in acc.items()}


def total_wrong(rounds):
    out = {}
    for r in rounds:
        for key, by_size in r["wrong"].items():
            for size, w in by_size.items():
                out.setdefault(key, {}).setdefault(size, 0)
                out[key][size] += w
    return out


def ops_and_sizes(args):
    pp = QUICK_PP_SIZES if args.quick else PP_SIZES
    ar = QUICK_AR_SIZES if args.quick else AR_SIZES
    rows = [("sendrecv", "send/recv", s) for s in pp]
    for world in args.ranks:
        rows += [(f"allreduce{world}", f"allreduce {world} ranks", s) for s in ar]
    return rows


def table(args, backends, m, wrong):
    first, last = backends[0], backends[-1]
    head = ["op", "size"] + [f"{b} µs" for b in backends]
    if len(backends) > 1:
        head.append(f"ratio {first}/{last}")
    head.append("#wrong")
    lines = report.header(head, first="---|")
    for op, label, size in ops_and_sizes(args):
        us = {b: m.get(f"{op}/{b}", {}).get(size) for b in backends}
        cells = [label, size_name(size)] + [report.fmt(us[b], 2) for b in backends]
        if len(backends) > 1:
            cells.append(report.fmt(report.ratio(us[first], us[last]), 2))
        counts = {b: wrong.get(f"{op}/{b}", {}).get(size) for b in backends}
        cells.append(checks.wrong_cell(counts, only_wrong=False))
        lines.append(report.row(cells))
    return "\n".join(lines)


def target(backends, m):
    name = f"8 B send/recv: ucx <= {TARGET_RATIO_8B} x gloo"
    ucx, gloo = m.get("sendrecv/ucx", {}).get(8), m.get("sendrecv/gloo", {}).get(8)
    if ucx is None or gloo is None:
        return {"target": name, "status": "not measured"}
    r = ucx / gloo
    return {"target": name, "status": "met" if r <= TARGET_RATIO_8B else "missed",
            "value": r, "limit": TARGET_RATIO_8B,
            "text": f"ucx {ucx:.2f} µs, gloo {gloo:.2f} µs, ratio {r:.3f}"}


def versions(backends):
    out = {"torch": torch.__version__, "sources": probe.source_version()}
    if any(b in ("ucx", "commux") for b in backends):
        out.update(probe.commux_package())
    return out


def markdown(args, backends, note, info, rounds, m, wrong, check):
    first, last = backends[0], backends[-1]
    ucx_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                       if k.startswith(("UCX_", "COMMUX_")))
    iters = next((r["iters"] for r in rounds if r["iters"]), {})
    out = [
        "# torch.distributed benchmark: " + " vs ".join(backends), "",
        f"- sources {info['sources']}, torch {info['torch']}"
        + (f", commux {info['commux']} ({info['commux_path']})" if "commux" in info else ""),
        f"- environment: {ucx_env or '(none)'}",
        f"- {len(rounds)} round(s), one launch of 2 ranks"
        + (f" and of {', '.join(str(w) for w in args.ranks if w != 2)} ranks"
           if any(w != 2 for w in args.ranks) else "")
        + " per round, backends interleaved per size; medians over rounds of per-round medians; "
        f"placement (CPU 0<->1 handoff, before -> after): {placement_text(rounds)}",
        "- send/recv: one-way latency (half the round trip, blocking dist.send + dist.recv, 2 "
        "ranks). allreduce: time of one dist.all_reduce (SUM, float32) on rank 0",
        "- iterations (timed, warm-up) per backend and round: " + ", ".join(
            f"{op.split('/')[0]} {size_name(int(op.split('/')[1]))}: {v[0]}+{v[1]}"
            for op, v in iters.items()),
    ]
    if note:
        out.append(f"- note: {note}")
    out += ["", table(args, backends, m, wrong), "", "## Target", ""]
    out.append(f"- **{check['status']}**: {check['target']}"
               + (f" ({check['text']})" if "text" in check else ""))
    n_wrong = sum(w for by_size in wrong.values() for w in by_size.values())
    out += ["", f"Correctness: {n_wrong} wrong bytes/elements."]
    if len(backends) > 1:
        out.append(f"Ratio column: {first} time / {last} time (below 1: {first} is faster).")
    out += [f"Failure: {e.splitlines()[-1] if e.splitlines() else e}" for r in rounds
            for e in r["errors"]]
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations (~30 s)")
    p.add_argument("--rounds", type=int, help="rounds (default 3, 1 with --quick)")
    p.add_argument("--ranks", default="2",
                   help="comma-separated world sizes for allreduce (default 2; e.g. 2,4)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated backends (default {DEFAULT_BACKENDS}; ucx is left out "
                        "with a note when commux is not installed)")
    p.add_argument("--settle", type=float, default=30, metavar="SEC",
                   help="before each round, wait up to SEC for other processes to go idle")
    p.add_argument("--op-timeout", type=int, default=60, metavar="SEC",
                   help="process-group timeout of every operation (default 60)")
    p.add_argument("--build", default=str(REPO / "build"),
                   help="build dir with bench/commux_bench, for the placement indicator")
    p.add_argument("--out", default=str(REPO / "results" / "torch"), help="output directory")
    args = p.parse_args(argv)
    try:
        args.ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    except ValueError:
        p.error(f"--ranks wants a list of integers, got '{args.ranks}'")
    if not args.ranks or any(not 2 <= w <= 16 for w in args.ranks):
        p.error("--ranks: world sizes from 2 to 16")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return p, args


def resolve_backends(parser, args):
    wanted = [b.strip() for b in (args.backends or DEFAULT_BACKENDS).split(",") if b.strip()]
    if not wanted or len(set(wanted)) != len(wanted):
        parser.error("--backends needs distinct backend names")
    if not any(b in ("ucx", "commux") for b in wanted) or fast_backend() is not None:
        return wanted, None
    if args.backends is not None:
        parser.error("backend 'ucx' needs the commux package (import commux failed)")
    kept = [b for b in wanted if b not in ("ucx", "commux")] or ["gloo"]
    return kept, "commux is not installed: ran " + ",".join(kept) + " only"


def main(argv):
    parser, args = parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    backends, note = resolve_backends(parser, args)
    if note:
        print(f"torch_bench: note: {note}", file=sys.stderr)
    info = versions(backends)
    rounds = [one_round(args, i, backends) for i in range(args.rounds)]
    m = medians(rounds)
    wrong = total_wrong(rounds)
    check = target(backends, m)
    md = markdown(args, backends, note, info, rounds, m, wrong, check)
    errors = [e for r in rounds for e in r["errors"]]
    data = {"info": info, "backends": backends, "note": note, "ranks": args.ranks,
            "quick": args.quick, "env": {k: v for k, v in os.environ.items()
                                         if k.startswith(("UCX_", "COMMUX_"))},
            "rounds": rounds, "medians": m, "wrong": wrong, "target": check, "errors": errors}
    report.write(Path(args.out), data, md)
    print(md)
    for e in errors:
        print(f"torch_bench: {e}", file=sys.stderr)
    n_wrong = sum(w for by_size in wrong.values() for w in by_size.values())
    return 1 if errors or n_wrong else 0

