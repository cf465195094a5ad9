"""Many process groups, and a long mix of operations, cost what they should.

* Groups share the process's UCX worker, its progress thread and a pool of collective threads:
  64 ``new_group()``s add no thread (they used to add two each: a UCX worker with its progress
  thread, and a collective worker thread), few fds and little memory; each group still gets its
  own results, and the threads that ran their collectives retire once idle.
* The soak (``-m soak``; 1 minute here, longer with bench/experiments/soak.py): point-to-point,
  collectives and groups created and destroyed in a loop keep the resident memory flat after a
  warm-up, with every result checked.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from suite import worlds

pytestmark = [pytest.mark.ucx, pytest.mark.ucx_semantics]

GROUPS = 64
# Per group: the endpoints it needs (one per peer, itself included) hold a few fds each (shared
# memory segments, the self transport); 64 groups used to add 640 fds on 2 ranks.
FDS_PER_GROUP = 4
MIB_PER_GROUP = 1.0  # 64 groups used to add 310 MiB per rank (a UCX context and worker each)


def proc_status(field: str) -> int:
    """A number from /proc/self/status (VmRSS in KiB, Threads)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def resources() -> dict:
    return {"threads": proc_status("Threads"), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mib": proc_status("VmRSS") / 1024}


def _many_groups(ctx):
    dist.barrier(group=ctx.ref)
    before = resources()
    groups = [dist.new_group() for _ in range(GROUPS)]
    created = resources()
    problems = []
    grown = {k: created[k] - before[k] for k in before}
    if grown["threads"] > 0:
        problems.append(f"{GROUPS} groups added {grown['threads']} threads")
    if grown["fds"] > FDS_PER_GROUP * GROUPS:
        problems.append(f"{GROUPS} groups added {grown['fds']} fds (more than {FDS_PER_GROUP} each)")
    if grown["rss_mib"] > MIB_PER_GROUP * GROUPS:
        problems.append(f"{GROUPS} groups added {grown['rss_mib']:.0f} MiB (more than "
                        f"{MIB_PER_GROUP} each)")
    # Each group's own result, all in flight at once: no group takes another's messages.
    xs = [torch.full((8,), float(i + ctx.rank)) for i in range(GROUPS)]
    works = [dist.all_reduce(x, group=g, async_op=True) for x, g in zip(xs, groups)]
    for i, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        want = float(i * ctx.world + ctx.world * (ctx.world - 1) // 2)
        if not bool((x == want).all()):
            problems.append(f"group {i}: all_reduce gave {x[0].item()}, not {want}")
    # The collective threads retire once idle (a bounded wait for that, not a timing check).
    deadline = time.monotonic() + 30
    while proc_status("Threads") > before["threads"] + 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc_status("Threads") > before["threads"] + 4:
        problems.append(f"{proc_status('Threads') - before['threads']} more threads than before the "
                        "groups remain after their collectives ended")
    for g in groups:
        dist.destroy_process_group(g)
    dist.barrier(group=ctx.ref)
    assert not problems, f"rank {ctx.rank}: " + "; ".join(problems)
    return grown


@worlds(2)
def test_many_groups_share_the_worker_and_threads(ranks, ws):
    ranks.run(_many_groups, timeout=120)


# ---------------------------------------------------------------------------------------------
# The soak

def soak(rank: int, world: int, seconds: float, ref, warmup: float) -> dict:
    """Mixed traffic for `seconds` on the default group (the backend under test): isend/irecv of
    1 MiB both ways, a small and a 1 MiB all_reduce, all_gather_into_tensor, broadcast, and every
    tenth round a new group that runs an all_reduce and is destroyed. Every result is checked.
    Rank 0 decides when to stop (the small all_reduce carries its decision). Returns the resident
    memory after `warmup` seconds and the highest seen after it, in MiB."""
    big = 1 << 18  # 1 MiB of float32
    peer = (rank + 1) % world
    src = (rank - 1) % world
    start = time.monotonic()
    base = peak = None
    rounds = 0
    while True:
        out = torch.full((big,), float(rank + rounds))
        got = torch.empty(big)
        works = [dist.irecv(got, src=src, tag=rounds % 1000), dist.isend(out, dst=peer, tag=rounds % 1000)]
        go = torch.tensor([1.0 if rank != 0 or time.monotonic() - start < seconds else 0.0, 1.0])
        dist.all_reduce(go)
        for w in works:
            w.wait()
        assert got[0].item() == src + rounds and got[-1].item() == src + rounds, "p2p payload"
        x = torch.full((big,), float(rank))
        dist.all_reduce(x)
        assert x[0].item() == world * (world - 1) / 2 and x[-1].item() == x[0].item(), "all_reduce"
        gathered = torch.empty(world * 1000)
        dist.all_gather_into_tensor(gathered, torch.full((1000,), float(rank)))
        assert all(gathered[r * 1000].item() == r for r in range(world)), "all_gather"
        b = torch.full((1000,), float(rank + rounds))
        dist.broadcast(b, src=rounds % world)
        assert b[-1].item() == rounds % world + rounds, "broadcast"
        if rounds % 10 == 0:
            g = dist.new_group()
            y = torch.ones(16)
            dist.all_reduce(y, group=g)
            assert y[0].item() == world, "all_reduce on a new group"
            dist.destroy_process_group(g)
        rounds += 1
        if go[1].item() != world:
            raise AssertionError(f"the stop vote summed to {go[1].item()}, not {world}")
        now = time.monotonic()
        rss = proc_status("VmRSS") / 1024
        if now - start >= warmup:
            if base is None:
                base = rss
            peak = max(peak or rss, rss)
        if go[0].item() < world:
            break
    dist.barrier(group=ref)
    return {"rounds": rounds, "base_mib": base, "peak_mib": peak}


def _soak(ctx, seconds, warmup, bound_mib):
    r = soak(ctx.rank, ctx.world, seconds, ctx.ref, warmup)
    grown = r["peak_mib"] - r["base_mib"]
    assert grown < bound_mib, (f"rank {ctx.rank}: resident memory grew {grown:.1f} MiB over "
                               f"{r['rounds']} rounds after the warm-up (from {r['base_mib']:.0f} MiB)")
    return r


@pytest.mark.soak
@worlds(2)
def test_soak_keeps_memory_flat(ranks, ws):
    ranks.run(_soak, 60.0, 15.0, 48.0, timeout=180)
