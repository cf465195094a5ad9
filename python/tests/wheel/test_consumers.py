"""C++ consumers of commux, each built by one recipe and run on 2 ranks: find_package against the
installed wheel (commux.cmake_prefix_path(): commux::commux and commux::c10d), the original
design's recipe (the package directory from Python, find_library, include and link directories),
and FetchContent of the repository (a local clone)."""
from __future__ import annotations

import os
import re
import subprocess

from wheelenv import REPO, cmake_exe, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
CONSUMERS = os.path.join(HERE, "consumers")


def _cmake_build(src: str, build: str, *defines: str, build_type: str = "Release") -> None:
    cmake = cmake_exe()
    subprocess.run([cmake, "-S", src, "-B", build, f"-DCMAKE_BUILD_TYPE={build_type}", *defines],
                   check=True, timeout=600, capture_output=True)
    r = subprocess.run([cmake, "--build", build, "-j2"], timeout=1800, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]


def test_find_package_of_the_installed_wheel(plain_venv, tmp_path):
    prefix = plain_venv.check(["-c", "import commux; print(commux.cmake_prefix_path())"]).strip()
    assert os.path.isfile(os.path.join(prefix, "lib", "cmake", "commux", "commuxConfig.cmake")), prefix
    build = str(tmp_path / "build")
    _cmake_build(os.path.join(CONSUMERS, "find_package"), build, f"-DCMAKE_PREFIX_PATH={prefix}")
    for exe in ("core_consumer", "c10d_consumer"):
        work = tmp_path / exe
        work.mkdir()
        run_ranks(os.path.join(build, exe), str(work))


def test_original_recipe_against_the_installed_wheel(plain_venv, tmp_path):
    build = str(tmp_path / "build")
    _cmake_build(os.path.join(CONSUMERS, "old_recipe"), build, f"-DCOMMUX_PYTHON={plain_venv.python}")
    run_ranks(os.path.join(build, "consumer"), str(tmp_path))


def test_fetch_content_of_a_local_clone(plain_venv, tmp_path):
    """FetchContent_Declare(GIT_REPOSITORY <a clone of this repository>): the committed HEAD."""
    clone = str(tmp_path / "clone")
    subprocess.run(["git", "clone", "-q", "--no-local", REPO, clone], check=True, timeout=300)
    head = subprocess.run(["git", "-C", clone, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    build = str(tmp_path / "build")
    # No build type: the consumer's (none: no optimisation, the cheapest build) must stand, and
    # only the library is built (no examples, no benchmarks, no commux_info).
    _cmake_build(os.path.join(CONSUMERS, "fetch_content"), build, f"-DCOMMUX_GIT={clone}",
                 f"-DCOMMUX_GIT_TAG={head}", f"-DCOMMUX_PYTHON={plain_venv.python}", build_type="")
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        cache = f.read()
    assert re.search(r"^CMAKE_BUILD_TYPE:STRING=$", cache, re.M), "commux changed the consumer's build type"
    built = os.path.join(build, "_deps", "commux-build")
    for extra in ("examples", "bench", "commux_info"):  # directories, and a program
        assert not os.path.exists(os.path.join(built, extra)), f"FetchContent built commux's {extra}"
    run_ranks(os.path.join(build, "consumer"), str(tmp_path))
