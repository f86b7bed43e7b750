"""The release ranges and engine builds that pick a plugin's patch units (kvcached_core.patches), with no
engine installed: the selection is pure, and `load_checked` must refuse loudly what it cannot patch."""

from __future__ import annotations

import pytest

from kvcached_core.patches import (
    EngineSupport,
    Patch,
    PluginLoadError,
    Releases,
    Uses,
    check_report,
    for_release,
    for_version,
    install,
    load_checked,
    observed,
    verify,
)


def test_a_range_includes_since_and_excludes_until():
    r = Releases("0.26", "0.29")
    assert "0.26.0" in r and "0.28.9" in r and "0.26.0rc1" in r and "0.28" in r
    assert "0.25.1" not in r and "0.29.0" not in r and "0.29.0rc1" not in r
    assert "1.0" in Releases("0.30") and "0.1" in Releases(until="0.2") and "9" in Releases()
    assert str(r) == "0.26 to before 0.29" and str(Releases("0.30")) == "0.30 on" and str(Releases()) == "all"


def unit(name: str, releases: Releases, builds: tuple[str, ...] = ()) -> Patch:
    return Patch(name, f"json.{name}", "around", None, "test", releases=releases, builds=builds)


def test_each_release_and_build_gets_its_own_units():
    units = [
        unit("old", Releases("0.26", "0.29")),
        unit("new", Releases("0.29")),
        unit("cpu-only", Releases("0.26"), builds=("engine-cpu",)),
    ]
    assert [u.name for u in for_release(units, "0.27.1", "engine")] == ["old"]
    assert [u.name for u in for_release(units, "0.30.0", "engine-cpu")] == ["new", "cpu-only"]
    assert [u.name for u in for_release(units, "0.25.0", "engine")] == []


def test_read_symbols_follow_the_release_and_plain_paths_always_apply():
    def source():
        used = ["json.dumps", Uses("json.loads", Releases("0.30")), Uses("json.JSONDecoder", Releases("0.26", "0.30"))]
        return [], used

    assert for_version(source, "0.28.0", None)[1] == ["json.dumps", "json.JSONDecoder"]
    assert for_version(source, "0.31.0", None)[1] == ["json.dumps", "json.loads"]


def test_load_checked_names_every_missing_symbol_of_the_installed_release(monkeypatch):
    """`pytest` stands in for an engine: its installed version picks the units; the one missing symbol of
    that release is named, the units of other releases are not looked at."""
    import importlib.metadata

    version = importlib.metadata.version("pytest")
    support = EngineSupport(engine="pytest", distributions=("pytest",), supported=(version.split(".")[0],))

    def source():
        here = Releases(version)
        elsewhere = Releases("0", "0.1")
        patches = [unit("dumps", here), unit("no_such_symbol", here), unit("also_missing", elsewhere)]
        return patches, []

    with pytest.raises(PluginLoadError) as err:
        load_checked(support, source)
    assert "json.no_such_symbol" in str(err.value) and "also_missing" not in str(err.value)
    with pytest.raises(PluginLoadError, match="is not supported"):
        load_checked(EngineSupport(engine="pytest", distributions=("pytest",), supported=("0.0",)), source)


def test_an_around_hook_that_cannot_take_its_targets_parameters_is_refused_at_load():
    """A release that adds a parameter to a wrapped function (vLLM 0.33 gave ``get_kv_cache_configs`` a
    fourth) must stop the plugin at load, naming the function, instead of failing at its first call.
    ``textwrap.indent(text, prefix, predicate=None)`` stands in for the engine's function."""

    def too_narrow(original, text, prefix):
        return original(text, prefix)

    def passes_the_rest_on(original, text, prefix, *rest):
        return original(text, prefix, *rest)

    def keywords_too(original, *args, **kwargs):
        return original(*args, **kwargs)

    def around(hook) -> Patch:
        return Patch("indent", "textwrap.indent", "around", hook, "test")

    with pytest.raises(PluginLoadError, match=r"changed the parameters of textwrap.indent .*predicate"):
        verify([around(too_narrow)], "engine", "9.9")
    verify([around(passes_the_rest_on), around(keywords_too)], "engine", "9.9")
    [narrow] = check_report([around(too_narrow)])  # what the plugins' check commands print
    assert narrow["status"] == "parameters changed" and "predicate" in narrow["why"]
    assert check_report([around(passes_the_rest_on)])[0]["status"] == "ok"
    # Replacements and hook-less units are not compared.
    verify([Patch("indent", "textwrap.indent", "replace", too_narrow, "test"), unit("dumps", Releases())], "e", "1")


def test_a_replacing_class_whose_override_cannot_take_the_engines_call_is_refused_at_load():
    """vLLM 0.34 gave ``BlockPool.free_blocks`` an ``evict_first`` parameter that its callers pass: a
    subclass that replaces the engine's class and overrides the method without it must stop the plugin at
    load. ``json.JSONEncoder`` (``default(self, o)``, ``encode(self, o)``) stands in for the engine's class."""
    import json

    class Narrow(json.JSONEncoder):
        def default(self):  # the engine calls default(o)
            return None

        def helper(self, anything, at, all):  # not the engine's: not compared
            return None

    class Wide(json.JSONEncoder):
        def encode(self, o, *rest, **options):
            return super().encode(o)

    class Derived(Wide):  # a plugin class above another: the overrides of both are compared
        def iterencode(self, o, _one_shot=False):
            return super().iterencode(o, _one_shot)

    def replace(cls) -> Patch:
        return Patch("encoder", "json.JSONEncoder", "replace", cls, "test")

    with pytest.raises(PluginLoadError, match=r"json.JSONEncoder \(default is now \(self, o\), ours takes \(self\)\)"):
        verify([replace(Narrow)], "engine", "9.9")
    verify([replace(Wide), replace(Derived)], "engine", "9.9")
    [row] = check_report([replace(Narrow)])
    assert row["status"] == "parameters changed" and row["why"].startswith("default is now")


@pytest.fixture
def core_logger():
    """The ``kvcached`` logger, restored after the test (routing it is process-wide)."""
    import logging

    core = logging.getLogger("kvcached")
    saved = (list(core.handlers), core.level, core.propagate)
    yield core
    core.handlers[:], core.level, core.propagate = saved[0], saved[1], saved[2]


def test_the_core_logs_where_the_engine_logs(core_logger):
    """An engine whose logger does not propagate to the root (vLLM's) shows the core's records (fair share,
    pressure, start-up lock) once, at the level the engine's logger has when they are logged, through its own
    handlers."""
    import logging

    from kvcached_core.plugin import route_core_logs

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    engine, root = Keep(), Keep()
    target = logging.getLogger("engine-under-test")
    target.addHandler(engine)
    target.setLevel(logging.WARNING)
    target.propagate = False
    logging.getLogger().addHandler(root)
    try:
        route_core_logs(target)
        route_core_logs(target)  # a second registration in the process adds nothing
        target.setLevel(logging.INFO)  # the engine configures its logging after loading its plugins
        core_logger.info("kvcached: yielding down to an equal share")
        core_logger.debug("kvcached: below the engine's level")
    finally:
        logging.getLogger().removeHandler(root)
        target.removeHandler(engine)
    assert engine.messages == ["kvcached: yielding down to an equal share"]
    assert root.messages == []


def test_a_wrap_unit_installs_the_replacement_its_hook_returns_and_is_checked_like_around(monkeypatch):
    """A ``wrap`` hook gets the original once and returns the method that replaces it, which the engine's
    calls then reach directly (a class's method in a module made here stands in for the engine's); its
    parameters are checked against the target's at load, as an ``around`` hook's are."""
    import sys
    import types

    engine = types.ModuleType("fake_engine")

    class Manager:
        def allocate(self, request, tokens, *, lookahead=0):
            return ("allocated", request, tokens, lookahead)

    engine.Manager = Manager
    monkeypatch.setitem(sys.modules, "fake_engine", engine)
    seen = []

    def counting(original):
        def allocate(manager, *args, **kwargs):
            seen.append(kwargs)
            return original(manager, *args, **kwargs)

        return allocate

    def positional_only(original):
        def allocate(manager, request, tokens):
            return original(manager, request, tokens)

        return allocate

    wrap = Patch("allocate", "fake_engine.Manager.allocate", "wrap", counting, "test")
    verify([wrap], "engine", "9.9")
    with pytest.raises(PluginLoadError, match=r"changed the parameters of fake_engine\.Manager\.allocate .*lookahead"):
        verify([Patch("allocate", "fake_engine.Manager.allocate", "wrap", positional_only, "test")], "e", "9.9")
    original = Manager.allocate
    install(wrap)
    assert Manager().allocate("r", 16, lookahead=2) == ("allocated", "r", 16, 2) and seen == [{"lookahead": 2}]
    assert Manager.allocate.__wrapped__ is original and Manager.allocate.__kvcached_patch__ == "allocate"
    assert Manager.allocate.__name__ == "allocate"


def test_an_after_unit_keeps_the_targets_parameters_and_sees_each_result(monkeypatch):
    """An ``after`` hook gets the call's first argument and the result once the target returned; the
    replacement is made with the target's own parameters (names, kinds, defaults), so the engine's
    positional, keyword, keyword-only, ``*args`` and ``**kwargs`` arguments reach the original as they came,
    and a call the target refuses is refused the same way. An exception passes through, unobserved."""
    import inspect
    import sys
    import types

    engine = types.ModuleType("fake_engine_after")

    class Coordinator:
        def count(self, request, tokens=16, /, scale=1, *extra, cap=None, result="r", **options):
            if tokens < 0:
                raise ValueError("negative")
            return (request, tokens, scale, extra, cap, result, options)

    engine.Coordinator = Coordinator
    monkeypatch.setitem(sys.modules, "fake_engine_after", engine)
    seen = []
    original = Coordinator.count
    install(Patch("count", "fake_engine_after.Coordinator.count", "after", lambda c, r: seen.append((c, r)), "t"))
    assert str(inspect.signature(Coordinator.count, follow_wrapped=False)) == str(inspect.signature(original))
    assert Coordinator.count.__wrapped__ is original and Coordinator.count.__kvcached_patch__ == "count"
    coordinator = Coordinator()
    assert coordinator.count("a") == ("a", 16, 1, (), None, "r", {})
    assert coordinator.count("b", 2, 3, 4, 5, cap=6, result=7, x=8) == ("b", 2, 3, (4, 5), 6, 7, {"x": 8})
    assert seen == [(coordinator, ("a", 16, 1, (), None, "r", {})), (coordinator, ("b", 2, 3, (4, 5), 6, 7, {"x": 8}))]
    with pytest.raises(TypeError):
        coordinator.count(request="c")  # positional-only, as in the original
    with pytest.raises(ValueError, match="negative"):
        coordinator.count("d", -1)
    assert len(seen) == 2
    # a target with no first positional parameter (or no signature) gets the generic wrapper
    calls = []
    generic = observed(lambda *, a: a * 2, lambda first, result: calls.append((first, result)))
    assert generic(a=1) == 2 and calls == [(None, 2)]
    builtin = observed(max, lambda first, result: calls.append((first, result)))
    assert builtin(3, 9) == 9 and calls == [(None, 2), (3, 9)]


def test_an_alias_checks_out_only_where_it_binds_the_target_itself():
    """An alias is a module that copied the target by name, so the plugin rebinds it too: it must hold the
    target itself (``posixpath.join`` is ``os.path.join``), not another object of that name
    (``pickle.dumps`` is not ``json.dumps``); ``verify`` refuses the copy at load, as ``install`` would."""
    shared = Patch("join", "os.path.join", "replace", None, "test", aliases=("posixpath",))
    copied = Patch("dumps", "json.dumps", "replace", None, "test", aliases=("pickle",))
    rows = {row["target"]: row["status"] for row in check_report([shared, copied])}
    assert rows == {"os.path.join": "ok", "json.dumps": "ok", "posixpath.join": "ok", "pickle.dumps": "missing"}
    verify([shared], "e", "1")
    with pytest.raises(PluginLoadError, match=r"e 1 lacks pickle\.dumps"):
        verify([copied], "e", "1")
