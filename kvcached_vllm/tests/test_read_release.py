"""``scripts/read_release.py``, the check of a release that cannot run here, reading the installed vLLM's own
sources: they must read as the plugin's load-time check finds them (every unit ok), and a copy of them
changed as a later release changes them (a new parameter of a wrapped function, an alias module that no
longer holds the target) must be caught. The copy is the installed sources linked file by file, the
changed files rewritten; nothing is faked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import vllm
from conftest import installed_release

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.dirname(os.path.dirname(vllm.__file__))


def read(sources: str) -> tuple[int, str]:
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "read_release.py"), "vllm", installed_release(), sources],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return run.returncode, run.stdout + run.stderr


def test_the_installed_release_reads_as_it_loads():
    code, out = read(SITE)
    assert code == 0, out
    assert "ok                   around   kv-cache-configs" in out and "missing" not in out


def test_a_new_parameter_and_a_moved_alias_are_caught(tmp_path):
    shutil.copytree(
        os.path.join(SITE, "vllm"),
        tmp_path / "vllm",
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    # As a later release would: the wrapped function takes a keyword the plugin's hook does not, and the
    # engine core module binds the name to something else. (The CI releases, 0.26 and 0.32, both have the
    # target in kv_cache_utils.)
    configs = "vllm/v1/core/kv_cache_utils.py"
    core = "vllm/v1/engine/core.py"
    for path, tail in (
        (
            configs,
            "\n\ndef get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory, *, hint=None):\n    pass\n",
        ),
        (core, "\n\nget_kv_cache_configs = None\n"),
    ):
        text = open(os.path.join(SITE, path)).read()
        os.unlink(tmp_path / path)
        (tmp_path / path).write_text(text + tail)
    code, out = read(str(tmp_path))
    assert code == 1
    assert "parameters changed   around   kv-cache-configs   vllm.v1.core.kv_cache_utils.get_kv_cache_configs" in out
    assert "hint=None" in out
    assert "missing              alias    kv-cache-configs   vllm.v1.engine.core.get_kv_cache_configs" in out
