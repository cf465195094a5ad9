"""Multi-tensor ping-pong through torch.distributed backend "ucx": how V tensors per message travel.

    python bench/vtensor_pingpong.py [--quick] [--rounds N] [--vs LIST] [--sizes LIST]
                                     [--settle SEC] [--out DIR]

Two ranks. Rank 0 sends V uint8 tensors (V = 1, 2, 4, 16; 8 B, 4 KiB, 64 KiB each) to rank 1,
which receives them and sends the same tensors back. Configurations, side by side in one run:

  loop            V dist.isend (tag k for tensor k), waited together; V dist.irecv likewise
  list            one pg.send(list_of_V_tensors, dst, tag) / pg.recv(list, src, tag) on the
                  backend object (_get_default_group()._get_backend(cpu)): one logical message
  list+COALESCE   the same with COMMUX_COALESCE=1: the list travels as one UCX message (IOV)
  batch           dist.batch_isend_irecv of V P2POps (torch's coalescing window)
  batch+GROUP     the same with COMMUX_GROUP=1: the window defers the posts and flushes them
                  together (a commux without it ignores the variable: the run stays correct)

The environment variables are read when a process group is created, so each rank creates one group
per setting (COMMUX_COALESCE=1 and COMMUX_GROUP=1 set only while new_group runs) and all five
configurations run in the same launch, interleaved per (V, size), their order alternating. The
VM's small-message latency differs from launch to launch (see the README), so only same-launch
comparisons are meaningful. Each iteration is timed on rank 0 (one-way = half the round trip;
median over iterations, then over rounds). Every iteration's echo is compared byte for byte with
what was sent (payloads change every iteration; receive buffers are zeroed first): #wrong counts
wrong bytes.

Writes results.json and table.md to --out (default results/vtensor/). Exit status 1 when a byte
was wrong or a launch failed. UCX_NET_DEVICES=lo unless set.
"""
import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

from bench.lib import REPO, probe, report
from bench.lib.launch import launch_ranks
from bench.lib.machine import cpu_seconds, other_load, placement_ns, wait_for_idle
from bench.lib.sizes import parse_size, size_name

VS = [1, 2, 4, 16]
SIZES = [8, 4 << 10, 64 << 10]
QUICK_VS = [1, 4]
QUICK_SIZES = [8, 64 << 10]
CONFIGS = ["loop", "list", "list+COALESCE", "batch", "batch+GROUP"]
# The launch environment: None unsets a variable the caller may have set (the groups that need
# one set it themselves while they are created).
LAUNCH_ENV = {"COMMUX_COALESCE": None, "COMMUX_GROUP": None}
# The setting each configuration's group is created with.
SETTING = {"list+COALESCE": "COMMUX_COALESCE", "batch+GROUP": "COMMUX_GROUP"}
REP_BYTES, MIN_ITERS, MAX_ITERS = 8 << 20, 40, 500
QUICK_REP_BYTES, QUICK_MIN_ITERS, QUICK_MAX_ITERS = 1 << 20, 10, 60
LAUNCH_TIMEOUT_S = 300


def iterations(v, size, quick):
    rep, lo, hi = ((QUICK_REP_BYTES, QUICK_MIN_ITERS, QUICK_MAX_ITERS) if quick
                   else (REP_BYTES, MIN_ITERS, MAX_ITERS))
    iters = max(lo, min(hi, rep // (v * size)))
    return iters, max(2, iters // 10)


# ------------------------------------------------------------------------------------------------
# Inside a rank

def transfer(mode, group, pg, tensors, peer, sending):
    """One direction of one iteration: all V tensors to (or from) peer, waited for. `group` is
    the configuration's process group, `pg` its CPU backend object."""
    import torch.distributed as dist
    base = mode.split("+")[0]
    if base == "list":
        work = pg.send(tensors, peer, 7) if sending else pg.recv(tensors, peer, 7)
        work.wait()
    elif base == "loop":
        fn = dist.isend if sending else dist.irecv
        reqs = [fn(t, peer, group=group, tag=k) for k, t in enumerate(tensors)]
        for r in reqs:
            r.wait()
    else:  # batch
        fn = dist.isend if sending else dist.irecv
        reqs = dist.batch_isend_irecv([dist.P2POp(fn, t, peer, group=group, tag=k)
                                       for k, t in enumerate(tensors)])
        for r in reqs:
            r.wait()


def pingpong(mode, group, pg, rank, v, size, iters, warmup):
    """Returns (one-way µs per timed iteration, wrong bytes), on rank 0."""
    import torch
    n_total = warmup + iters
    if rank == 1:
        bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(v)]
        for _ in range(n_total):
            transfer(mode, group, pg, bufs, 0, sending=False)
            transfer(mode, group, pg, bufs, 0, sending=True)
        return [], 0
    ramp = torch.arange(size, dtype=torch.int64)
    sent = [((ramp + 37 * k) % 251).to(torch.uint8) for k in range(v)]
    back = [torch.empty(size, dtype=torch.uint8) for _ in range(v)]
    times, wrong = [], 0
    clock = time.perf_counter
    for i in range(n_total):
        for t in sent:
            t.add_(1)  # every byte differs from the previous iteration's
        for t in back:
            t.fill_(0)
        t0 = clock()
        transfer(mode, group, pg, sent, 1, sending=True)
        transfer(mode, group, pg, back, 1, sending=False)
        t1 = clock()
        for s, b in zip(sent, back):
            if not torch.equal(s, b):
                wrong += int((s != b).sum())
        if i >= warmup:
            times.append((t1 - t0) / 2 * 1e6)
    return times, wrong


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux
    commux.register()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("ucx", init_method="env://",
                            timeout=datetime.timedelta(seconds=job["op_timeout_s"]))
    cpu = torch.device("cpu")
    groups = {}
    for mode in job["modes"]:
        var = SETTING.get(mode)
        if var is None:
            groups[mode] = dist.distributed_c10d._get_default_group()
            continue
        os.environ[var] = "1"  # read when the group is created
        try:
            groups[mode] = dist.new_group(backend="ucx")
        finally:
            os.environ.pop(var, None)
    rows = []
    k = 0
    for v in job["vs"]:
        for size in job["sizes"]:
            iters, warmup = iterations(v, size, job["quick"])
            modes = job["modes"] if (job["round"] + k) % 2 == 0 else job["modes"][::-1]
            k += 1
            for mode in modes:
                g = groups[mode]
                times, wrong = pingpong(mode, g, g._get_backend(cpu), rank, v, size, iters,
                                        warmup)
                rows.append({"config": mode, "v": v, "size": size, "iters": iters,
                             "warmup": warmup, "wrong": wrong,
                             "median_us": statistics.median(times) if times else None,
                             "min_us": min(times) if times else None})
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


# ------------------------------------------------------------------------------------------------
# The parent

def one_round(args, index, errors):
    idle = wait_for_idle(args.settle)
    print(f"vtensor_pingpong: round {index + 1} (CPUs {idle:.0%} busy before)", file=sys.stderr,
          flush=True)
    start, cpu_before = time.monotonic(), cpu_seconds()
    placement = [placement_ns(args.build)]
    rows = []
    job = {"vs": args.vs, "sizes": args.sizes, "modes": CONFIGS, "round": index,
           "quick": args.quick, "op_timeout_s": 60, "env": LAUNCH_ENV}
    results, errs = launch_ranks(2, run_rank, job, LAUNCH_TIMEOUT_S,
                                    f"vtensor round {index + 1}")
    errors += errs
    for e in errs:
        print(f"vtensor_pingpong: {e}", file=sys.stderr, flush=True)
    if 0 in results and 1 in results:
        for r0, r1 in zip(results[0]["rows"], results[1]["rows"]):
            rows.append(dict(r0, wrong=r0["wrong"] + r1["wrong"], round=index))
    placement.append(placement_ns(args.build))
    return {"round": index, "placement_ns": placement, "rows": rows,
            "load": other_load(cpu_before, cpu_seconds(), time.monotonic() - start)}


def summarize(rounds):
    acc = {}
    for r in rounds:
        for row in r["rows"]:
            a = acc.setdefault((row["config"], row["v"], row["size"]),
                               {"medians": [], "wrong": 0, "iters": row["iters"]})
            if row["median_us"] is not None:
                a["medians"].append(row["median_us"])
            a["wrong"] += row["wrong"]
    return [{"config": c, "v": v, "size": s, "bytes_per_message": v * s,
             "time_us": statistics.median(a["medians"]) if a["medians"] else None,
             "time_us_rounds": a["medians"], "iters": a["iters"], "wrong": a["wrong"]}
            for (c, v, s), a in sorted(acc.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                     CONFIGS.index(kv[0][0])))]


def table(rows, vs, sizes):
    by = {(r["config"], r["v"], r["size"]): r for r in rows}
    head = ["V", "bytes/tensor"] + [f"{c} µs" for c in CONFIGS] + [
        "list/loop", "COALESCE/list", "GROUP/batch", "#wrong"]
    lines = report.header(head)
    for v in vs:
        for s in sizes:
            t = {c: (by[(c, v, s)]["time_us"] if (c, v, s) in by else None) for c in CONFIGS}
            wrong = sum(by[(c, v, s)]["wrong"] for c in CONFIGS if (c, v, s) in by)
            fmt, ratio = report.fmt, report.ratio
            cells = [str(v), size_name(s)] + [fmt(t[c], 2) for c in CONFIGS] + [
                fmt(ratio(t["list"], t["loop"]), 2),
                fmt(ratio(t["list+COALESCE"], t["list"]), 2),
                fmt(ratio(t["batch+GROUP"], t["batch"]), 2), str(wrong)]
            lines.append(report.row(cells))
    return "\n".join(lines)


def markdown(args, info, rounds, rows, errors, elapsed):
    place = "; ".join(
        f"round {r['round'] + 1}: " + " -> ".join(f"{p:.0f}" for p in r["placement_ns"]
                                                   if p is not None) + " ns" for r in rounds)
    out = ["# V-tensor ping-pong, torch.distributed backend \"ucx\", 2 ranks", "",
           f"- {info['date']}, sources {info['sources']}, torch {info['torch']}, commux "
           f"{info['commux']}; UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}; "
           f"{'quick mode; ' if args.quick else ''}{len(rounds)} round(s), {elapsed:.0f} s",
           f"- placement (CPU 0<->1 handoff before -> after): {place}",
           "- one-way µs: half the round trip of V tensors there and back (median over "
           "iterations, then over rounds); loop: V isend/irecv; list: one pg.send/recv of the "
           "list; batch: batch_isend_irecv; +COALESCE / +GROUP: a group created with "
           "COMMUX_COALESCE=1 / COMMUX_GROUP=1, in the same launch",
           "- the installed commux mentions: " + ", ".join(
               f"{k} {'yes' if v else 'no (the variable is set but has no effect)'}"
               for k, v in info["knows"].items()),
           "- ratios below 1: the first is faster; #wrong: wrong bytes in the echoes, all "
           "configurations and rounds", "", table(rows, args.vs, args.sizes), ""]
    out.append(f"Correctness: {sum(r['wrong'] for r in rows)} wrong bytes.")
    out += [f"Failure: {e.strip().splitlines()[-1]}" for e in errors]
    return "\n".join(out) + "\n"


def knows_variables(commux):
    """{variable: whether the installed commux's libraries mention it} (COMMUX_GROUP is new)."""
    root = Path(commux.__file__).parent
    blobs = [p.read_bytes() for p in list(root.glob("*.so")) + list(root.glob("lib/*.so*"))
             if p.is_file()]
    return {v: any(v.encode() in b for b in blobs) for v in ("COMMUX_COALESCE", "COMMUX_GROUP")}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="V 1,4; 8 B and 64 KiB; few iterations")
    p.add_argument("--rounds", type=int, help="rounds (default 2, 1 with --quick)")
    p.add_argument("--vs", help="tensors per message (default 1,2,4,16)")
    p.add_argument("--sizes", help="bytes per tensor (default 8,4K,64K)")
    p.add_argument("--settle", type=float, default=10, metavar="SEC",
                   help="before each round, wait up to SEC for other processes to go idle")
    p.add_argument("--build", default=str(REPO / "build"),
                   help="build dir with bench/commux_bench (placement indicator)")
    p.add_argument("--out", default=str(REPO / "results" / "vtensor"), help="output directory")
    args = p.parse_args(argv)
    try:
        args.vs = [int(x) for x in args.vs.split(",")] if args.vs else (
            QUICK_VS if args.quick else VS)
        args.sizes = ([parse_size(x) for x in args.sizes.split(",")] if args.sizes
                      else (QUICK_SIZES if args.quick else SIZES))
    except ValueError as e:
        p.error(f"bad number: {e}")
    if any(v < 1 for v in args.vs) or any(s < 1 for s in args.sizes):
        p.error("V and sizes must be >= 1")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv):
    args = parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        import commux
        import torch
    except ImportError as e:
        print(f"vtensor_pingpong: needs torch and commux ({e}); run scripts/install.sh",
              file=sys.stderr)
        return 1
    info = {"date": probe.now(), "sources": probe.source_version(), "torch": torch.__version__,
            "commux": commux.__version__, "knows": knows_variables(commux)}
    errors = []
    start = time.monotonic()
    rounds = [one_round(args, i, errors) for i in range(args.rounds)]
    elapsed = time.monotonic() - start
    rows = summarize(rounds)
    md = markdown(args, info, rounds, rows, errors, elapsed)
    data = {"info": info, "vs": args.vs, "sizes": args.sizes, "quick": args.quick,
            "configs": CONFIGS, "rows": rows,
            "rounds": [{k: v for k, v in r.items()} for r in rounds], "errors": errors,
            "elapsed_s": elapsed}
    report.write(Path(args.out), data, md)
    print(md)
    n_wrong = sum(r["wrong"] for r in rows)
    missing = [c for c in CONFIGS if not any(r["config"] == c for r in rows)]
    if missing and not errors:
        errors.append(f"no rows for {', '.join(missing)}")
    return 1 if n_wrong or errors else 0

