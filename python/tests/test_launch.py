"""The package and the ways users start it: registration, both backend names, torchrun with
env://, and TORCH_DISTRIBUTED_DEBUG=DETAIL."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import check_equal, make
from suite import BACKEND, uses_commux, worlds

pytestmark = pytest.mark.ucx

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
def _backend_names(ctx):
    return dist.get_backend(), dist.get_backend(ctx.ref), dist.get_world_size(), dist.get_rank()


@worlds(2)
def test_default_group_uses_backend_under_test(ranks, ws):
    assert ranks.run(_backend_names) == [(BACKEND, "gloo", 2, r) for r in range(2)]


@pytest.mark.skipif(not uses_commux(), reason="the package itself is only checked with COMMUX_TEST_BACKEND=ucx/commux")
def test_package_registers_both_names():
    code = r"""
import os, torch.distributed as dist, commux
commux.register(); commux.register()          # idempotent
assert commux.preferred_backend() == "ucx", commux.preferred_backend()
names = set(dist.Backend.backend_list)
assert {"ucx", "commux"} <= names, names
root = os.path.dirname(commux.__file__)
print("OK", root)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


def _commux_name(ctx):
    x = torch.full((33,), float(ctx.rank + 1))
    dist.all_reduce(x)
    check_equal("all_reduce on backend 'commux'", x, torch.full((33,), 3.0))
    peer = 1 - ctx.rank
    buf = torch.zeros(9)
    w = [dist.irecv(buf, src=peer, tag=4), dist.isend(torch.full((9,), float(ctx.rank)), dst=peer, tag=4)]
    for r in w:
        r.wait()
    check_equal("p2p on backend 'commux'", buf, torch.full((9,), float(peer)))
    return dist.get_backend()


@pytest.mark.oneoff
@pytest.mark.skipif(not uses_commux(), reason="the 'commux' name exists only with commux")
def test_backend_name_commux_works():
    outs, closed = mp.run_once(_commux_name, 2, backend="commux", timeout=60)
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    assert [o.value for o in outs] == ["commux", "commux"]
    assert all(o.ok for o in closed), "\n".join(o.describe() for o in closed)


# ---------------------------------------------------------------------------------------------
@pytest.mark.oneoff
def test_torchrun_env_init_4_ranks():
    port = mp.free_port()
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if BACKEND == "gloo":
        env["COMMUX_SMOKE_BACKEND"] = "gloo"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.join(HERE, "scripts", "torchrun_smoke.py")]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=180)  # the script's own watchdog dumps stacks at 90 s
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"torchrun did not finish in 180s:\n{out[-8000:]}")
    took = time.monotonic() - t0
    print(out)
    assert p.returncode == 0, f"torchrun exited {p.returncode} after {took:.0f}s:\n{out[-8000:]}"
    want_backend = "gloo" if BACKEND == "gloo" else "ucx"  # preferred_backend() is "ucx"
    for r in range(4):
        line = f"SMOKE rank={r} world=4 backend={want_backend} allreduce=ok ring=ok"
        assert line in out, f"missing {line!r} in:\n{out[-8000:]}"


# ---------------------------------------------------------------------------------------------
def _detail_ops(ctx):
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL, dist.get_debug_level()
    W, me = ctx.world, ctx.rank
    x = make(me, 1001, "float32", salt="dbg")
    dist.all_reduce(x)
    check_equal("all_reduce under DETAIL", x, sum(make(r, 1001, "float32", salt="dbg") for r in range(W)))
    b = make(0, 77, "int64", salt="dbgb") if me == 0 else torch.zeros(77, dtype=torch.int64)
    dist.broadcast(b, src=0)
    check_equal("broadcast under DETAIL", b, make(0, 77, "int64", salt="dbgb"))
    outs = [torch.zeros(5) for _ in range(W)]
    dist.all_gather(outs, torch.full((5,), float(me)))
    for r in range(W):
        check_equal(f"all_gather[{r}] under DETAIL", outs[r], torch.full((5,), float(r)))
    o = torch.zeros(3)
    dist.reduce_scatter_tensor(o, torch.ones(3 * W))
    check_equal("reduce_scatter_tensor under DETAIL", o, torch.full((3,), float(W)))
    dist.barrier()
    peer = (me + 1) % W
    buf = torch.zeros(11)
    reqs = [dist.irecv(buf, src=(me - 1) % W, tag=3), dist.isend(torch.full((11,), float(me)), dst=peer, tag=3)]
    for r in reqs:
        r.wait()
    check_equal("p2p under DETAIL", buf, torch.full((11,), float((me - 1) % W)))
    return "ok"


@pytest.mark.oneoff
def test_torch_distributed_debug_detail():
    outs, closed = mp.run_once(_detail_ops, 2, backend=BACKEND, timeout=90,
                               env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert [o.value for o in outs] == ["ok", "ok"], "\n".join(o.describe() for o in outs)
    assert all(o.ok for o in closed), "\n".join(o.describe() for o in closed)
