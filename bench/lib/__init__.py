"""bench.lib: what the benchmarks share (bench/README.md).

    launch   spawned torch ranks with a deadline (launch_ranks), a command run to a deadline
             (run_command), mpirun's command line, free TCP ports
    machine  the CPU load of other processes and the CPU placement indicator (commux_bench)
    probe    the environment a result was measured in: sources, build, torch, commux, settings
    sizes    size names (8 B, 64 KiB, ...) and the command lines' size and list arguments
    checks   performance targets (met / missed / not measured) and the #wrong cell
    report   number formats, markdown rows and the output files (results.json, table.md, run.log)

Import it as ``bench.lib`` with the repository root on sys.path (every script under bench/ puts it
there), as ``bench.ep`` and ``bench.suites``.
"""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
