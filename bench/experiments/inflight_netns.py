#!/usr/bin/env python3
"""async_overlap.py's measurement over an emulated network: its two ranks run in two network
namespaces joined by a veth pair that delays every packet (netem), over UCX_TLS=tcp, so that a
collective waits for the wire the way it does between hosts and COMMUX_INFLIGHT's concurrency
can show.

    .venv/bin/python bench/experiments/inflight_netns.py [--delay-us 50] [--count 8] [--kib 64]
                                                        [--rounds 50] [--inflight 1,2,4] [--schedule on,off]

Needs root (ip netns; tc and the kernel's sch_netem for --delay-us > 0). Creates and removes
the namespaces itself. --delay-us is added on each side's egress, so a round trip takes twice
that on top of the machine's own cost. Prints async_overlap.py's table: K blocking all_reduces
against K async ones then waited, per "ucx" group (one per COMMUX_INFLIGHT value) and gloo, every
result checked.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.experiments.async_overlap import report  # noqa: E402
from bench.lib.launch import free_port  # noqa: E402

RANK = """
import json, os, sys
sys.path.insert(0, {repo!r})
from bench.experiments.async_overlap import run_rank
out = run_rank(json.loads(os.environ["INFLIGHT_JOB"]))
with open(os.environ["INFLIGHT_OUT"], "w") as f:
    json.dump(out, f)
"""


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-us", type=int, default=50)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--passes", type=int, default=10,
                   help="passes of K calls per timed round (async_overlap.py)")
    p.add_argument("--inflight", default="1,2,4")
    p.add_argument("--schedule", default="on", help="COMMUX_SCHEDULE values (on, off)")
    p.add_argument("--timeout", type=int, default=600)
    a = p.parse_args()
    inflight = a.inflight.split(",")
    schedule = a.schedule.split(",")
    pid = os.getpid()
    ns = [f"cmxi-a-{pid}", f"cmxi-b-{pid}"]
    dev = [f"cmxia{pid % 100000}", f"cmxib{pid % 100000}"]
    net = f"10.232.{pid % 250}."
    addr = [net + "1", net + "2"]
    try:
        ip("netns", "add", ns[0])
        ip("netns", "add", ns[1])
        ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in range(2):
            ip("link", "set", dev[i], "netns", ns[i])
            ip("-n", ns[i], "addr", "add", addr[i] + "/24", "dev", dev[i])
            ip("-n", ns[i], "link", "set", "lo", "up")
            ip("-n", ns[i], "link", "set", dev[i], "up")
            if a.delay_us > 0:
                r = subprocess.run(["tc", "-n", ns[i], "qdisc", "add", "dev", dev[i], "root",
                                    "netem", "delay", f"{a.delay_us}us"], capture_output=True,
                                   text=True)
                if r.returncode != 0:
                    print(f"inflight_netns: tc netem: {r.stderr.strip()} (this kernel may lack "
                          "sch_netem); --delay-us 0 runs over the bare veth pair", file=sys.stderr)
                    return 1
        job = {"count": a.count, "kib": a.kib, "rounds": a.rounds, "passes": a.passes,
               "inflight": inflight,
               "schedule": schedule}
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for r in range(2):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=addr[0],
                           MASTER_PORT=str(port), UCX_TLS="tcp", UCX_NET_DEVICES=dev[r],
                           GLOO_SOCKET_IFNAME=dev[r], OMP_NUM_THREADS="1",
                           INFLIGHT_JOB=json.dumps(job), INFLIGHT_OUT=f"{tmp}/{r}.json")
                env.pop("COMMUX_INFLIGHT", None)
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns[r], sys.executable, "-c", RANK.format(repo=str(REPO))],
                    env=env))
            bad = 0
            for proc in procs:
                try:
                    bad |= proc.wait(timeout=a.timeout) != 0
                except subprocess.TimeoutExpired:
                    proc.kill()
                    bad = 1
            if bad:
                print("inflight_netns: a rank failed or timed out", file=sys.stderr)
                return 1
            results = {r: json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(2)}
        delay = f", netem {a.delay_us} us each way" if a.delay_us > 0 else ""
        return report(results, a.count, a.kib, 2, a.rounds, inflight, schedule,
                      f" in two namespaces (tcp over veth{delay})")
    finally:
        for n in ns:
            ip("netns", "del", n, check=False)


if __name__ == "__main__":
    sys.exit(main())
