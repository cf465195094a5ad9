"""The main job and the benchmark run as users run them (small sizes), and fail loudly on a wrong
result: examples/halo_exchange.py checks bitwise against a single-process solve; bench/torch_bench.py
checks every payload."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, timeout):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    try:
        return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{args} did not finish in {timeout} s:\n{e.stdout}\n{e.stderr}")


# --overlap updates each block's inner cells while its halos travel and the ring next to the
# frame after the waits: the same values, bit for bit, or the check fails.
@pytest.mark.parametrize("nprocs,extra", [(3, []), (4, []), (4, ["--overlap"])])
def test_halo_exchange_matches_single_process_solve(nprocs, extra):
    r = _run(["examples/halo_exchange.py", "--nprocs", str(nprocs), "--n", "96", "--iters", "40",
              "--check-every", "7"] + extra, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for backend in ("ucx", "gloo"):
        line = [ln for ln in r.stdout.splitlines() if f"{backend}:" in ln and "per iteration" in ln]
        assert line and "check: OK" in line[0], r.stdout


def test_torch_bench_quick_smoke(tmp_path):
    r = _run(["bench/torch_bench.py", "--quick", "--settle", "0", "--out", str(tmp_path)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = (tmp_path / "table.md").read_text()
    assert "| send/recv | 8 B |" in table and "Correctness: 0 wrong" in table, table
