"""The per-user runtime directory: owner-only (0700), holding ledgers and shared-memory segments."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Settings


def ensure_runtime_dir(path: str) -> str:
    """Create ``path`` with mode 0700 if needed and check that this user owns it and nobody else can enter.

    Raises PermissionError naming the fix when the directory belongs to someone else or is open to others.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a link in the way: reported below
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory; remove it or set KVCACHED_RUNTIME_DIR")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to you; set KVCACHED_RUNTIME_DIR")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def runtime_subdir(settings: Settings, name: str) -> str:
    """The folder ``name`` (0700) of this user's runtime directory, both created and checked on first use."""
    runtime = ensure_runtime_dir(settings.resolved_runtime_dir())
    return ensure_runtime_dir(os.path.join(runtime, name))
