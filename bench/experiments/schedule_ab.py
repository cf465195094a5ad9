#!/usr/bin/env python3
"""COMMUX_SCHEDULE on against off in one launch: async all_reduces waited the three ways torch
code waits for them, and a DDP training step.

    .venv/bin/python bench/experiments/schedule_ab.py [--ranks 2] [--kib 256] [--rounds 40]

Per "ucx" group (one with COMMUX_SCHEDULE=1, one with 0; plus gloo for the DDP step):
  work1  one all_reduce(async_op=True), then Work.wait()      (a waiter resumes the schedule)
  fut1   one, then get_future().wait()                        (the pool thread runs it)
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


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for label, value in (("ucx schedule=on", "1"), ("ucx schedule=off", "0")):
        os.environ["COMMUX_SCHEDULE"] = value  # read when the group is created
        groups[label] = dist.new_group(backend="ucx")
        del os.environ["COMMUX_SCHEDULE"]
    groups["gloo"] = dist.new_group(backend="gloo")
    n = job["kib"] * 256
    want = float(sum(r + 1 for r in range(world)))
    out, wrong, params = {}, 0, {}
    for label, g in groups.items():
        for mode in ("work1", "fut1", "fut8"):
            if label == "gloo":
                continue
            times = []
            for _ in range(job["rounds"] + 3):
                xs = [torch.full((n,), float(me + 1)) for _ in range(8 if mode == "fut8" else 1)]
                dist.barrier()
                t0 = time.perf_counter()
                works = [dist.all_reduce(x, async_op=True, group=g) for x in xs]
                for w in works:
                    if mode == "work1":
                        w.wait()
                    else:
                        w.get_future().wait()
                times.append(time.perf_counter() - t0)
                wrong += sum(int((x != want).sum()) for x in xs)
            out[(label, mode)] = statistics.median(times[3:]) * 1e6
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        ddp = DDP(model, process_group=g, bucket_cap_mb=0.25)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        x = torch.full((32, 256), 0.01 * (me + 1))
        times = []
        for _ in range(job["rounds"] + 3):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[(label, "ddp")] = statistics.median(times[3:]) * 1e6
        params[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = params["gloo"]
    for label, p in params.items():
        if not torch.allclose(p, ref, rtol=1e-5, atol=1e-6):
            wrong += 1
            print(f"schedule_ab: rank {me}: DDP parameters on {label} differ from gloo's",
                  file=sys.stderr)
    return {"times": {f"{k[0]}|{k[1]}": v for k, v in out.items()}, "wrong": wrong}


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
    print("| what | schedule=on | schedule=off | on/off | gloo |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("work1", "fut1", "fut8", "ddp"):
        on, off = t[f"ucx schedule=on|{mode}"], t[f"ucx schedule=off|{mode}"]
        gloo = t.get(f"gloo|{mode}")
        print(f"| {mode} | {on:.1f} | {off:.1f} | {on / off:.2f} | "
              f"{'' if gloo is None else f'{gloo:.1f}'} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
