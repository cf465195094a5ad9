"""The environment a result was measured in: the sources' commit, the build's CMake cache, the date,
the host, torch and commux, and the UCX_ / COMMUX_ settings."""
import datetime
import os
import platform
import subprocess

from . import REPO

SETTINGS = ("UCX_", "COMMUX_")


def source_version():
    """The commit the sources are at ("+dirty" with local changes), or "?" outside git."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty=+dirty"],
                             capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    return out.stdout.strip() or "?"


def read_cmake_cache(build):
    """{variable: value} of build/CMakeCache.txt ({} when there is none)."""
    cache = {}
    path = build / "CMakeCache.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        if ":" in line and "=" in line and not line.startswith(("#", "//")):
            key, value = line.split("=", 1)
            cache[key.split(":", 1)[0]] = value
    return cache


def now():
    """The local date and time, ISO 8601 to the second, with the UTC offset."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def host():
    """{"host", "cpus", "python"}."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}


def settings(prefixes=SETTINGS):
    """The environment variables that change what is measured (UCX_*, COMMUX_* by default)."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def commux_package():
    """{"commux": version, "commux_path": directory} of the importable commux, {} when none is."""
    try:
        import commux
    except ImportError:
        return {}
    return {"commux": getattr(commux, "__version__", "?"),
            "commux_path": os.path.dirname(commux.__file__)}
