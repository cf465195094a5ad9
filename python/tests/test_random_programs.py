"""Random programs: every rank runs the same seeded sequence of collectives and point-to-point
messages, on groups made with different execution settings, each rank choosing on its own which
calls are async, when it waits and in what order. Every output, and every input a call must leave
alone, is checked against what the program computes.

This is the execution model's differential test: caller-run and pool-run collectives, schedules,
several collectives of a group in flight, p2p beside them with reused tags, and waits through
Work.wait() or the future, in orders no hand-written test spells out. A failure names the seed,
the round and the call, and `COMMUX_RANDOM_SEEDS=a,b,...` reruns those seeds.
"""
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from helpers import check_equal, group_with, make, red_op, reduce_all
from suite import worlds

pytestmark = pytest.mark.ucx

# Settings of the groups a program's calls are spread over (each group is made with these set).
GROUP_SETTINGS = [
    {},
    {"COMMUX_INFLIGHT": "4"},
    {"COMMUX_SCHEDULE": "1", "COMMUX_INFLIGHT": "4"},
    {"COMMUX_SCHEDULE": "1", "COMMUX_PROGRESS_RESUMES": "1"},
    {"COMMUX_CALLER_RUNS": "0", "COMMUX_INFLIGHT": "3"},
    {"COMMUX_GROUP": "1", "COMMUX_COALESCE": "1"},
    # A second worker (a wakeup mode of its own) whose progress thread sleeps on UCX's event fd,
    # and waiters that sleep at once: its calls complete through that thread's wake-ups.
    {"COMMUX_WAKEUP": "on", "COMMUX_SPIN_US": "0", "COMMUX_INFLIGHT": "3"},
]
SIZES = [1, 13, 1000, 40_000, 300_000]  # elements: eager and rendezvous messages, pipelined ones
DTYPES = ["float32", "int32", "float64", "int64", "bfloat16"]
OPS = ["SUM", "MAX", "MIN", "PRODUCT"]
KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
         "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "barrier", "p2p", "p2p",
         "batch_p2p", "overlapping_pair", "all_to_all", "reduce_scatter"]


def _program(seed, rnd, W, length):
    """The calls of one round, the same on every rank."""
    rng = random.Random(f"{seed}/{rnd}/{W}")
    calls = []
    for i in range(length):
        kind = rng.choice(KINDS)
        c = {"i": i, "kind": kind, "group": rng.randrange(len(GROUP_SETTINGS)),
             "n": rng.choice(SIZES if rng.random() < 0.7 else SIZES[:3]), "dtype": rng.choice(DTYPES),
             "op": rng.choice(OPS), "root": rng.randrange(W), "salt": f"{seed}/{rnd}/{i}"}
        if c["dtype"] == "bfloat16" and c["op"] in ("SUM", "PRODUCT"):
            c["op"] = "MAX"  # bfloat16 sums of many values are not exact in every order
        if kind == "all_to_all_single":
            c["splits"] = [[rng.randrange(0, 2 * c["n"] // max(W, 1) + 2) for _ in range(W)] for _ in range(W)]
        if kind in ("p2p", "batch_p2p"):
            pairs = max(1, rng.randrange(1, 4)) if kind == "batch_p2p" else 1
            c["msgs"] = []
            for _ in range(pairs):
                src = rng.randrange(W)
                dst = rng.randrange(W)
                if W > 1:
                    while dst == src:
                        dst = rng.randrange(W)
                # Few tags, so messages of one pair often share a tag: they must match in order.
                c["msgs"].append((src, dst, rng.randrange(3), rng.choice(SIZES)))
        calls.append(c)
    return calls


class _Round:
    def __init__(self, ctx, groups, seed, rnd):
        self.W, self.me = ctx.world, ctx.rank
        self.groups = groups
        self.where = f"seed {seed}, round {rnd}, {self.W} ranks"
        self.checks = []  # (what, tensor, expected)
        self.pending = []  # (what, work)

    def inp(self, c, rank, n=None, op=None, tag=""):
        return make(rank, c["n"] if n is None else n, c["dtype"], op or "SUM", salt=c["salt"] + tag)

    def expect(self, c, what, got, want):
        self.checks.append((f"{self.where}, call #{c['i']} ({c['kind']} on group {c['group']}): {what}",
                            got, want))

    def untouched(self, c, what, t):
        """`t` is an input the call must not write: checked after every wait."""
        self.expect(c, f"{what} (an input) is unchanged", t, t.clone())

    def issue(self, c, rng):
        W, me = self.W, self.me
        g = self.groups[c["group"]]
        async_op = rng.random() < 0.6
        kind = c["kind"]
        work = None
        if kind == "all_reduce":
            x = self.inp(c, me, op=c["op"])
            want = reduce_all([self.inp(c, r, op=c["op"]) for r in range(W)], c["op"], W)
            work = dist.all_reduce(x, op=red_op(c["op"]), group=g, async_op=async_op)
            self.expect(c, c["op"], x, want)
        elif kind == "broadcast":
            x = self.inp(c, me)
            work = dist.broadcast(x, src=c["root"], group=g, async_op=async_op)
            self.expect(c, f"from {c['root']}", x, self.inp(c, c["root"]))
        elif kind == "reduce":
            x = self.inp(c, me, op="SUM" if c["dtype"] != "bfloat16" else "MAX")
            op = "SUM" if c["dtype"] != "bfloat16" else "MAX"
            work = dist.reduce(x, dst=c["root"], op=red_op(op), group=g, async_op=async_op)
            if me == c["root"]:
                self.expect(c, f"at root {c['root']}", x,
                            reduce_all([self.inp(c, r, op=op) for r in range(W)], op, W))
        elif kind == "all_gather":
            x = self.inp(c, me)
            outs = [torch.zeros_like(x) for _ in range(W)]
            work = dist.all_gather(outs, x, group=g, async_op=async_op)
            for r in range(W):
                self.expect(c, f"[{r}]", outs[r], self.inp(c, r))
            self.untouched(c, "input", x)
        elif kind == "all_gather_into_tensor":
            x = self.inp(c, me)
            out = torch.zeros(W * c["n"], dtype=x.dtype)
            work = dist.all_gather_into_tensor(out, x, group=g, async_op=async_op)
            self.expect(c, "output", out, torch.cat([self.inp(c, r) for r in range(W)]))
            self.untouched(c, "input", x)
        elif kind == "reduce_scatter_tensor":
            op = "SUM" if c["dtype"] != "bfloat16" else "MAX"
            x = self.inp(c, me, n=W * c["n"], op=op)
            out = torch.zeros(c["n"], dtype=x.dtype)
            work = dist.reduce_scatter_tensor(out, x, op=red_op(op), group=g, async_op=async_op)
            full = reduce_all([self.inp(c, r, n=W * c["n"], op=op) for r in range(W)], op, W)
            self.expect(c, op, out, full[me * c["n"]:(me + 1) * c["n"]])
            self.untouched(c, "input", x)
        elif kind == "all_to_all_single":
            sp = c["splits"]  # sp[s][d]: elements rank s sends to rank d
            x = self.inp(c, me, n=sum(sp[me]))
            out = torch.zeros(sum(sp[s][me] for s in range(W)), dtype=x.dtype)
            work = dist.all_to_all_single(out, x, output_split_sizes=[sp[s][me] for s in range(W)],
                                          input_split_sizes=sp[me], group=g, async_op=async_op)
            parts = []
            for s in range(W):
                xs = self.inp(c, s, n=sum(sp[s]))
                off = sum(sp[s][:me])
                parts.append(xs[off:off + sp[s][me]])
            self.expect(c, "output", out, torch.cat(parts))
            self.untouched(c, "input", x)
        elif kind == "gather":
            x = self.inp(c, me)
            outs = [torch.zeros_like(x) for _ in range(W)] if me == c["root"] else None
            work = dist.gather(x, gather_list=outs, dst=c["root"], group=g, async_op=async_op)
            if outs is not None:
                for r in range(W):
                    self.expect(c, f"[{r}] at root {c['root']}", outs[r], self.inp(c, r))
            self.untouched(c, "input", x)
        elif kind == "scatter":
            x = torch.zeros(c["n"], dtype=self.inp(c, 0, n=1).dtype)
            ins = [self.inp(c, r, tag="/s") for r in range(W)] if me == c["root"] else None
            work = dist.scatter(x, scatter_list=ins, src=c["root"], group=g, async_op=async_op)
            self.expect(c, f"from {c['root']}", x, self.inp(c, me, tag="/s"))
            for r, t in enumerate(ins or []):
                self.untouched(c, f"scatter_list[{r}]", t)
        elif kind == "overlapping_pair":
            # Two calls on overlapping slices of one tensor: a group that runs several at once
            # must still run them in issue order, whose result is the one below.
            n, h = c["n"], max(1, c["n"] // 2)
            base = self.inp(c, me, n=n + h)
            work = dist.all_reduce(base[:n], op=red_op("MAX"), group=g, async_op=True)
            self.pending.append((f"call #{c['i']} all_reduce of the first slice", work))
            work = dist.broadcast(base[h:], src=c["root"], group=g, async_op=async_op)
            first = reduce_all([self.inp(c, r, n=n + h)[:n] for r in range(W)], "MAX", W)
            at_root = self.inp(c, c["root"], n=n + h)
            at_root[:n] = first
            want = self.inp(c, me, n=n + h)
            want[:n] = first
            want[h:] = at_root[h:]
            self.expect(c, "both slices, in issue order", base, want)
        elif kind == "all_to_all":
            ins = [self.inp(c, me, tag=f"/to{d}") for d in range(W)]
            outs = [torch.zeros_like(ins[0]) for _ in range(W)]
            work = dist.all_to_all(outs, ins, group=g, async_op=async_op)
            for s in range(W):
                self.expect(c, f"from {s}", outs[s], self.inp(c, s, tag=f"/to{me}"))
            for d, t in enumerate(ins):
                self.untouched(c, f"input [{d}]", t)
        elif kind == "reduce_scatter":
            op = "SUM" if c["dtype"] != "bfloat16" else "MAX"
            ins = [self.inp(c, me, op=op, tag=f"/rs{d}") for d in range(W)]
            out = torch.zeros_like(ins[0])
            work = dist.reduce_scatter(out, ins, op=red_op(op), group=g, async_op=async_op)
            self.expect(c, op, out, reduce_all([self.inp(c, s, op=op, tag=f"/rs{me}") for s in range(W)], op, W))
            for d, t in enumerate(ins):
                self.untouched(c, f"input [{d}]", t)
        elif kind == "barrier":
            work = dist.barrier(group=g, async_op=async_op)
        elif kind in ("p2p", "batch_p2p"):
            ops = []
            for k, (src, dst, tag, n) in enumerate(c["msgs"]):
                what = f"message {k}: {src} -> {dst}, tag {tag}, {n} elements"
                if me == src:
                    t = self.inp(c, src, n=n, tag=f"/m{k}")
                    ops.append((what + " (send)", "send", t, dst, tag))
                    self.untouched(c, what + ", send buffer", t)
                if me == dst:
                    t = torch.zeros(n, dtype=self.inp(c, 0, n=1).dtype)
                    ops.append((what + " (recv)", "recv", t, src, tag))
                    self.expect(c, what, t, self.inp(c, src, n=n, tag=f"/m{k}"))
            if kind == "batch_p2p" and ops:
                p2p = [dist.P2POp(dist.isend if d == "send" else dist.irecv, t, peer, group=g, tag=tag)
                       for _, d, t, peer, tag in ops]
                for k, w in enumerate(dist.batch_isend_irecv(p2p)):
                    self.pending.append((f"call #{c['i']} batch {k}", w))
            else:
                for what, d, t, peer, tag in ops:
                    f = dist.isend if d == "send" else dist.irecv
                    self.pending.append((f"call #{c['i']} {what}", f(t, peer, group=g, tag=tag)))
            return
        if async_op:
            self.pending.append((f"call #{c['i']} {kind}", work))

    def wait_some(self, rng, everything):
        if not self.pending:
            return
        k = len(self.pending) if everything else rng.randrange(len(self.pending) + 1)
        rng.shuffle(self.pending)
        for what, w in self.pending[:k]:
            if rng.random() < 0.3:
                w.get_future().wait()
            else:
                w.wait()
        del self.pending[:k]


def _run_programs(ctx, seeds, rounds, length):
    groups = [None if not env else group_with(env) for env in GROUP_SETTINGS]
    n = 0
    for seed in seeds:
        for rnd in range(rounds):
            rng = random.Random(f"{seed}/{rnd}/rank{ctx.rank}")  # this rank's own choices
            r = _Round(ctx, groups, seed, rnd)
            for c in _program(seed, rnd, ctx.world, length):
                r.issue(c, rng)
                if rng.random() < 0.15:
                    r.wait_some(rng, everything=False)
                if rng.random() < 0.05:
                    time.sleep(rng.random() * 0.003)
            r.wait_some(rng, everything=True)
            for what, got, want in r.checks:
                check_equal(what, got, want)
            n += len(r.checks)
    for g in groups:
        if g is not None:
            dist.destroy_process_group(g)
    return n


def _seeds(default):
    env = os.environ.get("COMMUX_RANDOM_SEEDS")
    return [int(s) for s in env.split(",")] if env else default


@worlds(2, 3, 4)
def test_random_programs(ranks, ws):
    ranks.run(_run_programs, _seeds([ws]), 3, 40, timeout=240)
