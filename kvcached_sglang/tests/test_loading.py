"""Loading through SGLang's own plugin machinery: entry point discovery, SGLANG_PLUGINS, KVCACHED_ENABLE,
the version and symbol checks. Everything runs against the installed SGLang 0.5.23."""

from __future__ import annotations

import pkgutil

import pytest
from conftest import run_python

ORIGINALS = """
import sglang.srt.mem_cache.memory_pool as mp
import sglang.srt.mem_cache.allocator.paged as pg
print("classes", mp.MHATokenToKVPool.__module__, pg.PagedTokenToKVPoolAllocator.__module__,
      mp.HybridReqToTokenPool.mamba_pool_cls.__module__)
"""


def test_sglang_applies_every_patch(sglang_loaded):
    from sglang.srt.mem_cache import kv_cache_configurator as kc
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcached_sglang.patches import PATCHES

    for patch in PATCHES:
        assert patch.target in HookRegistry._patched, f"{patch.name}: SGLang did not apply {patch.target}"
        current = pkgutil.resolve_name(patch.target)
        if isinstance(patch.hook, type):
            assert current is patch.hook, f"{patch.target} is not the elastic class"
        else:  # SGLang's wrapper: the original sits under __wrapped__, our hook is in the closure
            assert current.__wrapped__ is not None
            assert patch.hook in [c.cell_contents for c in current.__closure__ or ()], patch.target
    # `from X import Y` copies in SGLang's model-runner path follow the replacement.
    assert kc.MHATokenToKVPool.__module__ == "kvcached_sglang.pools"
    assert kc.PagedTokenToKVPoolAllocator.__module__ == "kvcached_sglang.allocators"
    # load_plugins() runs once per process; register() is idempotent on its own too.
    sglang_loaded.register()
    assert sum(
        1 for hooks in HookRegistry._hooks.values() for _, hook, _ in hooks if hook in {p.hook for p in PATCHES}
    ) == len(PATCHES)


def test_patch_target_check_lists_every_symbol(sglang_loaded, capsys):
    import json

    from kvcached_sglang.check import main
    from kvcached_sglang.patches import PATCHES, USED_SYMBOLS

    assert main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == "0.5.23"
    listed = {row["target"] for row in report["symbols"]}
    assert listed == {p.target for p in PATCHES} | set(USED_SYMBOLS)
    assert all(row["status"] == "ok" for row in report["symbols"])
    assert len(listed) >= 20


def test_missing_symbol_is_one_clear_error():
    from kvcached_core.patches import Patch, PluginLoadError, verify

    gone = Patch("gone", "sglang.srt.mem_cache.memory_pool.NoSuchPool", "replace", None, "test")
    with pytest.raises(PluginLoadError, match=r"SGLang 0\.5\.23 lacks sglang\.srt\.mem_cache\.memory_pool\.NoSuchPool"):
        verify([gone], "SGLang", "0.5.23", ["sglang.srt.utils.get_num_new_pages"])


def test_version_support():
    from kvcached_core.patches import PluginLoadError
    from kvcached_sglang import SUPPORT

    assert SUPPORT.installed_version() == "0.5.23"
    assert SUPPORT.is_supported("0.5.23") and SUPPORT.is_supported("0.5.23.post1")
    assert not SUPPORT.is_supported("0.5.2") and not SUPPORT.is_supported("0.5.24") and not SUPPORT.is_supported("x")
    with pytest.raises(
        PluginLoadError, match=r"SGLang 0\.5\.24 is not supported .*supported: 0\.5\.23.*KVCACHED_ENABLE=0"
    ):
        SUPPORT.check("0.5.24")


def test_disabled_or_not_allowed_means_plain_sglang():
    """Three fresh SGLang processes: KVCACHED_ENABLE=0, an SGLANG_PLUGINS allowlist without kvcached, and a
    bad KVCACHED_* value. Each loads plugins the way SGLang does and must end with SGLang's own classes."""
    code = "from sglang.srt.plugins import load_plugins\nload_plugins()\n" + ORIGINALS
    runs = {
        "disabled": run_python(code, {"KVCACHED_ENABLE": "0"}),
        "allowlist": run_python(code, {"SGLANG_PLUGINS": "someone_else"}),
        "bad-setting": run_python(code, {"KVCACHED_RESERVED_PAGES": "lots"}),
    }
    vanilla = (
        "classes sglang.srt.mem_cache.memory_pool sglang.srt.mem_cache.allocator.paged sglang.srt.mem_cache.memory_pool"
    )
    for what, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{what}: {err[-2000:]}"
        assert vanilla in out, f"{what}: {out}"
        assert "Traceback" not in err, f"{what}: {err[-2000:]}"
    _, err = runs["bad-setting"].communicate()
    errors = [line for line in err.splitlines() if "kvcached:" in line]
    assert len(errors) == 1 and "KVCACHED_RESERVED_PAGES" in errors[0], err[-2000:]
