"""Rank-side functions of the wheel tests (run by mp in the fresh venv's interpreter)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def mapped_files() -> list:
    """Every file mapped into this process."""
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and parts[5].strip() not in paths:
                paths.append(parts[5].strip())
    return paths


def allreduce_and_p2p(ctx) -> dict:
    import commux

    assert dist.get_backend() == "ucx", dist.get_backend()
    t = torch.full((6,), float(ctx.rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((6,), 3.0)), t
    # Tagged p2p out of order: receives for tags 8 then 7 posted first, the peer sends 7 then 8.
    peer = 1 - ctx.rank
    a, b = torch.zeros(3), torch.zeros(3)
    works = [dist.irecv(a, src=peer, tag=8), dist.irecv(b, src=peer, tag=7),
             dist.isend(torch.full((3,), 70.0 + ctx.rank), dst=peer, tag=7),
             dist.isend(torch.full((3,), 80.0 + ctx.rank), dst=peer, tag=8)]
    for w in works:
        w.wait()
    assert torch.equal(a, torch.full((3,), 80.0 + peer)), a
    assert torch.equal(b, torch.full((3,), 70.0 + peer)), b
    return {"commux": commux.__file__, "maps": mapped_files()}
