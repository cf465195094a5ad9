#!/usr/bin/env python3
"""The long soak: the loop of python/tests/test_groups.py (isend/irecv, all_reduce small and
1 MiB, all_gather, broadcast, a new group every tenth round) for --minutes, on --ranks ranks.

    .venv/bin/python bench/experiments/soak.py [--minutes 10] [--ranks 2] [--backend ucx]
                                               [--bound-mib 48]

Prints each rank's rounds and resident memory after the warm-up (a tenth of the run, at least
15 s) and at its highest after it; fails when it grew by --bound-mib or more, or a result was
wrong. UCX_NET_DEVICES=lo unless set.
"""
import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.lib.launch import launch_ranks  # noqa: E402


def run_rank(job):
    sys.path.insert(0, str(ROOT / "python" / "tests"))
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from test_groups import soak
    torch.set_num_threads(1)
    dist.init_process_group(job["backend"], init_method="env://")
    ref = dist.new_group(backend="gloo")
    r = soak(dist.get_rank(), dist.get_world_size(), job["seconds"], ref, job["warmup"])
    dist.destroy_process_group()
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default="ucx")
    p.add_argument("--bound-mib", type=float, default=48.0)
    a = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    seconds = a.minutes * 60
    job = {"seconds": seconds, "warmup": max(15.0, seconds / 10), "backend": a.backend, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, int(seconds) + 300, "soak")
    for e in errors:
        print(f"soak: {e}", file=sys.stderr)
    bad = bool(errors) or len(results) != a.ranks
    print(f"soak, {a.backend}, {a.ranks} ranks, {a.minutes:g} min")
    print("| rank | rounds | RSS after warm-up MiB | highest after MiB | growth MiB |\n|---:|---:|---:|---:|---:|")
    for rank, r in sorted(results.items()):
        grown = r["peak_mib"] - r["base_mib"]
        bad = bad or grown >= a.bound_mib
        print(f"| {rank} | {r['rounds']} | {r['base_mib']:.1f} | {r['peak_mib']:.1f} | {grown:.1f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
