"""Loading through SGLang's own plugin machinery: entry point discovery, SGLANG_PLUGINS, KVCACHED_ENABLE,
the version and symbol checks. Everything runs against the installed SGLang (0.5.16 or 0.5.23 in CI)."""

from __future__ import annotations

import pkgutil

import pytest
from conftest import release_units, run_python

ORIGINALS = """
import sglang.srt.mem_cache.memory_pool as mp
import sglang.srt.mem_cache.allocator.paged as pg
print("classes", mp.MHATokenToKVPool.__module__, pg.PagedTokenToKVPoolAllocator.__module__,
      mp.HybridReqToTokenPool.mamba_pool_cls.__module__)
"""


def test_sglang_applies_every_patch(sglang_loaded):
    from sglang.srt.mem_cache import kv_cache_configurator as kc
    from sglang.srt.plugins.hook_registry import HookRegistry

    patches, _ = release_units()
    assert len(patches) == 14  # one unit per patched symbol, whichever release
    for patch in patches:
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
        1 for hooks in HookRegistry._hooks.values() for _, hook, _ in hooks if hook in {p.hook for p in patches}
    ) == len(patches)


def test_patch_target_check_lists_every_symbol(sglang_loaded, capsys):
    import json

    from kvcached_sglang import SUPPORT
    from kvcached_sglang.check import main

    assert main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == SUPPORT.installed_version()
    patches, used = release_units()
    listed = {row["target"] for row in report["symbols"]}
    assert listed == {p.target for p in patches} | set(used)
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

    assert SUPPORT.installed_version() in SUPPORT.supported
    assert all(SUPPORT.is_supported(v) for v in ("0.5.16", "0.5.19", "0.5.23", "0.5.23.post1"))
    for version in ("0.5.2", "0.5.15", "0.5.24", "0.5.160", "x"):
        assert not SUPPORT.is_supported(version), version
    with pytest.raises(
        PluginLoadError,
        match=r"SGLang 0\.5\.24 is not supported .*supported: 0\.5\.16, .*0\.5\.23\);.*KVCACHED_ENABLE=0",
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
