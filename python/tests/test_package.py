"""The installed package: version, `python -m commux.info`, headers and libraries in place."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx


def _run(code_or_args, timeout=120):
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    args = [sys.executable] + code_or_args
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


def test_version_and_layout():
    r = _run(["-c", "import commux, os; print(commux.__version__); print(commux.get_include()); "
                    "print(commux.get_lib_dir()); print(os.path.dirname(commux.__file__))"])
    assert r.returncode == 0, r.stderr
    version, inc, lib, pkg = r.stdout.split()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert os.path.isfile(os.path.join(inc, "commux", "process_group_ucx.hpp"))
    assert os.path.isfile(os.path.join(inc, "commux", "communicator.hpp"))
    assert any(f.startswith("libcommux.so") for f in os.listdir(lib)), os.listdir(lib)
    assert any(f.startswith("libcommux_c10d.so") for f in os.listdir(lib)), os.listdir(lib)
    assert any(f.startswith("_C") and f.endswith(".so") for f in os.listdir(pkg)), os.listdir(pkg)


def test_info_prints_versions_transports_and_settings():
    r = _run(["-m", "commux.info"], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    import torch

    for pattern in (r"^commux\s+\d+\.\d+\.\d+", rf"^torch\s+{re.escape(torch.__version__)}",
                    r"^UCX\s+1\.\d+", r"^transports\s+.*\b(self|tcp|posix|sysv)\b",
                    r"^memory types\s+.*\bhost\b", r"^backends\s+ucx, commux", r"settings in effect"):
        assert re.search(pattern, out, re.M), f"missing {pattern!r} in:\n{out}"


def test_user_ucx_settings_are_reported_and_win():
    env_code = ("import os; os.environ['UCX_TLS']='tcp,self'; os.environ['UCX_KEEPALIVE_INTERVAL']='5s';"
                "import commux; i = commux.runtime_info(); print(i['transports']); print(i['applied_defaults']);"
                "print(i['user_settings'])")
    r = _run(["-c", env_code], timeout=60)
    assert r.returncode == 0, r.stderr
    transports, applied, user = r.stdout.strip().splitlines()
    assert "tcp" in transports and "posix" not in transports and "sysv" not in transports, transports
    assert "TLS" not in applied and "KEEPALIVE" not in applied, applied  # the user's settings win
    assert "UCX_TLS=tcp,self" in user, user


def test_torch_version_mismatch_is_a_clear_import_error(tmp_path):
    """A package built against another torch refuses to import, naming both versions."""
    import commux

    src = os.path.dirname(commux.__file__)
    fake = tmp_path / "commux"
    fake.mkdir()
    for f in os.listdir(src):
        p = os.path.join(src, f)
        if os.path.isfile(p):
            os.symlink(p, fake / f)
    (fake / "_build_info.py").unlink()
    (fake / "_build_info.py").write_text('TORCH_VERSION = "1.0.0"\n')
    r = _run(["-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import commux"])
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "1.0.0" in r.stderr and "no-build-isolation" in r.stderr, r.stderr


def _readelf(*args):
    try:
        return subprocess.run(["readelf", *args], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"readelf is not usable here: {e}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF libraries")
def test_the_libraries_use_the_shared_cxx_runtime():
    """libcommux, libcommux_c10d and _C load the shared libstdc++.so.6, as torch does, and carry no
    copy of their own. A build on a GPU machine linked libstdc++ statically into all three: every
    rank then crashed formatting its first COMMUX_DEBUG line (a static copy's iostreams do not
    work beside the process's shared one); built with LDFLAGS=-static-libstdc++ here, each log
    line stopped at its first number. cmake/CommuxLibstdcxx.cmake prevents both."""
    import commux
    lib, pkg = commux.get_lib_dir(), os.path.dirname(commux.__file__)
    paths = [os.path.join(lib, "libcommux.so.0"), os.path.join(lib, "libcommux_c10d.so.0")]
    paths += [os.path.join(pkg, f) for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so")]
    for p in paths:
        assert os.path.isfile(p), p
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", "--wide", p))
        assert "libstdc++.so.6" in needed, f"{p} does not load libstdc++.so.6 (NEEDED: {needed})"
        # std::locale::classic(), defined (not UND) in a library that carries its own libstdc++
        defined = [line for line in _readelf("--dyn-syms", "--wide", p).splitlines()
                   if line.endswith(" _ZNSt6locale7classicEv") and " UND " not in line]
        assert not defined, f"{p} carries its own copy of libstdc++: {defined}"
