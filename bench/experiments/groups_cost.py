#!/usr/bin/env python3
"""What many process groups cost: N new_group()s of "ucx" and of "gloo" in the same launch.

    .venv/bin/python bench/experiments/groups_cost.py [--groups 64] [--ranks 2] [--use]

Each rank initialises the default group ("ucx"), then creates --groups "ucx" groups over all
ranks and measures what that took (wall time of the creations, and the growth of the process's
threads, open fds and resident memory), then the same for --groups "gloo" groups. With --use every
new group also runs one all_reduce (checked), and the figures are read again after 2 s of idle
(so threads that serve queued collectives have had time to retire). Prints a table of rank 0's
figures (each rank's are in --json). UCX_NET_DEVICES=lo unless set.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402


def _status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def snapshot():
    return {"threads": _status("Threads"), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mib": _status("VmRSS") / 1024}


def delta(after, before):
    return {k: after[k] - before[k] for k in before}


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    ref = dist.new_group(backend="gloo")  # the barrier between phases (not counted)
    out, wrong = {}, 0
    keep = []
    for backend in ("ucx", "gloo"):
        dist.barrier(group=ref)
        before = snapshot()
        t0 = time.perf_counter()
        groups = [dist.new_group(backend=backend) for _ in range(job["groups"])]
        seconds = time.perf_counter() - t0
        dist.barrier(group=ref)
        row = {"seconds": seconds, **delta(snapshot(), before)}
        if job["use"]:
            for g in groups:
                x = torch.ones(4)
                dist.all_reduce(x, group=g)
                wrong += int((x != dist.get_world_size()).sum())
            time.sleep(2.0)
            row["after_use"] = delta(snapshot(), before)
        out[backend] = row
        keep.append(groups)
    dist.barrier(group=ref)
    dist.destroy_process_group()
    return {"rows": out, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--use", action="store_true", help="one all_reduce per group, then 2 s idle")
    p.add_argument("--json", action="store_true", help="print every rank's figures as JSON")
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"groups": a.groups, "use": a.use, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 600, "groups cost")
    for e in errors:
        print(f"groups_cost: {e}", file=sys.stderr)
    if errors or 0 not in results:
        return 1
    if a.json:
        print(json.dumps(results, indent=1, sort_keys=True))
    rows = results[0]["rows"]
    print(f"{a.groups} new_group()s on {a.ranks} ranks (rank 0; growth over the process before)")
    print("| backend | create s | threads | fds | RSS MiB |" +
          (" threads after use | fds after use | RSS MiB after use |" if a.use else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if a.use else ""))
    for backend, r in rows.items():
        line = f"| {backend} | {r['seconds']:.3f} | {r['threads']} | {r['fds']} | {r['rss_mib']:.1f} |"
        if a.use:
            u = r["after_use"]
            line += f" {u['threads']} | {u['fds']} | {u['rss_mib']:.1f} |"
        print(line)
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
