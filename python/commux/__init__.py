"""commux: the UCX backend for torch.distributed.

    import commux                          # registers the backends "ucx" and "commux"
    dist.init_process_group("ucx")         # under torchrun

or, portably:

    try:
        from commux import preferred_backend
        backend = preferred_backend()
    except ImportError:
        backend = "gloo"
"""
from __future__ import annotations

import atexit
import os
import threading

import torch
import torch.distributed as dist

_BUILT_WITH_TORCH = None  # filled from _build_info below


def _use_libucx(build_info) -> bool:
    """Whether UCX is taken from the libucx package: always for the wheel and system providers
    where it is installed; for a bundled UCX only where libucx is at least the bundled version,
    so that a process holds one UCX whichever of commux and libucx is imported first."""
    try:
        import libucx
    except ImportError:
        return False
    if getattr(build_info, "UCX_PROVIDER", "") != "bundled":
        return True
    have = tuple(int(x) for x in libucx.__version__.split(".")[:2] if x.isdigit())
    built = tuple(int(x) for x in getattr(build_info, "UCX_VERSION", "0.0").split(".")[:2])
    return have >= built


def _load_native():
    # UCX: when it comes from the libucx wheel, let the wheel load its libraries first (its own
    # loader knows where they are); the RPATHs of our libraries point there as well. Loaded by
    # soname, they are also what a bundled UCX's libcommux resolves to, so libucx imported after
    # commux finds its own UCX already in the process rather than loading a second one.
    from . import _build_info

    if _use_libucx(_build_info):
        import libucx

        libucx.load_library()
    from . import _C  # noqa: F401  (needs torch.distributed imported: it subclasses c10d.Backend)

    return _C


def _check_torch():
    from . import _build_info

    built = _build_info.TORCH_VERSION
    running = torch.__version__
    if built.split("+")[0].split(".")[:2] != running.split("+")[0].split(".")[:2]:
        raise ImportError(
            f"commux was built against torch {built} but torch {running} is installed; "
            "rebuild it with `pip install . --no-build-isolation` in this environment"
        )
    return built


_BUILT_WITH_TORCH = _check_torch()
_C = _load_native()
__version__ = _C.__version__
ProcessGroupUCX = _C.ProcessGroupUCX



def _quiesce_at_exit():
    # Future callbacks (Python code, e.g. a DDP comm hook's .then()) run on commux's own threads.
    # One that takes the GIL while the interpreter finalizes is ended on the spot, which aborts
    # the process ("terminate called without an active exception") in a program that exits
    # without destroy_process_group(). Before finalization: let those under way finish, start no
    # more.
    _C._quiesce_callbacks(2.0)


atexit.register(_quiesce_at_exit)

BACKEND_NAMES = ("ucx", "commux")
_lock = threading.Lock()
_registered = False


def _creator(name):
    def create(dist_opts, backend_opts=None):  # extended_api=True signature
        from . import transports

        transports.warn_once()  # a UCX or UCX_TLS that cannot carry this device's tensors
        return ProcessGroupUCX(
            dist_opts.store,
            dist_opts.group_rank,
            dist_opts.group_size,
            dist_opts.timeout,
            name,
            str(dist_opts.group_id),
        )

    create.__name__ = f"create_{name}_backend"
    return create


def register() -> None:
    """Registers the torch.distributed backends "ucx" and "commux" (cpu and cuda). Idempotent."""
    global _registered
    with _lock:
        if _registered:
            return
        for name in BACKEND_NAMES:
            if name.upper() in getattr(dist.Backend, "_plugins", {}):
                continue  # registered earlier in this process (re-registering raises)
            dist.Backend.register_backend(
                name, _creator(name), extended_api=True, devices=["cpu", "cuda"]
            )
        _registered = True


def preferred_backend() -> str:
    """Registers commux and returns the backend name to pass to init_process_group: "ucx"."""
    register()
    return "ucx"


def get_include() -> str:
    """Directory with the commux C++ headers (for C++ extensions and CMake projects)."""
    return os.path.join(os.path.dirname(__file__), "include")


def get_lib_dir() -> str:
    """Directory with libcommux.so and libcommux_c10d.so."""
    return os.path.join(os.path.dirname(__file__), "lib")


def cmake_prefix_path() -> str:
    """The prefix for CMAKE_PREFIX_PATH under which find_package(commux CONFIG) finds the package's
    CMake config (lib/cmake/commux): commux::commux, and commux::c10d with torch's usage
    requirements. `cmake -DCMAKE_PREFIX_PATH=$(python -c "import commux; print(commux.cmake_prefix_path())")`"""
    return os.path.dirname(os.path.abspath(__file__))


def transport_choice(accelerator: str | None = None) -> dict:
    """The UCX transports this process's accelerator needs (see commux.transports)."""
    from . import transports

    return transports.choose(accelerator)


def runtime_info() -> dict:
    """What this process's UCX offers and which settings commux applies (see commux.info)."""
    return dict(_C.runtime_info())


# Importing the package is enough to use backend="ucx" (as with other out-of-tree backends);
# register() stays available and idempotent.
register()

__all__ = [
    "ProcessGroupUCX",
    "__version__",
    "get_include",
    "get_lib_dir",
    "preferred_backend",
    "register",
    "runtime_info",
    "transport_choice",
]
