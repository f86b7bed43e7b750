"""The README's configuration table is the one in kvcached_core.config, default for default."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from kvcached_core.config import SETTINGS, Settings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_configuration_table_matches_settings():
    rows = re.findall(r"^\| `(KVCACHED_\w+)` \| (.+?) \| (.+?) \|$", README.read_text(), re.MULTILINE)
    documented = {env: (default.strip("`"), meaning) for env, default, meaning in rows}
    assert set(documented) == {s.env for s in SETTINGS.values()}
    defaults = {f.name: f.default for f in fields(Settings)}
    for name, setting in SETTINGS.items():
        default, meaning = documented[setting.env]
        assert meaning == setting.meaning, setting.env
        value = defaults[name]
        if value is None:
            continue
        assert default == str(int(value) if isinstance(value, bool) else value), setting.env
