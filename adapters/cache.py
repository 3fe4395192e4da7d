"""Where ortspec keeps what it makes once and reuses: converted model folders, measured cost curves, patched
peer folders. ``$ORTSPEC_CACHE`` if set, else the user cache directory (``~/.cache/ortspec`` on Linux)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The ortspec cache folder (not created here)."""
    root = os.environ.get("ORTSPEC_CACHE")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("ortspec")
    return Path(root).expanduser()
