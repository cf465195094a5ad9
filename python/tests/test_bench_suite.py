"""The benchmark suite's smoke runs (scripts/bench.sh --quick, in parts): bench/coll_bench.py
--quick writes its results, every backend the environment must provide has rows for every op (a
missing one fails the test by name), and nothing was wrong; bench/vtensor_pingpong.py on a small
selection, every configuration correct (COMMUX_COALESCE and COMMUX_GROUP included)."""
import json
import os
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


# What the test environment must provide, and what provides it. scripts/setup.sh installs torch
# (gloo) and Open MPI (mpirun; mpicc, so CMake builds mpi_coll); the test stages install commux
# (scripts/install.sh) and build build/ (scripts/build.sh; scripts/test.sh's python stage builds it
# when the binaries are missing). coll_bench leaves out what it cannot run, so the test does not
# take its list: a backend absent here is a broken environment, and the test says which.
REQUIRED_BACKENDS = {
    "ucx": "commux through torch.distributed: scripts/install.sh",
    "gloo": "torch's Gloo: scripts/setup.sh",
    "mpi": "build/bench/mpi_coll under mpirun: Open MPI by scripts/setup.sh, then scripts/build.sh",
    "commux-cpp": "build/bench/commux_coll_bench: scripts/build.sh",
}


def missing_backends(data):
    """The required backends that did not run every op of a coll_bench result, each named with
    what should provide it and coll_bench's own note on it ([] when none is missing)."""
    notes = [n for n in data.get("notes", []) if " left out: " in n]
    missing = []
    for backend, source in REQUIRED_BACKENDS.items():
        ops = {row["op"] for row in data["rows"] if row["backend"] == backend}
        if backend in data["backends"] and ops == set(data["ops"]):
            continue
        why = [n for n in notes if n.startswith(backend + " ")] or [
            f"ops without rows: {sorted(set(data['ops']) - ops)}"]
        missing.append(f"{backend} ({source}): {'; '.join(why)}")
    return missing


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
    missing = missing_backends(data)
    assert not missing, "required backends missing:\n" + "\n".join(missing)
    for row in rows:
        assert row["time_us"] > 0 and row["busbw_gbps"] >= 0, row
    table = (tmp_path / "table.md").read_text()
    assert "### allreduce, 2 ranks" in table and "Correctness: 0 wrong" in table, table


def _result(backends, ops=("allreduce", "barrier"), notes=()):
    rows = [{"op": op, "backend": b} for b in backends for op in ops]
    return {"backends": list(backends), "ops": list(ops), "rows": rows, "notes": list(notes)}


def test_missing_backends_names_each_one_missing():
    """The check itself, on result sets without ranks: all four present passes; one left out (as
    coll_bench does when a binary is not built), or one that lost an op's rows, fails by name."""
    every = list(REQUIRED_BACKENDS)
    assert missing_backends(_result(every)) == []
    note = "mpi left out: /x/build/bench/mpi_coll is not built (MPI not found by CMake?)"
    missing = missing_backends(_result([b for b in every if b != "mpi"], notes=[note]))
    assert len(missing) == 1 and missing[0].startswith("mpi (") and "is not built" in missing[0]
    data = _result(every)
    data["rows"] = [r for r in data["rows"] if (r["backend"], r["op"]) != ("gloo", "barrier")]
    missing = missing_backends(data)
    assert len(missing) == 1 and missing[0].startswith("gloo (") and "barrier" in missing[0]
    assert [m.split(" ")[0] for m in missing_backends(_result(["gloo"]))] == [
        "ucx", "mpi", "commux-cpp"]


def test_vtensor_pingpong_small(tmp_path):
    r = _run(["bench/vtensor_pingpong.py", "--quick", "--vs", "4", "--sizes", "8,4K",
              "--settle", "0", "--build", BUILD, "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    configs = {row["config"] for row in data["rows"]}
    assert configs == set(data["configs"]), configs
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in data["rows"]), data["rows"]
    assert (tmp_path / "table.md").exists()
