#!/usr/bin/env python3
"""Whether async collectives overlap: K all_reduces issued back to back, then waited, against K
blocking ones, for "ucx" and "gloo" in the same launch.

    .venv/bin/python bench/experiments/async_overlap.py [--ranks 2] [--count 8] [--kib 64]
                                                        [--rounds 50] [--passes 10] [--inflight 2]

Each round runs, per backend (alternating which goes first), --passes passes of K blocking
all_reduce calls of --kib KiB float32, then as many of K all_reduce(async_op=True) calls followed
by K wait()s; a round's time is the slowest rank's mean pass (the measured group's own barrier
before each: gloo's leaves the ranks tens of microseconds apart, as much as a pass takes at small
sizes). The groups share the processes, and so their progress thread: schedule_ab.py runs each
variant in launches of its own. Every result is checked
(integer-valued inputs, exact sums). Prints the median over rounds and async/blocking per backend;
issue 14 asks that async < blocking (the overlap is real). --inflight 1,2,auto adds a "ucx" group
per COMMUX_INFLIGHT value (collectives of one group run at once), --schedule on,off one per
COMMUX_SCHEDULE value (async collectives as schedules, or run whole on a collective thread), all
in the same launch.
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
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    groups = {}
    for label, env in ucx_groups(job["inflight"], job["schedule"]):
        os.environ.update(env)  # read when the group is created
        groups[label] = dist.new_group(backend="ucx")
        for name in env:
            os.environ.pop(name)
    groups["gloo"] = dist.new_group(backend="gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    n = job["kib"] * 256
    k = job["count"]
    passes = job["passes"]
    times = {b: {"blocking": [], "async": []} for b in groups}
    wrong = 0
    for rnd in range(job["rounds"] + 2):  # the first two are warm-up
        order = list(groups) if rnd % 2 == 0 else list(reversed(list(groups)))
        for backend in order:
            g = groups[backend]
            for mode in ("blocking", "async"):
                sets = [[torch.full((n,), float(me + i + rnd + p)) for i in range(k)]
                        for p in range(passes)]
                dist.barrier(group=g)  # the measured group's own: gloo's leaves ranks far apart
                t0 = time.perf_counter()
                for xs in sets:
                    all_reduces(dist, xs, g, mode)
                dt = (time.perf_counter() - t0) / passes
                for p, xs in enumerate(sets):
                    for i, x in enumerate(xs):
                        want = float(sum(r + i + rnd + p for r in range(world)))
                        wrong += int((x != want).sum())
                if rnd >= 2:
                    times[backend][mode].append(dt)
    # Every group ends before the interpreter does: a gloo worker thread that let go of the last
    # tensor during Python's finalization took the rank down (terminate in ProcessGroupGloo's
    # runLoop, 3 of 8 launches of inflight_netns.py in a row).
    dist.destroy_process_group()
    return {"times": times, "wrong": wrong}


def all_reduces(dist, xs, group, mode):
    """all_reduce of each tensor of xs on `group`: blocking ("blocking"), or all issued with
    async_op=True and then each waited (any other mode)."""
    if mode == "blocking":
        for x in xs:
            dist.all_reduce(x, group=group)
        return
    works = [dist.all_reduce(x, group=group, async_op=True) for x in xs]
    for w in works:
        w.wait()


def ucx_groups(inflight, schedule):
    """(label, environment) of each "ucx" group: every COMMUX_INFLIGHT value with every
    COMMUX_SCHEDULE value."""
    return [(f"ucx inflight={n} schedule={sc}", {"COMMUX_INFLIGHT": n, "COMMUX_SCHEDULE": sc})
            for sc in schedule for n in inflight]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--passes", type=int, default=10,
                   help="passes of K calls per timed round (a round's time is their mean)")
    p.add_argument("--inflight", default="auto",
                   help="COMMUX_INFLIGHT values (auto or 1..64), one ucx group each")
    p.add_argument("--schedule", default="on",
                   help="COMMUX_SCHEDULE values (on, off), one ucx group each with each --inflight")
    a = p.parse_args()
    inflight = a.inflight.split(",")
    schedule = a.schedule.split(",")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    job = {"count": a.count, "kib": a.kib, "rounds": a.rounds, "passes": a.passes,
           "inflight": inflight, "schedule": schedule, "env": {}}
    results, errors = launch_ranks(a.ranks, run_rank, job, 600, "async overlap")
    for e in errors:
        print(f"async_overlap: {e}", file=sys.stderr)
    if errors or len(results) != a.ranks:
        return 1
    return report(results, a.count, a.kib, a.ranks, a.rounds, inflight, schedule)


def report(results, count, kib, ranks, rounds, inflight, schedule=("on",), where=""):
    """Prints the table of run_rank's results (rank -> dict); 1 if any element was wrong."""
    print(f"{count} all_reduces of {kib} KiB on {ranks} ranks{where}, median of {rounds} rounds "
          "(each the slowest rank's)")
    print("| backend | blocking µs | async µs | async / blocking |")
    print("|---|---:|---:|---:|")
    for backend in [label for label, _ in ucx_groups(inflight, schedule)] + ["gloo"]:
        per = {}
        for mode in ("blocking", "async"):
            slowest = [max(results[r]["times"][backend][mode][i] for r in results)
                       for i in range(rounds)]
            per[mode] = statistics.median(slowest) * 1e6
        print(f"| {backend} | {per['blocking']:.1f} | {per['async']:.1f} | "
              f"{per['async'] / per['blocking']:.2f} |")
    wrong = sum(r["wrong"] for r in results.values())
    print(f"#wrong: {wrong}")
    return 1 if wrong else 0

if __name__ == "__main__":
    sys.exit(main())
