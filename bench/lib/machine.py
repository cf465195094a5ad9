"""The state of the machine around a measurement: how much CPU other processes took, and where the
VM placed its vCPUs (build/bench/commux_bench --mode placement: a CPU 0 <-> 1 cache-line handoff,
about 50 ns on a fast placement, about 200 ns on a slow one)."""
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

FAST_PLACEMENT_NS = 100  # cache-line handoff between CPU 0 and 1: ~50 ns fast, ~200 ns slow


def cpu_seconds():
    """(busy CPU seconds of the whole machine, of this script's finished children, stolen)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ((user + nice + system + irq + softirq) / tick, ours.ru_utime + ours.ru_stime,
            steal / tick)


def wait_for_idle(limit_s):
    """Waits up to limit_s for a second in which other processes keep under 10% of the CPUs busy
    (a shared VM: someone else's build skews every number). Returns the last busy fraction."""
    deadline = time.monotonic() + limit_s
    while True:
        before = cpu_seconds()[0]
        time.sleep(1)
        busy = (cpu_seconds()[0] - before) / os.cpu_count()
        if busy < 0.1 or time.monotonic() > deadline:
            return busy


def other_load(before, after, wall_s):
    """Cores kept busy by other processes (not this session's runs) and stolen by the host."""
    busy, ours, steal = (a - b for a, b in zip(after, before))
    return {"others_cores": max(0.0, busy - ours) / wall_s, "steal_cores": steal / wall_s}


def placement_ns(build):
    """The CPU 0 <-> 1 cache-line handoff (ns), from commux_bench when it is built, else None."""
    binary = Path(build) / "bench" / "commux_bench"
    if not binary.exists() or (os.cpu_count() or 1) < 2:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "placement.json"
        try:
            subprocess.run([str(binary), "--mode", "placement", "--json", str(out)],
                           capture_output=True, timeout=60, check=False)
            return json.loads(out.read_text())["rows"][0]["time_us_median"] * 1e3
        except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired):
            return None


def placement_kind(ns):
    """'fast/slow' for the indicator's readings (None readings left out)."""
    return "/".join("fast" if p < FAST_PLACEMENT_NS else "slow" for p in ns if p is not None)


def placement_text(rounds):
    """Each round's placement before -> after and the load of other processes, on one line."""
    parts = []
    for i, r in enumerate(rounds):
        ns = [p for p in r["placement_ns"] if p is not None]
        parts.append(f"round {i + 1}: {' -> '.join(f'{p:.0f}' for p in ns)} ns "
                     f"({placement_kind(ns)}), "
                     f"other processes {r['load']['others_cores']:.2f} cores, "
                     f"steal {r['load']['steal_cores']:.2f}")
    return "; ".join(parts)
