"""Workloads, plans and the case matrix (every cell runnable or unsupported with a reason).

A case is one (backend, world, workload, mode, precision, memory type) with a ladder of tokens per
rank; its rows are the ladder's points. Low-latency cases size their padded receive buffers for
the largest point of their ladder (``cap``, fixed per case as a real Buffer is), so their ladders
stop where that buffer would exceed ``ll_budget_mib`` per rank.

World sizes that do not divide a workload's expert count use the largest multiple below it
(3 ranks: 63 and 255 experts), recorded in the case's identity.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .adapters import ALL_BACKENDS, MEMTYPES, MODES, PRECISIONS, REFERENCE, REFERENCE_MODE, caps_of, unsupported_reason

WORKLOADS = {
    "small": {"hidden": 2048, "experts": 64, "topk": 8},
    "dsv3": {"hidden": 7168, "experts": 256, "topk": 8},      # DeepSeek-V3's MoE shape
}
LADDER = [1, 2, 4, 8, 16, 32, 64, 128]

# (world, workload) -> {mode: ladder}; the full run fits a 2-core machine in a few minutes
FULL_PLAN = {
    (2, "small"): {"normal": [0] + LADDER, "low-latency": [0] + LADDER},
    (3, "small"): {"normal": [1, 4, 16, 64, 128], "low-latency": [1, 4, 16, 64, 128]},
    (4, "small"): {"normal": [1, 4, 16, 64, 128], "low-latency": [1, 4, 16, 64, 128]},
    (2, "dsv3"): {"normal": [1, 8, 32, 128], "low-latency": [1, 8, 32, 128]},
}
QUICK_PLAN = {
    (2, "small"): {"normal": [0, 1, 8, 128], "low-latency": [0, 1, 8, 128]},
}
# (warm-up, timed) iterations per point, by plan and workload; 3- and 4-rank points take fewer
ITERS = {"full": {"small": (5, 40), "dsv3": (3, 15)}, "quick": {"small": (1, 3), "dsv3": (1, 3)}}
ITERS_WORLD_SCALE = {2: 1.0, 3: 0.5, 4: 0.5}


@dataclass
class Case:
    backend: str
    world: int
    workload: str
    experts: int
    hidden: int
    topk: int
    mode: str
    precision: str
    memtype: str
    tokens: list
    cap: int = 0
    alignment: int = 1
    seed: int = 1
    empty: float = 0.0
    warmup: int = 1
    iters: int = 3
    disposition: str = "runnable"
    reason: str | None = None
    notes: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.backend}.{self.mode}.{self.precision}.{self.memtype}.w{self.world}.{self.workload}"

    def identity(self) -> dict:
        d = asdict(self)
        for k in ("disposition", "reason", "notes", "warmup", "iters"):
            d.pop(k)
        d["tokens_ladder"] = d.pop("tokens")
        return d

    def spec(self, tokens: int, inject: str | None = None) -> dict:
        return {"backend": self.backend, "mode": self.mode, "precision": self.precision, "memtype": self.memtype,
                "tokens": tokens, "experts": self.experts, "hidden": self.hidden, "topk": self.topk,
                "seed": self.seed, "empty": self.empty, "cap": self.cap, "alignment": self.alignment,
                "warmup": self.warmup, "iters": self.iters, "inject": inject}


def ll_bytes_per_rank(experts: int, world: int, cap: int, hidden: int, precision: str) -> int:
    """The padded receive buffer, the combine input (bf16) and one more of each inside a backend."""
    rows = (experts // world) * cap * world
    recv = rows * (hidden + hidden // 128 * 4 if precision == "fp8" else hidden * 2)
    return 2 * (recv + rows * hidden * 2)


def build_matrix(plan: dict, env: dict, *, backends=ALL_BACKENDS, modes=MODES, precisions=PRECISIONS,
                 memtypes=MEMTYPES, tokens: list | None = None, iters_kind: str = "full", iters: int | None = None,
                 warmup: int | None = None, seed: int = 1, empty: float = 0.0, alignment: int = 1,
                 ll_budget_mib: int = 2048) -> list[Case]:
    cases = []
    for (world, wl), ladders in plan.items():
        w = WORKLOADS[wl]
        experts = w["experts"] - w["experts"] % world
        wu, it = ITERS[iters_kind][wl]
        it = max(3, int(it * ITERS_WORLD_SCALE.get(world, 0.5)))
        wu = wu if warmup is None else warmup
        it = it if iters is None else iters
        for backend in backends:
            b_modes = [REFERENCE_MODE] if backend == REFERENCE else list(modes)
            if backend == REFERENCE and "normal" not in modes:
                continue
            for mode in b_modes:
                ladder = list(tokens) if tokens is not None else list(ladders["normal" if mode == REFERENCE_MODE else mode])
                for prec in (["bf16"] if backend == REFERENCE else precisions):
                    for mem in memtypes:
                        c = Case(backend, world, wl, experts, w["hidden"], w["topk"], mode, prec, mem, ladder,
                                 alignment=alignment, seed=seed, empty=empty, warmup=wu, iters=it)
                        if experts != w["experts"]:
                            c.notes.append(f"{w['experts']} experts rounded down to {experts} (a multiple of {world})")
                        if mode == "low-latency":
                            c.cap = max(max(ladder, default=1), 1)
                        c.reason = unsupported_reason(backend, mode, prec, mem, env)
                        if c.reason is None and mode == "low-latency":
                            need = ll_bytes_per_rank(experts, world, c.cap, w["hidden"], prec)
                            if need > ll_budget_mib << 20:
                                c.reason = f"exceeds-memory-budget:{need >> 20}MiB>{ll_budget_mib}MiB"
                        if c.reason:
                            c.disposition = "unsupported"
                        cases.append(c)
    return cases


def matrix_json(cases: list[Case], env: dict) -> dict:
    return {
        "schema": "commux-ep-bench-matrix/1",
        "cases": [{"id": c.id, "identity": c.identity(), "disposition": c.disposition, "reason": c.reason,
                   "notes": c.notes, "capabilities": caps_of(c.backend).describe()} for c in cases],
        "counts": {"runnable": sum(c.disposition == "runnable" for c in cases),
                   "unsupported": sum(c.disposition == "unsupported" for c in cases)},
        "environment": env,
    }
