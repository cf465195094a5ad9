"""The backend's argument checks (src/c10d/tensor_checks.cpp and the dtype / ReduceOp tables of
src/c10d/types.cpp), each driven through torch.distributed on 2 "ucx" ranks: every check refuses
its bad input before anything is posted, with a ValueError whose text names the operation, says
what is wrong, and names the group (its name, this rank and the group size).

The calls go through the ProcessGroup object where torch's Python layer would otherwise refuse
the input first (lists of several tensors, non-roots passing gather lists, ...), so that the
backend's own check is what answers. One fresh pair of ranks runs every case, then checks that the
group still works.
"""
import functools

import pytest
import torch
import torch.distributed as dist

import mp
from helpers import expect_raises, health_check
from suite import BACKEND

pytestmark = [pytest.mark.ucx, pytest.mark.ucx_semantics, pytest.mark.oneoff]

WORLD = 2

# name: (the backend operation the message names, a fragment of the message)
CASES = {
    # check_tensor
    "non-contiguous tensor": ("allreduce", "tensor must be contiguous (sizes [4, 3], strides [1, 4])"),
    # single
    "two tensors per process": ("allreduce", "expects exactly one tensor per process, got 2"),
    # check_root
    "root outside the group": ("broadcast", "root rank 5 is outside the group (size 2)"),
    # check_same (through allgather's outputs)
    "allgather output of another size": ("allgather", "output tensor has 3 elements but the input has 4"),
    "allgather output of another dtype": ("allgather", "output tensor has dtype Double but the input has Float"),
    # check_allgather_outputs
    "allgather list of wrong length": ("allgather", "expects one output list of 2 tensors, got 3 tensors"),
    # check_blocks
    "allgather_into_tensor output too small": (
        "_allgather_base",
        "output must have the input's dtype and 2 times its elements (input: 4 Float, output: 6 Float)"),
    "reduce_scatter_tensor input too small": (
        "_reduce_scatter_base",
        "input must have the output's dtype and 2 times its elements (output: 4 Float, input: 4 Float)"),
    # root_list
    "gather list on a non-root": ("gather", "only the root (rank 0) takes output tensors"),
    "scatter list of wrong length": ("scatter", "the root expects one input list of 2 tensors, got 1 tensors"),
    # check_p2p
    "send without tensors": ("send", "needs at least one tensor"),
    "send to a rank outside the group": ("send", "destination rank 2 is outside the group"),
    "recv with a negative tag": ("recv", "tag -1 is negative; tags are 0 .. 2^31-1"),
    # check_coalesced
    "allreduce_coalesced of two dtypes": ("allreduce_coalesced", "all tensors must have one dtype"),
    # check_allgather_coalesced
    "allgather_coalesced with too few lists": ("allgather_coalesced", "expects 2 output lists, got 1"),
    # check_blocks_coalesced
    "allgather_into_tensor_coalesced unpaired": ("allgather_into_tensor_coalesced", "needs one output per input"),
    # check_reduce_scatter_inputs
    "reduce_scatter list of wrong length": ("reduce_scatter", "expects one input list of 2 tensors"),
    # check_alltoall_base
    "all_to_all_single of two dtypes": ("alltoall_base", "input and output dtypes differ"),
    # check_alltoall
    "all_to_all of wrong lengths": ("alltoall", "expects 2 input and output tensors, got 2 and 3"),
    # split_bytes
    "all_to_all_single rows not divisible": (
        "alltoall_base", "input has 3 rows, not divisible by the group size 2; pass split sizes"),
    "all_to_all_single negative split": ("alltoall_base", "input split sizes contain a negative entry"),
    "all_to_all_single split beyond the rows": (
        "alltoall_base", "input split size 4611686018427387908 (for rank 0) exceeds the tensor's 4 rows"),
    # types.cpp: the dtype table, the ReduceOp table and core's check_reduction behind it
    "reduction of an unsupported dtype": ("allreduce", "dtype UInt16 is not supported for reductions"),
    "AVG of integers": ("allreduce", "ReduceOp AVG needs a floating-point or complex tensor, got int32 "
                                     "(use SUM and divide yourself)"),
    "bitwise op on floats": ("allreduce", "BAND"),
}


def _calls(ctx):
    pg = dist.distributed_c10d._get_default_group()
    W, me = ctx.world, ctx.rank
    peer = (me + 1) % W

    def opts(cls, **kw):
        o = cls()
        for k, v in kw.items():
            setattr(o, k, v)
        return o

    return {
        "non-contiguous tensor": lambda: dist.all_reduce(torch.ones(3, 4).t()),
        "two tensors per process": lambda: pg.allreduce([torch.ones(4), torch.ones(4)]).wait(),
        "root outside the group": lambda: pg.broadcast([torch.ones(4)], opts(dist.BroadcastOptions, rootRank=5)).wait(),
        "allgather output of another size": lambda: dist.all_gather([torch.zeros(3) for _ in range(W)], torch.ones(4)),
        "allgather output of another dtype": lambda: pg.allgather(
            [[torch.zeros(4, dtype=torch.double) for _ in range(W)]], [torch.ones(4)]).wait(),
        "allgather list of wrong length": lambda: dist.all_gather(
            [torch.zeros(4) for _ in range(W + 1)], torch.ones(4)),
        "allgather_into_tensor output too small": lambda: dist.all_gather_into_tensor(torch.zeros(6), torch.ones(4)),
        "reduce_scatter_tensor input too small": lambda: dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4)),
        # (each on the one rank where the backend's check, not torch's Python layer, answers)
        "gather list on a non-root": (lambda: pg.gather(
            [[torch.zeros(4) for _ in range(W)]], [torch.ones(4)],
            opts(dist.GatherOptions, rootRank=0)).wait()) if me != 0 else None,
        "scatter list of wrong length": (lambda: dist.scatter(
            torch.zeros(4), scatter_list=[torch.ones(4)], src=0)) if me == 0 else None,
        # (the dispatcher refuses an empty list before any backend: asked of the backend itself)
        "send without tensors": lambda: pg._get_backend(torch.device("cpu")).send([], peer, 0).wait(),
        "send to a rank outside the group": lambda: pg.send([torch.ones(4)], W, 0).wait(),
        "recv with a negative tag": lambda: pg.recv([torch.zeros(4)], peer, -1).wait(),
        "allreduce_coalesced of two dtypes": lambda: pg.allreduce_coalesced(
            [torch.ones(4), torch.ones(4, dtype=torch.double)], dist.AllreduceCoalescedOptions()).wait(),
        "allgather_coalesced with too few lists": lambda: pg.allgather_coalesced(
            [[torch.zeros(4)]], [torch.ones(4)]).wait(),
        "allgather_into_tensor_coalesced unpaired": lambda: pg.allgather_into_tensor_coalesced(
            [torch.zeros(4 * W)], [torch.ones(4), torch.ones(4)]).wait(),
        "reduce_scatter list of wrong length": lambda: dist.reduce_scatter(
            torch.zeros(4), [torch.ones(4) for _ in range(W + 1)]),
        "all_to_all_single of two dtypes": lambda: pg.alltoall_base(
            torch.zeros(4, dtype=torch.double), torch.ones(4), [], [], dist.AllToAllOptions()).wait(),
        "all_to_all of wrong lengths": lambda: dist.all_to_all(
            [torch.zeros(2) for _ in range(W + 1)], [torch.ones(2) for _ in range(W)]),
        "all_to_all_single rows not divisible": lambda: dist.all_to_all_single(torch.zeros(3), torch.ones(3)),
        "all_to_all_single negative split": lambda: dist.all_to_all_single(
            torch.zeros(4), torch.ones(4), output_split_sizes=[2, 2], input_split_sizes=[5, -1]),
        "all_to_all_single split beyond the rows": lambda: dist.all_to_all_single(
            torch.zeros(4), torch.ones(4), output_split_sizes=[4] + [0] * (W - 1),
            input_split_sizes=[2**62 + 4] + [0] * (W - 1)),
        "reduction of an unsupported dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint16)),
        "AVG of integers": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG),
        "bitwise op on floats": lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND),
    }


def _run_checks(ctx):
    calls = _calls(ctx)
    res = {}
    for name in CASES:
        if calls[name] is not None:
            print(f"tensor-check case: {name}", flush=True)
            res[name] = expect_raises(calls[name])
        dist.barrier(group=ctx.ref)
    health_check(ctx)  # nothing was posted: the group still works
    return res


@functools.lru_cache(maxsize=None)
def _run():
    return mp.run_once(_run_checks, WORLD, backend=BACKEND, pg_timeout_s=20, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_check_refuses_with_its_message(case):
    outs, closed = _run()
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    op, fragment = CASES[case]
    checked = 0
    problems = []
    for o in outs:
        r = o.value.get(case)
        if r is None:
            continue  # the case runs on the other rank (root / non-root)
        checked += 1
        want = [f"commux {op}: ", fragment, f"rank {o.rank} of {WORLD}", "group '"]
        if not r["raised"]:
            problems.append(f"rank {o.rank}: accepted (no error)")
        elif r["type"] != "ValueError":
            problems.append(f"rank {o.rank}: raised {r['type']}, not ValueError: {r['msg']!r}")
        elif any(w not in r["msg"] for w in want):
            problems.append(f"rank {o.rank}: the message lacks one of {want}: {r['msg']!r}")
    assert checked > 0, f"{case}: no rank made the call"
    assert not problems, f"{case}:\n" + "\n".join(problems)


def test_group_works_and_exits_after_the_refused_calls():
    outs, closed = _run()
    assert all(o.ok for o in outs), "\n".join(o.describe() for o in outs)
    bad = [o for o in closed if o.exit_code != 0]
    assert not bad, "\n".join(o.describe() for o in bad)
