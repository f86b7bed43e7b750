"""Check a plugin's patch units against an engine release's sources, without installing or running it.

    python scripts/read_release.py vllm|sglang VERSION SOURCES [VERSION SOURCES ...] [--units VERSION] [--json|--brief]

SOURCES holds the release's package (``SOURCES/vllm/...``), e.g. a wheel unpacked with
``unzip -q vllm-0.33.0-*.whl 'vllm/*' -d SOURCES``. Run it where the plugin and some release of its engine
are installed (the plugin's units and hooks are the same objects for every release). For every unit of
VERSION it reads, in the sources alone, that each target exists (module, class, function, or a name a
module imports or assigns; methods also through base classes), that each alias module binds the target
itself, that each symbol the plugin reads exists, that every ``around`` hook takes the parameters of its
target as that release defines them, and that every method a replacing class overrides takes what the
release's own method takes. It is how a release that no machine here can run is "read":
what it cannot see is behaviour (a body that changed meaning), which still needs reading or a run.
Exit 0 when every row is ok, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import os
import sys
from dataclasses import dataclass

from kvcached_core.patches import (
    MISSING,
    EngineSymbols,
    Patch,
    around_mismatch,
    check_report,
    for_version,
    override_mismatches,
    report_text,
)

PLUGINS = {"vllm": ("kvcached_vllm", "vllm"), "sglang": ("kvcached_sglang", "sglang")}  # module, GPU build


@dataclass(frozen=True)
class Found:
    """A definition found in the sources: its node (None for a module) and the module it is in."""

    node: ast.AST | None
    module: str


class Sources:
    """A release's package sources, read with ``ast`` (nothing is imported)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.trees: dict[str, ast.Module | None] = {}
        self.packages: set[str] = set()  # modules that are a package's __init__.py
        self.following: set[tuple[str, str]] = set()  # imports being followed (a cycle reads as missing)

    def module(self, name: str) -> ast.Module | None:
        if name not in self.trees:
            base = os.path.join(self.root, *name.split("."))
            self.trees[name] = None
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        self.trees[name] = ast.parse(f.read(), path)
                    if path.endswith("__init__.py"):
                        self.packages.add(name)
                    break
        return self.trees[name]

    def resolve(self, dotted: str) -> Found | None:
        """The definition ``dotted`` names: the longest module prefix, then names within it."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if self.module(module) is not None:
                return self.within(module, parts[i:])
        return None

    def within(self, module: str, names: list[str]) -> Found | None:
        found: Found | None = Found(None, module)
        for name in names:
            if found is None:
                return None
            if found.node is None:  # a module
                found = self.binding(found.module, self.module(found.module).body, name)
            elif isinstance(found.node, ast.ClassDef):
                found = self.member(found, name)
            else:
                return None  # an attribute of a function or a value: not readable
        return found

    def binding(self, module: str, body: list[ast.stmt], name: str) -> Found | None:
        """What ``name`` is bound to at the top of ``module`` (inside ``if`` and ``try`` blocks too); the last
        binding, as when the module runs."""
        for stmt in reversed(body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                return Found(stmt, module)
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return Found(stmt, module)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return Found(stmt, module)
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    star = alias.name == "*"  # ``from x import *``: whatever x binds
                    if (star or (alias.asname or alias.name) == name) and (module, name) not in self.following:
                        self.following.add((module, name))
                        try:
                            found = self.resolve(f"{self.absolute(module, stmt)}.{name if star else alias.name}")
                        finally:
                            self.following.discard((module, name))
                        if found is not None or not star:
                            return found
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name:
                        return Found(None, alias.name) if self.module(alias.name) else None
            if isinstance(stmt, (ast.If, ast.Try)):
                blocks = [stmt.body, stmt.orelse]
                blocks += [h.body for h in stmt.handlers] if isinstance(stmt, ast.Try) else []
                for block in blocks:
                    if (found := self.binding(module, block, name)) is not None:
                        return found
        return None

    def member(self, cls: Found, name: str) -> Found | None:
        """``name`` in the body of class ``cls`` (a method, a field, an enum member), else in its bases."""
        for stmt in reversed(cls.node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                return Found(stmt, cls.module)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == name for t in targets
            ):
                return Found(stmt, cls.module)
        for base in cls.node.bases:
            dotted = ast.unparse(base)
            head, _, rest = dotted.partition(".")
            found = self.binding(cls.module, self.module(cls.module).body, head)
            if found is not None and rest:
                found = self.within(found.module, rest.split(".")) if found.node is None else None
            if found is not None and isinstance(found.node, ast.ClassDef):
                if (member := self.member(found, name)) is not None:
                    return member
        return None

    def absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        """The module a ``from ... import`` in ``module`` reads (relative imports made absolute)."""
        if not stmt.level:
            return stmt.module or ""
        parts = module.split(".")
        climb = stmt.level - 1 if module in self.packages else stmt.level  # a package's __init__ is its own level
        package = parts[: len(parts) - climb]
        return ".".join(package + ([stmt.module] if stmt.module else []))


def signature(node: ast.AST) -> inspect.Signature | None:
    """The signature a function definition gives its callers (a classmethod's without ``cls``)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a, P = node.args, inspect.Parameter
    positional = [(x.arg, P.POSITIONAL_ONLY) for x in a.posonlyargs]
    positional += [(x.arg, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    first_default = len(positional) - len(a.defaults)
    params = [P(n, k, default=None if i >= first_default else P.empty) for i, (n, k) in enumerate(positional)]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [
        P(x.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
        for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    if any(ast.unparse(d) == "classmethod" for d in node.decorator_list):
        params = params[1:]
    return inspect.Signature(params)


def method_signature(sources: Sources, cls: Found, name: str) -> inspect.Signature | None:
    """The signature of method ``name`` of class ``cls`` as the sources define it (bases included)."""
    member = sources.member(cls, name)
    return signature(member.node) if member else None


class ReleaseSymbols(EngineSymbols):
    """A release's symbols as its sources define them: what :func:`check_report` looks up, read, not imported."""

    def __init__(self, root: str) -> None:
        self.sources = Sources(root)

    def find(self, dotted: str) -> object:
        return self.sources.resolve(dotted) or MISSING

    def mismatches(self, patch: Patch, target: object) -> list[str]:
        assert isinstance(target, Found)
        if isinstance(target.node, ast.ClassDef):
            return override_mismatches(patch, functools.partial(method_signature, self.sources, target))
        defined = signature(target.node)  # None: not a def (an assignment), so its parameters are unread
        return [why] if defined is not None and (why := around_mismatch(patch, defined)) else []


def rows_for(plugin: str, units_of: str, root: str) -> list[dict[str, str]]:
    """One row per symbol the plugin's units for release ``units_of`` touch, read in the sources at ``root``."""
    module, build = PLUGINS[plugin]
    patches, symbols = for_version(__import__(module, fromlist=["patch_source"]).patch_source, units_of, build)
    return check_report(patches, symbols, ReleaseSymbols(root))


def read_one(engine: str, version: str, sources: str, units: str | None, as_json: bool, brief: bool) -> int:
    """Print one release's report (``brief``: its title alone when every row is ok, else the rows that are
    not); 0 when it reads clean, 1 otherwise."""
    units = units or version
    rows = rows_for(engine, units, sources)
    if not rows:
        print(
            f"read_release: no unit of the plugin is for {engine} {units}; --units VERSION reads the "
            "sources with another release's units",
            file=sys.stderr,
        )
        return 1
    clean = all(row["status"] == "ok" for row in rows)
    if as_json:
        print(json.dumps({"engine": engine, "version": version, "units": units, "symbols": rows}, indent=2))
    else:
        text = report_text(f"{engine} {version} (read from {sources}, units of {units})", rows)
        lines = text.splitlines()
        if brief:
            lines = lines[:1] if clean else [line for line in lines if not line.startswith("  ok")]
        print("\n".join(lines))
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=sorted(PLUGINS))
    parser.add_argument(
        "releases",
        nargs="+",
        metavar="VERSION SOURCES",
        help="a release (e.g. 0.33.0) and the folder holding its package folder; several pairs read them all "
        "with one import of the plugin",
    )
    parser.add_argument(
        "--units",
        metavar="VERSION",
        help="read the sources with the units of this release instead (e.g. the newest supported one, to see "
        "what a new release would break)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (one release only)")
    parser.add_argument("--brief", action="store_true", help="a clean release's title line only; else what is not ok")
    args = parser.parse_args(argv)
    if len(args.releases) % 2:
        parser.error("give each release as VERSION SOURCES, e.g. 0.33.0 .read-releases/vllm-0.33.0")
    pairs = list(zip(args.releases[::2], args.releases[1::2], strict=True))
    if args.json and len(pairs) > 1:
        parser.error("--json reads one release")
    for _, sources in pairs:
        if not os.path.isdir(os.path.join(sources, args.engine)):
            parser.error(f"{sources} has no {args.engine}/ folder: unpack the release's wheel there")
    codes = [read_one(args.engine, v, src, args.units, args.json, args.brief) for v, src in pairs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
