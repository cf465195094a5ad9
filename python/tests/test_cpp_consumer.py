"""A C++ program builds against the installed package (commux.get_include(), commux.get_lib_dir(),
torch's headers and libraries) and uses commux::ProcessGroupUCX as a c10d::ProcessGroup backend."""
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _compile(out):
    import torch
    import torch.utils.cpp_extension as ext

    import commux

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler found (scripts/setup.sh installs g++)")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch.compiled_with_cxx11_abi())
    # torch >= 2.14 needs C++20 in code that includes its headers; older torch builds with C++17.
    std = "c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14) else "c++17"
    cmd = [cxx, f"-std={std}", "-O1", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           os.path.join(HERE, "cpp", "consumer.cpp"), "-o", out,
           "-I", commux.get_include()]
    for inc in ext.include_paths():
        cmd += ["-isystem", inc]
    cmd += ["-L", commux.get_lib_dir(), "-lcommux_c10d", "-lcommux",
            "-L", torch_lib, "-ltorch", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{commux.get_lib_dir()}", f"-Wl,-rpath,{torch_lib}"]
    subprocess.run(cmd, check=True, timeout=600)


def test_cpp_program_uses_process_group_ucx(tmp_path):
    exe = str(tmp_path / "consumer")
    _compile(exe)
    size = 3
    store = str(tmp_path / "store")
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    procs = [subprocess.Popen([exe, str(r), str(size), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"C++ consumer rank {r} hung")
        outs.append(out)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    for r in range(size):
        assert f"rank {r}: consumer OK" in outs[r]


def _run_ranks(exe, tmp_path, size=3):
    store = str(tmp_path / "store")
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    procs = [subprocess.Popen([exe, str(r), str(size), store], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"C++ consumer rank {r} hung")
        outs.append(out)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    for r in range(size):
        assert f"rank {r}: consumer OK" in outs[r]


def test_cmake_consumer_finds_the_package_config(tmp_path):
    """find_package(commux CONFIG) against the installed package gives commux::c10d (and
    commux::commux): the same consumer, built by CMake with only CMAKE_PREFIX_PATH set."""
    import torch

    import commux

    pkg = os.path.dirname(commux.__file__)
    assert os.path.isfile(os.path.join(pkg, "lib", "cmake", "commux", "commuxConfig.cmake")), \
        "the package ships no CMake config (lib/cmake/commux/commuxConfig.cmake)"
    bindir = os.path.dirname(sys.executable)
    cmake = os.path.join(bindir, "cmake") if os.path.exists(os.path.join(bindir, "cmake")) else shutil.which("cmake")
    if cmake is None:
        pytest.fail("no cmake found (the build environment installs it)")
    std = "20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14) else "17"
    build = str(tmp_path / "build")
    args = [cmake, "-S", os.path.join(HERE, "cpp"), "-B", build, f"-DCMAKE_PREFIX_PATH={pkg}",
            f"-DCMAKE_CXX_STANDARD={std}", "-DCMAKE_BUILD_TYPE=Release"]
    torch_dir = os.path.dirname(torch.__file__)
    if not os.path.samefile(os.path.dirname(pkg), os.path.dirname(torch_dir)):
        # commux installed apart from torch (pip install --target): the config's default, the
        # torch next to commux, is not there; say where it is
        args.append(f"-DCOMMUX_TORCH_DIR={torch_dir}")
    subprocess.run(args, check=True, timeout=300)
    subprocess.run([cmake, "--build", build, "-j2"], check=True, timeout=900)
    _run_ranks(os.path.join(build, "consumer"), tmp_path)
