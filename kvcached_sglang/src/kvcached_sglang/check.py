"""``kvcached-sglang-check``: list every engine symbol the plugin touches and whether the installed engine has it."""

from __future__ import annotations

import sys

from kvcached_core.patches import check_main

from . import SUPPORT, patch_source


def main(argv: list[str] | None = None) -> int:
    return check_main("kvcached-sglang-check", SUPPORT, patch_source, argv)


if __name__ == "__main__":
    sys.exit(main())
