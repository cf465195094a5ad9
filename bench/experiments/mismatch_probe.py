#!/usr/bin/env python3
"""Random cross-rank disagreements: in each trial one rank's second call of four differs from the
others' in one argument that matters to it (size, dtype, reduce op, AVG against SUM, root,
all_to_all_single splits, or the collective itself), on a fresh group; every rank records what
each call raised or whether its result was right. Each trial is classified:

* all raised: every rank got an error (the goal);
* SILENT: no rank raised and some result was wrong (the defect to hunt);
* PARTIAL-SILENT: some ranks raised, and one that did not has a wrong result;
* unaware: some ranks raised, the others returned right results and were never told, not even
  by the fifth call;
* benign: nobody raised and every result was right.

    .venv/bin/python bench/experiments/mismatch_probe.py [--ranks 3] [--seed 2] [--trials 60]

Trials whose error surfaces as a timeout take the group timeout (4 s).
"""
import argparse
import collections
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1] / "python" / "tests"
sys.path.insert(0, str(TESTS))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mp  # noqa: E402
from helpers import make, red_op, reduce_all  # noqa: E402

KINDS = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
         "all_to_all_single", "gather", "scatter", "all_gather", "barrier"]
RELEVANT = {
    "all_reduce": ["n", "dtype", "op", "avg", "kind"], "broadcast": ["n", "dtype", "root", "kind"],
    "reduce": ["n", "dtype", "op", "root", "kind"], "all_gather_into_tensor": ["n", "dtype", "kind"],
    "all_gather": ["n", "dtype", "kind"], "reduce_scatter_tensor": ["n", "dtype", "op", "kind"],
    "all_to_all_single": ["splits", "dtype", "kind"], "gather": ["n", "dtype", "root", "kind"],
    "scatter": ["n", "dtype", "root", "kind"], "barrier": ["kind"]}


def _call(c, me, W, g):
    """Runs call c; returns (outputs to check, expected) or raises."""
    kind, n, dt, op, root = c["kind"], c["n"], c["dtype"], c["op"], c["root"]
    inp = lambda r, m=n, tag="": make(r, m, dt, "SUM" if op == "AVG" else op, salt=c["salt"] + tag)  # noqa: E731
    if kind == "all_reduce":
        x = inp(me)
        dist.all_reduce(x, op=red_op(op), group=g)
        want = reduce_all([inp(r) for r in range(W)], op, W) if op != "AVG" else None
        return [(x, want)]
    if kind == "broadcast":
        x = inp(me)
        dist.broadcast(x, src=root, group=g)
        return [(x, inp(root))]
    if kind == "reduce":
        x = inp(me)
        dist.reduce(x, dst=root, op=red_op(op), group=g)
        return [(x, reduce_all([inp(r) for r in range(W)], op, W))] if me == root else []
    if kind == "all_gather_into_tensor":
        x = inp(me)
        out = torch.zeros(W * n, dtype=x.dtype)
        dist.all_gather_into_tensor(out, x, group=g)
        return [(out, torch.cat([inp(r) for r in range(W)]))]
    if kind == "all_gather":
        x = inp(me)
        outs = [torch.zeros_like(x) for _ in range(W)]
        dist.all_gather(outs, x, group=g)
        return [(outs[r], inp(r)) for r in range(W)]
    if kind == "reduce_scatter_tensor":
        x = inp(me, W * n)
        out = torch.zeros(n, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x, op=red_op(op), group=g)
        full = reduce_all([inp(r, W * n) for r in range(W)], op, W)
        return [(out, full[me * n:(me + 1) * n])]
    if kind == "all_to_all_single":
        sp = c["splits"]
        x = inp(me, sum(sp[me]))
        out = torch.zeros(sum(sp[s][me] for s in range(W)), dtype=x.dtype)
        dist.all_to_all_single(out, x, output_split_sizes=[sp[s][me] for s in range(W)],
                               input_split_sizes=sp[me], group=g)
        parts = []
        for s in range(W):
            off = sum(sp[s][:me])
            parts.append(inp(s, sum(sp[s]))[off:off + sp[s][me]])
        return [(out, torch.cat(parts))]
    if kind == "gather":
        x = inp(me)
        outs = [torch.zeros_like(x) for _ in range(W)] if me == root else None
        dist.gather(x, gather_list=outs, dst=root, group=g)
        return [(outs[r], inp(r)) for r in range(W)] if outs is not None else []
    if kind == "scatter":
        x = torch.zeros(n, dtype=inp(0, 1).dtype)
        ins = [inp(r) for r in range(W)] if me == root else None
        dist.scatter(x, scatter_list=ins, src=root, group=g)
        return [(x, inp(me))]
    if kind == "barrier":
        dist.barrier(group=g)
        return []
    raise ValueError(kind)


def _perturb(c, how, rng, W, bad):
    c = dict(c)
    if how == "n":
        c["n"] = c["n"] + rng.choice([1, -1 if c["n"] > 1 else 2, c["n"]])
    elif how == "dtype":
        c["dtype"] = rng.choice([d for d in ("float32", "int32", "float64", "int64", "float16") if d != c["dtype"]])
    elif how == "op":
        c["op"] = rng.choice([o for o in ("SUM", "MAX", "MIN", "PRODUCT") if o != c["op"]])
    elif how == "avg":
        c["op"] = "AVG" if c["op"] != "AVG" else "SUM"
        if c["dtype"] not in ("float32", "float64"):
            c["dtype"] = "float32"
    elif how == "root":
        c["root"] = (c["root"] + rng.randrange(1, W)) % W
    elif how == "splits":
        # What the changed rank expects from another rank s (its own input stays as it was, so
        # the other ranks' results stay what they were: only the pair (s, bad) disagrees).
        sp = [list(r) for r in c["splits"]]
        s = rng.choice([r for r in range(W) if r != bad])
        sp[s][bad] += rng.choice([1, 2]) if sp[s][bad] == 0 or rng.random() < 0.5 else -1
        c["splits"] = sp
    elif how == "kind":
        c["kind"] = rng.choice([k for k in KINDS if k != c["kind"]])
    return c


def run_trials(ctx, seed, trials):
    W, me = ctx.world, ctx.rank
    results = []
    for t in range(trials):
        rng = random.Random(f"{seed}/{t}/{W}")
        g = dist.new_group(list(range(W)), timeout=timedelta(seconds=4))
        calls = []
        for i in range(4):
            n = rng.choice([1, 5, 1000, 70_000, 300_000])
            dt = rng.choice(["float32", "int32", "float64", "int64"])
            c = {"kind": rng.choice(KINDS), "n": n, "dtype": dt, "op": rng.choice(["SUM", "MAX", "MIN"]),
                 "root": rng.randrange(W), "salt": f"{seed}/{t}/{i}",
                 "splits": [[rng.randrange(0, 2 * n // W + 2) for _ in range(W)] for _ in range(W)]}
            calls.append(c)
        bad_rank = rng.randrange(W)
        how = rng.choice(RELEVANT[calls[1]["kind"]])
        changed = _perturb(calls[1], how, rng, W, bad_rank)  # every rank draws it: the same on all
        same = changed == calls[1]
        mine = list(calls)
        if me == bad_rank:
            mine[1] = changed
        outcome = []
        for i, c in enumerate(mine):
            t0 = time.monotonic()
            try:
                pairs = _call(c, me, W, g)
                wrong = sum(1 for got, want in pairs
                            if want is not None and (got.dtype != want.dtype or got.shape != want.shape
                                                     or not torch.equal(got, want)))
                outcome.append(("ok", wrong, round(time.monotonic() - t0, 2)))
            except Exception as e:  # noqa: BLE001
                outcome.append(("err", str(e).splitlines()[0][:200], round(time.monotonic() - t0, 2)))
        # One more collective on the group once every rank is done and a few ms have passed:
        # where a rank had returned from the bad call, this is where the torch backend tells it.
        dist.barrier(group=ctx.ref)
        time.sleep(0.02)
        try:
            x = torch.ones(3)
            dist.all_reduce(x, group=g)
            outcome.append(("ok", int(not torch.equal(x, torch.full((3,), float(W)))), 0.0))
        except Exception as e:  # noqa: BLE001
            outcome.append(("err", str(e).splitlines()[0][:200], 0.0))
        everyone = [None] * W
        dist.all_gather_object(everyone, outcome, group=ctx.ref)
        try:
            dist.destroy_process_group(g)
        except Exception:  # noqa: BLE001
            pass
        if me == 0 and not same:
            desc = f"trial {t}: rank {bad_rank} changed the {how} of {calls[1]['kind']}"
            raised = [any(o[0] == "err" for o in oc) for oc in everyone]
            results.append((desc, raised, everyone))
    return results


def classify(res, world):
    counts = collections.Counter()
    for desc, raised, everyone in res:
        wrong = [sum(o[1] for o in oc if o[0] == "ok") for oc in everyone]
        if all(raised):
            kind = "all raised"
        elif not any(raised):
            kind = "SILENT" if any(wrong) else "benign"
        else:
            unaware = [r for r in range(world) if not raised[r]]
            kind = "PARTIAL-SILENT" if any(wrong[r] for r in unaware) else "unaware"
        counts[kind] += 1
        if kind != "all raised":
            print(kind, desc, everyone)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--trials", type=int, default=60)
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    # The ranks import this module by name to run its trials.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))
    import mismatch_probe
    outs, _ = mp.run_once(mismatch_probe.run_trials, args.ranks, args.seed, args.trials,
                          timeout=max(120, 10 * args.trials))
    bad = [o for o in outs if not o.ok]
    if bad:
        print("\n".join(o.describe() for o in bad))
        return 1
    counts = classify(outs[0].value, args.ranks)
    print(dict(counts))
    return 1 if counts["SILENT"] else 0


if __name__ == "__main__":
    sys.exit(main())
