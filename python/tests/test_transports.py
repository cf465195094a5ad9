"""Transport choice by accelerator (issue: UCX copy transport chosen by accelerator, never one the
local UCX lacks, never overriding the user's UCX_TLS). Inputs are injected: no GPU needed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Imported, not importorskip'd: a package that fails to import must fail these tests, not skip them.
from commux import transports

CUDA_UCX = ["self", "tcp", "sysv", "posix", "cma", "cuda_copy", "cuda_ipc", "gdr_copy"]
ROCM_UCX = ["self", "tcp", "posix", "rocm_cpy", "rocm_ipc", "rocm_gdr"]
ZE_UCX = ["self", "tcp", "posix", "ze_copy", "ze_ipc"]
HOST_UCX = ["self", "tcp", "sysv", "posix", "cma"]


@pytest.mark.parametrize("acc, available, expected", [
    ("cuda", CUDA_UCX, ["cuda_copy", "cuda_ipc", "gdr_copy"]),
    ("cuda", ["self", "posix", "cuda_copy"], ["cuda_copy"]),
    ("rocm", ROCM_UCX, ["rocm_copy", "rocm_ipc"]),
    ("xpu", ZE_UCX, ["ze_copy", "ze_ipc"]),
    ("rocm", CUDA_UCX, []),
    ("xpu", CUDA_UCX, []),
    ("none", CUDA_UCX, []),
])
def test_transports_by_accelerator(acc, available, expected):
    c = transports.choose(acc, available, None, env={})
    assert c["transports"] == expected
    assert all(t.replace("rocm_copy", "rocm_cpy") in available for t in c["transports"])


def test_unknown_accelerator_gets_no_copy_transport_and_a_warning():
    c = transports.choose("mps", CUDA_UCX, None, env={})
    assert c["accelerator"] == "unknown" and c["transports"] == []
    assert any("'mps'" in w for w in c["warnings"])


def test_missing_copy_transport_warns_with_the_fix():
    c = transports.choose("cuda", HOST_UCX, None, env={})
    assert not c["copy_available"]
    assert any("no cuda_copy" in w and "libucx-cu13" in w for w in c["warnings"])


@pytest.mark.parametrize("tls, allowed", [
    ("tcp,sm", False), ("tcp,cuda_copy", True), ("sm,cuda", True), ("all", True),
    ("^cma", True), ("^cuda_copy", False), ("^cuda", False),
])
def test_user_ucx_tls_is_checked_not_changed(tls, allowed):
    env = {"UCX_TLS": tls}
    c = transports.choose("cuda", CUDA_UCX, None, env=env)
    assert c["copy_allowed"] is allowed
    assert any("cuda_copy" in w for w in c["warnings"]) is (not allowed)
    assert env == {"UCX_TLS": tls}


def test_expandable_segments_warns_for_cuda():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    c = transports.choose("cuda", CUDA_UCX, None, env=env)
    assert any("expandable segments" in w and "cuda_ipc" in w for w in c["warnings"])
    assert not transports.choose("cuda", CUDA_UCX, None, env={})["warnings"]


def test_available_transports_ignore_ucx_tls():
    code = "import commux._C as c; print(','.join(c.available_transports()))"
    run = lambda env: subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,  # noqa: E731
                                     text=True, timeout=60, check=True).stdout.strip()
    base = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    assert run(base) == run({**base, "UCX_TLS": "tcp"})
    assert "self" in run(base).split(",")


def test_info_shows_the_choice():
    out = subprocess.run([sys.executable, "-m", "commux.info"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "accelerator" in out
