"""The native module is self-contained: no torch, CUDA runtime or driver linked; CUDA found at run time."""

from __future__ import annotations

import shutil
import subprocess
import sys

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
