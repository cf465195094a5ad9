"""Helpers used inside the rank processes: deterministic data, expectations, exact comparisons.

Every rank can compute every other rank's input (``make``) so expectations need no communication.
Data is integer-valued and small, so float sums, products, min/max and power-of-two scalings are
exact in every dtype (including float16 and bfloat16) and results are compared with ``torch.equal``.
"""
from __future__ import annotations

import os
import re
import time
import zlib
from typing import Callable

import torch
import torch.distributed as dist

import mp

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int8", "int16", "int32", "int64", "uint8"]

PREMUL_FACTOR = 0.5  # a power of two: scaling stays exact


def red_op(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


# (op, dtype) combinations that must work
VALID_REDUCTIONS = (
    [("SUM", d) for d in FLOATS + INTS + ["complex64"]]
    + [("PRODUCT", d) for d in FLOATS + INTS]
    + [(op, d) for op in ("MIN", "MAX") for d in FLOATS + INTS]
    + [("AVG", d) for d in FLOATS + ["complex64"]]
    + [("PREMUL_SUM", d) for d in FLOATS + ["complex64"]]
    + [(op, d) for op in ("BAND", "BOR", "BXOR") for d in INTS + ["bool"]]
)

# (op, dtype) combinations that must raise a clear error on every rank
INVALID_REDUCTIONS = (
    [(op, "complex64") for op in ("MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")]
    + [(op, d) for op in ("BAND", "BOR", "BXOR") for d in ("float32", "float64", "float16", "bfloat16")]
    + [("AVG", d) for d in ("int8", "int32", "int64", "uint8", "bool")]
)


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def make(rank: int, shape, dtype_name: str, op: str = "SUM", salt: str = "") -> torch.Tensor:
    """Rank ``rank``'s deterministic input, integer-valued, chosen so ``op`` stays exact."""
    dt = DTYPES[dtype_name]
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator().manual_seed(seed_of(rank, tuple(shape), dtype_name, op, salt))
    if dtype_name == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if op in ("BAND", "BOR", "BXOR"):
        lo, hi = (0, 256) if dtype_name == "uint8" else (-128, 128) if dtype_name == "int8" else (-(1 << 14), 1 << 14)
        return torch.randint(lo, hi, shape, generator=g).to(dt)
    if op == "PRODUCT":
        vals = torch.tensor([1, 2, 3] if dtype_name == "uint8" else [-2, -1, 1, 2])
        return vals[torch.randint(0, len(vals), shape, generator=g)].to(dt)
    lo, hi = (0, 30) if dtype_name == "uint8" else (-30, 31)
    if dtype_name == "complex64":
        re_ = torch.randint(lo, hi, shape, generator=g).float()
        im_ = torch.randint(lo, hi, shape, generator=g).float()
        return torch.complex(re_, im_)
    return torch.randint(lo, hi, shape, generator=g).to(dt)


def reduce_all(inputs: list[torch.Tensor], op: str, world: int) -> torch.Tensor:
    """Expected result of reducing ``inputs`` (one per rank) with ``op``, in their dtype."""
    dt = inputs[0].dtype
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        acc_dt = torch.complex128 if dt.is_complex else torch.float64 if dt.is_floating_point else torch.int64
        acc = torch.zeros(inputs[0].shape, dtype=acc_dt)
        for x in inputs:
            acc += x.to(acc_dt) * (PREMUL_FACTOR if op == "PREMUL_SUM" else 1)
        if op == "AVG":
            acc = acc / world
        return acc.to(dt) if dt != torch.uint8 else (acc % 256).to(dt)
    if op == "PRODUCT":
        acc = torch.ones(inputs[0].shape, dtype=torch.float64 if dt.is_floating_point else torch.int64)
        for x in inputs:
            acc *= x.to(acc.dtype)
        return acc.to(dt)
    out = inputs[0].clone()
    for x in inputs[1:]:
        if op == "MIN":
            out = torch.minimum(out, x)
        elif op == "MAX":
            out = torch.maximum(out, x)
        elif op == "BAND":
            out = out & x
        elif op == "BOR":
            out = out | x
        elif op == "BXOR":
            out = out ^ x
        else:
            raise ValueError(op)
    return out


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    g, w = got.reshape(-1), want.reshape(-1)
    if g.dtype.is_complex:
        bad = (g != w).nonzero()
    elif g.dtype.is_floating_point:
        bad = ((g != w) & ~(g.isnan() & w.isnan())).nonzero()
    else:
        bad = (g != w).nonzero()
    idx = bad[:5, 0].tolist()
    return (f"{bad.shape[0]} of {g.numel()} elements differ; first at {idx}: "
            f"got {[g[i].item() for i in idx]} want {[w[i].item() for i in idx]}")


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True, hard: bool = False) -> None:
    """Checks dtype, shape and values (bitwise-equal unless ``exact`` is False). A mismatch is
    recorded (mp.soft_fail: the function goes on, the call fails at its end) unless ``hard``."""
    try:
        _check_equal(what, got, want, exact)
    except AssertionError as e:
        if hard:
            raise
        mp.soft_fail(str(e))


def _check_equal(what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    if exact:
        if not torch.equal(got, want):
            raise AssertionError(f"{what}: {first_mismatch(got, want)}")
    else:
        try:
            torch.testing.assert_close(got, want, rtol=None, atol=None)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


def try_ref(fn: Callable[[], torch.Tensor | list]):
    """Runs the gloo reference; None when gloo does not support the op/dtype (it raises)."""
    try:
        return fn()
    except (RuntimeError, ValueError):
        return None


def expect_raises(fn: Callable[[], object]) -> dict:
    """Runs ``fn``; returns what it raised (or that it did not) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0,
                # RuntimeError or ValueError, including torch's subclasses (DistBackendError...)
                "runtime_or_value": isinstance(e, (RuntimeError, ValueError))}
    return {"raised": False, "type": "", "msg": "", "s": time.monotonic() - t0, "runtime_or_value": False}


def mentions(msg: str, *words: str) -> bool:
    m = msg.lower()
    return all(w.lower() in m for w in words)


def mentions_number(msg: str, label_words: tuple[str, ...], value: int) -> bool:
    """True when ``msg`` names ``value`` right after one of ``label_words`` (e.g. 'tag 7', 'tag=7')."""
    pat = r"(?:%s)\W{0,3}%d\b" % ("|".join(label_words), value)
    return re.search(pat, msg, flags=re.IGNORECASE) is not None


def wait_file(path: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.02)
    return False


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def health_check(ctx) -> None:
    """A SUM all_reduce on the group under test, checked: the group still works."""
    x = torch.full((17,), float(ctx.rank + 1))
    dist.all_reduce(x)
    want = float(ctx.world * (ctx.world + 1) // 2)
    if not torch.equal(x, torch.full((17,), want)):
        raise AssertionError(f"health check after the previous step failed: got {x[:3].tolist()}, want {want}")


def gather_objects_ref(ctx, obj):
    """all_gather_object over the gloo reference group (for cross-rank comparisons)."""
    out = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.ref)
    return out


def verify(what: str, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor | None = None,
           exact: bool = True) -> None:
    """Checks (softly, see check_equal) ``got`` (backend under test) against the computed expectation ``want``; the gloo
    result ``ref`` (None when gloo lacks the op/dtype) is compared too and quoted on a mismatch,
    which tells a backend bug (gloo agrees with ``want``) from a wrong expectation (gloo agrees
    with ``got``)."""
    try:
        _check_equal(what, got, want, exact)
    except AssertionError as e:
        note = ""
        if ref is not None:
            try:
                _check_equal("gloo", ref, want, exact)
                note = " [gloo gives the expected values]"
            except AssertionError:
                try:
                    _check_equal("gloo", ref, got, exact)
                    note = " [gloo gives the same values as the backend: expectation suspect]"
                except AssertionError:
                    note = " [gloo differs from both]"
        mp.soft_fail(str(e) + note)
        return
    if ref is not None and exact and ref.dtype == got.dtype and ref.shape == got.shape and not torch.equal(ref, got):
        # the backend matches the expectation but gloo does not: gloo's problem; keep a trace of it
        print(f"note: {what}: gloo differs from the expectation ({first_mismatch(ref, want)})")


class GlooLacks(Exception):
    """Raised in gloo mode (COMMUX_TEST_BACKEND=gloo) when gloo, as the backend under test, rejects
    an op/dtype the suite requires from commux: the test is then skipped, not failed."""


def under_test(fn: Callable[[], object]):
    """Runs an op on the backend under test; see GlooLacks."""
    if os.environ.get("COMMUX_TEST_BACKEND", "ucx") != "gloo":
        return fn()
    try:
        return fn()
    except (RuntimeError, ValueError) as e:
        raise GlooLacks(f"gloo rejects this: {type(e).__name__}: {e}".splitlines()[0]) from None


def group_with(env: dict, **kwargs):
    """A new group of every rank, created with the environment variables in `env` set (their
    previous values, e.g. ones the whole run set, come back afterwards); `kwargs` go to
    dist.new_group (a timeout, say)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group(list(range(dist.get_world_size())), **kwargs)
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
