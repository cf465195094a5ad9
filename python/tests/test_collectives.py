"""Collectives on the backend under test, each checked element-wise against a computed expectation
and against gloo on the same inputs (``ctx.ref``) where gloo supports the op/dtype.

Counts: 0, 1, odd (1001) everywhere; 1<<20 elements for a few ops. Reductions: the full
(op, dtype) matrix for all_reduce, a sample for reduce / reduce_scatter / reduce_scatter_tensor /
the coalesced forms; unsupported combinations must raise a clear error on every rank, and the
group must still work afterwards.
"""
import time

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import (DTYPES, INVALID_REDUCTIONS, VALID_REDUCTIONS, expect_raises, first_mismatch,
                     health_check, make, mentions, red_op, reduce_all, try_ref, under_test, verify)
from suite import BACKEND, worlds

pytestmark = pytest.mark.ucx

COUNTS = [0, 1, 1001]
BIG = 1 << 20
FAST = 30  # seconds: these calls take milliseconds; a hang should not cost a minute

# a sample of the (op, dtype) matrix for the collectives other than all_reduce
REDUCTION_SAMPLE = [
    ("SUM", "float32"), ("SUM", "int16"), ("SUM", "complex64"), ("PRODUCT", "int8"),
    ("PRODUCT", "float64"), ("MIN", "float16"), ("MAX", "bfloat16"), ("MAX", "uint8"),
    ("AVG", "float32"), ("AVG", "bfloat16"), ("PREMUL_SUM", "float64"), ("BAND", "int32"),
    ("BOR", "bool"), ("BXOR", "int64"),
]


def rid(p):
    return "-".join(str(x) for x in p) if isinstance(p, tuple) else str(p)


def fresh(shape, dtype_name):
    """An output buffer filled with a sentinel, so an unwritten output is noticed."""
    dt = DTYPES[dtype_name]
    return torch.full(shape if isinstance(shape, tuple) else (shape,), True if dt == torch.bool else 99, dtype=dt)


# ---------------------------------------------------------------------------------------------
def _barrier(ctx):
    """Rank 0 arrives 0.5 s late: everyone else must wait for it in barrier()."""
    if ctx.rank == 0:
        time.sleep(0.5)
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    dist.barrier(async_op=True).wait()
    return waited


@worlds()
def test_barrier(ranks, ws):
    waited = ranks.run(_barrier, timeout=FAST)
    for r in range(1, ws):
        assert waited[r] > 0.3, f"rank {r} left barrier after {waited[r]:.3f}s although rank 0 came 0.5s late"


# ---------------------------------------------------------------------------------------------
def _broadcast(ctx, count, dtype):
    for root in range(ctx.world):
        want = make(root, count, dtype, salt="bc")
        x = want.clone() if ctx.rank == root else fresh(count, dtype)
        under_test(lambda: dist.broadcast(x, src=root))
        y = want.clone() if ctx.rank == root else fresh(count, dtype)
        ref = try_ref(lambda: (dist.broadcast(y, src=root, group=ctx.ref), y)[1])
        verify(f"broadcast from {root} ({dtype}, {count})", x, want, ref)


@worlds()
@pytest.mark.parametrize("count", COUNTS + [BIG])
def test_broadcast(ranks, ws, count):
    ranks.run(_broadcast, count, "float32", timeout=FAST)


@worlds(2, 3)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "int8", "int64", "bool", "complex64"])
def test_broadcast_dtypes(ranks, ws, dtype):
    ranks.run(_broadcast, 1001, dtype, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _all_reduce(ctx, op, dtype, count):
    inputs = [make(r, count, dtype, op, salt="ar") for r in range(ctx.world)]
    want = reduce_all(inputs, op, ctx.world)
    x = inputs[ctx.rank].clone()
    under_test(lambda: dist.all_reduce(x, op=red_op(op)))
    y = inputs[ctx.rank].clone()
    ref = try_ref(lambda: (dist.all_reduce(y, op=red_op(op), group=ctx.ref), y)[1])
    verify(f"all_reduce {op} {dtype} count {count}", x, want, ref, exact=op != "AVG")


@worlds()
@pytest.mark.parametrize("op_dtype", VALID_REDUCTIONS, ids=rid)
def test_all_reduce(ranks, ws, op_dtype):
    ranks.run(_all_reduce, *op_dtype, 1001, timeout=FAST)


@worlds()
@pytest.mark.parametrize("count", [0, 1, BIG])
@pytest.mark.parametrize("op_dtype", [("SUM", "float32"), ("MAX", "int64"), ("BXOR", "uint8")], ids=rid)
def test_all_reduce_counts(ranks, ws, op_dtype, count):
    ranks.run(_all_reduce, *op_dtype, count, timeout=FAST)


def _all_reduce_identical(ctx, dtype):
    """Random (non-integer) floats: every rank must end with bitwise the same result, and it must
    agree with gloo's up to rounding (the two may add the ranks' values in different orders:
    each partial sum rounds once, so |diff| <= world * eps * sum_r |x_r|)."""
    dt = DTYPES[dtype]

    def data(r):
        return torch.randn(10007, generator=torch.Generator().manual_seed(1234 + r)).to(dt)

    x = data(ctx.rank)
    y = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(y, group=ctx.ref)
    everyone = [torch.empty_like(x) for _ in range(ctx.world)]
    dist.all_gather(everyone, x, group=ctx.ref)
    for r, t in enumerate(everyone):
        if not torch.equal(t, everyone[0]):
            raise AssertionError(f"all_reduce result on rank {r} differs from rank 0's (not bitwise identical): "
                                 f"{first_mismatch(t, everyone[0])}")
    bound = ctx.world * torch.finfo(dt).eps * sum(data(r).double().abs() for r in range(ctx.world))
    diff = (x.double() - y.double()).abs()
    if not bool((diff <= bound).all()):
        i = int((diff - bound).argmax())
        raise AssertionError(f"all_reduce {dtype} differs from gloo beyond rounding at [{i}]: "
                             f"{x[i].item()} vs gloo {y[i].item()} (bound {bound[i].item():.3g})")


@worlds(2, 3, 4)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_identical_on_all_ranks(ranks, ws, dtype):
    ranks.run(_all_reduce_identical, dtype, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _reduce(ctx, op, dtype, count):
    inputs = [make(r, count, dtype, op, salt="red") for r in range(ctx.world)]
    want = reduce_all(inputs, op, ctx.world)
    for root in range(ctx.world):
        x = inputs[ctx.rank].clone()
        under_test(lambda: dist.reduce(x, dst=root, op=red_op(op)))
        y = inputs[ctx.rank].clone()
        ref = try_ref(lambda: (dist.reduce(y, dst=root, op=red_op(op), group=ctx.ref), y)[1])
        if ctx.rank == root:
            verify(f"reduce {op} {dtype} count {count} to {root}", x, want, ref, exact=op != "AVG")


@worlds()
@pytest.mark.parametrize("op_dtype", REDUCTION_SAMPLE, ids=rid)
def test_reduce(ranks, ws, op_dtype):
    ranks.run(_reduce, *op_dtype, 1001, timeout=FAST)


@worlds()
@pytest.mark.parametrize("count", [0, 1])
def test_reduce_counts(ranks, ws, count):
    ranks.run(_reduce, "SUM", "float32", count, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _all_gather(ctx, count, dtype):
    want = [make(r, count, dtype, salt="ag") for r in range(ctx.world)]
    outs = [fresh(count, dtype) for _ in range(ctx.world)]
    under_test(lambda: dist.all_gather(outs, want[ctx.rank].clone()))
    refs = [fresh(count, dtype) for _ in range(ctx.world)]
    ok = try_ref(lambda: dist.all_gather(refs, want[ctx.rank].clone(), group=ctx.ref) or True)
    for r in range(ctx.world):
        verify(f"all_gather slot {r} ({dtype}, {count})", outs[r], want[r], refs[r] if ok else None)


@worlds()
@pytest.mark.parametrize("count", COUNTS)
def test_all_gather(ranks, ws, count):
    ranks.run(_all_gather, count, "float32", timeout=FAST)


@worlds(3)
@pytest.mark.parametrize("dtype", ["float16", "int8", "bool", "complex64"])
def test_all_gather_dtypes(ranks, ws, dtype):
    ranks.run(_all_gather, 1001, dtype, timeout=FAST)


def _all_gather_into_tensor(ctx, count, dtype, stacked):
    want = torch.stack([make(r, count, dtype, salt="agt") for r in range(ctx.world)])
    if not stacked:
        want = want.reshape(-1)
    out = fresh(tuple(want.shape), dtype)
    under_test(lambda: dist.all_gather_into_tensor(out, make(ctx.rank, count, dtype, salt="agt")))
    ref = fresh(tuple(want.shape), dtype)
    ref = try_ref(lambda: (dist.all_gather_into_tensor(ref, make(ctx.rank, count, dtype, salt="agt"),
                                                       group=ctx.ref), ref)[1])
    verify(f"all_gather_into_tensor ({dtype}, {count}, {'stacked' if stacked else 'flat'})", out, want, ref)


@worlds()
@pytest.mark.parametrize("count", COUNTS + [BIG])
def test_all_gather_into_tensor(ranks, ws, count):
    ranks.run(_all_gather_into_tensor, count, "float32", False, timeout=FAST)


@worlds(2, 4)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_all_gather_into_tensor_stacked(ranks, ws, dtype):
    ranks.run(_all_gather_into_tensor, 1001, dtype, True, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _gather(ctx, count, dtype):
    want = [make(r, count, dtype, salt="ga") for r in range(ctx.world)]
    for root in range(ctx.world):
        outs = [fresh(count, dtype) for _ in range(ctx.world)] if ctx.rank == root else None
        under_test(lambda: dist.gather(want[ctx.rank].clone(), gather_list=outs, dst=root))
        refs = [fresh(count, dtype) for _ in range(ctx.world)] if ctx.rank == root else None
        ok = try_ref(lambda: dist.gather(want[ctx.rank].clone(), gather_list=refs, dst=root, group=ctx.ref) or True)
        if ctx.rank == root:
            for r in range(ctx.world):
                verify(f"gather to {root}, slot {r} ({dtype}, {count})", outs[r], want[r], refs[r] if ok else None)


@worlds()
@pytest.mark.parametrize("count", COUNTS)
def test_gather(ranks, ws, count):
    ranks.run(_gather, count, "float32", timeout=FAST)


def _scatter(ctx, count, dtype):
    for root in range(ctx.world):
        chunks = [make(root, count, dtype, salt=f"sc{j}") for j in range(ctx.world)]
        out = fresh(count, dtype)
        under_test(lambda: dist.scatter(out, scatter_list=[c.clone() for c in chunks] if ctx.rank == root else None,
                                        src=root))
        ref = fresh(count, dtype)
        ref = try_ref(lambda: (dist.scatter(ref, scatter_list=[c.clone() for c in chunks] if ctx.rank == root else None,
                                            src=root, group=ctx.ref), ref)[1])
        verify(f"scatter from {root} ({dtype}, {count})", out, chunks[ctx.rank], ref)


@worlds()
@pytest.mark.parametrize("count", COUNTS)
def test_scatter(ranks, ws, count):
    ranks.run(_scatter, count, "float32", timeout=FAST)


@worlds(3)
@pytest.mark.parametrize("dtype", ["int16", "bool", "complex64"])
def test_gather_scatter_dtypes(ranks, ws, dtype):
    ranks.run(_gather, 1001, dtype, timeout=FAST)
    ranks.run(_scatter, 1001, dtype, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _reduce_scatter(ctx, op, dtype, count):
    """List form: rank r's input j goes (reduced over ranks) to rank j."""
    inputs = [[make(r, count, dtype, op, salt=f"rs{j}") for j in range(ctx.world)] for r in range(ctx.world)]
    want = reduce_all([inputs[r][ctx.rank] for r in range(ctx.world)], op, ctx.world)
    out = fresh(count, dtype)
    under_test(lambda: dist.reduce_scatter(out, [t.clone() for t in inputs[ctx.rank]], op=red_op(op)))
    ref = fresh(count, dtype)
    ref = try_ref(lambda: (dist.reduce_scatter(ref, [t.clone() for t in inputs[ctx.rank]], op=red_op(op),
                                               group=ctx.ref), ref)[1])
    verify(f"reduce_scatter {op} {dtype} count {count}", out, want, ref, exact=op != "AVG")


def _reduce_scatter_tensor(ctx, op, dtype, count):
    inputs = [make(r, ctx.world * count, dtype, op, salt="rst") for r in range(ctx.world)]
    me = slice(ctx.rank * count, (ctx.rank + 1) * count)
    want = reduce_all([x[me] for x in inputs], op, ctx.world)
    out = fresh(count, dtype)
    under_test(lambda: dist.reduce_scatter_tensor(out, inputs[ctx.rank].clone(), op=red_op(op)))
    ref = fresh(count, dtype)
    ref = try_ref(lambda: (dist.reduce_scatter_tensor(ref, inputs[ctx.rank].clone(), op=red_op(op),
                                                      group=ctx.ref), ref)[1])
    verify(f"reduce_scatter_tensor {op} {dtype} count {count}", out, want, ref, exact=op != "AVG")


@worlds()
@pytest.mark.parametrize("op_dtype", REDUCTION_SAMPLE, ids=rid)
def test_reduce_scatter(ranks, ws, op_dtype):
    ranks.run(_reduce_scatter, *op_dtype, 1001, timeout=FAST)


@worlds()
@pytest.mark.parametrize("op_dtype", REDUCTION_SAMPLE, ids=rid)
def test_reduce_scatter_tensor(ranks, ws, op_dtype):
    ranks.run(_reduce_scatter_tensor, *op_dtype, 1001, timeout=FAST)


@worlds()
@pytest.mark.parametrize("count", [0, 1, BIG])
def test_reduce_scatter_counts(ranks, ws, count):
    if count != BIG:
        ranks.run(_reduce_scatter, "SUM", "float32", count, timeout=FAST)
    ranks.run(_reduce_scatter_tensor, "SUM", "float32", count, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def split(src: int, dst: int, kind: str, count: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``."""
    if kind == "even":
        return count
    if kind == "zero":
        return 0
    return (src * 2 + dst * 3 + 1) % 4 * (1 + count // 4)  # uneven, with zeros


def _all_to_all_single(ctx, kind, count, with_sizes):
    W, me = ctx.world, ctx.rank
    in_rows = [split(me, j, kind, count) for j in range(W)]
    out_rows = [split(j, me, kind, count) for j in range(W)]
    inputs = {r: make(r, (sum(split(r, j, kind, count) for j in range(W)), 3), "float32", salt="a2a") for r in range(W)}

    def chunk(r, j):  # what rank r sends to rank j
        off = sum(split(r, k, kind, count) for k in range(j))
        return inputs[r][off:off + split(r, j, kind, count)]

    want = torch.cat([chunk(j, me) for j in range(W)])
    out = fresh((sum(out_rows), 3), "float32")
    kw = dict(output_split_sizes=out_rows, input_split_sizes=in_rows) if with_sizes else {}
    under_test(lambda: dist.all_to_all_single(out, inputs[me].clone(), **kw))
    ref = fresh((sum(out_rows), 3), "float32")
    ref = try_ref(lambda: (dist.all_to_all_single(ref, inputs[me].clone(), group=ctx.ref, **kw), ref)[1])
    verify(f"all_to_all_single {kind} count {count} (explicit sizes: {with_sizes})", out, want, ref)


@worlds()
@pytest.mark.parametrize("count", COUNTS + [BIG // 3])
@pytest.mark.parametrize("with_sizes", [False, True], ids=["implicit", "sizes"])
def test_all_to_all_single_even(ranks, ws, count, with_sizes):
    ranks.run(_all_to_all_single, "even", count, with_sizes, timeout=FAST)


@worlds()
@pytest.mark.parametrize("kind", ["uneven", "zero"])
@pytest.mark.parametrize("count", [1, 1001])
def test_all_to_all_single_uneven(ranks, ws, kind, count):
    ranks.run(_all_to_all_single, kind, count, True, timeout=FAST)


def _all_to_all(ctx, kind, count, dtype):
    W, me = ctx.world, ctx.rank

    def piece(src, dst):
        return make(src, split(src, dst, kind, count), dtype, salt=f"a2al{dst}")

    outs = [fresh(split(j, me, kind, count), dtype) for j in range(W)]
    under_test(lambda: dist.all_to_all(outs, [piece(me, j) for j in range(W)]))
    refs = [fresh(split(j, me, kind, count), dtype) for j in range(W)]
    ok = try_ref(lambda: dist.all_to_all(refs, [piece(me, j) for j in range(W)], group=ctx.ref) or True)
    for j in range(W):
        verify(f"all_to_all {kind} {dtype} from {j}", outs[j], piece(j, me), refs[j] if ok else None)


@worlds()
@pytest.mark.parametrize("kind_count", [("even", 0), ("even", 1), ("even", 1001), ("uneven", 1), ("uneven", 1001)],
                         ids=rid)
def test_all_to_all(ranks, ws, kind_count):
    kind, count = kind_count
    ranks.run(_all_to_all, kind, count, "float32", timeout=FAST)


@worlds(3)
@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "complex64"])
def test_all_to_all_dtypes(ranks, ws, dtype):
    ranks.run(_all_to_all, "uneven", 1001, dtype, timeout=FAST)


# ---------------------------------------------------------------------------------------------
# The list forms run one collective over a flat buffer: the list's own memory where its tensors lie
# back to back in rank order (no copy), else a staging buffer (memcpy for small CPU lists, copy_
# above 256 KiB per tensor). Each layout below must give the same result:
#   separate  -- a tensor per rank (staged)
#   block     -- the rows of one tensor, in order (the list's own memory)
#   reversed  -- the rows of one tensor, in reverse order (adjacent, but not in rank order: staged)
#   aliased   -- one block, and the call's other tensor is one of its rows (in place)
LIST_OPS = ["all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"]
LAYOUTS = ["separate", "block", "reversed", "aliased"]


def _rows(layout, world, count, fill):
    """A list of `world` float32 tensors of `count` elements laid out as `layout` says, filled from
    fill(j) (None: a sentinel)."""
    if layout == "separate":
        return [fill(j) if fill else fresh(count, "float32") for j in range(world)]
    whole = torch.full((world, count), 99.0)
    rows = list(whole.unbind(0))
    if layout == "reversed":
        rows = rows[::-1]
    if fill:
        for j in range(world):
            rows[j].copy_(fill(j))
    return rows


def _list_layout(ctx, op, layout, count):
    W, me = ctx.world, ctx.rank
    ident = f"{op}, {layout} list, {count} elements"
    if op == "all_gather":
        want = [make(r, count, "float32", salt="lag") for r in range(W)]
        outs = _rows("block" if layout == "aliased" else layout, W, count, None)
        if layout == "aliased":  # in place: the input is this rank's own row of the output
            outs[me].copy_(want[me])
            x = outs[me]
        else:
            x = want[me].clone()
        dist.all_gather(outs, x)
        for r in range(W):
            verify(f"{ident}: slot {r}", outs[r], want[r])
    elif op == "gather":
        want = [make(r, count, "float32", salt="lga") for r in range(W)]
        for root in range(W):
            outs = None
            x = want[me].clone()
            if me == root:
                outs = _rows("block" if layout == "aliased" else layout, W, count, None)
                if layout == "aliased":
                    outs[me].copy_(want[me])
                    x = outs[me]
            dist.gather(x, gather_list=outs, dst=root)
            if me == root:
                for r in range(W):
                    verify(f"{ident}: to {root}, slot {r}", outs[r], want[r])
    elif op == "scatter":
        for root in range(W):
            chunks = [make(root, count, "float32", salt=f"lsc{j}") for j in range(W)]
            ins = None
            out = fresh(count, "float32")
            if me == root:
                ins = _rows("block" if layout == "aliased" else layout, W, count, lambda j: chunks[j])
                if layout == "aliased":  # the root receives into its own row of the list
                    out = ins[me]
            dist.scatter(out, scatter_list=ins, src=root)
            verify(f"{ident}: from {root}", out, chunks[me])
            if me == root:
                for j in range(W):
                    verify(f"{ident}: from {root}, the root's input {j} afterwards", ins[j], chunks[j])
    elif op == "reduce_scatter":
        inputs = [[make(r, count, "float32", salt=f"lrs{j}") for j in range(W)] for r in range(W)]
        want = reduce_all([inputs[r][me] for r in range(W)], "SUM", W)
        ins = _rows("block" if layout == "aliased" else layout, W, count, lambda j: inputs[me][j])
        out = ins[me] if layout == "aliased" else fresh(count, "float32")
        dist.reduce_scatter(out, ins)
        verify(ident, out, want)
        for j in range(W):
            if not (layout == "aliased" and j == me):
                verify(f"{ident}: input {j} afterwards", ins[j], inputs[me][j])
    else:  # all_to_all; aliased: the input list is the output list
        def piece(src, dst):
            return make(src, count, "float32", salt=f"la2a{dst}")
        ins = _rows("block" if layout == "aliased" else layout, W, count, lambda j: piece(me, j))
        outs = ins if layout == "aliased" else _rows(layout, W, count, None)
        dist.all_to_all(outs, ins)
        for j in range(W):
            verify(f"{ident}: from {j}", outs[j], piece(j, me))
            if layout != "aliased":
                verify(f"{ident}: input {j} afterwards", ins[j], piece(me, j))


@worlds(1, 2, 3)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", LIST_OPS)
def test_list_layouts(ranks, ws, op, layout):
    ranks.run(_list_layout, op, layout, 1001, timeout=FAST)


@worlds(2)
@pytest.mark.parametrize("layout", ["separate", "reversed", "block"])
@pytest.mark.parametrize("op", LIST_OPS)
def test_list_layouts_large(ranks, ws, op, layout):
    """Above 256 KiB per tensor a staged list goes through copy_ instead of memcpy."""
    ranks.run(_list_layout, op, layout, 70000, timeout=FAST)


def _all_to_all_single_in_place(ctx, count):
    W, me = ctx.world, ctx.rank

    def block(src, dst):
        return make(src, count, "float32", salt=f"ip{dst}")

    t = torch.cat([block(me, j) for j in range(W)])
    dist.all_to_all_single(t, t)
    for j in range(W):
        verify(f"in place, {count} per block: from {j}", t[j * count:(j + 1) * count], block(j, me))


@worlds(1, 2, 3)
@pytest.mark.parametrize("count", [1001, 262144])
def test_all_to_all_single_in_place(ranks, ws, count):
    """all_to_all_single(t, t): the input is read from a copy. Before, the 1 MiB blocks (a
    rendezvous reads the sender's memory after the receiver may have written it) came out wrong."""
    ranks.run(_all_to_all_single_in_place, count, timeout=FAST)


def _flat_blocks_aliased(ctx, count, which):
    """all_gather_into_tensor whose input is a row of its output, and reduce_scatter_tensor whose
    output is a block of its input: this rank's own row (in place) or the next rank's."""
    W, me = ctx.world, ctx.rank
    j = me if which == "own" else (me + 1) % W

    def block(src, b):
        return make(src, count, "float32", salt=f"fb{b}")

    for rep in range(3):  # (the wrong results depended on timing: before, 1 call in 2 or so)
        out = torch.zeros(W * count)
        out[j * count:(j + 1) * count] = block(me, 0)
        dist.all_gather_into_tensor(out, out[j * count:(j + 1) * count])
        for r in range(W):
            verify(f"all_gather_into_tensor #{rep}, input = row {j}: row {r}", out[r * count:(r + 1) * count],
                   block(r, 0))
        inp = torch.cat([block(me, b) for b in range(W)])
        res = inp[j * count:(j + 1) * count]
        dist.reduce_scatter_tensor(res, inp)
        verify(f"reduce_scatter_tensor #{rep}, output = block {j}", res,
               reduce_all([block(r, me) for r in range(W)], "SUM", W))


@worlds(1, 2, 3)
@pytest.mark.parametrize("which", ["own", "next"])
@pytest.mark.parametrize("count", [1001, 300000])
def test_flat_blocks_aliased(ranks, ws, count, which):
    """Before, reduce_scatter_tensor into the next rank's block of its input gave a wrong result at
    1 MiB per block on 2 ranks, silently; the input is now read from a copy there."""
    ranks.run(_flat_blocks_aliased, count, which, timeout=FAST)


# ---------------------------------------------------------------------------------------------
COALESCED_SIZES = [1, 1001, 33, 4096]


def _coalesced(ctx, kind, op, dtype):
    """all_reduce / all_gather_into_tensor / reduce_scatter_tensor inside
    dist._coalescing_manager(async_ops=True), then cm.wait(); checked per tensor."""
    W, me = ctx.world, ctx.rank
    results = []

    def run_coalesced(group):
        outs = []
        with dist._coalescing_manager(group, async_ops=True) as cm:
            for i, n in enumerate(COALESCED_SIZES):
                if kind == "all_reduce":
                    x = make(me, n, dtype, op, salt=f"co{i}")
                    dist.all_reduce(x, op=red_op(op), group=group)
                    outs.append(x)
                elif kind == "all_gather_into_tensor":
                    o = fresh(W * n, dtype)
                    dist.all_gather_into_tensor(o, make(me, n, dtype, salt=f"co{i}"), group=group)
                    outs.append(o)
                else:
                    o = fresh(n, dtype)
                    dist.reduce_scatter_tensor(o, make(me, W * n, dtype, op, salt=f"co{i}"), op=red_op(op), group=group)
                    outs.append(o)
        cm.wait()
        return outs

    results.append(under_test(lambda: run_coalesced(None)))
    results.append(try_ref(lambda: run_coalesced(ctx.ref)))
    for i, n in enumerate(COALESCED_SIZES):
        if kind == "all_reduce":
            want = reduce_all([make(r, n, dtype, op, salt=f"co{i}") for r in range(W)], op, W)
        elif kind == "all_gather_into_tensor":
            want = torch.cat([make(r, n, dtype, salt=f"co{i}") for r in range(W)])
        else:
            want = reduce_all([make(r, W * n, dtype, op, salt=f"co{i}")[me * n:(me + 1) * n] for r in range(W)], op, W)
        verify(f"coalesced {kind} {op} {dtype}, tensor {i} ({n} elements)", results[0][i], want,
               results[1][i] if results[1] is not None else None,
               exact=op != "AVG")


@worlds()
@pytest.mark.parametrize("kind_op", [("all_reduce", "SUM"), ("all_reduce", "MAX"), ("all_reduce", "AVG"),
                                     ("all_gather_into_tensor", "-"), ("reduce_scatter_tensor", "SUM"),
                                     ("reduce_scatter_tensor", "MIN")], ids=rid)
def test_coalesced(ranks, ws, kind_op):
    ranks.run(_coalesced, kind_op[0], kind_op[1] if kind_op[1] != "-" else "SUM", "float32", timeout=FAST)


def _coalesced_all_reduce_layout(ctx, layout, op, dtype):
    """all_reduce of views of one tensor inside a coalescing window (one allreduce_coalesced):
    in place where the views lie back to back in issue order (block), staged otherwise."""
    W, me = ctx.world, ctx.rank
    whole = torch.empty(sum(COALESCED_SIZES), dtype=DTYPES[dtype])
    if layout == "block":
        views = list(whole.split(COALESCED_SIZES))
    else:  # the same views, issued in reverse order of their place in memory
        views = list(whole.split(COALESCED_SIZES[::-1]))[::-1]
    for i, (v, n) in enumerate(zip(views, COALESCED_SIZES)):
        v.copy_(make(me, n, dtype, op, salt=f"cl{i}"))
    with dist._coalescing_manager(async_ops=True) as cm:
        for v in views:
            dist.all_reduce(v, op=red_op(op))
    cm.wait()
    for i, (v, n) in enumerate(zip(views, COALESCED_SIZES)):
        want = reduce_all([make(r, n, dtype, op, salt=f"cl{i}") for r in range(W)], op, W)
        verify(f"coalesced all_reduce {op} {dtype}, {layout} views, tensor {i}", v, want, exact=op != "AVG")


@worlds(1, 2, 3)
@pytest.mark.parametrize("layout", ["block", "reversed"])
@pytest.mark.parametrize("op_dtype", [("SUM", "float32"), ("AVG", "float32"), ("PREMUL_SUM", "float64"),
                                      ("MAX", "int64")], ids=rid)
def test_coalesced_all_reduce_layouts(ranks, ws, layout, op_dtype):
    ranks.run(_coalesced_all_reduce_layout, layout, *op_dtype, timeout=FAST)


# ---------------------------------------------------------------------------------------------
def _invalid_reduction(ctx, coll, op, dtype):
    n = 64
    x = make(ctx.rank, ctx.world * n, dtype, salt="bad")
    if coll == "all_reduce":
        res = expect_raises(lambda: dist.all_reduce(x, op=red_op(op)))
    elif coll == "reduce":
        res = expect_raises(lambda: dist.reduce(x, dst=ctx.world - 1, op=red_op(op)))
    elif coll == "reduce_scatter_tensor":
        res = expect_raises(lambda: dist.reduce_scatter_tensor(fresh(n, dtype), x, op=red_op(op)))
    else:
        raise ValueError(coll)
    dist.barrier(group=ctx.ref)
    health_check(ctx)  # nothing left half-done by the rejected call
    return res


INVALID_CASES = [("all_reduce", op, d) for op, d in INVALID_REDUCTIONS] + [
    (coll, op, d)
    for coll in ("reduce", "reduce_scatter_tensor")
    for op, d in (("BAND", "float32"), ("BXOR", "bfloat16"), ("AVG", "int32"), ("MIN", "complex64"))
]


@worlds(1, 2, 4)
@pytest.mark.parametrize("case", INVALID_CASES, ids=rid)
def test_unsupported_reduction_raises_on_every_rank(ranks, ws, case):
    coll, op, dtype = case
    res = ranks.run(_invalid_reduction, coll, op, dtype, timeout=FAST)
    problems = []
    for r, d in enumerate(res):
        if not d["raised"]:
            problems.append(f"rank {r}: {coll} {op} on {dtype} did not raise")
        elif not d["runtime_or_value"]:
            problems.append(f"rank {r}: raised {d['type']} (not a RuntimeError/ValueError): {d['msg']}")
        elif BACKEND != "gloo" and not mentions(d["msg"], op if op != "PREMUL_SUM" else "PREMUL"):
            problems.append(f"rank {r}: error does not name the op {op}: {d['type']}: {d['msg']!r}")
        elif d["s"] > 5:
            problems.append(f"rank {r}: raised only after {d['s']:.1f}s (timeout rather than validation?)")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
def _noncontig(ctx, kind):
    """Non-contiguous tensors: a strided slice (gaps hold a sentinel that must survive) and a
    transposed matrix. Either the result is right or a clear error is raised; never garbage."""
    W, me = ctx.world, ctx.rank
    out = {}

    def strided(values, sentinel=-77.0):
        base = torch.full((values.numel() * 2,), sentinel)
        view = base[::2]
        view.copy_(values)
        return base, view

    def gaps_ok(base, sentinel=-77.0):
        return torch.equal(base[1::2], torch.full_like(base[1::2], sentinel))

    for shape_kind in ("strided", "transposed"):
        def src(r):
            return make(r, 24, "float32", salt=f"nc{kind}").reshape(4, 6)

        def prep(values):
            if shape_kind == "strided":
                base, view = strided(values.reshape(-1))
                return base, view
            t = values.t().contiguous().t()  # same values, column-major: not contiguous, no gaps
            assert not t.is_contiguous()
            return None, t

        try:
            if kind == "all_reduce":
                base, v = prep(src(me))
                dist.all_reduce(v)
                want = sum(src(r) for r in range(W))
            elif kind == "broadcast":
                base, v = prep(src(0) if me == 0 else torch.zeros(4, 6))
                dist.broadcast(v, src=0)
                want = src(0)
            elif kind == "all_gather_out":
                outs = [prep(torch.zeros(4, 6)) for _ in range(W)]
                dist.all_gather([o[1] for o in outs], src(me).contiguous())
                base, v = outs[(me + 1) % W]
                want = src((me + 1) % W)
            elif kind == "send_recv":
                nxt, prv = (me + 1) % W, (me - 1) % W
                base, v = prep(torch.zeros(4, 6))
                _, s = prep(src(me))
                w = [dist.irecv(v, src=prv, tag=9), dist.isend(s, dst=nxt, tag=9)]
                for x in w:
                    x.wait()
                want = src(prv)
            else:
                raise ValueError(kind)
        except (RuntimeError, ValueError) as e:
            out[shape_kind] = f"raised {type(e).__name__}: {e}"
            dist.barrier(group=ctx.ref)
            continue
        want = want.reshape(-1) if shape_kind == "strided" else want
        out[shape_kind] = "ok"
        if not torch.equal(v, want):
            out[shape_kind] = "corrupt"
            mp.soft_fail(f"{kind} on a {shape_kind} tensor: silent corruption, "
                         f"got {v.reshape(-1)[:8].tolist()}..., want {want.reshape(-1)[:8].tolist()}...")
        if base is not None and not gaps_ok(base):
            out[shape_kind] = "corrupt"
            mp.soft_fail(f"{kind} on a {shape_kind} tensor wrote into the gaps between its elements: "
                         f"{base[:8].tolist()}")
        dist.barrier(group=ctx.ref)
    health_check(ctx)
    return out


@pytest.mark.ucx_semantics  # gloo (torch 2.13) silently corrupts a strided all_reduce: not a usable reference
@pytest.mark.parametrize("ws,kind", [(w, k) for w in (1, 2, 3) for k in ("all_reduce", "broadcast", "all_gather_out")]
                         + [(2, "send_recv"), (3, "send_recv")],
                         ids=lambda v: f"ws{v}" if isinstance(v, int) else v, scope="session")
def test_non_contiguous(ranks, ws, kind):
    res = ranks.run(_noncontig, kind, timeout=FAST)
    for shape_kind in ("strided", "transposed"):
        per_rank = [r[shape_kind] for r in res]
        raised = [p.startswith("raised") for p in per_rank]
        assert all(raised) or not any(raised), f"{kind} {shape_kind}: inconsistent across ranks: {per_rank}"
        for p in per_rank:
            if p.startswith("raised"):
                assert any(w in p.lower() for w in ("contiguous", "stride", "dense")), \
                    f"{kind} {shape_kind}: unclear error: {p}"


# ---------------------------------------------------------------------------------------------
def _premul_sum_factor_forms(ctx, factor_form, kind):
    """PREMUL_SUM carries its factor as a double or as a tensor (a ReduceOp supplement whose C++
    name changed across torch releases): both must scale every rank's input before the sum."""
    me, W, n = ctx.rank, ctx.world, 65
    f = 0.25
    factor = f if factor_form == "scalar" else torch.tensor(f, dtype=torch.float64)
    op = dist._make_nccl_premul_sum(factor)
    inputs = [torch.arange(W * n, dtype=torch.float64) * (r + 1) + r for r in range(W)]
    x = inputs[me].clone()
    if kind == "all_reduce":
        dist.all_reduce(x, op=op)
        got, want = x, sum(f * t for t in inputs)
    elif kind == "reduce_scatter_tensor":
        got = torch.full((n,), 99.0, dtype=torch.float64)
        dist.reduce_scatter_tensor(got, x, op=op)
        want = sum(f * t for t in inputs)[me * n:(me + 1) * n]
    else:  # reduce_scatter_tensor inside the coalescing manager (reduce_scatter_tensor_coalesced)
        from torch.distributed.distributed_c10d import _coalescing_manager
        outs = [torch.full((n,), 99.0, dtype=torch.float64) for _ in range(2)]
        with _coalescing_manager(async_ops=True) as cm:
            for o in outs:
                dist.reduce_scatter_tensor(o, x, op=op)
        cm.wait()
        want = sum(f * t for t in inputs)[me * n:(me + 1) * n]
        for o in outs[1:]:
            assert torch.equal(o, want), f"coalesced PREMUL_SUM ({factor_form}): second tensor wrong"
        got = outs[0]
    if kind != "all_reduce":
        assert torch.equal(x, inputs[me]), f"{kind} PREMUL_SUM ({factor_form}) modified its input"
    assert torch.equal(got, want), f"{kind} PREMUL_SUM ({factor_form}): {first_mismatch(got, want)}"


@worlds(2, 3)
@pytest.mark.ucx_semantics  # gloo has no PREMUL_SUM
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"])
@pytest.mark.parametrize("factor_form", ["scalar", "tensor"])
def test_premul_sum_factor_forms(ranks, ws, factor_form, kind):
    ranks.run(_premul_sum_factor_forms, factor_form, kind, timeout=FAST)
