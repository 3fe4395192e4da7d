"""Publishing a folder the tools built: every folder (a converted model, a drafter) is written into a temporary
sibling of its destination and renamed into place only when complete, so a run killed half way never leaves a
half-written folder at the destination."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def replace_folder(staged: Path, dest: Path) -> Path:
    """Make the finished folder ``staged`` (a sibling of ``dest``: same filesystem, so the rename is atomic)
    ``dest``. ``staged`` gets the umask's permissions (``tempfile.mkdtemp`` made it 0700); a folder already at
    ``dest`` is renamed aside first and removed (a process that has its files open keeps them until it closes
    them). Returns ``dest``."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o777 & ~umask)
    if dest.exists():
        trash = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        dest.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    staged.rename(dest)
    return dest
