"""Fixtures of the wheel stage (scripts/test.sh wheel; not collected by `pytest python/tests`):
the wheels as users build them, and one fresh virtual environment, holding torch and nothing of
the build, into which they are installed in turn.

* ``plain_wheel``: ``pip wheel . --no-build-isolation`` in the build directory the python stage's
  install uses (scripts/install.sh), so after it the wheel build is incremental.
* ``bundled_wheel``: the same with COMMUX_UCX_PROVIDER=bundled (UCX copied into the package), in
  that build directory too: only the install step differs, nothing is recompiled.
* ``venv``: a new venv (torch of the running interpreter's version, from the index or the local
  wheel files); ``venv.use(...)`` installs one of the wheels, uninstalling the other first.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from wheelenv import Venv, build_wheel


@pytest.fixture(scope="session")
def plain_wheel() -> str:
    return build_wheel("plain", None)


@pytest.fixture(scope="session")
def bundled_wheel(plain_wheel) -> str:  # after the plain one: the build directory is shared
    return build_wheel("bundled", "bundled")


@pytest.fixture(scope="session")
def venv(tmp_path_factory) -> Venv:
    import torch

    root = str(tmp_path_factory.mktemp("fresh-venv"))
    work = str(tmp_path_factory.mktemp("venv-cwd"))
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    subprocess.run([base, "-m", "venv", root], check=True, timeout=300)
    v = Venv(root, work)
    v.pip("install", f"torch=={torch.__version__}")
    return v


@pytest.fixture(scope="session")
def wheels(plain_wheel, bundled_wheel) -> dict:
    return {"plain": plain_wheel, "bundled": bundled_wheel}


@pytest.fixture
def plain_venv(venv, plain_wheel) -> Venv:
    venv.use("plain", {"plain": plain_wheel})
    return venv
