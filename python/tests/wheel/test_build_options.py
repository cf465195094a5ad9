"""The interface's build options fail at configure time, clearly, on a value they cannot honour
(cmake alone: the project is configured, nothing is built). One build directory for all, so that
only the first configure pays for the compiler checks; every call passes both options."""
from __future__ import annotations

import subprocess
import sys

import pytest

from wheelenv import REPO, cmake_exe


@pytest.fixture(scope="module")
def configure(tmp_path_factory):
    build = str(tmp_path_factory.mktemp("options-build"))

    def run(provider: str = "auto", gdrcopy: str = "auto", *defines: str) -> subprocess.CompletedProcess:
        args = [cmake_exe(), "-S", REPO, "-B", build, "-DCOMMUX_BUILD_BENCH=OFF",
                "-DCOMMUX_BUILD_EXAMPLES=OFF", f"-DCOMMUX_PYTHON={sys.executable}",
                f"-DCOMMUX_UCX_PROVIDER={provider}", f"-DCOMMUX_WITH_GDRCOPY={gdrcopy}", *defines]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        # CMake wraps its messages' lines: compare with the whitespace folded
        r.stdout, r.stderr = " ".join(r.stdout.split()), " ".join(r.stderr.split())
        return r

    return run


@pytest.mark.parametrize("provider,gdrcopy,bad,valid", [
    ("conda", "auto", "COMMUX_UCX_PROVIDER='conda'", "valid: auto, wheel, system, bundled"),
    ("auto", "maybe", "COMMUX_WITH_GDRCOPY='maybe'", "valid: auto, on, off"),
])
def test_unknown_value_lists_the_valid_ones(configure, provider, gdrcopy, bad, valid):
    r = configure(provider, gdrcopy)
    assert r.returncode != 0, r.stdout
    assert bad in r.stderr and valid in r.stderr, r.stderr


def test_gdrcopy_on_without_libgdrapi_fails(configure):
    r = configure("auto", "on", "-DGDRCOPY_ROOT=/nonexistent")
    if r.returncode == 0:
        pytest.fail(f"configured with COMMUX_WITH_GDRCOPY=on: is libgdrapi installed here?\n{r.stdout}")
    assert "COMMUX_WITH_GDRCOPY=on, but libgdrapi was not found" in r.stderr, r.stderr


@pytest.mark.parametrize("gdrcopy", ["auto", "off"])
def test_bundled_without_gdrcopy_configures(configure, gdrcopy):
    """bundled, gdr_copy auto (libgdrapi absent here: left out, and said so) or off."""
    r = configure("bundled", gdrcopy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"gdr_copy bundled: OFF (COMMUX_WITH_GDRCOPY={gdrcopy}" in r.stdout, r.stdout
    assert "bundling UCX from" in r.stdout, r.stdout
