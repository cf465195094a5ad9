"""The benchmark suite's smoke runs (scripts/bench.sh --quick, in parts): bench/coll_bench.py --quick
writes its results, every available backend has rows for every op, and nothing was wrong;
bench/vtensor_pingpong.py on a small selection, every configuration correct (COMMUX_COALESCE and
COMMUX_GROUP included)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build")


def _run(args, timeout):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    try:
        return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{args} did not finish in {timeout} s:\n{e.stdout}\n{e.stderr}")


def _expected_backends():
    expected = {"ucx", "gloo"}
    if os.path.exists(os.path.join(BUILD, "bench", "commux_coll_bench")):
        expected.add("commux-cpp")
    if shutil.which("mpirun") and os.path.exists(os.path.join(BUILD, "bench", "mpi_coll")):
        expected.add("mpi")
    return expected


def test_coll_bench_quick(tmp_path):
    r = _run(["bench/coll_bench.py", "--quick", "--settle", "0", "--build", BUILD,
              "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for name in ("results.json", "table.md", "coll_w2.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert rows and data["errors"] == []
    assert all(row["wrong"] == 0 for row in rows), [r for r in rows if r["wrong"]]
    expected = _expected_backends()
    if not shutil.which("mpirun"):
        expected.discard("mpi")
    assert expected <= set(data["backends"]), (expected, data["backends"], data["notes"])
    for backend in expected:
        ops = {row["op"] for row in rows if row["backend"] == backend}
        assert ops == set(data["ops"]), (backend, ops)
    for row in rows:
        assert row["time_us"] > 0 and row["busbw_gbps"] >= 0, row
    table = (tmp_path / "table.md").read_text()
    assert "### allreduce, 2 ranks" in table and "Correctness: 0 wrong" in table, table


def test_vtensor_pingpong_small(tmp_path):
    r = _run(["bench/vtensor_pingpong.py", "--quick", "--vs", "4", "--sizes", "8,4K",
              "--settle", "0", "--build", BUILD, "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    configs = {row["config"] for row in data["rows"]}
    assert configs == set(data["configs"]), configs
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in data["rows"]), data["rows"]
    assert (tmp_path / "table.md").exists()
