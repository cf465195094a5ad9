"""The parent: environment probe, case matrix, rank launches, records, summary, plots.

    .venv/bin/python -m bench.ep [--quick] [--worlds 2,3,4] [--workloads small,dsv3]
        [--backends LIST] [--modes normal,low-latency] [--precisions bf16,fp8] [--memtypes cpu,cuda]
        [--tokens 0,1,8,128] [--iters N] [--warmup N] [--case-timeout S] [--empty-slots P]
        [--seed N] [--expert-alignment N] [--inject KIND[:BACKEND]] [--out DIR]

Ranks come from python/tests/mp.py (``Ranks``: spawned interpreters, per-call deadlines, stacks
dumped on a hang, children killed with the parent). One launch per world size; inside it one call
per (case, tokens point), the cases interleaved per point (their order rotating with the point),
so every backend meets the same machine state. The per-case timeout is a hang guard: the rows a
case measured before it fired are kept (each row is written as it is measured), its remaining
points are listed as not run, the ranks are restarted and the other cases go on.

Exit status: 0 when every runnable case succeeded; 1 when any was invalid (a wrong result on any
rank), failed or timed out; 2 for bad arguments. Missed performance targets do not fail the run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS_DIR = os.path.join(REPO, "python", "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import mp  # noqa: E402  (python/tests/mp.py: the rank launcher)

from . import report, workloads  # noqa: E402
from .adapters import ALL_BACKENDS, MEMTYPES, MODES, PRECISIONS, caps_of  # noqa: E402
from .inject import COMBINE_KINDS, KINDS  # noqa: E402
from .rankside import close_adapters as _close_adapters, run_point as _run_point  # noqa: E402
from .routing import RoutingSpec, Trace, logical_bytes  # noqa: E402

HANG = "hang"

PROBE = r"""
import json, os, sys
out = {"python": sys.version.split()[0]}
import torch
out["torch"] = torch.__version__
out["cuda"] = {"available": bool(torch.cuda.is_available()),
               "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
try:
    import commux
    info = commux.runtime_info()
    out["commux"] = {"ok": True, "version": commux.__version__, "path": os.path.dirname(commux.__file__),
                     "ucx_version": info.get("ucx_version"), "transports": list(info.get("transports", [])),
                     "memory_types": list(info.get("memory_types", [])), "runtime_info": info}
except Exception as e:
    out["commux"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
mods = {}
for m in ("commux.ep", "deep_ep", "uccl.ep"):
    try:
        __import__(m)
        mods[m] = {"ok": True}
    except Exception as e:
        mods[m] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
out["modules"] = mods
print("PROBE-JSON " + json.dumps(out, default=str))
"""


def probe_environment(timeout: float = 180.0) -> dict:
    """Versions, UCX transports and memory types, which backends import: in a subprocess, so a
    crashing import cannot take the harness down."""
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    try:
        p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout, env=env)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PROBE-JSON ")), None)
        info = json.loads(line[len("PROBE-JSON "):]) if line else None
        err = (p.stderr or "")[-2000:]
    except subprocess.TimeoutExpired:
        info, err = None, f"the environment probe took over {timeout:.0f}s"
    if info is None:
        import torch

        info = {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": {"available": False, "devices": 0},
                "commux": {"ok": False, "error": f"probe failed: {err}"}, "modules": {}}
    info.update(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), host=platform.node(),
                cpus=os.cpu_count(), git=_git_rev(),
                env={k: v for k, v in os.environ.items() if k.startswith(("UCX_", "COMMUX_"))})
    return info


def _git_rev() -> str | None:
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ------------------------------------------------------------------------------------------------


def _csv(allowed):
    def parse(text):
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if allowed is not None and t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(map(str, allowed))}")
        return items
    return parse


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.ep", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smoke run: 2 ranks, small, tokens 0,1,8,128, 3 iterations")
    ap.add_argument("--worlds", type=lambda s: [int(v) for v in s.split(",")], default=None)
    ap.add_argument("--workloads", type=_csv(workloads.WORKLOADS), default=None)
    ap.add_argument("--backends", type=_csv(ALL_BACKENDS), default=list(ALL_BACKENDS))
    ap.add_argument("--modes", type=_csv(MODES), default=list(MODES))
    ap.add_argument("--precisions", type=_csv(PRECISIONS), default=list(PRECISIONS))
    ap.add_argument("--memtypes", type=_csv(MEMTYPES), default=list(MEMTYPES))
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=None,
                    help="tokens per rank for every case (default: the plan's ladders)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per point")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up iterations per point")
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="hang guard per case, seconds (default 240; 90 with --quick)")
    ap.add_argument("--empty-slots", type=float, default=0.0, help="probability of a -1 top-k slot (default 0)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--expert-alignment", type=int, default=1)
    ap.add_argument("--ll-budget-mib", type=int, default=2048,
                    help="largest low-latency receive footprint per rank; larger cases are unsupported")
    ap.add_argument("--inject", default=None,
                    help=f"KIND[:BACKEND]: corrupt one result on rank 0 before the oracle (a self-test; "
                         f"KIND in {', '.join(KINDS + COMBINE_KINDS)}), or '{HANG}': rank 0 hangs at each "
                         "case's second point (the hang guard's self-test); the run must then fail")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "ep"))
    args = ap.parse_args(argv)
    if args.inject:
        kind = args.inject.split(":")[0]
        if kind not in KINDS + COMBINE_KINDS + (HANG,):
            ap.error(f"--inject: unknown kind {kind!r}")
    return args


def select_plan(args) -> dict:
    plan = dict(workloads.QUICK_PLAN if args.quick else workloads.FULL_PLAN)
    if args.worlds is not None or args.workloads is not None:
        worlds = args.worlds or sorted({w for w, _ in plan})
        wls = args.workloads or sorted({wl for _, wl in plan})
        base = workloads.FULL_PLAN
        plan = {}
        for w in worlds:
            for wl in wls:
                plan[(w, wl)] = base.get((w, wl)) or base.get((3 if w > 2 else 2, wl)) or base[(2, "small")]
        if args.quick:
            plan = {k: workloads.QUICK_PLAN[(2, "small")] for k in plan}
    return plan


# ------------------------------------------------------------------------------------------------


class Session:
    def __init__(self, args, env, cases):
        self.args, self.env, self.cases = args, env, cases
        self.out = args.out
        self.case_timeout = args.case_timeout or (90.0 if args.quick else 240.0)
        self.records = {c.id: self._new_record(c) for c in cases}
        self.elapsed = {c.id: 0.0 for c in cases}
        self.dead: set[str] = set()
        os.makedirs(os.path.join(self.out, "cases"), exist_ok=True)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.rows_path = os.path.join(self.out, "rows.jsonl")
        open(self.rows_path, "w").close()
        for rec in self.records.values():
            self._save(rec)

    def _new_record(self, c) -> dict:
        return {"schema": report.SCHEMA, "id": c.id, "identity": c.identity(),
                "capabilities": caps_of(c.backend).describe(), "disposition": c.disposition, "reason": c.reason,
                "notes": c.notes, "iterations": {"warmup": c.warmup, "timed": c.iters},
                "environment": self._env_summary(), "rows": [], "points_not_run": [],
                "outcome": "unsupported" if c.disposition == "unsupported" else "pending",
                "verdict": None}

    def _env_summary(self) -> dict:
        cm = self.env.get("commux", {})
        return {"torch": self.env.get("torch"), "python": self.env.get("python"), "commux": cm.get("version"),
                "ucx_version": cm.get("ucx_version"), "ucx_transports": cm.get("transports"),
                "ucx_memory_types": cm.get("memory_types"), "cuda": self.env.get("cuda"), "cpus": self.env.get("cpus"),
                "host": self.env.get("host"), "git": self.env.get("git"), "date": self.env.get("date"),
                "settings": self.env.get("env")}

    def _save(self, rec) -> None:
        rec["outcome"] = report.case_outcome(rec) if rec["rows"] or rec["points_not_run"] or \
            rec["disposition"] == "unsupported" else "pending"
        fails = [m for r in rec["rows"] for m in (r.get("failures") or [])]
        rec["verdict"] = None if rec["disposition"] == "unsupported" or not rec["rows"] else {
            "passed": rec["outcome"] == "success", "failures": fails[:20], "n_failures": len(fails)}
        report.write_json(os.path.join(self.out, "cases", rec["id"] + ".json"), rec)

    def add_row(self, case, row) -> None:
        rec = self.records[case.id]
        rec["rows"].append(row)
        self._save(rec)
        with open(self.rows_path, "a") as f:
            f.write(json.dumps({"case": case.id, **row}, default=str) + "\n")
        tag = row["outcome"] if row["outcome"] != "success" else ""
        comps = row.get("components", {})
        txt = " ".join(f"{c[:4]} {comps[c]['max']['p50']:.0f}" for c in report.COMPONENTS if c in comps)
        print(f"  {case.id:<48} T={row['tokens']:<4} {txt:<34} {tag}", flush=True)

    # -- launches -------------------------------------------------------------------------------
    def start_ranks(self, world: int):
        backend = "ucx" if self.env["commux"]["ok"] else "gloo"
        cfg = mp.RanksConfig(world=world, backend=backend, ref_backend="gloo",
                             pg_timeout_s=max(60.0, self.case_timeout), startup_timeout_s=180.0)
        return mp.Ranks(cfg).start()

    def run_world(self, world: int) -> None:
        cases = [c for c in self.cases if c.world == world and c.disposition == "runnable"]
        if not cases:
            return
        print(f"== {world} ranks: {len(cases)} runnable cases", flush=True)
        try:
            ranks = self.start_ranks(world)
        except mp.DistFailure as e:
            for c in cases:
                self._fail_case(c, f"ranks failed to start: {str(e)[:3000]}")
            return
        inject = self._inject_target()
        index = 0
        for wl in sorted({c.workload for c in cases}, key=list(workloads.WORKLOADS).index):
            wl_cases = [c for c in cases if c.workload == wl]
            points = sorted({t for c in wl_cases for t in c.tokens})
            for t in points:
                todo = [c for c in wl_cases if t in c.tokens and c.id not in self.dead]
                k = index % len(todo) if todo else 0
                index += 1
                for c in todo[k:] + todo[:k]:
                    ranks = self.run_call(ranks, c, t, inject)
                    if ranks is None:
                        for rest in cases:
                            if rest.id not in self.dead:
                                self._fail_case(rest, "ranks failed to restart")
                        return
        try:
            outs = ranks.run_outcomes(_close_adapters, timeout=60.0)
            for o in outs:
                if not o.ok or o.value:
                    print(f"  closing the adapters: rank {o.rank}: {o.value or o.exc_msg}", flush=True)
        except mp.DistFailure as e:
            print(f"  closing the adapters hung or failed: {str(e)[:500]}", flush=True)
        for o in ranks.close(timeout=60.0):
            if not o.ok:
                print(f"  rank {o.rank} did not close cleanly ({mp.describe_exit(o.exit_code)}): {o.tb[-800:]}",
                      flush=True)

    def _inject_target(self):
        if not self.args.inject:
            return None
        kind, _, backend = self.args.inject.partition(":")
        return kind, backend or None

    def _fail_case(self, c, why: str) -> None:
        rec = self.records[c.id]
        rec["points_not_run"] = [t for t in c.tokens if t not in {r["tokens"] for r in rec["rows"]}]
        rec.setdefault("errors", []).append(why)
        self.dead.add(c.id)
        self._save(rec)

    def run_call(self, ranks, c, tokens: int, inject):
        """One (case, point); returns the Ranks to go on with (a fresh one after a hang or a backend
        error), or None when they could not be restarted."""
        kind = None
        if inject and (inject[1] in (None, c.backend)):
            kind = inject[0]
            if kind == HANG and tokens != c.tokens[min(1, len(c.tokens) - 1)]:
                kind = None   # hang at the case's second point: the first row must survive
        spec = c.spec(tokens, kind)
        left = self.case_timeout - self.elapsed[c.id]
        t0 = time.monotonic()
        row = {"tokens": tokens, "iters": c.iters, "warmup": c.warmup}
        if c.mode != "reference":
            row["logical_bytes"] = logical_bytes(self._trace(c, tokens), c.precision)
        restart = False
        try:
            outs = ranks.run_outcomes(_run_point, spec, timeout=max(left, 5.0))
        except mp.DistFailure as e:
            raised = [o for o in e.outcomes if o.replied and not o.ok]
            row["outcome"] = "failed" if raised else "timeout"
            row["failures"] = [f"rank {o.rank} raised {o.exc_type}: {o.exc_msg}"[:1500] for o in raised] or \
                [f"no answer within {max(left, 5.0):.0f}s (the case's hang guard, --case-timeout "
                 f"{self.case_timeout:.0f}s): stacks in logs/{c.id}.T{tokens}.txt"]
            self._log(c, tokens, str(e))
            outs = None
            restart = True
        self.elapsed[c.id] += time.monotonic() - t0
        row["wall_s"] = round(time.monotonic() - t0, 3)
        if outs is not None:
            bad = [o for o in outs if not o.ok]
            if bad:
                row["outcome"] = "failed"
                row["failures"] = [f"rank {o.rank} raised {o.exc_type}: {o.exc_msg}"[:1500] for o in bad]
                self._log(c, tokens, "\n\n".join(o.describe() for o in bad))
                restart = True   # a backend error may leave operations pending: fresh ranks
            else:
                vals = [o.value for o in outs]
                fails = [m for v in vals for m in v["failures"]]
                row["outcome"] = "invalid" if fails else "success"
                row["failures"] = fails
                row["n_failures"] = sum(v["n_failures"] for v in vals)
                row["max_rel_err"] = max(v["max_rel_err"] for v in vals)
                row["components"] = report.reduce_times([v["times"] for v in vals])
                if c.mode == "reference":
                    chunk = vals[0]["chunk_elems"]
                    row["logical_bytes"] = {"basis": "one all_to_all_single, even split: world x world chunks "
                                            "of bf16", "chunk_elems": chunk,
                                            "dispatch": chunk * 2 * c.world * c.world}
                d = row["components"].get("dispatch", {}).get("max", {}).get("p50")
                if d:
                    row["logical_GBps_per_rank"] = row["logical_bytes"]["dispatch"] / c.world / (d * 1e3)
        self.add_row(c, row)
        if row["outcome"] in ("timeout", "failed") and restart:
            if row["outcome"] == "timeout":
                self._fail_case(c, row["failures"][0])
            try:
                ranks.kill()
            except Exception:  # noqa: BLE001
                pass
            try:
                return self.start_ranks(c.world)
            except mp.DistFailure as e:
                print(f"  restarting {c.world} ranks failed: {str(e)[:1000]}", flush=True)
                return None
        if self.elapsed[c.id] > self.case_timeout and c.id not in self.dead:
            self._fail_case(c, f"the case ran past its hang guard ({self.case_timeout:.0f}s)")
        return ranks

    def _trace(self, c, tokens):
        return Trace(RoutingSpec(c.world, tokens, c.experts, c.hidden, c.topk, c.seed, c.empty))

    def _log(self, c, tokens, text) -> None:
        with open(os.path.join(self.out, "logs", f"{c.id}.T{tokens}.txt"), "w") as f:
            f.write(text)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.monotonic()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    env = probe_environment()
    plan = select_plan(args)
    cases = workloads.build_matrix(
        plan, env, backends=args.backends, modes=args.modes, precisions=args.precisions, memtypes=args.memtypes,
        tokens=args.tokens, iters_kind="quick" if args.quick else "full", iters=args.iters, warmup=args.warmup,
        seed=args.seed, empty=args.empty_slots, alignment=args.expert_alignment, ll_budget_mib=args.ll_budget_mib)
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(os.path.join(args.out, "cases")) if os.path.isdir(os.path.join(args.out, "cases")) else []:
        os.unlink(os.path.join(args.out, "cases", name))   # records of an earlier run
    report.write_json(os.path.join(args.out, "matrix.json"), workloads.matrix_json(cases, env))
    cm = env["commux"]
    print(f"bench/ep: torch {env.get('torch')}, commux {cm.get('version') if cm['ok'] else 'NOT importable'}, "
          f"UCX {cm.get('ucx_version', '-')}; {sum(c.disposition == 'runnable' for c in cases)} runnable and "
          f"{sum(c.disposition == 'unsupported' for c in cases)} unsupported cases (matrix.json)", flush=True)
    if not cm["ok"]:
        print(f"  commux: {cm.get('error')}", flush=True)
    s = Session(args, env, cases)
    for world in sorted({c.world for c in cases}):
        s.run_world(world)
    records = list(s.records.values())
    for rec in records:
        s._save(rec)
    report.write_json(os.path.join(args.out, "results.json"),
                      {"schema": report.SCHEMA, "argv": argv, "environment": env, "records": records})
    try:
        pngs = report.plots(records, args.out)
    except Exception as e:  # noqa: BLE001 - a plot problem must not hide the results
        print(f"bench/ep: plotting failed: {type(e).__name__}: {e}", flush=True)
        pngs = []
    md = report.markdown(records, env, pngs, time.monotonic() - t0, argv)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md)
    print()
    print(md)
    bad = [r["id"] for r in records if r["outcome"] in ("invalid", "failed", "timeout", "pending")]
    if bad:
        print(f"bench/ep: FAILED: {len(bad)} case(s) wrong or unfinished: {', '.join(bad[:10])}", file=sys.stderr)
        return 1
    print(f"bench/ep: done; results in {os.path.relpath(args.out, os.getcwd())}/ (summary.md, matrix.json, "
          f"results.json, cases/, rows.jsonl, plots)")
    return 0
