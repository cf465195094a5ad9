"""Same-launch A/B of COMMUX_ATEN_REDUCE on CPU tensors: allreduce through commux's own reduction
kernels (group A) and through the ATen DeviceOps that CUDA tensors use (group B, the variable set
while that group is created), interleaved in one run of 2 ranks, every result checked.

    .venv/bin/python bench/experiments/aten_reduce_ab.py [--sizes 4096,1048576,67108864]
                                                         [--iters 20]

Prints per size: median time of each group and the ratio aten/kernels (< 1: ATen faster).
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
    import commux  # noqa: F401  -- registers "ucx"

    torch.set_num_threads(1)  # 2 ranks on 2 cores: no OpenMP spinning against the peer
    sizes, iters = job["sizes"], job["iters"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("ucx", init_method="env://")
    os.environ.pop("COMMUX_ATEN_REDUCE", None)
    kernels = dist.new_group(backend="ucx")
    os.environ["COMMUX_ATEN_REDUCE"] = "1"
    aten = dist.new_group(backend="ucx")
    os.environ.pop("COMMUX_ATEN_REDUCE", None)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        times = {"kernels": [], "aten": []}
        wrong = 0
        for it in range(iters):
            pair = (("kernels", kernels), ("aten", aten))
            for name, g in pair if it % 2 == 0 else pair[::-1]:
                t = torch.full((n,), float(rank + 1))
                dist.barrier(group=g)
                t0 = time.perf_counter()
                dist.all_reduce(t, group=g)
                times[name].append(time.perf_counter() - t0)
                if not bool((t == float(world * (world + 1) // 2)).all()):
                    wrong += 1
        rows.append((nbytes, statistics.median(times["kernels"]), statistics.median(times["aten"]),
                     wrong))
    be = aten._get_backend(torch.device("cpu"))
    calls = be.device_ops_calls
    dist.destroy_process_group()
    return {"rows": rows, "calls": calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,1048576,67108864")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    results, errors = launch_ranks(2, run_rank, {"sizes": sizes, "iters": a.iters}, 600,
                                   "aten_reduce A/B")
    for e in errors:
        print(f"aten_reduce_ab: {e}", file=sys.stderr)
    if errors or 0 not in results:
        return 1
    rows, calls = results[0]["rows"], results[0]["calls"]
    print(f"{'bytes':>10} {'kernels ms':>11} {'aten ms':>9} {'aten/kernels':>13} {'#wrong':>7}")
    bad = 0
    for nbytes, k, at, wrong in rows:
        print(f"{nbytes:>10} {k * 1e3:>11.3f} {at * 1e3:>9.3f} {at / k:>13.2f} {wrong:>7}")
        bad += wrong
    print(f"(the ATen group ran {calls} collective calls through the DeviceOps)")
    return 1 if bad or calls == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
