"""The benchmark suite's smoke runs (scripts/bench.sh --quick, in parts): bench/coll_bench.py
--quick writes its results, every backend the environment must provide has rows for every op (a
missing one fails the test by name), nothing was wrong, and the reference backend "noop" gives
its columns (ucx-noop, the share target, the spread) without entering #wrong;
bench/vtensor_pingpong.py on a small selection, every configuration correct (COMMUX_COALESCE and
COMMUX_GROUP included)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.suites import coll  # noqa: E402


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
    "noop": "the reference backend commux._C._NoopBackend: scripts/install.sh",
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
    checked = [row for row in rows if row["backend"] != "noop"]
    assert all(row["wrong"] == 0 for row in checked), [r for r in checked if r["wrong"]]
    # noop computes nothing: its rows are marked unchecked, never 0 wrong, never a failure.
    assert all(row["wrong"] is None and row["reference"] for row in rows
               if row["backend"] == "noop")
    missing = missing_backends(data)
    assert not missing, "required backends missing:\n" + "\n".join(missing)
    for row in rows:
        assert row["time_us"] > 0 and row["busbw_gbps"] >= 0, row
    # One round: the share target is measured at every (op, size), the spread nowhere.
    found = data["targets"]
    assert len(found) == len({(r["op"], r["bytes"]) for r in rows}), found
    for f in found:
        assert f["share"]["status"] in ("met", "missed"), f
        assert f["ucx_minus_noop_us"] == pytest.approx(f["share"]["value"]), f
        assert {v["status"] for v in f["spread"].values()} == {"not measured"}, f
    table = (tmp_path / "table.md").read_text()
    assert "### allreduce, 2 ranks" in table and "Correctness: 0 wrong" in table, table
    for column in ("| noop µs |", "| ucx−noop µs |", "| ucx−noop ≤ 1.2×cpp+1µs |",
                   "| spread ucx/noop/gloo/mpi/cpp |"):
        assert column in table, column
    assert "Target: ucx-noop <= 1.2 x cpp + 1 µs: met at " in table, table


def _row(backend, time_us, wrong, rounds=(1.0,), op="allreduce", nbytes=8):
    return {"op": op, "world": 2, "bytes": nbytes, "backend": backend, "time_us": time_us,
            "time_us_rounds": list(rounds), "busbw_gbps": 0.0, "wrong": wrong,
            "spread": max(rounds) / min(rounds) if len(rounds) > 1 else None}


def test_coll_reference_never_hides_a_wrong_result():
    """On rows without ranks: noop (wrong None, not checked) stays out of #wrong and of the
    total, a wrong ucx beside it is still counted and shown; the share target and the spread are
    computed and judged as documented (1.2 x cpp + 1 us, 1.5x)."""
    backends = ["ucx", "noop", "commux-cpp"]
    rows = [_row("ucx", 10.0, 3, rounds=(9.0, 10.0)), _row("noop", 4.0, None, rounds=(4.0, 8.0)),
            _row("commux-cpp", 4.0, 0, rounds=(4.0, 4.0))]
    assert coll.wrong_total(rows) == 3
    table = coll.table(rows, backends, ["allreduce"], [2])
    line = next(x for x in table.splitlines() if x.startswith("| 8 B"))
    assert line.endswith("| ucx 3 |"), line
    [f] = coll.targets(rows)
    assert f["ucx_minus_noop_us"] == pytest.approx(6.0)
    assert f["share"]["status"] == "missed" and f["share"]["limit"] == pytest.approx(5.8)
    assert {b: v["status"] for b, v in f["spread"].items()} == {
        "ucx": "met", "noop": "missed", "commux-cpp": "met"}
    assert "| 6.00 | **missed** | 1.11 / **2.00** / 1.00 | ucx 3 |" in line, line
    assert coll.target_summary([f]) == [
        "ucx-noop <= 1.2 x cpp + 1 µs: met at 0 of 1 (op, size, ranks); missed: allreduce 1 of 1",
        "spread between rounds <= 1.5x: met at 2 of 3 (op, size, backend); missed: noop 1 of 1 "
        "(worst 2.00x, allreduce 8 B)"]
    rows[0].update(wrong=0, time_us=9.0)  # 9 - 4 = 5 <= 5.8
    assert coll.wrong_total(rows) == 0
    line = next(x for x in coll.table(rows, backends, ["allreduce"], [2]).splitlines()
                if x.startswith("| 8 B"))
    assert line.endswith("| 5.00 | met | 1.11 / **2.00** / 1.00 | 0 |"), line
    rows[0].update(wrong=None)  # a checked backend that lost its check result
    with pytest.raises(RuntimeError, match="ucx allreduce 8 B has no correctness result"):
        coll.wrong_total(rows)


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
        "ucx", "noop", "mpi", "commux-cpp"]


def test_vtensor_pingpong_small(tmp_path):
    r = _run(["bench/vtensor_pingpong.py", "--quick", "--vs", "4", "--sizes", "8,4K",
              "--settle", "0", "--build", BUILD, "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    configs = {row["config"] for row in data["rows"]}
    assert configs == set(data["configs"]), configs
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in data["rows"]), data["rows"]
    assert (tmp_path / "table.md").exists()
