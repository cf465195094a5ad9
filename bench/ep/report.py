"""Statistics, the per-case JSON records, the markdown summary and the plots.

Times: per iteration, the cross-rank MAX (a layer is done when its slowest rank is) and MIN (the
skew-free floor) of each component; nearest-rank percentiles over the pooled iterations.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

PCTS = (50, 90, 95, 99)
COMPONENTS = ("dispatch", "combine", "roundtrip")
SCHEMA = "commux-ep-bench/1"
# the targets of the issue: 2 ranks, CPU, bf16, small workload, normal mode
TARGETS = (("commux-ep", "a2a-ucx", "roundtrip", 0.7), ("commux-ep", "a2a-gloo", "roundtrip", 0.3))
DISPATCH_TARGET = 2.0
COLORS = {"commux-ep": "tab:blue", "commux-ep-gloo": "tab:cyan", "a2a-ucx": "tab:orange", "a2a-gloo": "tab:green",
          "deepep": "tab:red", "uccl-ep": "tab:purple", "a2a-even-ucx": "black"}  # one color per backend everywhere


def nearest_rank(sorted_v: list, p: float):
    if not sorted_v:
        return None
    return sorted_v[max(1, math.ceil(p / 100 * len(sorted_v))) - 1]


def summarize(values: list) -> dict:
    v = sorted(values)
    out = {f"p{p}": nearest_rank(v, p) for p in PCTS}
    out.update(n=len(v), min=v[0] if v else None, max=v[-1] if v else None,
               mean=sum(v) / len(v) if v else None)
    return out


def reduce_times(per_rank: list[dict]) -> dict:
    """per_rank[r][component] = [us per iteration] -> {component: {"max": stats, "min": stats}}."""
    out = {}
    for comp in COMPONENTS:
        series = [t.get(comp) for t in per_rank]
        if any(s is None for s in series) or not series:
            continue
        n = min(len(s) for s in series)
        maxes = [max(s[i] for s in series) for i in range(n)]
        mins = [min(s[i] for s in series) for i in range(n)]
        out[comp] = {"max": summarize(maxes), "min": summarize(mins),
                     "per_rank_p50": [nearest_rank(sorted(s[:n]), 50) for s in series]}
    return out


def case_outcome(case_rec: dict) -> str:
    if case_rec["disposition"] == "unsupported":
        return "unsupported"
    outs = [r["outcome"] for r in case_rec["rows"]]
    for o in ("invalid", "timeout", "failed"):
        if o in outs:
            return o
    if case_rec.get("points_not_run"):
        return "failed"
    return "success" if outs else "failed"


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# summary


def _p50(rec: dict, tokens: int, comp: str, which: str = "max"):
    for r in rec["rows"]:
        if r["tokens"] == tokens and r["outcome"] == "success":
            c = r.get("components", {}).get(comp)
            return c[which]["p50"] if c else None
    return None


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _key(rec):
    i = rec["identity"]
    return (i["world"], i["workload"], i["memtype"], i["mode"], i["precision"])


def _ratio(a, b):
    return a / b if a and b else None


def targets(records: list[dict]) -> list[dict]:
    """The issue's ratios: 2 ranks, CPU, bf16, small, normal mode. Judged on p50 of the cross-rank
    MAX (the layer's time); the same ratio of the MIN (the skew-free floor) is given beside it."""
    by = {}
    for rec in records:
        i = rec["identity"]
        if (i["world"], i["workload"], i["memtype"], i["precision"]) == (2, "small", "cpu", "bf16") \
                and i["mode"] in ("normal", "reference"):
            by[i["backend"]] = rec
    out = []
    ce = by.get("commux-ep")

    def entry(what, tokens, num, den, comp, limit):
        r = _ratio(_p50(num, tokens, comp), _p50(den, tokens, comp)) if num and den else None
        rmin = _ratio(_p50(num, tokens, comp, "min"), _p50(den, tokens, comp, "min")) if num and den else None
        out.append({"what": what, "tokens": tokens, "ratio": r, "ratio_min": rmin, "target": limit,
                    "status": "not measured" if r is None else ("met" if r <= limit else "MISSED")})

    for num, den, comp, limit in TARGETS:
        what = f"{num} {comp} / {den} {comp}"
        ladder = ce["identity"]["tokens_ladder"] if ce else [None]
        for t in ladder:
            entry(what, t, ce, by.get(den), comp, limit)
    entry("commux-ep normal dispatch / one all_to_all_single (ucx, even split)", 128, ce, by.get("a2a-even-ucx"),
          "dispatch", DISPATCH_TARGET)
    return out


def markdown(records: list[dict], env: dict, plots: list[str], elapsed_s: float, argv: list[str]) -> str:
    L = []
    counts = defaultdict(int)
    for rec in records:
        counts[rec["outcome"]] += 1
    L.append("# Expert-parallel dispatch/combine benchmark (bench/ep)")
    L.append("")
    cm = env.get("commux", {})
    L.append(f"torch {env.get('torch')}, commux {cm.get('version', '-')}, UCX {cm.get('ucx_version', '-')} "
             f"(transports {', '.join(cm.get('transports', [])) or '-'}; memory types "
             f"{', '.join(cm.get('memory_types', [])) or '-'}), {env.get('cpus')} CPUs, "
             f"{'CUDA ' + str(env['cuda'].get('devices')) + ' device(s)' if env['cuda']['available'] else 'no GPU'}; "
             f"{env.get('date')}; {elapsed_s:.0f} s. `{' '.join(argv) or '(defaults)'}`")
    L.append("")
    L.append("Cases: " + ", ".join(f"{counts[o]} {o}" for o in ("success", "invalid", "failed", "timeout", "unsupported")
                                   if counts[o]) + ". Times are microseconds, p50 of the per-iteration cross-rank "
             "MAX (nearest rank); cells are dispatch / combine / round trip. Compare within one run only.")
    L.append("")
    L.append("## Targets (2 ranks, CPU, bf16, small workload, normal mode)")
    L.append("")
    L.append("| ratio | tokens/rank | measured (p50 of MAX) | p50 of MIN | target | status |")
    L.append("|---|---:|---:|---:|---:|---|")
    for t in targets(records):
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        rmin = "-" if t["ratio_min"] is None else f"{t['ratio_min']:.2f}"
        tokens = "-" if t["tokens"] is None else t["tokens"]
        L.append(f"| {t['what']} | {tokens} | {ratio} | {rmin} | <= {t['target']} | {t['status']} |")
    L.append("")
    L.append("Missed targets are reported, never a failure of the run; wrong results and unfinished cases are.")
    L.append("")
    groups = defaultdict(list)
    for rec in records:
        if rec["disposition"] == "runnable" and rec["identity"]["mode"] != "reference":
            groups[_key(rec)].append(rec)
    refs = {(r["identity"]["world"], r["identity"]["workload"], r["identity"]["memtype"]): r for r in records
            if r["identity"]["mode"] == "reference" and r["disposition"] == "runnable"}
    for key in sorted(groups):
        world, wl, mem, mode, prec = key
        recs = sorted(groups[key], key=lambda r: r["identity"]["backend"])
        i0 = recs[0]["identity"]
        L.append(f"## {world} ranks, {wl} (hidden {i0['hidden']}, {i0['experts']} experts, top-{i0['topk']}), "
                 f"{mode}, {prec}, {mem}" + (f", cap {i0['cap']}" if mode == "low-latency" else ""))
        L.append("")
        ref = refs.get((world, wl, mem)) if mode == "normal" else None
        head = [r["identity"]["backend"] for r in recs]
        extra = ["one a2a_single (us)", "commux-ep dispatch / a2a_single"] if ref and "commux-ep" in head else []
        L.append("| tokens/rank | " + " | ".join(head + extra) + " |")
        L.append("|---:|" + "---|" * (len(head) + len(extra)))
        tokens = sorted({t for r in recs for t in r["identity"]["tokens_ladder"]})
        for t in tokens:
            cells = []
            for r in recs:
                row = next((x for x in r["rows"] if x["tokens"] == t), None)
                if row is None:
                    cells.append("not run" if t in r.get("points_not_run", []) else "")
                elif row["outcome"] != "success":
                    cells.append(f"**{row['outcome'].upper()}**")
                else:
                    cells.append(" / ".join(_fmt(_p50(r, t, c)) for c in COMPONENTS))
            if extra:
                a2 = _p50(ref, t, "dispatch")
                ce = next(r for r in recs if r["identity"]["backend"] == "commux-ep")
                d = _p50(ce, t, "dispatch")
                cells += [_fmt(a2), f"{d / a2:.2f}" if a2 and d else "-"]
            L.append(f"| {t} | " + " | ".join(cells) + " |")
        L.append("")
    bad = [r for r in records if r["outcome"] in ("invalid", "failed", "timeout")]
    if bad:
        L.append("## Wrong or unfinished cases")
        L.append("")
        for r in bad:
            L.append(f"* `{r['id']}`: **{r['outcome']}**")
            for row in r["rows"]:
                if row["outcome"] != "success":
                    for m in (row.get("failures") or [])[:4]:
                        L.append(f"  * T={row['tokens']}: {m[:400]}")
            if r.get("points_not_run"):
                L.append(f"  * points not run (after a timeout or failure): {r['points_not_run']}")
        L.append("")
    uns = defaultdict(list)
    for r in records:
        if r["disposition"] == "unsupported":
            uns[r["reason"]].append(r["id"])
    if uns:
        L.append("## Unsupported cells (a reason, never a result)")
        L.append("")
        L.append("| reason | cases | examples |")
        L.append("|---|---:|---|")
        for reason in sorted(uns):
            ids = uns[reason]
            L.append(f"| `{reason}` | {len(ids)} | {', '.join('`' + i + '`' for i in ids[:3])}{' ...' if len(ids) > 3 else ''} |")
        L.append("")
    if plots:
        L.append("Plots: " + ", ".join(f"[{os.path.basename(p)}]({os.path.basename(p)})" for p in plots))
        L.append("")
    L.append("Logical bytes (in each record) count (token, destination rank) copies x hidden x bytes per value "
             "(+ fp8 scales; combine in bf16): a property of the routing, not link bandwidth.")
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------------
# plots


def plots(records: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = defaultdict(lambda: defaultdict(list))   # (world, workload, memtype) -> (mode, precision) -> recs
    for rec in records:
        i = rec["identity"]
        if rec["disposition"] != "runnable" or not any(r["outcome"] == "success" for r in rec["rows"]):
            continue
        panel = ("normal", "bf16") if i["mode"] == "reference" else (i["mode"], i["precision"])
        by[(i["world"], i["workload"], i["memtype"])][panel].append(rec)
    paths = []
    for (world, wl, mem), panels in sorted(by.items()):
        keys = sorted(panels)
        fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.8), squeeze=False)
        for ax, (mode, prec) in zip(axes[0], keys):
            for rec in sorted(panels[(mode, prec)], key=lambda r: r["identity"]["backend"]):
                ref = rec["identity"]["mode"] == "reference"
                comp = "dispatch" if ref else "roundtrip"
                pts = [(r["tokens"], r["components"][comp]["max"]) for r in rec["rows"]
                       if r["outcome"] == "success" and r["tokens"] > 0 and comp in r.get("components", {})]
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                p50 = [p[1]["p50"] for p in pts]
                p99 = [p[1]["p99"] for p in pts]
                label = "one all_to_all_single (ucx), dispatch bytes" if ref else rec["identity"]["backend"]
                color = COLORS.get(rec["identity"]["backend"], "gray")
                ax.plot(xs, p50, marker="o", ms=3, label=label, ls="--" if ref else "-", color=color)
                ax.fill_between(xs, p50, p99, color=color, alpha=0.15, lw=0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("round trip, us")
            ax.set_title(f"{mode}, {prec}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"EP dispatch + combine round trip, {world} ranks, {wl}, {mem}: p50 of the cross-rank max, "
                     "band to p99", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"ep_w{world}_{wl}_{mem}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
