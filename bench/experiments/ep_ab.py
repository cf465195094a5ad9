#!/usr/bin/env python3
"""Same-run A/B of one MoE round trip (dispatch + combine), back to back, results checked:

    .venv/bin/python bench/experiments/ep_ab.py [--world 2] [--tokens 1,8,32,128] [--rounds 5]
                                                [--iters 40] [--ll] [--timeout S]

commux-ep (commux.ep.Buffer on the "ucx" group) beside the torchtitan-style path (permute,
all_to_all_single of the counts, of the rows and of the metadata, the reverse all_to_all_single
and an index_add in float32) on "ucx" and on gloo, and commux-ep's dispatch beside one
all_to_all_single of the same bytes with its buffers reused (the transport floor). Unlike bench/ep
there is no barrier between iterations: each point is `--iters` calls back to back, `--rounds`
times, the backends interleaved per round; the table gives the median of the rounds' medians in
microseconds and the ratios. Every round trip's result is compared with the reference (the sum of
each token's row over the ranks it was sent to): a difference exits 1. The small workload of
bench/ep (hidden 2048, 64 experts, top-8), bf16, CPU. `--world 1` measures the Buffer's own cost
(no communication); `--ll` adds the low-latency round trip.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import launch_ranks  # noqa: E402

H, E, K = 2048, 64, 8


def _a2a_round_trip(dist, torch, x, idx, w, world, group=None):
    epr = E // world
    dest = torch.where(idx >= 0, idx // epr, torch.full_like(idx, world))
    in_rank = torch.zeros(x.shape[0], world + 1, dtype=torch.bool).scatter_(1, dest, True)
    in_rank = in_rank[:, :world]
    order = in_rank.t().nonzero()[:, 1]
    cnt = in_rank.sum(0)
    rc = torch.empty_like(cnt)
    dist.all_to_all_single(rc, cnt, group=group)
    sc, rcl = cnt.tolist(), rc.tolist()
    send = x.index_select(0, order)
    recv = torch.empty(sum(rcl), H, dtype=x.dtype)
    dist.all_to_all_single(recv, send, rcl, sc, group=group)
    meta = torch.cat([idx, w.view(torch.int32).to(torch.int64)], 1).index_select(0, order)
    rmeta = torch.empty(sum(rcl), 2 * K, dtype=torch.int64)
    dist.all_to_all_single(rmeta, meta, rcl, sc, group=group)
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, sc, rcl, group=group)
    acc = torch.zeros(x.shape, dtype=torch.float32)
    acc.index_add_(0, order, back.float())
    return acc.to(torch.bfloat16)


def run_rank(job):
    import torch
    import torch.distributed as dist
    import commux  # noqa: F401  (registers "ucx")
    from commux.ep import Buffer

    args = SimpleNamespace(**job["args"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("ucx", init_method="env://")
    gloo = dist.new_group(backend="gloo")
    buf = Buffer()
    llbuf = Buffer(low_latency_mode=True) if args.ll else None
    tokens = [int(t) for t in args.tokens.split(",")]
    res, wrong = {}, 0
    for _ in range(args.rounds):
        for T in tokens:
            g = torch.Generator().manual_seed(1000 * rank + T)
            x = (torch.randint(-64, 64, (T, H), generator=g).float() / 64).to(torch.bfloat16)
            idx = torch.rand(T, E, generator=g).topk(K, 1).indices
            w = torch.rand(T, K, generator=g)
            epr = E // world
            want = torch.zeros(T, H)
            for r in range(world):  # the unweighted rank sum of the token's own row
                want += x.float() * ((idx >= r * epr) & (idx < (r + 1) * epr)).any(1, keepdim=True)
            want = want.to(torch.bfloat16)
            rows = sum(int(((idx >= r * epr) & (idx < (r + 1) * epr)).any(1).sum())
                       for r in range(world))
            t = torch.tensor([rows])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)  # one size on every rank
            rows = int(t)
            ysend = torch.zeros(world * max(1, rows // world) * H, dtype=torch.bfloat16)
            yrecv = torch.empty_like(ysend)

            def ep_rt():
                rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
                return buf.combine(rx, h)[0]

            def ll_rt():
                rx, cnt, h, _, _ = llbuf.low_latency_dispatch(x, idx, max(tokens), E, use_fp8=False)
                return rx, h

            def a2a_rt(group=None):
                return _a2a_round_trip(dist, torch, x, idx, w, world, group)

            def ep_dispatch():
                return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)

            cases = [("commux-ep", ep_rt, True), ("a2a-ucx", a2a_rt, True)]
            if world > 1:
                cases.append(("a2a-gloo", lambda: a2a_rt(gloo), True))
            cases += [("ep-dispatch", ep_dispatch, False),
                      ("a2a-single", lambda: dist.all_to_all_single(yrecv, ysend), False)]
            if llbuf is not None:
                cases.append(("ll-dispatch", ll_rt, False))
            for name, fn, checked in cases:
                n = args.iters if name != "a2a-gloo" else max(5, args.iters // 3)
                out = None
                for _ in range(3):
                    out = fn()
                if checked and not torch.equal(out, want):
                    wrong += 1
                dist.barrier()
                ts = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                ts.sort()
                res.setdefault((T, name), []).append(ts[len(ts) // 2] * 1e6)
    if rank == 0:
        def med(T, n):
            v = sorted(res.get((T, n), [float("nan")]))
            return v[len(v) // 2]
        print(f"ep_ab: {world} ranks, hidden {H}, {E} experts, top-{K}, bf16, cpu; "
              f"{args.rounds} rounds x {args.iters} back-to-back iterations; microseconds")
        cols = (["commux-ep", "a2a-ucx"] + (["a2a-gloo"] if world > 1 else [])
                + ["ep-dispatch", "a2a-single"] + (["ll-dispatch"] if args.ll else []))
        print("| T | " + " | ".join(cols) + " | ep / a2a-ucx | "
              + ("ep / a2a-gloo | " if world > 1 else "") + "dispatch / a2a-single |")
        print("|---:|" + "---:|" * (len(cols) + 2 + (world > 1)))
        for T in tokens:
            m = {c: med(T, c) for c in cols}
            extra = f" {m['commux-ep'] / m['a2a-gloo']:.2f} |" if world > 1 else ""
            print(f"| {T} | " + " | ".join(f"{m[c]:.0f}" for c in cols)
                  + f" | {m['commux-ep'] / m['a2a-ucx']:.2f} |{extra} "
                  + f"{m['ep-dispatch'] / m['a2a-single']:.2f} |")
        print(f"wrong round trips: {wrong}")
    dist.destroy_process_group()
    return {"wrong": wrong}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--ll", action="store_true", help="also time the low-latency dispatch")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds before the ranks are killed")
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"args": vars(args), "env": {"OMP_NUM_THREADS": "1"}}
    results, errors = launch_ranks(args.world, run_rank, job, args.timeout, "ep_ab")
    for e in errors:
        print(f"ep_ab: {e}", file=sys.stderr)
    sys.exit(1 if errors or any(r["wrong"] for r in results.values()) else 0)


if __name__ == "__main__":
    main()
