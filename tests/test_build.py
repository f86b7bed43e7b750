"""The native module is self-contained: no torch, CUDA runtime or driver linked; CUDA found at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvcached_core as kc
from kvcached_core import _native


def test_native_module_links_no_torch_cudart_or_libcuda():
    if shutil.which("ldd") is None:
        pytest.fail("ldd is needed to check the native module's links")
    out = subprocess.run(["ldd", _native.__file__], capture_output=True, text=True, check=True).stdout
    for forbidden in ("libtorch", "libc10", "libcudart", "libcuda.so"):
        assert forbidden not in out, f"{_native.__file__} links {forbidden}:\n{out}"


def test_import_does_not_import_torch(tmp_path):
    code = "import sys, kvcached_core; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    out = run.stdout
    assert out.strip() == "False"


def test_available_backends_and_reason_agree():
    backends = kc.available_backends()
    assert backends[0] == "host"
    reason = kc.cuda_unavailable_reason()
    assert ("cuda" in backends) == (reason == "")
    if "cuda" not in backends:
        assert reason  # says why: no driver, no device, or built without headers


def test_version():
    assert kc.__version__ == "0.1.0"


def test_builds_and_runs_without_cuda_headers(tmp_path):
    """Configure and build the checkout as on a machine without cuda.h, then use the result."""
    import pybind11

    repo = Path(__file__).resolve().parent.parent
    build = tmp_path / "build"
    configure = [
        "cmake",
        "-S",
        str(repo),
        "-B",
        str(build),
        "-DKVCACHED_DISABLE_CUDA=ON",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    log = subprocess.run(configure, capture_output=True, text=True)
    assert log.returncode == 0, log.stdout + log.stderr
    assert "building the host backend only" in log.stdout
    log = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    assert log.returncode == 0, log.stdout + log.stderr
    package = tmp_path / "site" / "kvcached_core"
    shutil.copytree(repo / "src" / "kvcached_core", package)
    for built in build.glob("_native*.so"):
        shutil.copy(built, package)
    code = "import kvcached_core as kc; print(kc.available_backends()); print(kc.cuda_unavailable_reason())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path / "site", check=True
    ).stdout.splitlines()
    assert out[0] == "['host']"
    assert "built without CUDA" in out[1]
