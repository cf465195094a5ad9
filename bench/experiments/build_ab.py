#!/usr/bin/env python3
"""Same-run A/B of two builds of commux: the C++ point-to-point ping-pong and the C++ collectives.

    python3 bench/experiments/build_ab.py OLD_BUILD NEW_BUILD [--rounds N] [--np 2,4]
                                          [--sizes 8,4K,64K,1M] [--ops allreduce,...]
                                          [--env K=V] [--old-env K=V] [--new-env K=V]

--env sets a variable for both sides, --old-env and --new-env for one (each may be repeated): the
same build twice with --new-env COMMUX_WAKEUP=on, say, compares a setting (UCX_NET_DEVICES is lo
unless set).

Each round runs, for each build in turn (the order alternates between rounds, so neither build
always goes first): commux_bench --mode pingpong (one-way latency) and commux_coll_bench on each
world size. Every run checks its data; a wrong byte fails the comparison. Prints, per (test,
size), the median over rounds of each build and NEW/OLD (below 1: the new build is faster). The
VM's timings drift: only the ratio within this run means anything.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.launch import run_command  # noqa: E402
from bench.lib.sizes import parse_size, size_name  # noqa: E402

ENV = {**os.environ, "UCX_NET_DEVICES": "lo"}
TIMEOUT_S = 600


def run_json(cmd, env):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        p = run_command(cmd + ["--json", str(out)], env, TIMEOUT_S)
        if p.returncode != 0 or not out.exists():
            sys.exit(f"build_ab: {' '.join(map(str, cmd))} failed (rc {p.returncode}): "
                     f"{(p.stderr or p.error or '')[-2000:]}")
        return json.loads(out.read_text())


def measure(build, args, env):
    """{(test, size): microseconds} of one build, and the wrong-byte count."""
    times, wrong = {}, 0
    sizes = ",".join(str(s) for s in args.sizes)
    r = run_json([str(build / "bench" / "commux_bench"), "--mode", "pingpong", "--sizes", sizes],
                 env)
    for row in r["rows"]:
        times[("p2p one-way", row["size"])] = row["time_us_median"]
        wrong += row["wrong"]
    for np_ in args.np:
        r = run_json([str(build / "bench" / "commux_coll_bench"), "--np", str(np_), "--ops",
                      ",".join(args.ops), "--sizes", sizes, "--reps", "5"], env)
        for row in r["rows"]:
            times[(f"{row['op']} np={np_}", row["bytes"])] = statistics.median(row["times_us"])
            wrong += row["wrong"]
    return times, wrong


def setting(text):
    """'K=V' -> (K, V)."""
    k, eq, v = text.partition("=")
    if not eq or not k:
        raise argparse.ArgumentTypeError(f"not K=V: {text!r}")
    return k, v


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--np", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[8, 4096, 65536, 1 << 20])
    p.add_argument("--ops", type=lambda s: s.split(","),
                   default=["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"])
    for name, whose in (("env", "both sides"), ("old-env", "OLD_BUILD"), ("new-env", "NEW_BUILD")):
        p.add_argument(f"--{name}", type=setting, action="append", default=[],
                       help=f"K=V: a variable for {whose} (repeatable)")
    args = p.parse_args(argv)
    extra = {w: {**dict(args.env), **dict(getattr(args, f"{w}_env"))} for w in ("old", "new")}
    envs = {w: {**ENV, **extra[w]} for w in ("old", "new")}
    runs = {"old": [], "new": []}
    wrong = 0
    for i in range(args.rounds):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for which in order:
            t, w = measure(getattr(args, which).resolve(), args, envs[which])
            runs[which].append(t)
            wrong += w
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    keys = list(runs["old"][0])
    for which in ("old", "new"):
        if extra[which]:
            print(f"{which}: " + " ".join(f"{k}={v}" for k, v in extra[which].items()))
    print(f"| test | size | old µs | new µs | new/old |  ({args.rounds} rounds, medians)")
    print("|---|---:|---:|---:|---:|")
    ratios = []
    for k in keys:
        old = statistics.median(r[k] for r in runs["old"])
        new = statistics.median(r[k] for r in runs["new"])
        ratios.append(new / old)
        print(f"| {k[0]} | {size_name(k[1])} | {old:.2f} | {new:.2f} | {new / old:.2f} |")
    geo = statistics.geometric_mean(ratios)
    print(f"\ngeometric mean of new/old over {len(ratios)} rows: {geo:.3f}; wrong bytes: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
