#!/usr/bin/env python3
"""COMMUX_SCHEDULE (and COMMUX_PROGRESS_RESUMES) on against off in one launch: async all_reduces
waited the three ways torch code waits for them, and a DDP training step.

    .venv/bin/python bench/experiments/schedule_ab.py [--ranks 2] [--kib 256] [--rounds 40]

Per "ucx" group (COMMUX_SCHEDULE=1 with the progress thread resuming the schedules nobody waits
for, the same with COMMUX_PROGRESS_RESUMES=0 (a pool thread runs them to their end), and
COMMUX_SCHEDULE=0; plus gloo for the DDP step), rounds interleaved across them:
  work1  one all_reduce(async_op=True), then Work.wait()      (a waiter resumes the schedule)
  fut1   one, then get_future().wait()                        (nobody resumes it but the
                                                               progress or a pool thread)
  fut8   eight issued back to back, then each future waited  (DDP's buckets)
  ddp    one DistributedDataParallel step (8 Linear(256, 256), 0.25 MB buckets, SGD)
Medians over rounds of rank 0's time (a barrier on a gloo group before each). Every all_reduce
result is checked, and the DDP parameters must be equal across backends after the run.
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


VARIANTS = (  # label: the environment its group is created with
    ("on+progress", {"COMMUX_SCHEDULE": "1", "COMMUX_PROGRESS_RESUMES": "1"}),
    ("on+pool", {"COMMUX_SCHEDULE": "1", "COMMUX_PROGRESS_RESUMES": "0"}),
    ("off", {"COMMUX_SCHEDULE": "0"}),
)


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for label, env in VARIANTS:
        os.environ.update(env)  # read when the group is created
        groups[label] = dist.new_group(backend="ucx")
        for k in env:
            del os.environ[k]
    groups["gloo"] = dist.new_group(backend="gloo")
    n = job["kib"] * 256
    want = float(sum(r + 1 for r in range(world)))
    wrong, params = 0, {}
    times = {}
    # Rounds interleave the variants, so that a change of the machine's pace hits them alike.
    for mode in ("work1", "fut1", "fut8"):
        for _ in range(job["rounds"] + 3):
            for label, g in groups.items():
                if label == "gloo":
                    continue
                xs = [torch.full((n,), float(me + 1)) for _ in range(8 if mode == "fut8" else 1)]
                dist.barrier()
                t0 = time.perf_counter()
                works = [dist.all_reduce(x, async_op=True, group=g) for x in xs]
                for w in works:
                    if mode == "work1":
                        w.wait()
                    else:
                        w.get_future().wait()
                times.setdefault((label, mode), []).append(time.perf_counter() - t0)
                wrong += sum(int((x != want).sum()) for x in xs)
    models = {}
    for label, g in groups.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        ddp = DDP(model, process_group=g, bucket_cap_mb=0.25)
        models[label] = (model, ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    x = torch.full((32, 256), 0.01 * (me + 1))
    for _ in range(job["rounds"] + 3):
        for label, (model, ddp, opt) in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            times.setdefault((label, "ddp"), []).append(time.perf_counter() - t0)
    for label, (model, _, _) in models.items():
        params[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = params["gloo"]
    for label, p in params.items():
        if not torch.allclose(p, ref, rtol=1e-5, atol=1e-6):
            wrong += 1
            print(f"schedule_ab: rank {me}: DDP parameters on {label} differ from gloo's",
                  file=sys.stderr)
    out = {f"{k[0]}|{k[1]}": statistics.median(v[3:]) * 1e6 for k, v in times.items()}
    return {"times": out, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--kib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=40)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"kib": a.kib, "rounds": a.rounds, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 600, "schedule a/b")
    for e in errors:
        print(f"schedule_ab: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    t = results[0]["times"]
    print(f"{a.ranks} ranks, all_reduce of {a.kib} KiB, median of {a.rounds} rounds, rank 0's µs")
    labels = [v[0] for v in VARIANTS]
    print("| what | " + " | ".join(f"schedule={x}" for x in labels) +
          " | progress/pool | progress/off | gloo |")
    print("|---|" + "---:|" * (len(labels) + 3))
    for mode in ("work1", "fut1", "fut8", "ddp"):
        v = [t[f"{x}|{mode}"] for x in labels]
        gloo = t.get(f"gloo|{mode}")
        print(f"| {mode} | " + " | ".join(f"{x:.1f}" for x in v) +
              f" | {v[0] / v[1]:.2f} | {v[0] / v[2]:.2f} | {'' if gloo is None else f'{gloo:.1f}'} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
