"""Beyond one machine: torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d across two
"hosts", two network namespaces joined by a veth pair whose addresses exist only inside them,
with UCX_TLS=tcp (namespaces do not hide shared memory from UCX, so TCP is forced, as between
real hosts). Runs the halo example (examples/halo_exchange.py, checked bitwise against a single
process by the example itself) and a DDP training with an elastic restart (one worker SIGKILLed on
the first attempt, --max-restarts=1; the final parameters must equal a single-process training).

The test creates and removes the namespaces itself and skips, saying why, where they are not
permitted (not root, no CAP_SYS_ADMIN, no iproute2). tests/netns_two_hosts.sh is the C++ driver's
version of the same setup.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from suite import uses_commux

pytestmark = [pytest.mark.ucx, pytest.mark.oneoff,
              pytest.mark.skipif(not uses_commux(), reason="the multi-host runs use the 'ucx' backend")]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HALO = os.path.join(REPO, "examples", "halo_exchange.py")
DDP_JOB = os.path.join(HERE, "scripts", "multinode_ddp.py")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class TwoHosts:
    """Two network namespaces a, b joined by a veth pair: a = NET.1, b = NET.2."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = [f"cmx-mn-a{tag}", f"cmx-mn-b{tag}"]
        self.dev = [f"cmxma{tag}", f"cmxmb{tag}"]
        net = f"10.232.{tag % 250}."
        self.addr = [net + "1", net + "2"]
        self.created: list[str] = []

    def up(self):
        if shutil.which("ip") is None:
            pytest.skip("iproute2 (the `ip` command) is not installed: cannot create network namespaces")
        r = _ip("netns", "add", self.ns[0], check=False)
        if r.returncode != 0:
            pytest.skip(f"network namespaces are not permitted here (ip netns add: {r.stderr.strip()}); "
                        "the two-host test needs root or CAP_SYS_ADMIN")
        self.created.append(self.ns[0])
        _ip("netns", "add", self.ns[1])
        self.created.append(self.ns[1])
        r = _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1], check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair here: {r.stderr.strip()}")
        for i in (0, 1):
            _ip("link", "set", self.dev[i], "netns", self.ns[i])
            _ip("-n", self.ns[i], "addr", "add", self.addr[i] + "/24", "dev", self.dev[i])
            _ip("-n", self.ns[i], "link", "set", "lo", "up")
            _ip("-n", self.ns[i], "link", "set", self.dev[i], "up")
        outside = _ip("-o", "addr", "show").stdout
        assert self.addr[0] + "/" not in outside, "the namespace's address is visible outside it"
        return self

    def veth_bytes(self) -> tuple[int, int]:
        def stat(name):
            return int(subprocess.run(["ip", "netns", "exec", self.ns[0], "cat",
                                       f"/sys/class/net/{self.dev[0]}/statistics/{name}"],
                                      capture_output=True, text=True, timeout=30, check=True).stdout)
        return stat("tx_bytes"), stat("rx_bytes")

    def down(self):
        for ns in self.created:
            # Whatever is left in a namespace (a hung launcher's children) is ours: end it first.
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self.created.clear()


@pytest.fixture(scope="module")
def hosts():
    h = TwoHosts()
    try:
        yield h.up()
    finally:
        h.down()


def torchrun_on_both(h: TwoHosts, script_args: list[str], timeout: float, extra=(),
                     env_extra=None) -> list[str]:
    """Starts one torchrun agent per namespace (node a hosts the c10d rendezvous); returns their
    outputs after both exit 0 (fails the test naming the node otherwise)."""
    port = 29400
    rdzv_id = f"commux-mn-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    for i in (0, 1):
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=h.dev[i], GLOO_SOCKET_IFNAME=h.dev[i],
                   OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env_extra or {}))
        cmd = ["ip", "netns", "exec", h.ns[i], sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={h.addr[0]}:{port}", f"--rdzv-id={rdzv_id}",
               # Node a serves the rendezvous store: torch's own test (is the endpoint this
               # machine's hostname?) cannot tell, since both namespaces share one hostname.
               f"--rdzv-conf=is_host={1 if i == 0 else 0}",
               f"--local-addr={h.addr[i]}", "--monitor-interval=0.5", *extra, *script_args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True))
    outs = [""] * 2
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs):
        try:
            outs[i], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            for j, q in enumerate(procs):
                outs[j] = (outs[j] or "") + (q.communicate()[0] or "")
            pytest.fail(f"torchrun did not finish in {timeout:.0f} s:\n" + _both(outs))
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"node {i} ({h.ns[i]}): torchrun exited {p.returncode}:\n" + _both(outs)
    return outs


def _both(outs):
    return "\n".join(f"--- node {i} ---\n{o[-6000:]}" for i, o in enumerate(outs))


def test_halo_example_across_two_hosts(hosts):
    tx0, rx0 = hosts.veth_bytes()
    # (No --n: torchrun's parser would take it for an abbreviation of its own --nnodes.)
    outs = torchrun_on_both(hosts, [HALO, "--iters", "30", "--warmup", "2", "--timeout", "60"],
                            timeout=240)
    text = outs[0] + outs[1]
    for backend in ("ucx", "gloo"):
        assert any(f"halo_exchange: {backend:>6}:" in ln and "check: OK" in ln for ln in text.splitlines()), \
            f"no 'check: OK' line for {backend}:\n" + _both(outs)
    tx, rx = hosts.veth_bytes()
    # 30 iterations of 512-cell halos between the hosts, per backend: the traffic crossed the veth.
    assert tx - tx0 > 50_000 and rx - rx0 > 50_000, (tx - tx0, rx - rx0)


def test_ddp_training_with_an_elastic_restart(hosts, tmp_path):
    sys.path.insert(0, os.path.dirname(DDP_JOB))
    try:
        import multinode_ddp as job
    finally:
        sys.path.pop(0)
    out = str(tmp_path)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers of each round get a fresh store (rank 0
    # hosts it). By default they share the agents' rendezvous store, where the first round's keys
    # outlive it when an agent restarts for the other node's re-joining (its restart count stays
    # 0): the restarted workers then read the dead workers' addresses, and gloo fails exactly like
    # ucx ("connectFullMesh failed ... Connection refused").
    outs = torchrun_on_both(hosts, [DDP_JOB, out], timeout=240, extra=["--max-restarts=1"],
                            env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    with open(os.path.join(out, "attempts.log")) as f:
        attempts = f.read()
    assert f"rank {job.KILL_RANK} kills itself" in attempts, attempts + _both(outs)
    for r in range(4):  # every rank started twice: the first round, and the restarted one
        assert len(re.findall(rf"^attempt \d rank {r} world 4 backend ucx", attempts, re.M)) == 2, \
            attempts + _both(outs)
    torch.set_num_threads(1)
    want = job.train(job.model(), 1, 0).state_dict()
    for r in range(4):
        got = torch.load(os.path.join(out, f"params-rank{r}.pt"))
        for k, v in want.items():
            assert torch.allclose(got[k], v, rtol=0, atol=1e-12), (r, k, (got[k] - v).abs().max())
