"""CUDA benchmark of commux: two ranks on one GPU, p2p bandwidth against a device-to-device copy,
and allreduce against Gloo, on CUDA tensors, every result checked.

    python bench/cuda_bench.py [--device cuda|cuda:N|cpu] [--quick] [--sections p2p,allreduce]
                               [--sizes LIST] [--max-bytes N] [--window N] [--reps N]
                               [--budget-ms MS] [--out DIR]

Two ranks, both on the same device (default cuda:0, e.g. one H200, where UCX carries the data with
cuda_ipc), started by this script (torch.multiprocessing, spawn; MASTER_ADDR 127.0.0.1 and a free
port; every rank has a watchdog and the launch a deadline: see bench/lib/launch.py). Each
section is its own launch, so a failure in one still leaves the other's results. Both launches
hold two process groups: the default one on "ucx" (commux) and dist.new_group(backend="gloo").

  p2p        one-way streaming as osu_bw: rank 0 posts a window of W dist.isend of one buffer
             (backend "ucx", tag 1), rank 1 the W matching dist.irecv into one buffer; both wait
             for all, then rank 1 sends a 1-element CPU ack (tag 2) that rank 0 receives. Repeated
             `iters` times per repetition; bandwidth = W * size * iters / time on rank 0 (wall
             clock from after torch.cuda.synchronize() and a barrier to after the last ack and a
             synchronize). Sizes 1 MiB .. 1 GiB in x4 steps; W = min(64, 4 GiB / size) (so a
             window never holds more than 4 GiB; --window caps it). Beside it, on rank 0 while
             rank 1 waits, the reference: dst.copy_(src) of the same size on the same device,
             timed with CUDA events over back-to-back copies (with --device cpu: a memcpy timed
             with the wall clock). Both bandwidths count the bytes once (GB/s = 1e9 bytes per
             second of `size` payload; a copy reads and writes, so memory traffic is twice that);
             the ratio p2p/copy is what the target is about.
  allreduce  dist.all_reduce(SUM) of float32, 1 MiB .. 256 MiB in x4 steps, on the "ucx" group
             and on the gloo group, same tensors, same device, interleaved per size (the order
             alternates with the size). Per repetition `iters` back-to-back operations between
             torch.cuda.synchronize() calls, after a barrier; a repetition's time is the slowest
             rank's. gloo/ucx = gloo's time / ucx's (higher: commux faster).

Timings: a warm-up, then the iteration count fitted so that one repetition takes about
--budget-ms (rank 0's estimate, shared through gloo), --reps repetitions; a row shows the median
over repetitions (and the best for p2p).

Correctness, every run: p2p payloads are byte patterns (a pseudo-random 1 MiB row plus a constant
per row and message) that depend on the byte index and the message (the checked message has
another pattern than the timed ones). Rank 1 poisons its buffer (0xA5) before the timed windows
and checks every byte after them, then poisons it again and checks one more message with a fresh
pattern. Allreduce inputs are integer-valued (exact in float32); after the timed repetitions each
backend runs one more operation on fresh inputs whose every element is compared with the expected
sum on every rank. #wrong counts wrong bytes (p2p; the reference copy is checked too) and elements
(allreduce); any wrong result, or a launch that failed, gives exit status 1.

Targets (CUDA on an H200, two ranks on one GPU through cuda_ipc): p2p at 256 MiB >= 0.7 x the
device-to-device copy; allreduce of 64 MiB: gloo/ucx >= 5. They are printed and recorded
(results.json "targets"); a missed target is reported, not an error. With --device cpu (the smoke
run on a machine without a GPU) they are informational.

UCX settings: with --device cpu, UCX_NET_DEVICES=lo unless set (as the other benchmarks); on a GPU
the UCX environment is left as it is (no UCX_TLS; commux applies its own defaults).

Writes results.json and table.md to --out (default results/cuda/) and prints the table.
"""
import argparse
import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path

from bench.lib import REPO, probe, report
from bench.lib.launch import launch_ranks
from bench.lib.sizes import parse_list, parse_size, size_name as _size_name
MiB, GiB = 1 << 20, 1 << 30
P2P_SIZES = [MiB << (2 * k) for k in range(6)]       # 1 MiB, 4 MiB, ..., 1 GiB
AR_SIZES = [MiB << (2 * k) for k in range(5)]        # 1 MiB, 4 MiB, ..., 256 MiB
QUICK_SIZES = {"cuda": ([MiB, 16 * MiB, 256 * MiB], [MiB, 64 * MiB]),  # the target sizes
               "cpu": ([MiB, 4 * MiB], [MiB, 4 * MiB])}
SECTIONS = ["p2p", "allreduce"]
MAX_WINDOW = 64
WINDOW_BYTES = {"cuda": 4 * GiB, "cpu": 64 * MiB}     # a window holds at most this much
PLANS = {  # reps: timed repetitions; budget_ms: one repetition's target length
    "full": {"reps": 3, "budget_ms": 200, "max_iters": 200},
    "quick": {"reps": 2, "budget_ms": 20, "max_iters": 20},
}
AR_MAX_ITERS = 100     # back-to-back in-place sums double the values: 2^100 * 2042 < float32 max
TAG_DATA, TAG_ACK, TAG_CHECK = 1, 2, 3
POISON = 0xA5
BYTE_ROW = 1 << 20     # a row of the p2p byte pattern
RAMP_ROW = 1021 * 1024  # the allreduce input's period in elements (about 4 MiB of float32)
ROWS_PER_STEP = 64     # rows generated or compared at once (temporaries of 64 to 256 MiB)
TARGET_P2P = {"bytes": 256 * MiB, "min_ratio": 0.7}
TARGET_AR = {"bytes": 64 * MiB, "min_ratio": 5.0}
OP_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 300


def size_name(n):
    return _size_name(n, gib=True)


# ------------------------------------------------------------------------------------------------
# Inside a rank: patterns

def _torch():
    import torch
    import torch.distributed as dist
    return torch, dist


def _rows(n, row):
    """(full rows, tail length) of an n-element buffer cut into rows of `row` elements."""
    return n // row, n % row


_BASE_ROW = {}  # device -> the pattern's base row


def base_row(device):
    """BYTE_ROW pseudo-random bytes, the same in every process (a fixed seed on the CPU)."""
    torch, _ = _torch()
    key = str(device)
    if key not in _BASE_ROW:
        g = torch.Generator().manual_seed(20260)
        _BASE_ROW[key] = torch.randint(0, 256, (BYTE_ROW,), generator=g,
                                       dtype=torch.uint8).to(device)
    return _BASE_ROW[key]


def pattern_rows(r0, r1, salt, device):
    """Rows r0 .. r1-1 of the p2p payload for `salt`, shape (r1 - r0, BYTE_ROW), uint8: byte i is
    (base[i % BYTE_ROW] + 7 (i // BYTE_ROW) + salt) mod 256, with a pseudo-random base row (one
    uint8 add per row, wrapping mod 256). A stale message (another salt) differs in every byte, a
    shifted one in almost every byte, a torn one where it was not written (the receiver poisons)."""
    torch, _ = _torch()
    c = (torch.arange(r0, r1, dtype=torch.int32, device=device) * 7 + salt) % 256
    return base_row(device)[None, :] + c.to(torch.uint8)[:, None]


def _byte_steps(buf):
    """(view, r0, r1) over buf in steps of ROWS_PER_STEP rows; the tail as a 1-row view."""
    full, tail = _rows(buf.numel(), BYTE_ROW)
    rows = buf[:full * BYTE_ROW].view(full, BYTE_ROW)
    for r0 in range(0, full, ROWS_PER_STEP):
        r1 = min(full, r0 + ROWS_PER_STEP)
        yield rows[r0:r1], r0, r1, None
    if tail:
        yield buf[full * BYTE_ROW:].view(1, tail), full, full + 1, tail


def fill_bytes(buf, salt):
    for view, r0, r1, tail in _byte_steps(buf):
        want = pattern_rows(r0, r1, salt, buf.device)
        view.copy_(want if tail is None else want[:, :tail])


def wrong_bytes(buf, salt):
    torch, _ = _torch()
    wrong = torch.zeros((), dtype=torch.int64, device=buf.device)
    for view, r0, r1, tail in _byte_steps(buf):
        want = pattern_rows(r0, r1, salt, buf.device)
        wrong += (view != (want if tail is None else want[:, :tail])).sum()
    return int(wrong)


def ramp_period(salt, device):
    """float32 (7 j + salt) mod 1021 for j < RAMP_ROW: the allreduce input repeats with this
    period (RAMP_ROW is a multiple of 1021). Integers below 1021, so sums of a few are exact."""
    torch, _ = _torch()
    j = torch.arange(RAMP_ROW, dtype=torch.int32, device=device)
    return ((j * 7 + salt) % 1021).to(torch.float32)


def fill_ramp(x, salt, add):
    """x[i] = (7 i + salt) mod 1021 + add."""
    tile = ramp_period(salt, x.device).add_(add)
    full, tail = _rows(x.numel(), RAMP_ROW)
    x[:full * RAMP_ROW].view(full, RAMP_ROW).copy_(tile.expand(full, RAMP_ROW))
    x[full * RAMP_ROW:].copy_(tile[:tail])


def wrong_sum(x, salt, world):
    """Elements of x that differ from the sum over ranks r of ((7 i + salt) mod 1021 + r)."""
    torch, _ = _torch()
    want = ramp_period(salt, x.device).mul_(world).add_(float(world * (world - 1) // 2))
    full, tail = _rows(x.numel(), RAMP_ROW)
    wrong = torch.zeros((), dtype=torch.int64, device=x.device)
    for r0 in range(0, full, ROWS_PER_STEP):
        r1 = min(full, r0 + ROWS_PER_STEP)
        wrong += (x[r0 * RAMP_ROW:r1 * RAMP_ROW].view(r1 - r0, RAMP_ROW) != want).sum()
    wrong += (x[full * RAMP_ROW:] != want[:tail]).sum()
    return int(wrong)


# ------------------------------------------------------------------------------------------------
# Inside a rank: the device, clocks, the shared iteration count

class Dev:
    """The rank's device: synchronize(), and a timer for back-to-back device work."""

    def __init__(self, name):
        torch, _ = _torch()
        self.torch = torch
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {name}: torch {torch.__version__} sees no CUDA "
                                   "device (use --device cpu for the CPU smoke run)")
            torch.cuda.set_device(self.device)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def time_device(self, fn, n):
        """Seconds per call of fn over n back-to-back calls: CUDA events on a GPU (the host does
        not wait between calls), the wall clock on a CPU."""
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n


def shared_iters(gloo, estimate_s, plan, cap):
    """Iterations for one repetition of about plan['budget_ms'], from rank 0's estimate of one
    iteration, broadcast so that every rank runs the same count."""
    torch, dist = _torch()
    budget = plan["budget_ms"] / 1e3
    n = max(1, min(cap, int(budget / estimate_s) if estimate_s > 0 else cap))
    t = torch.tensor([n], dtype=torch.int64)
    dist.broadcast(t, src=0, group=gloo)
    return int(t[0])


def environment(dev):
    torch, _ = _torch()
    import commux
    info = {"date": probe.now(), **probe.host(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "commux": commux.__version__, "commux_path": os.path.dirname(commux.__file__),
            "device": str(dev.device),
            "env": {k: v for k, v in os.environ.items()
                    if k.startswith(("UCX_", "COMMUX_", "PYTORCH_CUDA_ALLOC_CONF",
                                     "CUDA_VISIBLE_DEVICES"))}}
    if dev.cuda:
        info["device_name"] = torch.cuda.get_device_name(dev.device)
    try:
        rt = commux.runtime_info()
        info["ucx_version"] = rt.get("ucx_version")
        info["ucx_transports"] = list(rt.get("transports", []))
        info["ucx_memory_types"] = list(rt.get("memory_types", []))
        info["commux_defaults"] = list(rt.get("applied_defaults", []))
        choice = commux.transport_choice()
        info["transport_choice"] = {k: choice.get(k) for k in ("accelerator", "transports",
                                                                "copy_allowed", "warnings")}
    except Exception as e:  # noqa: BLE001 -- informational only
        info["runtime_info_error"] = repr(e)
    return info


# ------------------------------------------------------------------------------------------------
# Inside a rank: the sections

def window_fn(rank, buf, window, ack):
    """One window of the streaming test on this rank: rank 0 posts `window` isends of buf and
    waits for them and for rank 1's ack; rank 1 posts the matching irecvs into buf (every message
    writes the same bytes), waits, and sends the ack. Default group ("ucx")."""
    _, dist = _torch()
    if rank == 0:
        def send_window():
            reqs = [dist.isend(buf, dst=1, tag=TAG_DATA) for _ in range(window)]
            for r in reqs:
                r.wait()
            dist.recv(ack, src=1, tag=TAG_ACK)
        return send_window

    def recv_window():
        reqs = [dist.irecv(buf, src=0, tag=TAG_DATA) for _ in range(window)]
        for r in reqs:
            r.wait()
        dist.send(ack, dst=0, tag=TAG_ACK)
    return recv_window


def p2p_section(job, dev, rank, gloo):
    """Rank 0 streams to rank 1 over the default ("ucx") group; rank 0 also times the copy."""
    torch, dist = _torch()
    plan, sizes = job["plan"], job["p2p_sizes"]
    top = max(sizes)
    if rank == 0:
        src = torch.empty(top, dtype=torch.uint8, device=dev.device)
        cpy = torch.empty(top, dtype=torch.uint8, device=dev.device)
    else:
        dst = torch.empty(top, dtype=torch.uint8, device=dev.device)
    ack = torch.zeros(1, dtype=torch.int32)  # host memory, as osu_bw's

    rows = []
    for k, size in enumerate(sizes):
        window = max(1, min(job["max_window"], job["window_bytes"] // size))
        salt_timed, salt_check = (17 * k + 3) % 256, (17 * k + 101) % 256
        if rank == 0:
            buf = src[:size]
            fill_bytes(buf, salt_timed)
        else:
            buf = dst[:size]
            buf.fill_(POISON)
        one_window = window_fn(rank, buf, window, ack)
        dev.sync()
        dist.barrier(group=gloo)

        # Warm-up (connection set-up, IPC mappings): two windows; the second one is the estimate.
        one_window()
        dev.sync()
        t0 = time.perf_counter()
        one_window()
        dev.sync()
        iters = shared_iters(gloo, time.perf_counter() - t0, plan, plan["max_iters"])

        gbps = []
        for _ in range(plan["reps"]):
            dev.sync()
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(iters):
                one_window()
            dev.sync()
            gbps.append(window * size * iters / (time.perf_counter() - t0) / 1e9)
        wrong_timed = wrong_bytes(buf, salt_timed) if rank == 1 else 0

        # One checked message with a fresh pattern into a poisoned buffer.
        if rank == 0:
            fill_bytes(buf, salt_check)
        else:
            buf.fill_(POISON)
        dev.sync()
        dist.barrier(group=gloo)
        if rank == 0:
            dist.isend(buf, dst=1, tag=TAG_CHECK).wait()
        else:
            dist.irecv(buf, src=0, tag=TAG_CHECK).wait()
        dev.sync()
        wrong_check = wrong_bytes(buf, salt_check) if rank == 1 else 0

        # The reference copy, on rank 0 alone (rank 1 waits in the barrier).
        copy_gbps, copy_wrong, copy_iters = [], 0, 0
        if rank == 0:
            out = cpy[:size]
            out.copy_(buf)
            dev.sync()
            copy = functools.partial(out.copy_, buf)
            one = dev.time_device(copy, 1)
            copy_iters = max(1, min(1000, int(plan["budget_ms"] / 1e3 / one) if one > 0 else 1000))
            for _ in range(plan["reps"]):
                copy_gbps.append(size / dev.time_device(copy, copy_iters) / 1e9)
            copy_wrong = wrong_bytes(out, salt_check)
        dist.barrier(group=gloo)
        rows.append({"bytes": size, "window": window, "iters": iters, "reps": plan["reps"],
                     "p2p_gbps": gbps, "copy_gbps": copy_gbps,
                     "copy_iters": copy_iters,
                     "wrong_timed": wrong_timed, "wrong_check": wrong_check,
                     "copy_wrong": copy_wrong})
        if rank == 0:
            print(f"cuda_bench: p2p {size_name(size)} done", file=sys.stderr, flush=True)
    return rows


def allreduce_fn(x, group):
    """One in-place dist.all_reduce(SUM) of x on `group` (blocking: on return the sum is in x)."""
    _, dist = _torch()
    return lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)


def allreduce_section(job, dev, rank, world, groups):
    """Every size on "ucx" and on "gloo" (the order alternating), each timed and then checked."""
    torch, dist = _torch()
    plan, sizes = job["plan"], job["ar_sizes"]
    xbuf = torch.empty(max(sizes) // 4, dtype=torch.float32, device=dev.device)
    gloo = groups["gloo"]
    rows = []
    for k, size in enumerate(sizes):
        x = xbuf[:size // 4]
        order = ["ucx", "gloo"] if k % 2 == 0 else ["gloo", "ucx"]
        for b in order:
            op = allreduce_fn(x, groups[b])
            salt_timed, salt_check = (31 * k + 5) % 1021, (31 * k + 509) % 1021

            fill_ramp(x, salt_timed, rank)
            dev.sync()
            dist.barrier(group=gloo)
            op()  # warm-up
            dev.sync()
            t0 = time.perf_counter()
            op()  # the estimate
            dev.sync()
            iters = shared_iters(gloo, time.perf_counter() - t0, plan,
                                 min(plan["max_iters"], AR_MAX_ITERS))
            times = []
            for _ in range(plan["reps"]):
                fill_ramp(x, salt_timed, rank)  # the sums double every iteration: start low
                dev.sync()
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                dev.sync()
                times.append((time.perf_counter() - t0) / iters * 1e3)
            fill_ramp(x, salt_check, rank)
            dev.sync()
            dist.barrier(group=gloo)
            op()
            dev.sync()
            wrong = wrong_sum(x, salt_check, world)
            rows.append({"bytes": size, "backend": b, "iters": iters, "reps": plan["reps"],
                         "times_ms": times, "wrong": wrong})
        if rank == 0:
            print(f"cuda_bench: allreduce {size_name(size)} done", file=sys.stderr, flush=True)
    return rows


def run_rank(job):
    torch, dist = _torch()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # two ranks share the CPUs; GPU work uses no intra-op threads
    dev = Dev(job["device"])
    import commux
    commux.register()
    timeout = datetime.timedelta(seconds=job["op_timeout_s"])
    dist.init_process_group(backend="ucx", init_method="env://", timeout=timeout)
    groups = {"ucx": dist.group.WORLD,
              "gloo": dist.new_group(backend="gloo", timeout=timeout)}
    result = {"rank": rank, "world": world}
    if rank == 0:
        result["environment"] = environment(dev)
    if job["section"] == "p2p":
        result["rows"] = p2p_section(job, dev, rank, groups["gloo"])
    else:
        result["rows"] = allreduce_section(job, dev, rank, world, groups)
    # The last collective: no rank tears down while another still talks to it.
    dist.barrier(group=groups["gloo"])
    dist.destroy_process_group()
    return result


# ------------------------------------------------------------------------------------------------
# The parent: launches, merging, the report

def merge_p2p(results):
    """Rank 0's bandwidths, wrong bytes from both."""
    rows = []
    for r0, r1 in zip(results[0]["rows"], results[1]["rows"]):
        p2p = statistics.median(r0["p2p_gbps"])
        copy = statistics.median(r0["copy_gbps"])
        rows.append({"bytes": r0["bytes"], "window": r0["window"], "iters": r0["iters"],
                     "reps": r0["reps"], "copy_iters": r0["copy_iters"],
                     "p2p_gbps": p2p, "p2p_best_gbps": max(r0["p2p_gbps"]),
                     "p2p_gbps_reps": r0["p2p_gbps"], "copy_gbps": copy,
                     "copy_gbps_reps": r0["copy_gbps"], "ratio": p2p / copy if copy else None,
                     "wrong": sum(r["wrong_timed"] + r["wrong_check"] for r in (r0, r1)),
                     "copy_wrong": r0["copy_wrong"]})
    return rows


def merge_allreduce(results):
    """Per size and backend: per repetition the slowest rank's time, median over repetitions;
    wrong elements summed over ranks. Then one row per size with both backends."""
    per = {}
    for rows in zip(*(results[r]["rows"] for r in sorted(results))):
        reps = [max(t) for t in zip(*(r["times_ms"] for r in rows))]
        per[(rows[0]["bytes"], rows[0]["backend"])] = {
            "time_ms": statistics.median(reps), "times_ms": reps, "iters": rows[0]["iters"],
            "wrong": sum(r["wrong"] for r in rows)}
    out = []
    for size in sorted({s for s, _ in per}):
        u, g = per.get((size, "ucx")), per.get((size, "gloo"))
        row = {"bytes": size, "ucx": u, "gloo": g,
               "ratio": g["time_ms"] / u["time_ms"] if u and g and u["time_ms"] > 0 else None,
               "wrong": (u["wrong"] if u else 0) + (g["wrong"] if g else 0)}
        out.append(row)
    return out


def run_section(args, section):
    job = {"section": section, "device": args.device, "plan": args.plan,
           "p2p_sizes": args.p2p_sizes, "ar_sizes": args.ar_sizes,
           "max_window": args.window, "window_bytes": WINDOW_BYTES[args.kind],
           "op_timeout_s": args.op_timeout}
    start = time.monotonic()
    print(f"cuda_bench: {section} on {args.device}, 2 ranks ...", file=sys.stderr, flush=True)
    results, errors = launch_ranks(2, run_rank, job, args.launch_timeout, f"{section} launch")
    elapsed = time.monotonic() - start
    if errors or sorted(results) != [0, 1]:
        return None, None, errors or [f"{section}: missing rank results"], elapsed
    env = results[0].get("environment")
    rows = merge_p2p(results) if section == "p2p" else merge_allreduce(results)
    return rows, env, [], elapsed


def fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def target_lines(data):
    """The two target lines and their records (None where the size was not measured)."""
    cpu = data["kind"] == "cpu"
    copy_name = "memcpy" if cpu else "D2D"
    suffix = " [CPU run: informational]" if cpu else ""
    lines, targets = [], {}
    p2p = {r["bytes"]: r for r in data.get("p2p") or []}
    row = p2p.get(TARGET_P2P["bytes"])
    name = size_name(TARGET_P2P["bytes"])
    if row and row["ratio"] is not None:
        met = row["ratio"] >= TARGET_P2P["min_ratio"]
        lines.append(f"p2p {name}: {row['p2p_gbps']:.1f} GB/s = {row['ratio']:.2f} x {copy_name} "
                     f"({row['copy_gbps']:.1f} GB/s) (target >= {TARGET_P2P['min_ratio']}: "
                     f"{'met' if met else 'MISSED'}){suffix}")
        targets["p2p"] = {"bytes": TARGET_P2P["bytes"], "p2p_gbps": row["p2p_gbps"],
                          "copy_gbps": row["copy_gbps"], "ratio": row["ratio"],
                          "min_ratio": TARGET_P2P["min_ratio"], "met": met}
    else:
        lines.append(f"p2p {name}: not measured (target >= {TARGET_P2P['min_ratio']} x "
                     f"{copy_name}){suffix}")
        targets["p2p"] = {"bytes": TARGET_P2P["bytes"], "ratio": None,
                          "min_ratio": TARGET_P2P["min_ratio"], "met": None}
    ar = {r["bytes"]: r for r in data.get("allreduce") or []}
    row = ar.get(TARGET_AR["bytes"])
    name = size_name(TARGET_AR["bytes"])
    if row and row["ratio"] is not None:
        met = row["ratio"] >= TARGET_AR["min_ratio"]
        lines.append(f"allreduce {name}: ucx {row['ucx']['time_ms']:.3f} ms, gloo "
                     f"{row['gloo']['time_ms']:.3f} ms, gloo/ucx = {row['ratio']:.2f} "
                     f"(target >= {TARGET_AR['min_ratio']:g}: {'met' if met else 'MISSED'})"
                     f"{suffix}")
        targets["allreduce"] = {"bytes": TARGET_AR["bytes"], "ucx_ms": row["ucx"]["time_ms"],
                                "gloo_ms": row["gloo"]["time_ms"], "ratio": row["ratio"],
                                "min_ratio": TARGET_AR["min_ratio"], "met": met}
    else:
        lines.append(f"allreduce {name}: not measured (target gloo/ucx >= "
                     f"{TARGET_AR['min_ratio']:g}){suffix}")
        targets["allreduce"] = {"bytes": TARGET_AR["bytes"], "ratio": None,
                                "min_ratio": TARGET_AR["min_ratio"], "met": None}
    return lines, targets


def markdown(data, lines):
    env = data.get("environment") or {}
    cpu = data["kind"] == "cpu"
    copy_name = "memcpy" if cpu else "D2D copy"
    where = env.get("device_name") or data["device"]
    out = [f"# commux CUDA benchmark: 2 ranks on {data['device']} ({where})", ""]
    out.append(f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda') or 'none'}), commux "
               f"{env.get('commux', '?')}, UCX {env.get('ucx_version', '?')}; transports: "
               f"{', '.join(env.get('ucx_transports') or []) or '?'}; {data['date']}; "
               f"{'quick' if data['quick'] else 'full'} run, {data['elapsed_s']:.0f} s.")
    for w in (env.get("transport_choice") or {}).get("warnings") or []:
        out.append(f"Warning: {w}")
    out.append("")
    if data.get("p2p") is not None:
        out += [f"## p2p bandwidth (one-way streaming, window of W isend/irecv + ack, \"ucx\") "
                f"against a {copy_name} on the same device", "",
                "GB/s = 1e9 bytes of payload per second, bytes counted once (a copy reads and "
                "writes each byte: its memory traffic is twice the figure). p2p: median (best) "
                "over repetitions on rank 0; copy: median.", "",
                f"| size | W | windows x reps | p2p GB/s | best | {copy_name} GB/s | p2p/copy "
                "| #wrong |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in data["p2p"]:
            out.append(f"| {size_name(r['bytes'])} | {r['window']} | {r['iters']} x "
                       f"{r['reps']} | {fmt(r['p2p_gbps'])} | {fmt(r['p2p_best_gbps'])} | "
                       f"{fmt(r['copy_gbps'])} | {fmt(r['ratio'])} | "
                       f"{r['wrong'] + r['copy_wrong']} |")
        out.append("")
    if data.get("allreduce") is not None:
        out += ["## allreduce (SUM, float32), \"ucx\" against \"gloo\", same tensors and device",
                "", "Time per operation: median over repetitions of the slowest rank's mean; "
                "algbw = bytes / time. gloo/ucx > 1: commux faster.", "",
                "| size | ucx ms | gloo ms | gloo/ucx | ucx GB/s | gloo GB/s | iters ucx/gloo "
                "| #wrong ucx/gloo |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in data["allreduce"]:
            u, g = r["ucx"] or {}, r["gloo"] or {}
            ub = r["bytes"] / u["time_ms"] / 1e6 if u.get("time_ms") else None
            gb = r["bytes"] / g["time_ms"] / 1e6 if g.get("time_ms") else None
            out.append(f"| {size_name(r['bytes'])} | {fmt(u.get('time_ms'), 3)} | "
                       f"{fmt(g.get('time_ms'), 3)} | {fmt(r['ratio'])} | {fmt(ub)} | "
                       f"{fmt(gb)} | {u.get('iters', '-')}/{g.get('iters', '-')} | "
                       f"{u.get('wrong', '-')}/{g.get('wrong', '-')} |")
        out.append("")
    out.append("## Targets")
    out.append("")
    out += [f"* {line}" for line in lines]
    out.append("")
    wrong = data["wrong_total"]
    out.append(f"Correctness: {wrong} wrong" + (" (see #wrong above)" if wrong else
                                                  ": every payload and sum checked"))
    for e in data["errors"]:
        out.append(f"\nERROR: {e}")
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda",
                   help="cuda, cuda:N (both ranks on that one device) or cpu (smoke run)")
    p.add_argument("--quick", action="store_true",
                   help="a few sizes (cuda: the target sizes; cpu: 1 and 4 MiB), short repetitions")
    p.add_argument("--sections", default=",".join(SECTIONS), help="p2p,allreduce (default both)")
    p.add_argument("--sizes", help="explicit comma-separated sizes for both sections (e.g. 1M,64M)")
    p.add_argument("--max-bytes", help="drop sizes above this (e.g. 4M)")
    p.add_argument("--window", type=int, default=MAX_WINDOW,
                   help=f"largest p2p window W (default {MAX_WINDOW})")
    p.add_argument("--reps", type=int, help="timed repetitions per row (default 3, 2 with --quick)")
    p.add_argument("--budget-ms", type=float, help="target length of one repetition "
                                                   "(default 200, 20 with --quick)")
    p.add_argument("--op-timeout", type=int, default=OP_TIMEOUT_S, metavar="SEC",
                   help="process-group timeout of every operation")
    p.add_argument("--launch-timeout", type=int, default=LAUNCH_TIMEOUT_S, metavar="SEC",
                   help="deadline of one launch of the two ranks (they are killed after it)")
    p.add_argument("--out", default=str(REPO / "results" / "cuda"), help="output directory")
    args = p.parse_args(argv)
    if args.device != "cpu" and not (args.device == "cuda" or args.device.startswith("cuda:")):
        p.error("--device: cuda, cuda:N or cpu")
    if args.device == "cuda":
        args.device = "cuda:0"
    args.kind = "cpu" if args.device == "cpu" else "cuda"
    args.sections = parse_list(p, "--sections", args.sections, SECTIONS)
    try:
        if args.sizes:
            sizes = sorted({parse_size(x) for x in args.sizes.split(",") if x.strip()})
            p2p_sizes, ar_sizes = sizes, sizes
        elif args.quick:
            p2p_sizes, ar_sizes = QUICK_SIZES[args.kind]
        else:
            p2p_sizes, ar_sizes = P2P_SIZES, AR_SIZES
        max_bytes = parse_size(args.max_bytes) if args.max_bytes else None
    except ValueError as e:
        p.error(f"bad size: {e}")
    if max_bytes is not None:
        p2p_sizes = [s for s in p2p_sizes if s <= max_bytes]
        ar_sizes = [s for s in ar_sizes if s <= max_bytes]
    if any(s <= 0 or s % 4 for s in p2p_sizes + ar_sizes):
        p.error("sizes must be positive multiples of 4 bytes")
    args.p2p_sizes, args.ar_sizes = list(p2p_sizes), list(ar_sizes)
    if ("p2p" in args.sections and not args.p2p_sizes) or \
            ("allreduce" in args.sections and not args.ar_sizes):
        p.error("no sizes left (check --sizes / --max-bytes)")
    if args.window < 1:
        p.error("--window must be >= 1")
    plan = dict(PLANS["quick" if args.quick else "full"])
    if args.reps is not None:
        if args.reps < 1:
            p.error("--reps must be >= 1")
        plan["reps"] = args.reps
    if args.budget_ms is not None:
        if args.budget_ms <= 0:
            p.error("--budget-ms must be > 0")
        plan["budget_ms"] = args.budget_ms
    args.plan = plan
    return args


def main(argv):
    args = parse_args(argv)
    if args.kind == "cpu":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    else:
        import torch
        if not torch.cuda.is_available():
            print(f"cuda_bench: torch {torch.__version__} sees no CUDA device; use --device cpu "
                  "for the CPU smoke run", file=sys.stderr)
            return 2
    start = time.monotonic()
    data = {"device": args.device, "kind": args.kind, "quick": args.quick,
            "date": probe.now(), "sources": probe.source_version(), "plan": args.plan,
            "sections": args.sections,
            "p2p_sizes": args.p2p_sizes, "allreduce_sizes": args.ar_sizes,
            "conventions": {"GB": "1e9 bytes", "p2p_gbps": "window*size*iters/time on rank 0, "
                            "payload bytes counted once",
                            "copy_gbps": "size/time of dst.copy_(src), bytes counted once "
                            "(memory traffic is twice)",
                            "allreduce_ms": "per operation; per repetition the slowest rank, "
                            "median over repetitions", "ratio_allreduce": "gloo_ms / ucx_ms"},
            "p2p": None, "allreduce": None, "environment": None, "errors": [],
            "launch_s": {}}
    for section in args.sections:
        rows, env, errors, elapsed = run_section(args, section)
        data["launch_s"][section] = round(elapsed, 1)
        data[section] = rows
        data["environment"] = data["environment"] or env
        data["errors"] += errors
        for e in errors:
            print(f"cuda_bench: {e}", file=sys.stderr, flush=True)
    data["elapsed_s"] = time.monotonic() - start
    data["wrong_total"] = (sum(r["wrong"] + r["copy_wrong"] for r in data["p2p"] or []) +
                           sum(r["wrong"] for r in data["allreduce"] or []))
    lines, data["targets"] = target_lines(data)
    md = markdown(data, lines)
    report.write(Path(args.out), data, md)
    print(md)
    for line in lines:
        print(line)
    if data["wrong_total"]:
        print(f"cuda_bench: {data['wrong_total']} wrong bytes/elements", file=sys.stderr)
    return 1 if data["wrong_total"] or data["errors"] else 0

