"""The expert-parallel benchmark harness (bench/ep, docs/ep-bench.md).

Without ranks: the routing is deterministic and well-formed, the oracle passes correct results
(computed in one process by bench/ep/loopback.py for worlds 1..4 and 0, 1, odd and larger token
counts, both modes, bf16 and fp8) and catches each injected error (a dropped row, two rows
swapped, a wrong weight, one flipped payload bit, a wrong local id, a wrong combine), the case
matrix gives the right reasons, the percentiles are nearest-rank.

With ranks (marked ``ucx``; each a subprocess of ``python -m bench.ep``): the CI smoke (small
workload, 2 ranks, T = 0, 1, 8, 128, every installed adapter, every check; fails when the oracle
fails anywhere or commux-ep did not run), an injected error that must make the run fail, and the
hang guard (a rank that hangs: stacks, the rows before kept, the other cases finished).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.ep import inject as inj  # noqa: E402
from bench.ep import loopback as lb  # noqa: E402
from bench.ep import oracle as O  # noqa: E402
from bench.ep import report, workloads  # noqa: E402
from bench.ep.adapters import a2a_plan, unsupported_reason  # noqa: E402
from bench.ep.routing import (FP8_MAX, RoutingSpec, Trace, decode_ids, dequantize,  # noqa: E402
                              ll_quantize, logical_bytes)

SMALL = dict(experts=64, hidden=256, topk=8)   # the small workload's routing, a narrower hidden


def trace(world, tokens, empty=0.0, seed=1, **kw):
    p = dict(SMALL, **kw)
    return Trace(RoutingSpec(world, tokens, p["experts"] - p["experts"] % world, p["hidden"], p["topk"], seed, empty))


# ------------------------------------------------------------------------------------------------
# routing and activations


def test_routing_is_deterministic_and_well_formed():
    a, b = trace(4, 33, empty=0.1), trace(4, 33, empty=0.1)
    assert a.digest == b.digest and torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.weights, b.weights)
    assert trace(4, 33, empty=0.1, seed=2).digest != a.digest
    for row in a.topk_idx.tolist():
        live = [e for e in row if e >= 0]
        assert len(set(live)) == len(live) and all(0 <= e < 64 for e in live)
    frac = float((a.topk_idx < 0).float().mean())
    assert 0.03 < frac < 0.2, frac
    assert not (trace(2, 50).topk_idx < 0).any()
    w = a.weights
    assert ((w >= 0.75) & (w <= 1.0)).all() and torch.equal(w * 32, (w * 32).round())
    # a rank's routing does not depend on the token count of the trace it is part of
    assert torch.equal(trace(2, 8).topk_idx[:8], Trace(RoutingSpec(2, 8, 64, 256, 8)).topk_idx[:8])


def test_activations_are_exact_and_carry_their_token():
    t = trace(3, 7)
    g = torch.arange(21)
    x = t.x_bf16(g)
    assert x.dtype == torch.bfloat16
    assert torch.equal(x[:, 32:].float() * 64, (x[:, 32:].float() * 64).round())
    ids, ok = decode_ids(x.float())
    assert ok.all() and torch.equal(ids, g)
    q, s = t.x_fp8(g)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (21, 2)
    v = dequantize(q, s)
    assert torch.equal(v.to(torch.bfloat16).float(), v)   # exact in bf16 too
    assert torch.equal(decode_ids(v)[0], g)


def test_ll_quantize_follows_the_contract():
    x = trace(2, 5).x_bf16(torch.arange(10))
    q, s = ll_quantize(x)
    blocks = x.float().view(10, 2, 128)
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(s, amax / FP8_MAX)
    assert torch.equal(q.view(torch.uint8), (blocks / (amax / FP8_MAX)[..., None]).to(torch.float8_e4m3fn)
                       .view(10, 256).view(torch.uint8))
    assert torch.equal(decode_ids(dequantize(q, s))[0], torch.arange(10))


def test_logical_bytes_come_from_the_trace():
    t = trace(2, 16)
    copies = int(t.in_rank.sum())
    assert logical_bytes(t, "bf16")["dispatch"] == copies * 256 * 2
    assert logical_bytes(t, "fp8")["dispatch"] == copies * (256 + 2 * 4)
    assert logical_bytes(t, "fp8")["combine"] == copies * 256 * 2


def test_a2a_plan_orders_rows_by_destination_then_token():
    topk = torch.tensor([[0, 5, -1], [6, 7, 1], [2, -1, -1]])
    perm, counts, local = a2a_plan(topk, lpr=4, world=2)
    assert perm.tolist() == [0, 1, 2, 0, 1] and counts.tolist() == [3, 2]
    assert local.tolist() == [[0, -1, -1], [-1, -1, 1], [2, -1, -1], [-1, 1, -1], [2, 3, -1]]


# ------------------------------------------------------------------------------------------------
# the oracle on correct results


CASES = [(1, 3), (2, 0), (2, 1), (2, 8), (3, 5), (4, 2), (2, 33)]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("world,tokens", CASES, ids=[f"w{w}-T{t}" for w, t in CASES])
def test_oracle_passes_correct_normal_results(world, tokens, precision):
    t = trace(world, tokens, empty=0.1)
    res = lb.normal_dispatch(t, precision, alignment=4)
    for r in range(world):
        assert O.check_normal_dispatch(t, r, res[r], precision, alignment=4) == []
    ys = [O.expert_input_normal(t, r, res[r]) for r in range(world)]
    outs = lb.normal_combine(t, ys, res)
    weights = lb.combined_weights(t, res)
    for s in range(world):
        fails, err = O.check_combine(t, s, outs[s], precision, "normal")
        assert fails == [] and err < O.TOLERANCE / 2, (fails, err)
        assert O.check_combined_weights(t, s, weights[s]) == []


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("world,tokens", CASES, ids=[f"w{w}-T{t}" for w, t in CASES])
def test_oracle_passes_correct_low_latency_results(world, tokens, precision):
    t = trace(world, tokens, empty=0.1)
    cap = max(tokens, 1) + 1
    res = lb.ll_dispatch(t, precision, cap)
    for r in range(world):
        assert O.check_ll_dispatch(t, r, res[r], precision, cap) == []
    ys = [O.expert_input_ll(t, r, res[r]) for r in range(world)]
    for s, out in enumerate(lb.ll_combine(t, ys, res)):
        fails, err = O.check_combine(t, s, out, precision, "low-latency")
        assert fails == [] and err < O.TOLERANCE / 2, (fails, err)


# ------------------------------------------------------------------------------------------------
# the oracle on injected errors

EXPECT = {  # the check that must speak up
    ("normal", "drop-row"): "dispatch/set", ("normal", "swap-rows"): "dispatch/order",
    ("normal", "wrong-weight"): "dispatch/weights", ("normal", "flip-bit"): "dispatch/payload",
    ("normal", "wrong-local-id"): "dispatch/topk_idx",
    ("low-latency", "drop-row"): "ll-dispatch/count", ("low-latency", "swap-rows"): "ll-dispatch/",
    ("low-latency", "flip-bit"): "ll-dispatch/payload", ("low-latency", "wrong-local-id"): "ll-dispatch/set",
}


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("mode,kind", sorted(EXPECT), ids=[f"{m}-{k}" for m, k in sorted(EXPECT)])
def test_oracle_catches_injected_dispatch_errors(mode, kind, precision):
    t = trace(3, 6)
    res = lb.normal_dispatch(t, precision) if mode == "normal" else lb.ll_dispatch(t, precision, 6)
    check = ((lambda r, x: O.check_normal_dispatch(t, r, x, precision)) if mode == "normal"
             else (lambda r, x: O.check_ll_dispatch(t, r, x, precision, 6)))
    for r in range(3):
        assert check(r, res[r]) == [], "the unmodified result must pass"
        bad = inj.inject(res[r], kind, mode)
        fails = check(r, bad)
        assert any(EXPECT[(mode, kind)] in m for m in fails), (r, fails)
        assert check(r, res[r]) == [], "inject must not touch its input"


def test_oracle_catches_injected_combine_errors():
    t = trace(2, 6)
    # normal: a combine that forgets one rank's contribution, or scales one token
    res = lb.normal_dispatch(t, "bf16")
    ys = [O.expert_input_normal(t, r, res[r]) for r in range(2)]
    good = lb.normal_combine(t, ys, res)
    assert O.check_combine(t, 0, good[0], "bf16", "normal")[0] == []
    forgot = lb.normal_combine(t, [ys[0], torch.zeros_like(ys[1])], res)
    assert O.check_combine(t, 0, forgot[0], "bf16", "normal")[0]
    assert O.check_combine(t, 0, inj.inject_combine(good[0], "combine-scale"), "bf16", "normal")[0]
    # a combine of untransformed rows (an identity round trip) cannot pass
    ident = lb.normal_combine(t, [r["recv_x"] for r in res], res)
    assert O.check_combine(t, 0, ident[0], "bf16", "normal")[0]
    # low-latency: a wrong weight at the source; NaN rows past recv_count must not be read
    lres = lb.ll_dispatch(t, "bf16", 6)
    lys = [O.expert_input_ll(t, r, lres[r]) for r in range(2)]
    assert torch.isnan(lys[0][0, int(lres[0]["recv_count"][0]):].float()).all()
    assert O.check_combine(t, 0, lb.ll_combine(t, lys, lres)[0], "bf16", "low-latency")[0] == []
    wrong = lb.ll_combine(t, lys, lres, weights=inj.wrong_weight_ll(t.weights))
    fails, _ = O.check_combine(t, 0, wrong[0], "bf16", "low-latency")
    assert fails and "token(s) off" in fails[0]
    # a reduced weight that is wrong
    w = lb.combined_weights(t, res)[0]
    w[0, 0] += 1 / 32
    assert O.check_combined_weights(t, 0, w)


def test_oracle_catches_malformed_results():
    t = trace(2, 4)
    res = lb.normal_dispatch(t, "bf16")[0]
    assert O.check_normal_dispatch(t, 0, dict(res, counts=tuple(res["counts"])), "bf16")  # not a list
    assert O.check_normal_dispatch(t, 0, dict(res, recv_topk_idx=res["recv_topk_idx"].int()), "bf16")
    assert O.check_normal_dispatch(t, 0, dict(res, recv_x=res["recv_x"].float()), "bf16")
    lay = dict(res["layout"], num_tokens_per_rank=res["layout"]["num_tokens_per_rank"] + 1)
    assert any("layout" in m for m in O.check_normal_dispatch(t, 0, dict(res, layout=lay), "bf16"))
    fails, err = O.check_combine(t, 0, torch.zeros(4, 256, dtype=torch.float32), "bf16", "normal")
    assert fails
    x = torch.ones(3, 4)
    assert O.check_unchanged(0, ["x"], O.snapshot(x), [x]) == []
    y = x.clone()
    y[1, 1] = 2
    assert O.check_unchanged(0, ["x"], O.snapshot(x), [y])


# ------------------------------------------------------------------------------------------------
# matrix and statistics


def _env(commux=True, ep=True, cuda=False, memtypes=("host",)):
    return {"commux": {"ok": commux, "memory_types": list(memtypes)}, "cuda": {"available": cuda, "devices": int(cuda)},
            "modules": {"commux.ep": {"ok": ep}, "deep_ep": {"ok": False}, "uccl.ep": {"ok": False}}}


def test_unsupported_reasons():
    e = _env()
    assert unsupported_reason("commux-ep", "normal", "fp8", "cpu", e) is None
    assert unsupported_reason("commux-ep", "low-latency", "fp8", "cpu", e) is None
    assert unsupported_reason("commux-ep", "normal", "bf16", "cpu", _env(ep=False)) == "backend-not-installed"
    assert unsupported_reason("a2a-ucx", "normal", "bf16", "cpu", _env(commux=False)) == "backend-not-installed"
    assert unsupported_reason("a2a-gloo", "normal", "bf16", "cpu", _env(commux=False)) is None
    assert unsupported_reason("a2a-ucx", "low-latency", "bf16", "cpu", e) == "mode-not-offered:low-latency"
    assert unsupported_reason("a2a-gloo", "normal", "bf16", "cuda", e) == "memtype-not-offered:cuda"
    assert unsupported_reason("commux-ep", "normal", "bf16", "cuda", e) == "no-accelerator"
    assert unsupported_reason("commux-ep", "normal", "bf16", "cuda", _env(cuda=True)) == "ucx-lacks-memtype:cuda"
    assert unsupported_reason("commux-ep", "normal", "bf16", "cuda", _env(cuda=True, memtypes=("host", "cuda"))) is None
    assert unsupported_reason("deepep", "normal", "bf16", "cuda", e) == "backend-not-installed"
    assert unsupported_reason("a2a-even-ucx", "reference", "bf16", "cpu", e) is None


def test_matrix_covers_every_cell():
    cases = workloads.build_matrix(workloads.FULL_PLAN, _env())
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    assert all(c.reason for c in cases if c.disposition == "unsupported")
    w3 = [c for c in cases if c.world == 3]
    assert w3 and all(c.experts % 3 == 0 for c in w3) and all(c.notes for c in w3)
    run = {(c.backend, c.world, c.workload, c.mode, c.precision) for c in cases
           if c.disposition == "runnable" and c.memtype == "cpu"}
    for world in (2, 3, 4):
        for mode in ("normal", "low-latency"):
            for prec in ("bf16", "fp8"):
                assert ("commux-ep", world, "small", mode, prec) in run
    assert ("commux-ep", 2, "dsv3", "low-latency", "fp8") in run
    assert ("a2a-even-ucx", 2, "small", "reference", "bf16") in run
    doc = workloads.matrix_json(cases, _env())
    json.dumps(doc)
    assert doc["counts"]["runnable"] + doc["counts"]["unsupported"] == len(cases)


def test_nearest_rank_percentiles_and_cross_rank_reduction():
    assert report.nearest_rank(list(range(1, 101)), 50) == 50
    assert report.nearest_rank(list(range(1, 101)), 99) == 99
    assert report.nearest_rank([7.0], 99) == 7.0 and report.nearest_rank([], 50) is None
    assert report.nearest_rank([1, 2, 3, 4], 50) == 2 and report.nearest_rank([1, 2, 3, 4], 90) == 4
    t = report.reduce_times([{"dispatch": [1, 5, 3]}, {"dispatch": [2, 4, 9]}])
    assert t["dispatch"]["max"]["p50"] == 5 and t["dispatch"]["min"]["p50"] == 3
    assert t["dispatch"]["max"]["max"] == 9 and t["dispatch"]["min"]["min"] == 1


# ------------------------------------------------------------------------------------------------
# runs (subprocesses of python -m bench.ep)


def _run(args, out, timeout=150):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    try:
        p = subprocess.run([sys.executable, "-m", "bench.ep", "--out", str(out)] + args, cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"bench.ep {args} did not finish in {timeout}s:\n{e.stdout}\n{e.stderr}")
    records = {}
    if (out / "results.json").exists():
        records = {r["id"]: r for r in json.loads((out / "results.json").read_text())["records"]}
    return p, records


def _installed(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
        return True
    except Exception:  # noqa: BLE001 - any failure to import is "not installed"
        return False


@pytest.mark.ucx
def test_smoke_every_installed_adapter_passes_the_oracle(tmp_path):
    p, recs = _run(["--quick"], tmp_path)
    detail = p.stdout[-6000:] + p.stderr[-3000:]
    for name in ("matrix.json", "results.json", "summary.md", "rows.jsonl", "ep_w2_small_cpu.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    want = {"commux-ep": ("normal", "low-latency"), "commux-ep-gloo": ("normal", "low-latency"),
            "a2a-ucx": ("normal",), "a2a-gloo": ("normal",),
            "a2a-even-ucx": ("reference",)}
    for backend, modes in want.items():
        for mode in modes:
            for prec in (("bf16",) if mode == "reference" else ("bf16", "fp8")):
                rid = f"{backend}.{mode}.{prec}.cpu.w2.small"
                assert rid in recs, (rid, sorted(recs))
                r = recs[rid]
                assert r["disposition"] == "runnable", (rid, r["reason"], detail)
                assert r["outcome"] == "success", (rid, r["verdict"], detail)
                assert [row["tokens"] for row in r["rows"]] == [0, 1, 8, 128]
                for row in r["rows"]:
                    comps = row["components"]
                    assert set(comps) == ({"dispatch"} if mode == "reference" else set(report.COMPONENTS))
                    for c in comps.values():
                        assert c["max"]["p50"] >= c["min"]["p50"] > 0 and c["max"]["p99"] >= c["max"]["p50"]
                    assert row["logical_bytes"]["dispatch"] >= 0
                env = r["environment"]
                assert env["torch"] and env["ucx_version"] and env["ucx_transports"] and env["ucx_memory_types"]
    for backend, module in (("deepep", "deep_ep"), ("uccl-ep", "uccl.ep")):
        r = recs[f"{backend}.normal.bf16.cpu.w2.small"]
        if not _installed(module):
            assert r["outcome"] == "unsupported" and r["reason"] == "backend-not-installed"
    if not torch.cuda.is_available():
        assert recs["commux-ep.normal.bf16.cuda.w2.small"]["reason"] == "no-accelerator"
    assert p.returncode == 0, detail
    summary = (tmp_path / "summary.md").read_text()
    assert "## Targets" in summary and "commux-ep roundtrip / a2a-ucx roundtrip" in summary
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert matrix["counts"]["runnable"] >= 9 and matrix["counts"]["unsupported"] > 0


@pytest.mark.ucx
def test_an_injected_error_fails_the_run(tmp_path):
    p, recs = _run(["--quick", "--tokens", "8", "--backends", "a2a-gloo,a2a-ucx", "--precisions", "bf16",
                    "--memtypes", "cpu", "--inject", "flip-bit:a2a-gloo"], tmp_path)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    bad = recs["a2a-gloo.normal.bf16.cpu.w2.small"]
    assert bad["outcome"] == "invalid" and not bad["verdict"]["passed"]
    assert any("dispatch/payload: rank 0" in m for m in bad["verdict"]["failures"]), bad["verdict"]
    assert recs["a2a-ucx.normal.bf16.cpu.w2.small"]["outcome"] == "success"


@pytest.mark.ucx
def test_a_hang_is_cut_by_the_case_timeout_and_the_run_goes_on(tmp_path):
    p, recs = _run(["--quick", "--tokens", "1,8,16", "--backends", "a2a-gloo,a2a-ucx", "--precisions", "bf16",
                    "--memtypes", "cpu", "--inject", "hang:a2a-gloo", "--case-timeout", "8"], tmp_path)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    hung = recs["a2a-gloo.normal.bf16.cpu.w2.small"]
    assert hung["outcome"] == "timeout"
    assert [(r["tokens"], r["outcome"]) for r in hung["rows"]] == [(1, "success"), (8, "timeout")]
    assert hung["points_not_run"] == [16]
    log = (tmp_path / "logs" / "a2a-gloo.normal.bf16.cpu.w2.small.T8.txt").read_text()
    assert "run_point" in log and "all_to_all_single" in log   # the stacks of both ranks
    ok = recs["a2a-ucx.normal.bf16.cpu.w2.small"]
    assert ok["outcome"] == "success" and [r["tokens"] for r in ok["rows"]] == [1, 8, 16]


@pytest.mark.ucx
def test_back_to_back_ab_runs_and_checks_every_round_trip():
    """bench/experiments/ep_ab.py (the same-run A/B without barriers) finishes, prints its table and finds
    every round trip equal to the rank sum."""
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    script = os.path.join(ROOT, "bench", "experiments", "ep_ab.py")
    p = subprocess.run([sys.executable, script, "--rounds", "1", "--iters", "2",
                        "--tokens", "0,3", "--ll", "--timeout", "100"],
                       capture_output=True, text=True, timeout=150, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "wrong round trips: 0" in out and "| 3 |" in out, out[-3000:]
