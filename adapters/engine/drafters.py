"""Which shared-KV drafter an Engine opens: ``Engine.from_dir``'s ``drafter`` argument resolved to a folder, and the
folder opened for the Engine's backend (one sequence: a ``SharedKvProposer``; batched: ``SlotDrafters``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ortspec.adapters.engine.cache import find_drafter
from ortspec.backends.onnx import ModelFolder

T = TypeVar("T")


def open_drafter(
    folder: ModelFolder, drafter: str | os.PathLike[str] | bool | None, open_at: Callable[[Path], T]
) -> T | None:
    """``open_at(path)`` for the drafter folder ``drafter`` asks for, or None for none: a path is opened (its
    ``DrafterError`` raised); ``False`` is none; ``True`` is the one found beside the model
    (``cache.find_drafter``; ``DrafterError`` when there is none or it does not fit); ``None`` is that one if any,
    one that does not fit being skipped with a warning."""
    from ortspec.backends.onnx.drafter import DrafterError

    if drafter is False:
        return None
    if drafter not in (None, True):
        return open_at(Path(drafter))  # type: ignore[arg-type]
    found = find_drafter(folder.path)
    if found is None:
        if drafter is True:
            raise DrafterError(
                f"no drafter found for {folder.path}; train one with: ortspec train-drafter --model {folder.path}"
            )
        return None
    try:
        return open_at(found)
    except DrafterError as exc:
        if drafter is True:
            raise
        warnings.warn(f"not using the drafter found at {found}: {exc}", RuntimeWarning, stacklevel=3)
        return None
