"""Collectives benchmark suite in the style of nccl-tests: commux beside Gloo and Open MPI.

    python bench/coll_bench.py [--quick] [--ops LIST] [--worlds LIST] [--backends LIST]
                               [--max-bytes N] [--rounds N] [--settle SEC] [--build DIR]
                               [--out DIR]

Ops: p2p (nccl-tests' sendrecv: every rank isends to rank+1 and irecvs from rank-1), allreduce,
broadcast, reduce (root 0), allgather, reduce_scatter, alltoall, barrier; float32, SUM. Sizes are
the per-rank buffer in nccl-tests' convention (allgather: the output, reduce_scatter: the input),
8 B .. 64 MiB in x8 steps. Backends, each in its own processes:

  ucx         commux through torch.distributed (backend "ucx"; `import commux` registers it)
  noop        the reference: a torch.distributed backend that communicates nothing and returns
              completed Works (commux._C._NoopBackend, src/c10d/noop_backend.hpp), registered as
              "ucx" is, through Backend.register_backend with a creator. Its time is torch's own
              cost per call, so ucx-noop is commux's share. Its outputs are not checked (it
              computes nothing): it never counts as wrong and never enters #wrong.
  gloo        Gloo through torch.distributed. ucx, noop and gloo run in one launch (noop as a
              dist.new_group beside the others), interleaved per size (the order alternates with
              size and round)
  mpi         Open MPI's own collectives: build/bench/mpi_coll under mpirun
  commux-cpp  commux's C++ collectives (commux/collectives.hpp): build/bench/commux_coll_bench

Why a backend of our own and not torch's "fake" (FakeProcessGroup, in torch 2.11-2.13): both are
C++ backends, as "ucx" is, so neither adds a Python call of its own (a Python ProcessGroup would,
and would make torch's share look larger than it is); but from torch 2.13 on "fake" copies input
to output in allgather, reduce_scatter and alltoall, a cost that grows with the size and that
would be subtracted from commux's. "noop" does nothing at every size and on every torch.
bench/experiments/noop_reference.py, one process, torch 2.13, µs per call: allreduce 8 B noop
4.0, fake 3.9, Python 4.7; allgather 8 B 2.9, 4.8, 4.0; allgather 64 MiB 3.0, 10552, 4.5.

Every implementation sizes, times and checks alike (bench/native/coll_common.h): warm-up, a fit to a
time budget, `reps` repetitions of back-to-back iterations after a barrier (a repetition's time
is the slowest rank's), then one checked operation whose inputs are rank- and index-dependent
integers (exact in float32) and whose every output element is compared: #wrong. A row's time is
the median over repetitions; with several rounds, the median over rounds. algbw = bytes / time;
busbw = algbw x nccl-tests' factor (allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall
(n-1)/n; broadcast, reduce, p2p 1).

The VM's two vCPUs flip between fast and slow placements, so each world size runs --rounds rounds
(default 2; 1 with --quick) with the launchers' order rotating, the placement indicator
(build/bench/commux_bench --mode placement) recorded before and after each round, and the table
gives ratios within the run (ucx/gloo, ucx/mpi, cpp/mpi). Targets of the run, reported (met /
missed) and never a failure: ucx-noop <= 1.2 x cpp + 1 us at each (op, size), and each backend's
spread between rounds (max / min of its per-round times) <= 1.5x. World sizes above the CPU
count are oversubscribed and labelled so. UCX_NET_DEVICES=lo unless set.

Writes results.json, table.md and plots (coll_w<N>.png) to --out (default results/coll/) and
prints the table. Exit status 1 when any element was wrong or a backend failed to run; backends
that are not available (no commux package, no mpirun, binaries not built) are left out with a
note unless --backends names them.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lib import REPO, checks, probe, report
from bench.lib.launch import MPI_ENV, launch_ranks, mpirun, run_command
from bench.lib.machine import cpu_seconds, other_load, placement_kind, placement_ns, wait_for_idle
from bench.lib.sizes import parse_list, parse_size, size_name

OPS = ["p2p", "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
       "barrier"]  # the order of coll_op in coll_common.h (the salt depends on it)
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [8, 64 << 10, 1 << 20]
BACKENDS = ["ucx", "noop", "gloo", "mpi", "commux-cpp"]
TORCH_BACKENDS = ("ucx", "noop", "gloo")
REFERENCES = ("noop",)  # timed, never checked: not in #wrong
SHORT = {"ucx": "ucx", "noop": "noop", "gloo": "gloo", "mpi": "mpi", "commux-cpp": "cpp"}
RATIOS = [("ucx", "gloo"), ("ucx", "mpi"), ("commux-cpp", "mpi")]
# The targets (issue 14): commux's share of a torch-level call against its C++ API, and the
# spread between rounds; reported, never a failure.
SHARE_FACTOR, SHARE_SLACK_US = 1.2, 1.0
SPREAD_LIMIT = 1.5
# Plans (see coll_common.h): the same numbers go to every implementation.
FULL_PLAN = {"reps": 5, "min_reps": 3, "rep_bytes": 32 << 20, "min_iters": 1, "max_iters": 200,
             "budget_ms": 200}
QUICK_PLAN = {"reps": 3, "min_reps": 2, "rep_bytes": 2 << 20, "min_iters": 1, "max_iters": 20,
              "budget_ms": 25}
LAUNCH_TIMEOUT_S = 900
OP_TIMEOUT_S = 120


def busbw_factor(op, n):
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 0.0 if op == "barrier" else 1.0


def shape(op, size, n):
    """(count, chunk) in float32 elements, as coll_make_shape."""
    if op == "barrier":
        return 0, 0
    if op in ("allgather", "reduce_scatter", "alltoall"):
        chunk = max(1, size // 4 // n)
        return chunk * n, chunk
    count = max(1, size // 4)
    return count, count


def plan_iters(plan, nbytes):
    if nbytes == 0:
        return plan["max_iters"]
    return max(plan["min_iters"], min(plan["max_iters"], plan["rep_bytes"] // nbytes))


def plan_warmup(iters):
    return max(1, min(10, iters // 10))


def fit_budget(plan, us_per_iter, iters, reps):
    if us_per_iter <= 0:
        return iters, reps
    budget_us = plan["budget_ms"] * 1e3
    iters = max(plan["min_iters"], min(iters, int(budget_us / (us_per_iter * reps))))
    reps = max(plan["min_reps"], min(reps, int(budget_us / (us_per_iter * iters))))
    return iters, reps


def row_salt(salt, op, size_index):
    return (salt * 97 + OPS.index(op) * 13 + size_index * 3) % 1021


# ------------------------------------------------------------------------------------------------
# Inside a torch rank

def _torch():
    import torch
    import torch.distributed as dist
    return torch, dist


_RAMP = []  # [(7 i) % 1021 as float32 for i < length], computed once per rank


def values(rank, start, count, salt):
    """v(rank, i, salt) = (7 i + 131 rank + salt) % 1021 for start <= i < start + count, float32
    (coll_value): a cached ramp plus one remainder, exact (integers below 2042)."""
    torch, _ = _torch()
    if not _RAMP or len(_RAMP[0]) < start + count:
        i = torch.arange(max(start + count, 1 << 10), dtype=torch.int64)
        _RAMP[:] = [((i * 7) % 1021).to(torch.float32)]
    ramp = _RAMP[0][start:start + count]
    return torch.remainder(ramp + float((rank * 131 + salt) % 1021), 1021.0)


def prepare_check(op, rank, count, chunk, inp, out, salt):
    if op == "barrier":
        return
    if op == "broadcast" and rank != 0:
        inp.fill_(-1)
    else:
        n = chunk if op == "allgather" else count
        inp[:n].copy_(values(rank, 0, n, salt))
    if op in ("p2p", "allgather", "reduce_scatter", "alltoall"):
        out[:chunk if op == "reduce_scatter" else count].fill_(-1)


def check(op, rank, n, count, chunk, inp, out, salt):
    """Wrong elements in this rank's output (coll_check)."""
    torch, _ = _torch()
    if op == "barrier" or (op == "reduce" and rank != 0):
        return 0
    if op == "p2p":
        got, want = out[:count], values((rank - 1) % n, 0, count, salt)
    elif op in ("allreduce", "reduce"):
        got, want = inp[:count], sum(values(q, 0, count, salt) for q in range(n))
    elif op == "broadcast":
        got, want = inp[:count], values(0, 0, count, salt)
    elif op == "allgather":
        got, want = out[:count], torch.cat([values(q, 0, chunk, salt) for q in range(n)])
    elif op == "reduce_scatter":
        got, want = out[:chunk], sum(values(q, rank * chunk, chunk, salt) for q in range(n))
    else:  # alltoall
        got = out[:count]
        want = torch.cat([values(q, rank * chunk, chunk, salt) for q in range(n)])
    return int((got != want).sum())


def make_runner(op, group, rank, n, count, chunk, inp, out):
    """A no-argument function doing one operation on these buffers."""
    _, dist = _torch()
    i, o = inp[:count], out[:count]
    if op == "p2p":
        nxt, prv = (rank + 1) % n, (rank - 1) % n

        def p2p():
            reqs = [dist.irecv(o, src=prv, group=group), dist.isend(i, dst=nxt, group=group)]
            for r in reqs:
                r.wait()
        return p2p
    if op == "allreduce":
        return lambda: dist.all_reduce(i, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(i, src=0, group=group)
    if op == "reduce":
        return lambda: dist.reduce(i, dst=0, group=group)
    if op == "allgather":  # all_gather_single: torch >= 2.13's name of all_gather_into_tensor
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(o, inp[:chunk], group=group)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out[:chunk], i, group=group)
    if op == "alltoall":
        return lambda: dist.all_to_all_single(o, i, group=group)
    return lambda: dist.barrier(group=group)


def measure(job, op, size_index, size, backend, group, sync, rank, n, bufs):
    """coll_run_size for one torch backend; times are this rank's (the parent takes the max).
    `sync` carries the barriers and the plan's broadcast: `group` itself, except for a reference
    (noop), whose own barrier and broadcast do nothing. A reference's result is not checked."""
    torch, dist = _torch()
    plan = job["plan"]
    count, chunk = shape(op, size, n)
    inp, out = bufs
    salt = row_salt(job["salt"], op, size_index)
    run = make_runner(op, group, rank, n, count, chunk, inp, out)
    iters = plan_iters(plan, count * 4)
    warmup = plan_warmup(iters)
    reps = plan["reps"]
    prepare_check(op, rank, count, chunk, inp, out, salt)
    clock = time.perf_counter
    dist.barrier(group=sync)
    warm = []
    for _ in range(warmup):
        t0 = clock()
        run()
        warm.append((clock() - t0) * 1e6)
    shared = torch.tensor(fit_budget(plan, statistics.median(warm), iters, reps), dtype=torch.int64)
    dist.broadcast(shared, src=0, group=sync)
    iters, reps = int(shared[0]), int(shared[1])
    times = []
    for _ in range(reps):
        dist.barrier(group=sync)
        t0 = clock()
        for _ in range(iters):
            run()
        times.append((clock() - t0) * 1e6 / iters)
    dist.barrier(group=sync)
    wrong = None  # a reference computes nothing: not checked
    if backend not in REFERENCES:
        prepare_check(op, rank, count, chunk, inp, out, salt)
        run()
        wrong = check(op, rank, n, count, chunk, inp, out, salt)
    return {"op": op, "backend": backend, "bytes": count * 4, "count": count, "iters": iters,
            "warmup": warmup, "reps": reps, "times_us": times, "wrong": wrong}


def register_noop():
    """Registers the reference backend "noop" as commux registers "ucx": a creator that makes the
    C++ backend (commux._C._NoopBackend). Idempotent."""
    _, dist = _torch()
    from commux import _C
    if "NOOP" in getattr(dist.Backend, "_plugins", {}):
        return

    def create_noop_backend(dist_opts, backend_opts=None):  # extended_api=True signature
        return _C._NoopBackend(dist_opts.group_rank, dist_opts.group_size)

    dist.Backend.register_backend("noop", create_noop_backend, extended_api=True,
                                  devices=["cpu"])


def run_rank(job):
    torch, dist = _torch()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    backends = job["backends"]
    if "ucx" in backends or "noop" in backends:
        import commux
        commux.register()
    if "noop" in backends:
        register_noop()
    timeout = datetime.timedelta(seconds=job["op_timeout_s"])
    # WORLD is a backend that communicates: it carries a reference's barriers and plan.
    world_backend = next(b for b in backends if b not in REFERENCES)
    dist.init_process_group(backend=world_backend, init_method="env://", timeout=timeout)
    groups = {world_backend: dist.group.WORLD}
    for b in backends:
        if b != world_backend:
            groups[b] = dist.new_group(backend=b, timeout=timeout)
    max_count = max([1] + [shape(op, s, n)[0] for op in job["ops"] for s in job["sizes"]])
    bufs = (torch.empty(max_count, dtype=torch.float32),
            torch.empty(max_count, dtype=torch.float32))
    rows = []
    k = 0
    for op in job["ops"]:
        for si, size in enumerate(job["sizes"]):
            if op == "barrier" and si > 0:
                break
            order = backends if (job["salt"] + k) % 2 == 0 else backends[::-1]
            k += 1
            for b in order:
                sync = dist.group.WORLD if b in REFERENCES else groups[b]
                rows.append(measure(job, op, si, size, b, groups[b], sync, rank, n, bufs))
    # The last collective: no rank tears down while another still talks to it.
    dist.barrier(group=groups["gloo"] if "gloo" in groups else None)
    dist.destroy_process_group()
    return {"rank": rank, "world": n, "rows": rows}


# ------------------------------------------------------------------------------------------------
# The parent: launchers

class Session:
    def __init__(self, args, backends):
        self.args = args
        self.backends = backends
        self.plan = QUICK_PLAN if args.quick else FULL_PLAN
        self.build = Path(args.build)
        self.errors = []
        self.log = []
        self.info = {}

    def fail(self, message):
        print(f"coll_bench: {message}", file=sys.stderr, flush=True)
        self.errors.append(message)

    def env(self, extra=None):
        return {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
                **(extra or {})}

    def timeout(self):
        return self.args.launch_timeout


def merge_ranks(results, world):
    """Rank files -> rows: per repetition the slowest rank's time, wrong summed over ranks."""
    ranks = [results[r]["rows"] for r in sorted(results)]
    merged = []
    for per_rank in zip(*ranks):
        row = dict(per_rank[0])
        row["times_us"] = [max(t) for t in zip(*(r["times_us"] for r in per_rank))]
        row["wrong"] = (None if row["backend"] in REFERENCES
                        else sum(r["wrong"] for r in per_rank))
        row["world"] = world
        merged.append(row)
    return merged


def launch_torch(session, world, backends, salt):
    """One launch of `world` torch ranks running every op for `backends`; returns rows."""
    args = session.args
    job = {"backends": backends, "ops": args.ops, "sizes": args.sizes, "plan": session.plan,
           "salt": salt, "op_timeout_s": args.op_timeout}
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    results, errors = launch_ranks(world, run_rank, job, session.timeout(),
                                   f"torch {world} ranks")
    for e in errors:
        session.fail(e)
    if errors or len(results) != world:
        return []
    return merge_ranks(results, world)


def c_flags(session, salt, json_path):
    p, args = session.plan, session.args
    return ["--ops", ",".join(args.ops), "--sizes", ",".join(map(str, args.sizes)),
            "--reps", str(p["reps"]), "--min-reps", str(p["min_reps"]),
            "--rep-bytes", str(p["rep_bytes"]), "--min-iters", str(p["min_iters"]),
            "--max-iters", str(p["max_iters"]), "--budget-ms", str(p["budget_ms"]),
            "--salt", str(salt), "--timeout", str(session.timeout() - 10), "--json", json_path]


def launch_c(session, backend, world, salt):
    """mpi_coll under mpirun, or commux_coll_bench; returns rows."""
    with tempfile.TemporaryDirectory(prefix="coll-bench-") as tmp:
        out = Path(tmp) / "out.json"
        if backend == "mpi":
            cmd = mpirun(world) + [str(session.build / "bench" / "mpi_coll")]
            env = session.env(MPI_ENV)
        else:
            cmd = [str(session.build / "bench" / "commux_coll_bench"), "--np", str(world)]
            env = session.env()
        cmd += c_flags(session, salt, str(out))
        p = run_command(cmd, env, session.timeout())
        if p.returncode is None:
            session.fail(f"{backend} {world} ranks: {p.error}")
            return []
        session.log.append(f"$ {' '.join(cmd)}   # rc {p.returncode}, "
                           f"{p.seconds:.1f} s\n{p.stderr[-4000:]}")
        if p.returncode not in (0, 1) or not out.exists():
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            session.fail(f"{backend} {world} ranks: exit status {p.returncode}: {tail}")
            return []
        data = json.loads(out.read_text())
    session.info.setdefault(backend, data.get("info", {}))
    rows = data["rows"]
    for r in rows:
        r.update(backend=backend, world=world)
    return rows


def one_round(session, world, index):
    idle = wait_for_idle(session.args.settle)
    print(f"coll_bench: {world} ranks, round {index + 1} (CPUs {idle:.0%} busy before)",
          file=sys.stderr, flush=True)
    start, cpu_before = time.monotonic(), cpu_seconds()
    placement = [placement_ns(session.build)]
    launchers = []
    torch_backends = [b for b in session.backends if b in TORCH_BACKENDS]
    if torch_backends:
        launchers.append(("torch", lambda: launch_torch(session, world, torch_backends, index)))
    for b in session.backends:
        if b not in TORCH_BACKENDS:
            launchers.append((b, lambda b=b: launch_c(session, b, world, index)))
    shift = index % len(launchers) if launchers else 0
    launchers = launchers[shift:] + launchers[:shift]
    rows, times = [], {}
    for name, fn in launchers:
        t0 = time.monotonic()
        got = fn()
        times[name] = round(time.monotonic() - t0, 1)
        for r in got:
            r["round"] = index
        rows += got
    placement.append(placement_ns(session.build))
    return {"world": world, "round": index, "placement_ns": placement, "launch_s": times,
            "load": other_load(cpu_before, cpu_seconds(), time.monotonic() - start),
            "rows": rows}


# ------------------------------------------------------------------------------------------------
# Summaries, the table, the plots

def summarize(rounds):
    """One row per (op, world, bytes, backend): median over rounds of the per-round medians."""
    acc = {}
    for rd in rounds:
        for r in rd["rows"]:
            key = (r["op"], r["world"], r["bytes"], r["backend"])
            a = acc.setdefault(key, {"medians": [], "mins": [], "wrong": 0, "iters": [],
                                     "reps": []})
            a["medians"].append(statistics.median(r["times_us"]))
            a["mins"].append(min(r["times_us"]))
            a["wrong"] = None if r["wrong"] is None else a["wrong"] + r["wrong"]
            a["iters"].append(r["iters"])
            a["reps"].append(r["reps"])
    rows = []
    for (op, world, nbytes, backend), a in sorted(
            acc.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1], kv[0][2],
                                         BACKENDS.index(kv[0][3]))):
        t = statistics.median(a["medians"])
        algbw = nbytes / (t * 1e3) if t > 0 else 0.0  # GB/s
        spread = (max(a["medians"]) / min(a["medians"])
                  if len(a["medians"]) > 1 and min(a["medians"]) > 0 else None)
        rows.append({"op": op, "world": world, "bytes": nbytes, "backend": backend,
                     "reference": backend in REFERENCES,
                     "time_us": t, "time_us_min": min(a["mins"]),
                     "time_us_rounds": a["medians"], "spread": spread, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * busbw_factor(op, world), "wrong": a["wrong"],
                     "iters": a["iters"], "reps": a["reps"],
                     "oversubscribed": world > (os.cpu_count() or 1)})
    return rows


def wrong_total(rows):
    """Wrong elements over rows; a reference's rows (wrong None: not checked) count nothing. A
    checked backend's row without a check result is an error, never a silent 0."""
    total = 0
    for r in rows:
        if r["backend"] in REFERENCES:
            continue
        if r["wrong"] is None:
            raise RuntimeError(f"coll_bench: {r['backend']} {r['op']} {r['bytes']} B has no "
                               "correctness result")
        total += r["wrong"]
    return total


def targets(rows):
    """Per (op, world, bytes): ucx-noop, its limit 1.2 x cpp + 1 us and verdict, and each
    backend's spread between rounds with its verdict (checks.target records)."""
    by = {}
    for r in rows:
        by.setdefault((r["op"], r["world"], r["bytes"]), {})[r["backend"]] = r
    out = []
    for (op, world, nbytes), cell in by.items():
        t = {b: c["time_us"] for b, c in cell.items()}
        share = t["ucx"] - t["noop"] if "ucx" in t and "noop" in t else None
        limit = (SHARE_FACTOR * t["commux-cpp"] + SHARE_SLACK_US if "commux-cpp" in t
                 else None)
        out.append({
            "op": op, "world": world, "bytes": nbytes, "ucx_minus_noop_us": share,
            "share": checks.target("ucx-noop <= 1.2 x cpp + 1 us", share, limit,
                                   lambda have, lim: have <= lim,
                                   "ucx-noop {have:.2f} us against {limit:.2f} us"),
            "spread": {b: checks.target("spread between rounds <= 1.5x", c["spread"],
                                        SPREAD_LIMIT, lambda have, lim: have <= lim,
                                        "{have:.2f}x against {limit}x")
                       for b, c in cell.items()}})
    return out


def target_summary(found):
    """The run's verdicts, one line per target: how many met, and the misses counted by op (the
    share) or by backend with the worst (the spread); the table and results.json have each."""
    lines = []
    share = [f for f in found if f["share"]["status"] != "not measured"]
    if share:
        missed = {}
        for f in share:
            n = missed.setdefault(f["op"], [0, 0])
            n[1] += 1
            n[0] += f["share"]["status"] == "missed"
        by_op = ", ".join(f"{op} {m} of {n}" for op, (m, n) in missed.items() if m)
        met = sum(f["share"]["status"] == "met" for f in share)
        lines.append(f"ucx-noop <= {SHARE_FACTOR} x cpp + {SHARE_SLACK_US:g} µs: met at {met} of "
                     f"{len(share)} (op, size, ranks)" + (f"; missed: {by_op}" if by_op else ""))
    spread = [(f, b, v) for f in found for b, v in f["spread"].items()
              if v["status"] != "not measured"]
    if spread:
        parts = []
        for b in BACKENDS:
            mine = [(v["value"], f) for f, c, v in spread if c == b]
            bad = [(x, f) for x, f in mine if x > SPREAD_LIMIT]
            if bad:
                x, f = max(bad, key=lambda t: t[0])
                parts.append(f"{SHORT[b]} {len(bad)} of {len(mine)} (worst {x:.2f}x, {f['op']} "
                             f"{size_name(f['bytes']) if f['bytes'] else '0'})")
        met = sum(v["status"] == "met" for _, _, v in spread)
        lines.append(f"spread between rounds <= {SPREAD_LIMIT}x: met at {met} of {len(spread)} "
                     "(op, size, backend)" + (f"; missed: {', '.join(parts)}" if parts else ""))
    return lines


def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 100 else f"{v:.2f}"


def fmt_bw(v):
    return "-" if v is None else (f"{v:.2f}" if v >= 0.01 else f"{v:.4f}")


def world_label(world):
    over = world > (os.cpu_count() or 1)
    return f"{world} ranks" + (f" (oversubscribed: {os.cpu_count()} CPUs)" if over else "")


def table(rows, backends, ops, worlds):
    out = []
    by = {(r["op"], r["world"], r["bytes"], r["backend"]): r for r in rows}
    found = {(f["op"], f["world"], f["bytes"]): f for f in targets(rows)}
    ratios = [(a, b) for a, b in RATIOS if a in backends and b in backends]
    timed = [b for b in backends if b not in REFERENCES]  # busbw and #wrong: the real ones
    share = "ucx" in backends and "noop" in backends
    limit = "commux-cpp" in backends and share
    for op in ops:
        for world in worlds:
            sizes = sorted({r["bytes"] for r in rows if r["op"] == op and r["world"] == world})
            if not sizes:
                continue
            f = busbw_factor(op, world)
            out += [f"### {op}, {world_label(world)}" + (
                f" — busbw = algbw × {f:.2f}" if op != "barrier" else ""), ""]
            head = ["bytes"] + [f"{SHORT[b]} µs" for b in backends]
            if op != "barrier":
                head += [f"{SHORT[b]} busbw GB/s" for b in timed]
            head += [f"{SHORT[a]}/{SHORT[b]}" for a, b in ratios]
            head += ["ucx−noop µs"] if share else []
            head += [f"ucx−noop ≤ {SHARE_FACTOR}×cpp+{SHARE_SLACK_US:g}µs"] if limit else []
            head += ["spread " + "/".join(SHORT[b] for b in backends), "#wrong"]
            out += report.header(head)
            for s in sizes:
                cell = {b: by.get((op, world, s, b)) for b in backends}
                t = {b: (c["time_us"] if c else None) for b, c in cell.items()}
                got = found[(op, world, s)]
                cells = [size_name(s) if s else "0"] + [fmt_us(t[b]) for b in backends]
                if op != "barrier":
                    cells += [fmt_bw(cell[b]["busbw_gbps"] if cell[b] else None)
                              for b in timed]
                cells += [report.fmt(report.ratio(t[a], t[b]), 2) for a, b in ratios]
                cells += [fmt_us(got["ucx_minus_noop_us"])] if share else []
                cells += [verdict(got["share"])] if limit else []
                cells.append(" / ".join(fmt_spread(got["spread"].get(b)) for b in backends))
                cells.append(checks.wrong_cell({SHORT[b]: c["wrong"] for b, c in cell.items()
                                                if c and b not in REFERENCES}, only_wrong=True))
                out.append(report.row(cells))
            out.append("")
    return "\n".join(out)


def verdict(record):
    return {"met": "met", "missed": "**missed**"}.get(record["status"], "-")


def fmt_spread(record):
    """A backend's spread between rounds, in bold past the limit; "-" with one round."""
    if record is None or record["status"] == "not measured":
        return "-"
    v = f"{record['value']:.2f}"
    return v if record["status"] == "met" else f"**{v}**"


def plots(rows, backends, ops, worlds, out_dir):
    """One grid per world size: time against bytes (log-log), one line per backend."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: no plots"
    paths = []
    styles = {"ucx": ("tab:blue", "o"), "noop": ("tab:gray", "x"), "gloo": ("tab:orange", "s"),
              "mpi": ("tab:green", "^"), "commux-cpp": ("tab:purple", "D")}
    for world in worlds:
        wrows = [r for r in rows if r["world"] == world]
        wops = [op for op in ops if any(r["op"] == op for r in wrows)]
        if not wops:
            continue
        cols = min(4, len(wops))
        nrows = (len(wops) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
        for ax in axes.flat[len(wops):]:
            ax.set_visible(False)
        for ax, op in zip(axes.flat, wops):
            if op == "barrier":
                present = [b for b in backends if any(r["op"] == op and r["backend"] == b
                                                      for r in wrows)]
                vals = [next(r["time_us"] for r in wrows if r["op"] == op and r["backend"] == b)
                        for b in present]
                ax.bar([SHORT[b] for b in present], vals,
                       color=[styles[b][0] for b in present])
                ax.set_yscale("log")
                ax.set_ylabel("µs")
            else:
                for b in backends:
                    pts = sorted((r["bytes"], r["time_us"]) for r in wrows
                                 if r["op"] == op and r["backend"] == b)
                    if pts:
                        color, marker = styles[b]
                        ax.plot(*zip(*pts), marker=marker, color=color, label=b, markersize=4)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("bytes per rank")
                ax.set_ylabel("time µs")
                ax.legend(fontsize=7)
            ax.set_title(op, fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
        fig.suptitle(f"commux collectives, {world_label(world)} (median time, lower is better)",
                     fontsize=11)
        fig.tight_layout()
        path = Path(out_dir) / f"coll_w{world}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths, None


def environment(session):
    info = {"date": probe.now(), "sources": probe.source_version(), **probe.host(),
            "env": probe.settings()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    if "ucx" in session.backends:
        info.update(probe.commux_package())
    cpp = session.info.get("commux-cpp", {})
    if cpp:
        info["ucx_version"] = cpp.get("ucx_version")
        info["ucx_transports"] = cpp.get("transports")
    if session.info.get("mpi"):
        info["mpi_library"] = session.info["mpi"].get("mpi_library")
    return info


def placement_line(rounds):
    parts = []
    for r in rounds:
        ns = [p for p in r["placement_ns"] if p is not None]
        kind = placement_kind(ns) or "?"
        parts.append(f"{r['world']} ranks round {r['round'] + 1}: "
                     f"{' -> '.join(f'{p:.0f}' for p in ns) or '?'} ns ({kind}), other "
                     f"processes {r['load']['others_cores']:.2f} cores")
    return "; ".join(parts)


def markdown(session, env, rows, rounds, notes, plot_paths, elapsed):
    a = session.args
    backends = [b for b in session.backends if any(r["backend"] == b for r in rows)]
    p = session.plan
    out = [
        "# Collectives benchmark (nccl-tests style): " + ", ".join(backends), "",
        f"- {env['date']}, sources {env['sources']}, torch {env.get('torch', '?')}, commux "
        f"{env.get('commux', '?')}, UCX {env.get('ucx_version', '?')} "
        f"({env.get('ucx_transports', '?')}), MPI: {env.get('mpi_library', 'not run')}",
        f"- {env['cpus']} CPUs; world sizes {', '.join(world_label(w) for w in a.worlds)}; "
        f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', 'lo')}; "
        f"{'quick mode; ' if a.quick else ''}{a.rounds} round(s) per world size, "
        f"{elapsed:.0f} s in all",
        f"- placement (CPU 0<->1 handoff before -> after each round): {placement_line(rounds)}",
        "- ucx, noop, gloo: torch.distributed (one launch, interleaved per size); noop: the "
        "reference, a C++ backend that communicates nothing (torch's own cost per call; not "
        "checked, not in #wrong); mpi: Open MPI's collectives (mpi_coll); cpp: commux's C++ "
        "collectives (commux_coll_bench)",
        "- time: median over repetitions (each the slowest rank's mean over back-to-back "
        "iterations), median over rounds; bytes: per-rank buffer (allgather output, "
        "reduce_scatter input); float32 SUM, root 0; p2p: ring isend/irecv",
        f"- plan: {p['reps']} repetitions (>= {p['min_reps']}), {p['rep_bytes'] >> 20} MiB per "
        f"repetition in {p['min_iters']} .. {p['max_iters']} iterations, about "
        f"{p['budget_ms']} ms per (op, size, backend)",
        "- ratios: time / time (below 1: the first is faster); #wrong: wrong elements in the "
        "checked operation, all ranks and rounds",
        f"- targets (reported, never a failure): ucx−noop (commux's share of a torch-level "
        f"call) ≤ {SHARE_FACTOR} × cpp + {SHARE_SLACK_US:g} µs; spread (each backend's max / "
        f"min over rounds of its per-round time) ≤ {SPREAD_LIMIT}x, in bold past it, - with "
        "one round",
    ]
    out += [f"- note: {n}" for n in notes]
    if plot_paths:
        out.append("- plots: " + ", ".join(Path(x).name for x in plot_paths))
    out += ["", table(rows, backends, a.ops, a.worlds)]
    out += [f"Target: {line}." for line in target_summary(targets(rows))]
    checked = [SHORT[b] for b in backends if b not in REFERENCES]
    out.append(f"Correctness: {wrong_total(rows)} wrong elements ({', '.join(checked)} checked"
               + ("; noop, the reference, computes nothing and is not checked)."
                  if "noop" in backends else ")."))
    out += [f"Failure: {e.splitlines()[-1] if e.splitlines() else e}" for e in session.errors]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# Command line

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3 sizes, few iterations, world size 2, one round (< 1 min)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default all)")
    p.add_argument("--worlds", help="comma-separated world sizes (default 2,4; 2 with --quick)")
    p.add_argument("--backends", help=f"comma-separated, of {','.join(BACKENDS)} (default: the "
                                      "available ones)")
    p.add_argument("--max-bytes", help="largest size (e.g. 1M; default 64M)")
    p.add_argument("--sizes", help="explicit comma-separated sizes (e.g. 8,4K,1M)")
    p.add_argument("--rounds", type=int, help="rounds per world size (default 2, 1 with --quick)")
    p.add_argument("--settle", type=float, default=10, metavar="SEC",
                   help="before each round, wait up to SEC for other processes to go idle")
    p.add_argument("--op-timeout", type=int, default=OP_TIMEOUT_S, metavar="SEC",
                   help="torch process-group timeout of every operation")
    p.add_argument("--launch-timeout", type=int, default=LAUNCH_TIMEOUT_S, metavar="SEC",
                   help="deadline of one launch of ranks (they are killed after it)")
    p.add_argument("--build", default=str(REPO / "build"),
                   help="build dir with bench/mpi_coll, bench/commux_coll_bench, "
                        "bench/commux_bench")
    p.add_argument("--out", default=str(REPO / "results" / "coll"), help="output directory")
    args = p.parse_args(argv)
    args.ops = parse_list(p, "--ops", args.ops, OPS)
    try:
        args.worlds = sorted({int(x) for x in (args.worlds or ("2" if args.quick else "2,4"))
                              .split(",") if x.strip()})
        sizes = ([parse_size(x) for x in args.sizes.split(",") if x.strip()] if args.sizes
                 else list(QUICK_SIZES if args.quick else SIZES))
        max_bytes = parse_size(args.max_bytes) if args.max_bytes else None
    except ValueError as e:
        p.error(f"bad number: {e}")
    if not args.worlds or any(not 2 <= w <= 16 for w in args.worlds):
        p.error("--worlds: world sizes from 2 to 16")
    if max_bytes is not None:
        sizes = [s for s in sizes if s <= max_bytes]
    if not sizes or any(s <= 0 for s in sizes):
        p.error("no sizes left (check --sizes / --max-bytes)")
    args.sizes = sorted(set(sizes))
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return p, args


def available(build):
    """{backend: None if it can run, else why not}."""
    why = {}
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        why["gloo"] = None if dist.is_gloo_available() else "torch has no gloo"
    except ImportError:
        why["gloo"] = "torch is not installed"
    try:
        import commux  # noqa: F401
        why["ucx"] = None  # commux imports torch itself
        why["noop"] = (None if hasattr(commux._C, "_NoopBackend") else
                       f"{commux.__file__}: commux._C has no _NoopBackend (an older build)")
    except ImportError as e:
        why["ucx"] = why["noop"] = f"import commux failed ({e})"
    mpi = Path(build) / "bench" / "mpi_coll"
    why["mpi"] = ("mpirun is not installed" if shutil.which("mpirun") is None else
                  None if mpi.exists() else f"{mpi} is not built (MPI not found by CMake?)")
    cpp = Path(build) / "bench" / "commux_coll_bench"
    why["commux-cpp"] = None if cpp.exists() else f"{cpp} is not built"
    return why


def main(argv):
    parser, args = parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    why = available(args.build)
    notes = []
    if args.backends:
        backends = parse_list(parser, "--backends", args.backends, BACKENDS)
        missing = [f"{b}: {why[b]}" for b in backends if why[b]]
        if missing:
            parser.error("backends not available: " + "; ".join(missing))
    else:
        backends = [b for b in BACKENDS if not why[b]]
        notes += [f"{b} left out: {why[b]}" for b in BACKENDS if why[b]]
        if not backends:
            parser.error("no backend is available")
    if "noop" in backends and not any(b in backends for b in ("ucx", "gloo")):
        parser.error("--backends: noop is a reference that communicates nothing: run it beside "
                     "ucx or gloo")
    for n in notes:
        print(f"coll_bench: note: {n}", file=sys.stderr)
    over = [w for w in args.worlds if w > (os.cpu_count() or 1)]
    if over:
        notes.append(f"world size(s) {','.join(map(str, over))} oversubscribe the "
                     f"{os.cpu_count()} CPUs: fine for correctness and ratios, not for absolute "
                     "figures")
    session = Session(args, backends)
    start = time.monotonic()
    rounds = [one_round(session, w, i) for w in args.worlds for i in range(args.rounds)]
    elapsed = time.monotonic() - start
    rows = summarize(rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_paths, plot_note = plots(rows, backends, args.ops, args.worlds, out)
    if plot_note:
        notes.append(plot_note)
    env = environment(session)
    md = markdown(session, env, rows, rounds, notes, plot_paths, elapsed)
    data = {"environment": env, "backends": backends, "ops": args.ops, "worlds": args.worlds,
            "sizes": args.sizes, "quick": args.quick, "plan": session.plan,
            "rounds": [{k: v for k, v in r.items() if k != "rows"} for r in rounds],
            "rows": rows, "targets": targets(rows),
            "raw": [row for r in rounds for row in r["rows"]],
            "notes": notes, "errors": session.errors, "plots": plot_paths,
            "elapsed_s": elapsed}
    report.write(out, data, md, "\n".join(session.log) + "\n")
    print(md)
    n_wrong = wrong_total(rows)
    if n_wrong:
        print(f"coll_bench: {n_wrong} wrong elements", file=sys.stderr)
    return 1 if n_wrong or session.errors else 0

