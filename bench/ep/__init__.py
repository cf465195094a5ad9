"""bench/ep: the expert-parallel dispatch/combine benchmark harness (docs/ep-bench.md).

Every backend sits behind one adapter interface (adapters.py) with declared capabilities and is
held to one oracle (oracle.py) over one deterministic routing trace (routing.py). The parent
(run.py) builds the case matrix (workloads.py), starts ranks with python/tests/mp.py's launcher,
runs one call per (case, tokens point) with the cases interleaved per point (rankside.py), and
writes one JSON record per case, a markdown summary and a plot (report.py).

    .venv/bin/python -m bench.ep [--quick] [options]       # from the repository root
    scripts/bench.sh ep [--quick] [options]
"""
