#!/usr/bin/env python3
"""Where the time of a CUDA all_reduce goes: per size, on 2 ranks sharing one GPU, the one-way time
of a blocking send/recv of the same bytes, the all_reduce's time, the time its async call takes to
return, and a host-tensor all_reduce of the same size, all on "ucx" in one launch.

    python bench/experiments/cuda_latency.py [--sizes 64K,1M,16M,64M] [--reps 20] [--device cuda:0]
                                             [--json PATH]

Each figure is the median over --reps repetitions of rank 0's time (after a barrier and a
torch.cuda.synchronize(); each operation ends with one); the p2p one is per one-way transfer of
--round-trips round trips. On a GPU one more all_reduce is issued right behind --busy-ms of
kernel work (torch.cuda._sleep) on rank 0's stream: its time beyond the kernel's, against the plain
all_reduce's, is how late commux sees the stream's work end (the fence before it posts).
float32 inputs are integers, so sums are exact, and every result is checked. Environment
variables (COMMUX_ALGO_ALLREDUCE, UCX_*) pass to the ranks, so one launch per setting compares
settings. With --device cpu it runs on host tensors (a dry run of the script on a machine
without a GPU). --json writes rank 0's figures ({"us": {size: {...}}, "wrong": N}) for other
scripts (device_latency.py).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402
from bench.lib.sizes import parse_size  # noqa: E402


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    torch.set_num_threads(1)
    dev = torch.device(job["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("ucx", init_method="env://")
    me, world = dist.get_rank(), dist.get_world_size()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    out, wrong = {}, 0
    if dev.type == "cuda":  # how many cycles torch.cuda._sleep needs for --busy-ms
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        e0.record()
        torch.cuda._sleep(1_000_000)
        e1.record()
        sync()
        job["busy_cycles"] = int(1_000_000 * job["busy_ms"] / max(e0.elapsed_time(e1), 1e-3))
    for size in job["sizes"]:
        n = size // 4
        buf = torch.zeros(n, device=dev)
        host = torch.zeros(n)
        t = {"p2p": [], "allreduce": [], "issue": [], "host allreduce": [], "busy": []}
        for rep in range(job["reps"] + 2):  # two warm-up repetitions
            # p2p: --round-trips round trips of `size` bytes, per one-way transfer (so that
            # the ranks' skew after the barrier is spread over them).
            buf.fill_(float(rep))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(job["round_trips"]):
                if me == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif me == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
            sync()
            dt_p2p = (time.perf_counter() - t0) / (2 * job["round_trips"])
            wrong += int((buf != float(rep)).sum()) if me < 2 else 0
            # all_reduce, blocking
            buf.fill_(float(me + rep))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            dt_ar = time.perf_counter() - t0
            wrong += int((buf != float(sum(r + rep for r in range(world)))).sum())
            # all_reduce, async: the time until the call returns, then wait
            buf.fill_(float(me + rep + 1))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            w = dist.all_reduce(buf, async_op=True)
            dt_issue = time.perf_counter() - t0
            w.wait()
            sync()
            wrong += int((buf != float(sum(r + rep + 1 for r in range(world)))).sum())
            # all_reduce issued behind --busy-ms of kernel work on rank 0's stream (rank 0 only:
            # two processes' kernels time-slice one GPU): the time beyond the kernel's is the
            # plain all_reduce's plus how late commux sees the stream finish.
            if dev.type == "cuda":
                buf.fill_(float(me + rep))
                sync()
                dist.barrier()
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                if me == 0:
                    torch.cuda._sleep(job["busy_cycles"])
                e1.record()
                dist.all_reduce(buf)
                sync()
                dt_busy = time.perf_counter() - t0 - e0.elapsed_time(e1) / 1e3
                wrong += int((buf != float(sum(r + rep for r in range(world)))).sum())
                if rep >= 2:
                    t["busy"].append(dt_busy)
            # host tensors, for contrast
            host.fill_(float(me + rep))
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(host)
            dt_host = time.perf_counter() - t0
            wrong += int((host != float(sum(r + rep for r in range(world)))).sum())
            if rep >= 2:
                t["p2p"].append(dt_p2p)
                t["allreduce"].append(dt_ar)
                t["issue"].append(dt_issue)
                t["host allreduce"].append(dt_host)
        out[size] = {k: statistics.median(v) * 1e6 for k, v in t.items() if v}
    dist.destroy_process_group()
    return {"us": out, "wrong": wrong}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64K,1M,16M,64M")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="write rank 0's figures and the wrong count here")
    p.add_argument("--busy-ms", type=float, default=2.0,
                   help="kernel time queued before the 'behind a kernel' all_reduce (CUDA only)")
    p.add_argument("--round-trips", type=int, default=10,
                   help="send/recv round trips per repetition of the p2p figure (docs/gpu.md's "
                        "first H200 figures used 1, which counted the ranks' skew after the "
                        "barrier)")
    a = p.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    job = {"sizes": sizes, "reps": a.reps, "device": a.device, "env": {},
           "round_trips": max(1, a.round_trips), "busy_ms": a.busy_ms}
    results, errors = launch_ranks(2, run_rank, job, a.timeout, "cuda latency")
    for e in errors:
        print(f"cuda_latency: {e}", file=sys.stderr)
    if errors or len(results) != 2:
        return 1
    r0 = results[0]["us"]
    print(f"2 ranks on {a.device}, median of {a.reps} repetitions on rank 0, µs")
    print("| size | p2p one-way | all_reduce | async call returns in | all_reduce behind a "
          f"{a.busy_ms:g} ms kernel, beyond the kernel | host all_reduce |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        row = r0[s] if s in r0 else r0[str(s)]
        busy = f"{row['busy']:.1f}" if "busy" in row else "-"
        print(f"| {s} | {row['p2p']:.1f} | {row['allreduce']:.1f} | {row['issue']:.1f} | {busy} | "
              f"{row['host allreduce']:.1f} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    if a.json:
        Path(a.json).write_text(json.dumps({"us": r0, "wrong": wrong}))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
