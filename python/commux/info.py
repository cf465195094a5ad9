"""python -m commux.info: versions of commux, torch and UCX, UCX's transports and memory types,
and the settings in effect: commux's UCX defaults, the user's UCX_* variables, and every commux
setting (the table of commux/settings.hpp) with its value and whether it came from the environment."""
from __future__ import annotations

import os
import sys


def ucx_libraries() -> list:
    """The files of UCX's libraries (libucp, libuct, libucs, libucm) mapped into this process."""
    import re

    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
            if re.search(r"/libuc[ptsm](_signal)?\.so[.0-9]*$", path) and path not in found:
                found.append(path)
    return found


def _ucx_origin() -> str:
    import commux

    libs = ucx_libraries()
    ucp = next((p for p in libs if "/libucp.so" in p), None)
    if ucp is None:
        return "not loaded"
    if os.path.dirname(ucp).startswith(os.path.dirname(os.path.abspath(commux.__file__)) + os.sep):
        where = "bundled in commux"
    else:
        try:
            import libucx

            libucx_dir = os.path.dirname(os.path.abspath(libucx.__file__))
            where = f"libucx wheel {libucx.__version__}" if ucp.startswith(libucx_dir + os.sep) else "system"
        except ImportError:
            where = "system"
    return f"{where}: {os.path.dirname(ucp)}"


def main() -> int:
    import torch

    import commux

    info = commux.runtime_info()
    print(f"commux        {commux.__version__} ({os.path.dirname(commux.__file__)})")
    print(f"torch         {torch.__version__} (commux built against {commux._BUILT_WITH_TORCH}; "
          f"cuda {torch.version.cuda or 'none'})")
    print(f"python        {sys.version.split()[0]}")
    print(f"UCX           {info['ucx_version']} ({_ucx_origin()})")
    print(f"transports    {', '.join(info['transports']) or '(none)'}")
    print(f"memory types  {', '.join(info['memory_types']) or '(none)'}")
    print(f"backends      {', '.join(commux.BACKEND_NAMES)} (devices cpu, cuda)")
    try:
        from commux import _build_info

        device = getattr(_build_info, "DEVICE_TENSORS", True)
    except ImportError:  # an in-tree build without the generated module
        device = True
    if not device:
        print("device tensors off (built with COMMUX_CUDA=OFF: CPU tensors only)")
    else:
        mt = [m for m in info["memory_types"] if m != "host"]
        print(f"device tensors on; this UCX carries {', '.join(mt) + ' memory' if mt else 'host memory only'}"
              f"{'' if mt else ' (a device tensor would be refused: see docs/torch-backend.md)'}")
    choice = commux.transport_choice()
    acc = choice["accelerator"]
    if acc == "none":
        print("accelerator   none (CPU tensors; no copy transport needed)")
    else:
        print(f"accelerator   {acc}: copy transports {', '.join(choice['transports']) or '(none in this UCX)'}"
              f"{'' if choice['copy_allowed'] else ' (excluded by UCX_TLS)'}")
    for w in choice["warnings"]:
        print(f"  warning: {w}")
    print("settings in effect:")
    print(f"  packing of multi-tensor messages: {info['packing']}")
    print(f"  p2p ops in a coalescing window: {info['coalescing_window']}")
    print(f"  waits: spin {info['spin_us']} us, then "
          f"{'sleep on the worker event fd' if info['event_fd'] else 'backoff polling by the progress thread'}")
    print(f"  shutdown bound: {info['shutdown_timeout_ms']} ms")
    for d in info["applied_defaults"]:
        print(f"  commux default: {d}")
    for s in info["user_settings"]:
        print(f"  from the environment: {s}")
    print("commux settings (README, Runtime settings):")
    from commux import _C

    values = _C.settings()
    for row in _C.settings_table():
        v = values[row["name"]]
        text = "(set)" if v["text"] and row["type"] == "secret" else v["text"] or "-"
        print(f"  {row['name']:<28} {text:<12} ({v['source']}; read {row['read']})")
    known = {row["name"] for row in _C.settings_table()}
    for k in sorted(k for k in os.environ if k.startswith("COMMUX_") and k not in known):
        print(f"  {k}={os.environ[k]}: not a commux runtime setting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
