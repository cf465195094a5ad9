"""What the wheel tests share: building the wheels, the fresh venv, running C++ consumers."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import mp

REPO = os.path.dirname(os.path.dirname(mp.TESTS_DIR))
WHEEL_OUT = os.path.join(REPO, "build-wheel")
BUILD_DIR = "build-py/{wheel_tag}"  # scripts/install.sh's (pyproject.toml's default)
LIBUCX_REQ = "libucx-cu13>=1.22,<1.23"
# What builds commux: none of it may be in the users' environment.
BUILD_TOOLS = ("cmake", "ninja", "pybind11", "scikit-build-core", "pytest")


def build_wheel(kind: str, provider: str | None) -> str:
    out = os.path.join(WHEEL_OUT, kind)
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    env.pop("COMMUX_UCX_PROVIDER", None)
    if provider:
        env["COMMUX_UCX_PROVIDER"] = provider
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
           "--no-build-isolation", "--no-deps", "-C", "cmake.define.COMMUX_WERROR=ON",
           "-C", f"build-dir={BUILD_DIR}", "-w", out, REPO]
    subprocess.run(cmd, check=True, timeout=3600, env=env, cwd=REPO)
    wheels = glob.glob(os.path.join(out, "commux-*.whl"))
    assert len(wheels) == 1, f"pip wheel left {wheels} in {out}"
    return wheels[0]


def wheel_metadata(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


class Venv:
    """A fresh virtual environment; commands run in it with nothing of the checkout in sight
    (cwd outside it, no PYTHONPATH, no user site)."""

    def __init__(self, root: str, workdir: str):
        self.root = root
        self.python = os.path.join(root, "bin", "python")
        self.workdir = workdir
        self.current: str | None = None

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PYTHONNOUSERSITE="1", UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"),
                   OMP_NUM_THREADS="1")
        return env

    def pip(self, *args: str, timeout: float = 900) -> None:
        subprocess.run([self.python, "-m", "pip", "-q", "--disable-pip-version-check", *args],
                       check=True, timeout=timeout, env=self.env(), cwd=self.workdir)

    def run(self, args: list, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env(), cwd=self.workdir)

    def check(self, args: list, timeout: float = 120) -> str:
        r = self.run(args, timeout)
        assert r.returncode == 0, f"{args} in the fresh venv exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def packages(self) -> set:
        out = self.check(["-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"])
        return {line.split("==")[0].lower() for line in out.split()}

    def package_dir(self, name: str = "commux") -> str:
        return self.check(["-c", f"import {name}, os; print(os.path.dirname({name}.__file__))"]).strip()

    def use(self, state: str, wheels: dict) -> None:
        """state: "plain" (the plain wheel, libucx-cu13 from the index as its dependency),
        "bundled" (the bundled wheel, no libucx-cu13) or "bundled+libucx" (both)."""
        if self.current == state:
            return
        if state == "bundled+libucx" and self.current == "bundled":
            self.pip("install", LIBUCX_REQ)
        else:
            if self.current is not None:
                self.pip("uninstall", "-y", "commux", "libucx-cu13")
            self.pip("install", wheels["bundled" if state.startswith("bundled") else "plain"])
            if state == "bundled+libucx":
                self.pip("install", LIBUCX_REQ)
        self.current = state


def cmake_exe() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "cmake")
    cmake = here if os.path.exists(here) else shutil.which("cmake")
    if cmake is None:
        pytest.fail("no cmake found (scripts/setup.sh installs it into .venv)")
    return cmake


def run_ranks(exe: str, workdir: str, size: int = 2, env: dict | None = None) -> list:
    """Runs a C++ consumer (`exe RANK SIZE STORE`) on `size` ranks; every rank must print
    "rank R: consumer OK". Never hangs: a rank still running after 120 s fails the test."""
    store = os.path.join(workdir, "store")
    env = dict(env or os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    procs = [subprocess.Popen([exe, str(r), str(size), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=workdir) for r in range(size)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"C++ consumer {exe} rank {r} hung")
        outs.append(out)
        assert p.returncode == 0, f"{exe} rank {r} exited {p.returncode}:\n{out}"
    for r in range(size):
        assert f"rank {r}: consumer OK" in outs[r], outs[r]
    return outs
