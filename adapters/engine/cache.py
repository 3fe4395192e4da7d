"""Where ortspec keeps what it makes once and reuses: converted model folders, measured cost curves, patched
peer folders, trained drafters and shipped ones materialised. ``$ORTSPEC_CACHE`` if set, else the user cache
directory (``~/.cache/ortspec`` on Linux)."""

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


def drafter_dir(model_dir: str | os.PathLike[str]) -> Path:
    """Where ``ortspec train-drafter`` puts the drafter of the model folder ``model_dir``, and where ``Engine``
    looks for it: ``drafters/<folder name>-<hash of its resolved path>`` in the cache (one per model folder)."""
    import hashlib

    resolved = Path(model_dir).expanduser().resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    return cache_root() / "drafters" / f"{resolved.name}-{digest}"
