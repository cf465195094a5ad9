"""The wheel as users install it: `pip wheel . --no-build-isolation`, installed into a fresh venv
that holds only torch (libucx-cu13 comes from the index as the wheel's dependency), used there
with no build tree in sight; and the bundled wheel (COMMUX_UCX_PROVIDER=bundled: UCX inside the
package, no libucx-cu13) the same way. Runs in scripts/test.sh's wheel stage."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

import mp
from wheelenv import BUILD_TOOLS, REPO, wheel_metadata

HERE = os.path.dirname(os.path.abspath(__file__))

# A child of the fresh venv prints which files of UCX it has mapped, after importing the modules
# named in argv[1] in that order ("libucx": import it and call its load_library(), as UCX's own
# Python packages do) and after commux has opened a UCX context (runtime_info), so that UCX's
# transport modules are loaded too.
ONE_UCX_SCRIPT = r"""
import importlib, json, os, re, sys
for name in sys.argv[1].split(","):
    if name == "libucx":
        import libucx
        libucx.load_library()
    else:
        importlib.import_module(name)
import commux
info = commux.runtime_info()
libs = {}
for line in open("/proc/self/maps"):
    parts = line.split(None, 5)
    path = parts[5].strip() if len(parts) == 6 else ""
    m = re.search(r"/(libuc[ptsm](?:_signal)?|libuct_\w+|libucm_\w+)\.so[.0-9]*$", path)
    if m:
        st = os.stat(path)
        libs.setdefault(m.group(1), set()).add((path, st.st_dev, st.st_ino))
print(json.dumps({"libs": {k: sorted(v) for k, v in libs.items()}, "transports": info["transports"],
                  "commux": os.path.dirname(commux.__file__)}))
"""


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _supported_torch_from_readme() -> tuple:
    text = _read(os.path.join(REPO, "README.md"))
    m = re.search(r"\*\*Supported torch: ([0-9., and]+)\*\* \(`torch([^`]+)`\)", text)
    assert m, "README.md has no '**Supported torch: ...** (`torch>=...`)' line"
    return re.findall(r"\d+\.\d+", m.group(1)), m.group(2)


def test_metadata_states_the_supported_torch(plain_wheel, bundled_wheel):
    """README's "Supported torch", scripts/test.sh's OLDER_TORCH and the wheels' metadata agree."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    versions, spec = _supported_torch_from_readme()
    test_sh = _read(os.path.join(REPO, "scripts", "test.sh"))
    older = re.search(r"^OLDER_TORCH=\(([^)]*)\)", test_sh, re.M).group(1).split()
    assert set(older) <= set(versions), (older, versions)
    for wheel, ucx in ((plain_wheel, True), (bundled_wheel, False)):
        meta = wheel_metadata(wheel)
        reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
        torch_req = [r for r in reqs if r.name == "torch"]
        assert len(torch_req) == 1, meta
        assert torch_req[0].specifier == Requirement("torch" + spec).specifier, (torch_req, spec)
        for v in versions:
            assert torch_req[0].specifier.contains(Version(v + ".0")), (v, torch_req)
        last = versions[-1].split(".")
        assert not torch_req[0].specifier.contains(Version(f"{last[0]}.{int(last[1]) + 1}.0"))
        summary = re.search(r"^Summary: (.*)$", meta, re.M).group(1)
        assert f"torch {versions[0]} to {versions[-1]}" in summary, summary
        assert any(r.name == "libucx-cu13" for r in reqs) == ucx, (wheel, reqs)


def _elf_files(pkg: str) -> list:
    out = []
    for d, _, files in os.walk(pkg):
        for f in files:
            p = os.path.join(d, f)
            if re.search(r"\.so(\.\d+)*$", f):
                with open(p, "rb") as fh:
                    if fh.read(4) == b"\x7fELF":
                        out.append(p)
    return out


def check_rpaths(pkg: str) -> dict:
    """Every ELF file of the installed package: RPATH/RUNPATH entries only $ORIGIN-relative, and
    no path of the build machine (the checkout, its build directories) in its dynamic section."""
    rpaths = {}
    for f in _elf_files(pkg):
        dyn = subprocess.run(["readelf", "-d", f], capture_output=True, text=True, check=True).stdout
        dynstr = subprocess.run(["readelf", "-p", ".dynstr", f], capture_output=True, text=True,
                                check=True).stdout
        for text in (dyn, dynstr):
            assert REPO not in text and "/build-py" not in text and "/__w/" not in text, \
                f"{f} names a path of the build machine:\n{text}"
        entries = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dyn)
        for entry in entries:
            for e in entry.split(":"):
                assert e.startswith("$ORIGIN"), f"{f}: RPATH entry {e!r} is not $ORIGIN-relative"
        rpaths[os.path.relpath(f, pkg)] = entries
    return rpaths


def run_allreduce_and_p2p(venv) -> list:
    outs, _ = mp.run_once(_rank_fn(), 2, timeout=90, python=venv.python,
                          env={"PYTHONPATH": mp.TESTS_DIR + os.pathsep + HERE, "PYTHONNOUSERSITE": "1"})
    pkg = venv.package_dir()
    values = [o.value for o in outs]
    for v in values:
        assert v["commux"].startswith(pkg + os.sep), v["commux"]
        stray = [p for p in v["maps"] if p.startswith(REPO + os.sep)]
        assert not stray, f"files of the checkout mapped in a rank of the fresh venv: {stray}"
    return values


def _rank_fn():
    import wheel_ranks

    return wheel_ranks.allreduce_and_p2p


def one_ucx(venv, order: str) -> dict:
    r = json.loads(venv.check(["-c", ONE_UCX_SCRIPT, order], timeout=60))
    for lib, copies in r["libs"].items():
        assert len(copies) == 1, f"importing {order}: {lib} loaded from {len(copies)} files: {copies}"
    dirs = {os.path.dirname(c[0][0]) for name, c in r["libs"].items() if re.match(r"libuc[ptsm]", name)
            and not re.match(r"libuc[tm]_", name)}
    assert len(dirs) == 1, f"importing {order}: UCX's libraries from several directories: {dirs}"
    mod_dirs = {os.path.dirname(c[0][0]) for name, c in r["libs"].items() if re.match(r"libuc[tm]_", name)}
    assert mod_dirs <= {os.path.join(d, "ucx") for d in dirs}, (dirs, mod_dirs)
    assert "self" in r["transports"] or "tcp" in r["transports"], r
    r["ucx_dir"] = dirs.pop()
    return r


# ------------------------------------------------------------------------------------------------
# The plain wheel (libucx-cu13 as its dependency)

def test_plain_wheel_installs_alone(plain_venv):
    pkgs = plain_venv.packages()
    assert {"torch", "commux", "libucx-cu13"} <= pkgs, pkgs
    assert not pkgs & set(BUILD_TOOLS), f"the fresh venv holds build tools: {pkgs & set(BUILD_TOOLS)}"


def test_plain_wheel_rpaths_are_relative(plain_venv):
    rpaths = check_rpaths(plain_venv.package_dir())
    assert rpaths["lib/libcommux.so.0"] == ["$ORIGIN/../../libucx/lib"], rpaths
    assert any(k.startswith("_C") for k in rpaths), rpaths


def test_plain_wheel_info(plain_venv):
    out = plain_venv.check(["-m", "commux.info"], timeout=60)
    assert re.search(r"^UCX\s+1\.\d+.*\(libucx wheel", out, re.M), out
    assert re.search(r"^transports\s+.*\b(self|tcp|posix|sysv)\b", out, re.M), out


def test_plain_wheel_allreduce_and_tagged_p2p(plain_venv):
    run_allreduce_and_p2p(plain_venv)


def test_plain_wheel_selftest_passes(plain_venv):
    """What a user with only Python and torch does after `pip install <wheel>`."""
    out = plain_venv.check(["-m", "commux.selftest", "--nprocs", "2"], timeout=240)
    assert "commux selftest: PASSED" in out, out
    assert re.search(r"torch\s+2\.\d+", out), out


@pytest.mark.parametrize("order", ["torch,commux", "commux,torch", "libucx,commux", "commux,libucx"])
def test_plain_wheel_one_ucx_per_process(plain_venv, order):
    r = one_ucx(plain_venv, order)
    assert r["ucx_dir"].endswith(os.path.join("libucx", "lib")), r


# ------------------------------------------------------------------------------------------------
# The bundled wheel (UCX inside the package; no libucx-cu13). Last: the venv switches wheels.

@pytest.fixture
def bundled_venv(venv, wheels):
    venv.use("bundled", wheels)
    return venv


def test_bundled_wheel_installs_without_libucx(bundled_venv):
    pkgs = bundled_venv.packages()
    assert "commux" in pkgs and "libucx-cu13" not in pkgs, pkgs
    pkg = bundled_venv.package_dir()
    mods = os.listdir(os.path.join(pkg, "lib", "ucx"))
    assert any(m.startswith("libuct_") for m in mods), mods
    assert os.path.isfile(os.path.join(pkg, "include", "ucp", "api", "ucp.h"))
    rpaths = check_rpaths(pkg)
    assert rpaths["lib/libcommux.so.0"] == ["$ORIGIN"], rpaths
    assert rpaths["lib/libucp.so.0"] == ["$ORIGIN"], rpaths
    assert all(v == ["$ORIGIN/.."] for k, v in rpaths.items() if k.startswith("lib/ucx/")), rpaths


def test_bundled_wheel_info_and_ranks(bundled_venv):
    out = bundled_venv.check(["-m", "commux.info"], timeout=60)
    assert re.search(r"^UCX\s+1\.\d+.*\(bundled in commux", out, re.M), out
    run_allreduce_and_p2p(bundled_venv)


@pytest.mark.parametrize("order", ["torch,commux", "commux,torch"])
def test_bundled_wheel_one_ucx_per_process(bundled_venv, order):
    r = one_ucx(bundled_venv, order)
    assert r["ucx_dir"] == os.path.join(r["commux"], "lib"), r


@pytest.mark.parametrize("order", ["commux,libucx", "libucx,commux"])
def test_bundled_wheel_beside_libucx_one_ucx(venv, wheels, order):
    """With UCX's own package installed as well, whichever is imported first, one UCX is loaded
    (libucx's: commux lets it load first, so its libraries are the ones the sonames resolve to)."""
    venv.use("bundled+libucx", wheels)
    r = one_ucx(venv, order)
    assert r["ucx_dir"].endswith(os.path.join("libucx", "lib")), r
