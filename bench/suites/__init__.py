"""bench.suites: each benchmark's body (the scripts in bench/ are thin command lines over these).

    p2p        bench/run_bench.py         commux_bench beside ucx_perftest, MPI and memcpy
    coll       bench/coll_bench.py        collectives, nccl-tests style: ucx, noop, gloo, mpi, cpp
    torchdist  bench/torch_bench.py       torch.distributed send/recv and allreduce: ucx vs gloo
    cuda       bench/cuda_bench.py        two ranks on one GPU: p2p beside a copy, allreduce vs gloo
    vtensor    bench/vtensor_pingpong.py  V tensors per message, five ways

The expert-parallel harness is a package of its own (bench/ep, bench/ep_bench.py).
"""
