#!/usr/bin/env python3
"""What the list forms of the collectives cost beside their flat forms: all_gather, reduce_scatter
and all_to_all with a list of tensors (a tensor per rank, or the rows of one tensor) against
all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single of the same bytes, for "ucx"
and "gloo" in the same launch.

    .venv/bin/python bench/experiments/list_forms.py [--ranks 2] [--sizes 8,64K,16M]
                                                     [--rounds 5] [--budget-ms 150]

Sizes are each rank's block (one tensor of the list). Each round times every (op, size, backend,
form), alternating the backends' order, as the slowest rank's mean over back-to-back calls; the
table gives the median over rounds and list/flat per backend (1: the list form costs what the
flat form costs). Every call's result is checked (integer-valued float32, exact sums).
UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402
from bench.lib.sizes import parse_size, size_name  # noqa: E402

OPS = ("all_gather", "reduce_scatter", "all_to_all")
FORMS = ("flat", "list: tensor per rank", "list: rows of one tensor")


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    groups = {"ucx": dist.new_group(backend="ucx"), "gloo": dist.new_group(backend="gloo")}
    me, world = dist.get_rank(), dist.get_world_size()
    times = {}
    wrong = 0

    def call(op, form, n, g):
        """A callable running one call, and a check of its result (wrong elements)."""
        if op == "all_gather":
            x = torch.full((n,), float(me + 1))
            out = torch.empty(world * n)
            outs = list(out.view(world, n).unbind(0)) if "rows" in form else \
                [torch.empty(n) for _ in range(world)]
            run = (lambda: dist.all_gather_into_tensor(out, x, group=g)) if form == "flat" else \
                (lambda: dist.all_gather(outs, x, group=g))
            got = (lambda: out.view(world, n)) if form == "flat" else (lambda: torch.stack(outs))
            want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n).view(world, n)
            return run, lambda: int((got() != want).sum())
        if op == "reduce_scatter":
            inp = torch.arange(world, dtype=torch.float32).repeat_interleave(n) + me
            ins = list(inp.view(world, n).unbind(0)) if "rows" in form else \
                [c.clone() for c in inp.view(world, n).unbind(0)]
            out = torch.empty(n)
            run = (lambda: dist.reduce_scatter_tensor(out, inp, group=g)) if form == "flat" else \
                (lambda: dist.reduce_scatter(out, ins, group=g))
            want = float(world * me + sum(range(world)))
            return run, lambda: int((out != want).sum())
        inp = torch.full((world * n,), float(me))
        out = torch.empty(world * n)
        if "rows" in form:
            ins, outs = list(inp.view(world, n).unbind(0)), list(out.view(world, n).unbind(0))
        else:
            ins = [torch.full((n,), float(me)) for _ in range(world)]
            outs = [torch.empty(n) for _ in range(world)]
        run = (lambda: dist.all_to_all_single(out, inp, group=g)) if form == "flat" else \
            (lambda: dist.all_to_all(outs, ins, group=g))
        got = (lambda: out.view(world, n)) if form == "flat" else (lambda: torch.stack(outs))
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(n).view(world, n)
        return run, lambda: int((got() != want).sum())

    for rnd in range(job["rounds"] + 1):  # the first is warm-up
        order = list(groups) if rnd % 2 == 0 else list(reversed(list(groups)))
        for op in OPS:
            for size in job["sizes"]:
                n = max(1, size // 4)
                for backend in order:
                    for form in FORMS:
                        run, check = call(op, form, n, groups[backend])
                        run()
                        wrong += check()
                        dist.barrier()
                        t0 = time.perf_counter()
                        run()
                        once = time.perf_counter() - t0
                        iters = max(1, min(2000, int(job["budget_ms"] / 1e3 / max(once, 1e-7))))
                        # every rank runs the slowest rank's count (calls must pair up)
                        count = torch.tensor([iters])
                        dist.all_reduce(count, op=dist.ReduceOp.MIN)
                        iters = int(count)
                        dist.barrier()
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            run()
                        dt = (time.perf_counter() - t0) / iters
                        wrong += check()
                        if rnd > 0:
                            times.setdefault(f"{op}|{size}|{backend}|{form}", []).append(dt)
    dist.destroy_process_group()  # before the interpreter ends (async_overlap.py says why)
    return {"times": times, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="8,64K,16M", help="bytes per rank's block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=150.0, help="time per timed loop")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    job = {"sizes": sizes, "rounds": a.rounds, "budget_ms": a.budget_ms, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 1800, "list forms")
    for e in errors:
        print(f"list_forms: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    print(f"{a.ranks} ranks, median of {a.rounds} rounds (each the slowest rank's mean), µs per call")
    print("| op | block | backend | flat | list: tensor per rank | list: rows of one tensor | "
          "per rank / flat | rows / flat |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for op in OPS:
        for size in sizes:
            for backend in ("ucx", "gloo"):
                med = {}
                for form in FORMS:
                    key = f"{op}|{size}|{backend}|{form}"
                    med[form] = statistics.median(
                        max(results[r]["times"][key][i] for r in results) for i in range(a.rounds)) * 1e6
                flat = med["flat"]
                print(f"| {op} | {size_name(size)} | {backend} | {flat:.1f} | {med[FORMS[1]]:.1f} | "
                      f"{med[FORMS[2]]:.1f} | {med[FORMS[1]] / flat:.2f} | {med[FORMS[2]] / flat:.2f} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
