"""What every rank runs for one (case, tokens point): called by run.py through python/tests/mp.py's
launcher (``Ranks.run_outcomes(run_point, spec)``), so ``ctx`` is mp.Ctx: the default group is
"ucx" (or gloo when commux is not installed; the ucx cases are then unsupported), ``ctx.ref`` a
gloo group over the same ranks (barriers, the trace digest, the a2a-gloo adapter).

One call:
  1. the routing trace (every rank computes it alone) and its digest all-gathered and compared;
  2. inputs built and copied;
  3. checked round "before timing": dispatch (+ the cached-layout dispatch where offered), the
     oracle, the expert transform, combine, the oracle;
  4. warm-up iterations, then timed iterations: [barrier, dispatch], [barrier, combine],
     [barrier, dispatch + combine] (round trip), each timed per rank (perf_counter_ns; a CUDA
     device is synchronised before the clock stops);
  5. checked round "after timing"; the inputs compared with their copies.
A failed check never stops a rank (every rank makes the same calls); failures come back as text.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import inject as inj
from . import oracle as O
from .adapters import ADAPTERS, REFERENCE, Inputs
from .routing import REF, RoutingSpec, Trace, keyed

MAX_FAILURES = 12


def _barrier(ctx) -> None:
    """The start line of each timed iteration: the default group's barrier ("ucx", whose ranks
    leave it within microseconds of each other). Gloo's barrier lets ranks leave it hundreds of
    microseconds apart, and that skew would be timed as the first exchange's wait, whatever the
    backend under test."""
    dist.barrier()


def _trace(ctx, spec: dict) -> tuple[Trace, list[str]]:
    rs = RoutingSpec(world=ctx.world, tokens=spec["tokens"], experts=spec["experts"], hidden=spec["hidden"],
                     topk=spec["topk"], seed=spec["seed"], empty=spec["empty"])
    cache = ctx.cache.setdefault("ep-traces", {})
    if rs not in cache:
        while len(cache) >= 2:
            cache.pop(next(iter(cache)))
        tr = Trace(rs)
        mine = torch.frombuffer(bytearray(bytes.fromhex(tr.digest)), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(ctx.world)]
        dist.all_gather(every, mine, group=ctx.ref)
        bad = [r for r, d in enumerate(every) if not torch.equal(d, mine)]
        fails = [f"routing: rank {ctx.rank}: trace digest differs from rank(s) {bad}"] if bad else []
        cache[rs] = (tr, fails)
    return cache[rs]


def _device(ctx, memtype: str) -> torch.device:
    if memtype == "cuda":
        return torch.device("cuda", ctx.rank % torch.cuda.device_count())
    return torch.device("cpu")


def _adapter(ctx, spec: dict, device):
    key = ("ep-adapter", spec["backend"], spec["mode"], spec["memtype"], spec["experts"])
    ad = ctx.cache.get(key)
    if ad is None:
        ad = ADAPTERS[spec["backend"]](ctx, spec["mode"], device, spec["experts"])
        ctx.cache[key] = ad
    return ad


def close_adapters(ctx) -> list[str]:
    """Destroys every cached adapter (a call of its own at the end of a launch)."""
    problems = []
    for key in [k for k in ctx.cache if isinstance(k, tuple) and k and k[0] == "ep-adapter"]:
        try:
            ctx.cache.pop(key).close()
        except Exception as e:  # noqa: BLE001
            problems.append(f"{key[1]} {key[2]}: close raised {type(e).__name__}: {e}")
    return problems


def _to(x, device):
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


def _inputs(trace: Trace, rank: int, spec: dict, device) -> Inputs:
    sl = trace.own(rank)
    g = torch.arange(sl.start, sl.stop)
    if spec["precision"] == "fp8" and spec["mode"] == "normal":
        x = trace.x_fp8(g)
    else:
        x = trace.x_bf16(g)   # low-latency fp8: the backend quantises bf16 activations
    return Inputs(x=_to(x, device), topk_idx=trace.topk_idx[sl].clone().to(device),
                  topk_weights=trace.weights[sl].clone().to(device), num_experts=trace.experts,
                  precision=spec["precision"], cap=spec.get("cap", 0), alignment=spec.get("alignment", 1))


def _safe(fails: list, what: str, fn, *args):
    """Runs one oracle check; a check that raises on a malformed result is a failure, not a crash
    (a crash on one rank would leave the others waiting in the next collective)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        fails.append(f"{what}: the result could not be checked ({type(e).__name__}: {e})")
        return None


def _fallback_y(d: dict, mode: str, trace: Trace, cap: int) -> torch.Tensor:
    """A combine input of the right shape when the received rows could not be read."""
    x = d["recv_x"][0] if isinstance(d["recv_x"], tuple) else d["recv_x"]
    shape = (x.shape[0], trace.hidden) if mode == "normal" else (trace.lpr, cap * trace.world, trace.hidden)
    return torch.zeros(shape, dtype=torch.bfloat16)


def _checked_round(ad, inp: Inputs, trace: Trace, rank: int, spec: dict, phase: str):
    """Returns (failures, y for the timed combines, max relative combine error)."""
    mode, prec, injected = spec["mode"], spec["precision"], spec.get("inject")
    fails: list[str] = []
    d = ad.dispatch(inp)
    ad.sync()
    res = d
    if injected in inj.KINDS and rank == spec.get("inject_rank", 0):
        try:
            res = inj.inject(d, injected, mode)
        except inj.NotApplicable:
            pass
    if mode == "normal":
        _safe(fails, f"dispatch: rank {rank}", lambda: fails.extend(
            O.check_normal_dispatch(trace, rank, res, prec, inp.alignment)))
        y = _safe(fails, f"expert input: rank {rank}", O.expert_input_normal, trace, rank, d)
        again = ad.dispatch_cached(inp, d)
        ad.sync()
        if again is not None:
            same = O._payload_equal(O._cpu(again), O._cpu(d["recv_x"])) if _same_shape(again, d["recv_x"]) else None
            if same is None or not bool(same.all()):
                fails.append(f"dispatch/cached: rank {rank}: dispatch(x, handle=...) differs from the first dispatch")
    else:
        _safe(fails, f"ll-dispatch: rank {rank}", lambda: fails.extend(
            O.check_ll_dispatch(trace, rank, res, prec, inp.cap)))
        y = _safe(fails, f"expert input: rank {rank}", O.expert_input_ll, trace, rank, d)
    if y is None:
        y = _fallback_y(d, mode, trace, inp.cap)
    y = y.to(ad.device)
    out, weights = ad.combine(y, d, inp)
    ad.sync()
    if injected in inj.COMBINE_KINDS and rank == spec.get("inject_rank", 0):
        try:
            out = inj.inject_combine(out, injected)
        except inj.NotApplicable:
            pass
    r = _safe(fails, f"combine: rank {rank}", O.check_combine, trace, rank, out, prec, mode)
    cf, err = r if r is not None else ([], float("inf"))
    fails += cf
    if mode == "normal":
        _safe(fails, f"combine/weights: rank {rank}", lambda: fails.extend(
            O.check_combined_weights(trace, rank, weights)))
    return [f"{phase}: {m}" for m in fails], y, err


def _same_shape(a, b) -> bool:
    if isinstance(a, tuple) != isinstance(b, tuple):
        return False
    if isinstance(a, tuple):
        return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype


def _timed(ctx, ad, inp: Inputs, y, warmup: int, iters: int) -> dict:
    ns = time.perf_counter_ns
    for _ in range(warmup):
        _barrier(ctx)
        d = ad.dispatch(inp)
        ad.combine(y, d, inp)
        ad.sync()
    disp, comb, rt = [], [], []
    for _ in range(iters):
        _barrier(ctx)
        t0 = ns()
        d = ad.dispatch(inp)
        ad.sync()
        disp.append((ns() - t0) / 1e3)
        _barrier(ctx)
        t0 = ns()
        ad.combine(y, d, inp)
        ad.sync()
        comb.append((ns() - t0) / 1e3)
        _barrier(ctx)
        t0 = ns()
        d = ad.dispatch(inp)
        ad.combine(y, d, inp)
        ad.sync()
        rt.append((ns() - t0) / 1e3)
    return {"dispatch": disp, "combine": comb, "roundtrip": rt}


def run_point(ctx, spec: dict) -> dict:
    """One (case, tokens point) on this rank; returns failures, per-iteration times (us), extras."""
    t_start = time.monotonic()
    if spec.get("inject") == "hang" and ctx.rank == 0:
        time.sleep(3600)   # the hang guard's self-test: the parent must dump stacks, kill and go on
    trace, fails = _trace(ctx, spec)
    fails = list(fails)
    device = _device(ctx, spec["memtype"])
    if spec["backend"] == REFERENCE:
        return _run_reference(ctx, spec, trace, fails, device, t_start)
    ad = _adapter(ctx, spec, device)
    inp = _inputs(trace, ctx.rank, spec, device)
    names = ["x", "topk_idx", "topk_weights"]
    before = O.snapshot(inp.x, inp.topk_idx, inp.topk_weights)
    f, y, err1 = _checked_round(ad, inp, trace, ctx.rank, spec, "before timing")
    fails += f
    times = _timed(ctx, ad, inp, y, spec["warmup"], spec["iters"])
    f, _, err2 = _checked_round(ad, inp, trace, ctx.rank, spec, "after timing")
    fails += f
    fails += O.check_unchanged(ctx.rank, names, before, [inp.x, inp.topk_idx, inp.topk_weights])
    return {"failures": fails[:MAX_FAILURES], "n_failures": len(fails), "times": times,
            "max_rel_err": max(err1, err2), "wall_s": time.monotonic() - t_start}


# ------------------------------------------------------------------------------------------------
# the yardstick: one all_to_all_single, even split, of the normal dispatch's logical bytes


def _ref_values(seed: int, src: int, start: int, n: int) -> torch.Tensor:
    import numpy as np

    h = keyed(seed, REF, src, np.arange(start, start + n)) if n else np.zeros(0, np.uint64)
    return torch.from_numpy(((h % np.uint64(17)).astype(np.int64) - 8).astype(np.float32) / 64).to(torch.bfloat16)


def reference_chunk(trace: Trace) -> int:
    """bf16 elements per (source, destination) chunk: the normal dispatch's logical bytes (bf16)
    spread evenly over the ranks' sends, rounded up."""
    per_rank_elems = trace.rank_copies * trace.hidden / trace.world
    return -(-int(per_rank_elems) // trace.world)


def _run_reference(ctx, spec, trace, fails, device, t_start) -> dict:
    R, r = ctx.world, ctx.rank
    chunk = reference_chunk(trace)
    send = _ref_values(spec["seed"], r, 0, R * chunk).to(device)
    recv = torch.empty_like(send)
    want = torch.cat([_ref_values(spec["seed"], s, r * chunk, chunk) for s in range(R)])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def check(phase):
        recv.fill_(float("nan"))
        dist.all_to_all_single(recv, send)
        sync()
        if not torch.equal(recv.cpu().view(torch.int16), want.view(torch.int16)):
            bad = int((recv.cpu().view(torch.int16) != want.view(torch.int16)).sum())
            fails.append(f"{phase}: all_to_all_single: rank {r}: {bad} element(s) wrong")

    check("before timing")
    ns = time.perf_counter_ns
    for _ in range(spec["warmup"]):
        _barrier(ctx)
        dist.all_to_all_single(recv, send)
    sync()
    disp = []
    for _ in range(spec["iters"]):
        _barrier(ctx)
        t0 = ns()
        dist.all_to_all_single(recv, send)
        sync()
        disp.append((ns() - t0) / 1e3)
    check("after timing")
    return {"failures": fails[:MAX_FAILURES], "n_failures": len(fails), "times": {"dispatch": disp},
            "max_rel_err": 0.0, "wall_s": time.monotonic() - t_start, "chunk_elems": chunk}
