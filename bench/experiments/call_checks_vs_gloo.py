#!/usr/bin/env python3
"""The cross-rank call-check cases of python/tests/test_call_checks.py on "ucx" and on "gloo", in
one run: what each rank of each backend got (error type and the head of its message, or no error)
and how long it took, and whether the all_reduces after each case were right.

    PYTHONPATH=<commux package> python3 bench/experiments/call_checks_vs_gloo.py [--timeout S]

--timeout is the group timeout of both backends (default 5 s: a backend that waits for it shows
it). Prints one Markdown table.
"""
import argparse
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "python" / "tests"
sys.path.insert(0, str(TESTS))

import mp  # noqa: E402
import test_call_checks  # noqa: E402

CASES = [
    ("rejected", "rank 1's all_gather_into_tensor has a wrong output size"),
    ("kind", "all_reduce on rank 0, broadcast on rank 1 (1000 float32)"),
    ("dtype_broadcast", "broadcast of 1000 float32 vs 1000 int32"),
    ("dtype_allreduce", "all_reduce of 200 float32 vs 100 float64"),
]


def outcome(r):
    if not r.get("raised"):
        return f"no error ({r['s']:.2f} s)"
    msg = r["msg"].split("\n")[0]
    return f"{r['type']} after {r['s']:.2f} s: {msg[:100]}"


def later(r):
    if r["after"]["raised"]:
        return f"{r['after']['type']}: {r['after']['msg'][:60]}"
    return str(r.get("sums"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    print("| case | backend | rank 0 | rank 1 | the 2 all_reduces after it (right: 21, 41) |")
    print("|---|---|---|---|---|")
    for key, what in CASES:
        for backend in ("ucx", "gloo"):
            try:
                outs, _ = mp.run_once(test_call_checks._one, 2, key, backend=backend,
                                      pg_timeout_s=args.timeout, timeout=6 * args.timeout + 30)
                cells = [outcome(o.value) if o.ok else f"{o.exc_type}: {o.exc_msg[:80]}" for o in outs]
                after = " / ".join(later(o.value) for o in outs if o.ok)
            except mp.DistFailure as e:
                head = str(e).strip().split("\n")[0][:120]
                cells, after = [f"the run failed: {head}"] * 2, "-"
            print(f"| {what} | {backend} | {cells[0]} | {cells[1]} | {after} |", flush=True)


if __name__ == "__main__":
    main()
