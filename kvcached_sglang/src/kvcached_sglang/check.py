"""``kvcached-sglang-check``: list every SGLang symbol the plugin touches and whether the installed SGLang has it.

Exit status 0 when the version is supported and every symbol resolves, 1 when a symbol is missing, 2 when
SGLang is absent or its version unsupported.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvcached_core.patches import PluginLoadError, check_report

from . import SUPPORT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcached-sglang-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        version = SUPPORT.check()
    except PluginLoadError as exc:
        print(f"kvcached-sglang-check: {exc}", file=sys.stderr)
        return 2
    try:
        from .patches import PATCHES, USED_SYMBOLS
    except (ImportError, AttributeError) as exc:
        print(f"kvcached-sglang-check: SGLang {version}: {exc}", file=sys.stderr)
        return 1
    rows = check_report(PATCHES, USED_SYMBOLS)
    if args.json:
        print(json.dumps({"engine": "sglang", "version": version, "symbols": rows}, indent=2))
    else:
        print(f"SGLang {version}: {len(rows)} symbols")
        for row in rows:
            print(f"  {row['status']:<8} {row['kind']:<8} {row['patch']:<16} {row['target']}")
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
