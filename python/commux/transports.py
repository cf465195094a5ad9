"""Which UCX copy transport the tensors of this process need, by accelerator.

UCX_TLS is an allow list: leaving out the accelerator's copy transport silently loses device-memory
detection, and naming a transport the local UCX lacks narrows UCX's selection. commux therefore
never writes accelerator transports into UCX_TLS (UCX's own selection already includes every copy
transport it has). It computes the choice to show it (``python -m commux.info``) and to warn when
the UCX or the user's UCX_TLS cannot carry the device's tensors. The logic lives in C++
(``commux::choose_transports``, also used by C++ programs); this module supplies torch's view of
the accelerator.
"""
from __future__ import annotations

import os
import warnings

import torch

from . import _C


def detect_accelerator() -> str:
    """'cuda', 'rocm', 'xpu', 'none', or the device type of another accelerator torch has."""
    if getattr(torch.version, "hip", None):  # ROCm builds report device type "cuda"
        return "rocm" if torch.cuda.is_available() else "none"
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        try:
            dev = acc.current_accelerator()
        except Exception:  # noqa: BLE001 -- a probe; no accelerator then
            dev = None
        if dev is not None and dev.type not in ("cpu", "cuda", "xpu"):
            return dev.type
    return "none"


def expandable_segments_on(env=None) -> bool:
    """PyTorch's expandable segments make CUDA IPC impossible (cuda_ipc silently unused)."""
    env = os.environ if env is None else env
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = env.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            return True
    return False


def choose(accelerator: str | None = None, available: list[str] | None = None,
           user_tls: str | None = None, env=None) -> dict:
    """The choice for ``accelerator`` (default: detected) with the transports ``available``
    (default: what the local UCX has) and ``user_tls`` (default: $UCX_TLS). Adds a warning when
    expandable segments are on for CUDA."""
    env = os.environ if env is None else env
    if accelerator is None:
        accelerator = detect_accelerator()
    if available is None:
        available = list(_C.available_transports())
    if user_tls is None:
        user_tls = env.get("UCX_TLS") or None
    c = dict(_C.choose_transports(accelerator, available, user_tls))
    c["warnings"] = list(c["warnings"])
    if c["accelerator"] == "cuda" and expandable_segments_on(env):
        c["warnings"].append(
            "commux: PyTorch's expandable segments are on (PYTORCH_CUDA_ALLOC_CONF); CUDA IPC cannot "
            "map such memory, so cuda_ipc is silently unused and GPU-to-GPU transfers on one node "
            "go through host memory; unset expandable_segments for full speed")
    return c


_warned = False


def warn_once() -> None:
    """Emits the choice's warnings (once per process) when the process has an accelerator."""
    global _warned
    if _warned:
        return
    _warned = True
    acc = detect_accelerator()
    if acc == "none":
        return
    for w in choose(acc)["warnings"]:
        warnings.warn(w, RuntimeWarning, stacklevel=3)
