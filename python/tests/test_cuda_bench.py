"""Smoke run of the CUDA benchmark on the CPU (bench/cuda_bench.py --device cpu --quick): the same
code path as on a GPU (two spawned ranks, p2p streaming with its reference copy, allreduce on
"ucx" and "gloo", every payload checked), with 1 and 4 MiB. It must exit 0, write results.json
with both sections, every size present, positive timings and nothing wrong, and table.md with
the two target lines."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [1 << 20, 4 << 20]


def test_cuda_bench_cpu_quick(tmp_path):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    cmd = [sys.executable, "bench/cuda_bench.py", "--device", "cpu", "--quick",
           "--max-bytes", "4M", "--launch-timeout", "50", "--out", str(tmp_path)]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} did not finish in 60 s:\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["errors"] == [] and data["wrong_total"] == 0, data["errors"]
    assert data["kind"] == "cpu" and data["sections"] == ["p2p", "allreduce"]

    p2p = data["p2p"]
    assert [row["bytes"] for row in p2p] == SIZES, p2p
    for row in p2p:
        assert row["wrong"] == 0 and row["copy_wrong"] == 0, row
        assert row["p2p_gbps"] > 0 and row["copy_gbps"] > 0 and row["ratio"] > 0, row
        assert row["window"] >= 1 and row["iters"] >= 1, row

    ar = data["allreduce"]
    assert [row["bytes"] for row in ar] == SIZES, ar
    for row in ar:
        assert row["wrong"] == 0, row
        for backend in ("ucx", "gloo"):
            assert row[backend]["wrong"] == 0 and row[backend]["time_ms"] > 0, row
        assert row["ratio"] > 0, row

    assert set(data["targets"]) == {"p2p", "allreduce"}
    table = (tmp_path / "table.md").read_text()
    assert "## p2p bandwidth" in table and "## allreduce" in table, table
    assert "p2p 256 MiB:" in table and "allreduce 64 MiB:" in table, table
    assert "Correctness: 0 wrong" in table, table
    assert "p2p 256 MiB:" in r.stdout and "allreduce 64 MiB:" in r.stdout, r.stdout
