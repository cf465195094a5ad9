#!/usr/bin/env python3
"""Where async collectives should run: COMMUX_SCHEDULE on (the progress thread or a pool thread
resuming the schedules nobody waits for: COMMUX_PROGRESS_RESUMES=1 or 0) against off, for async
all_reduces waited the ways torch code waits for them, and a DDP training step.

    .venv/bin/python bench/experiments/schedule_ab.py [--ranks 2] [--kib 64] [--rounds 15]
                                                      [--passes 10] [--launches 2]
                                                      [--variant LABEL:NAME=VALUE,... ...]

Each variant runs in launches of its own, alternated (--launches of each): the variants share no
process, so none of them weighs on another's figures through the process's one progress thread,
and the default group is the measured one, whose own barrier lines the ranks up (gloo's leaves
them tens of microseconds apart, more than the calls themselves take at small sizes). Per round,
each of these is timed over --passes passes after a barrier, rounds interleaving them:
  blocking  8 blocking all_reduces (the reference of the ratios)
  work1     8 times: one all_reduce(async_op=True), then Work.wait()  (a waiter resumes it)
  fut1      8 times: one, then get_future().wait()  (nobody resumes it but a commux thread)
  async8    8 issued back to back, then each Work.wait()ed  (issue 14: less than blocking)
  fut8      8 issued back to back, then each future waited  (DDP's buckets)
  ddp       one DistributedDataParallel step (8 Linear(W, W), W = --ddp-width, default 256;
            --ddp-bucket-mb buckets, default 0.25; SGD)
Prints, per variant, the median over its launches of each launch's median (slowest rank's time
per pass, µs) and the ratio to that launch's blocking figure. Every all_reduce result is checked,
and the DDP parameters must be equal on every rank of every launch. UCX_NET_DEVICES=lo unless set.
--variant (repeatable) measures the given variants instead of the three above, e.g.
--variant inflight1:COMMUX_INFLIGHT=1 --variant default: (an empty environment: the defaults).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402


VARIANTS = (  # label: the environment of its launches
    ("on+progress", {"COMMUX_SCHEDULE": "1", "COMMUX_PROGRESS_RESUMES": "1"}),
    ("on+pool", {"COMMUX_SCHEDULE": "1", "COMMUX_PROGRESS_RESUMES": "0"}),
    ("off", {"COMMUX_SCHEDULE": "0"}),
)
MODES = ("blocking", "work1", "fut1", "async8", "fut8", "ddp")
K = 8  # all_reduces per pass


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()
    n, passes = job["kib"] * 256, job["passes"]
    sets = [[torch.empty(n) for _ in range(K)] for _ in range(passes)]
    wrong = 0

    def calls(mode, xs):
        if mode == "blocking":
            for x in xs:
                dist.all_reduce(x)
        elif mode == "work1":
            for x in xs:
                dist.all_reduce(x, async_op=True).wait()
        elif mode == "fut1":
            for x in xs:
                dist.all_reduce(x, async_op=True).get_future().wait()
        else:
            works = [dist.all_reduce(x, async_op=True) for x in xs]
            for w in works:
                if mode == "async8":
                    w.wait()
                else:
                    w.get_future().wait()

    torch.manual_seed(0)
    width = job["ddp_width"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
    ddp = DDP(model, bucket_cap_mb=job["ddp_bucket_mb"])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    inp = torch.full((32, width), 0.01 * (me + 1))

    def ddp_step():
        opt.zero_grad()
        ddp(inp).square().mean().backward()
        opt.step()

    times = {m: [] for m in MODES}
    for rnd in range(job["rounds"] + 2):  # the first two are warm-up
        for mode in MODES:
            for p, xs in enumerate(sets):
                for i, x in enumerate(xs):
                    x.fill_(float(me + i + p))
            dist.barrier()
            t0 = time.perf_counter()
            for xs in sets:
                if mode == "ddp":
                    ddp_step()
                else:
                    calls(mode, xs)
            dt = (time.perf_counter() - t0) / passes
            if mode != "ddp":
                for p, xs in enumerate(sets):
                    for i, x in enumerate(xs):
                        wrong += int((x != float(sum(r + i + p for r in range(world)))).sum())
            if rnd >= 2:
                times[mode].append(dt * 1e6)
    params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    dist.destroy_process_group()
    return {"times": times, "wrong": wrong, "params": params.tolist()[:4096]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--launches", type=int, default=2, help="launches of each variant, alternated")
    p.add_argument("--ddp-width", type=int, default=256,
                   help="the DDP model's 8 Linear(W, W) layers (256: 2 MiB of parameters)")
    p.add_argument("--ddp-bucket-mb", type=float, default=0.25,
                   help="DDP's bucket_cap_mb (torch's default is 25)")
    p.add_argument("--per-launch", action="store_true",
                   help="also print each launch's ratios to its blocking figure, sorted (the "
                        "patterns that are bimodal from launch to launch show as two groups)")
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL:NAME=VALUE,... (repeatable): measure these instead")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    variants = VARIANTS
    if a.variant:
        variants = []
        for v in a.variant:
            label, _, spec = v.partition(":")
            pairs = [kv.split("=", 1) for kv in spec.split(",") if kv]
            if not label or any(len(kv) != 2 for kv in pairs):
                p.error(f"--variant {v!r}: expected LABEL:NAME=VALUE,... (LABEL: for the defaults)")
            variants.append((label, dict(pairs)))
        variants = tuple(variants)
    figures = {label: [] for label, _ in variants}  # per launch: mode -> µs
    wrong, params = 0, None
    for launch in range(a.launches):
        order = variants if launch % 2 == 0 else tuple(reversed(variants))
        for label, env in order:
            job = {"kib": a.kib, "rounds": a.rounds, "passes": a.passes, "env": env,
                   "ddp_width": a.ddp_width, "ddp_bucket_mb": a.ddp_bucket_mb}
            results, errors = launch_ranks(a.ranks, run_rank, job, 600, f"schedule a/b {label}")
            for e in errors:
                print(f"schedule_ab: {label}: {e}", file=sys.stderr)
            if errors or len(results) != a.ranks:
                return 1
            rounds = len(results[0]["times"]["blocking"])
            figures[label].append({
                m: statistics.median(max(results[r]["times"][m][i] for r in results)
                                     for i in range(rounds))
                for m in MODES})
            for r, res in results.items():
                wrong += res["wrong"]
                if params is None:
                    params = res["params"]
                elif res["params"] != params:
                    wrong += 1
                    print(f"schedule_ab: {label}: rank {r}'s DDP parameters differ from the "
                          "first launch's", file=sys.stderr)
    print(f"{a.ranks} ranks, all_reduce of {a.kib} KiB (DDP: 8 Linear({a.ddp_width}, "
          f"{a.ddp_width}), buckets of {a.ddp_bucket_mb:g} MB), µs per pass "
          f"(slowest rank), median of {a.rounds} rounds, then of {a.launches} launches per "
          "variant; (ratio to the launch's blocking)")
    labels = [label for label, _ in variants]
    print("| what | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for m in MODES:
        cells = []
        for label in labels:
            us = statistics.median(f[m] for f in figures[label])
            ratio = statistics.median(f[m] / f["blocking"] for f in figures[label])
            cells.append(f"{us:.1f} ({ratio:.2f})")
        print(f"| {m} | " + " | ".join(cells) + " |")
    if a.per_launch:
        print("each launch's ratio to its blocking figure, sorted:")
        for m in MODES[1:]:
            for label in labels:
                rs = sorted(f[m] / f["blocking"] for f in figures[label])
                print(f"  {m:8s} {label:16s} " + " ".join(f"{r:.2f}" for r in rs))
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
