"""Which shared-KV drafter an Engine opens: ``Engine.from_dir``'s ``drafter`` argument resolved to a folder
(:func:`find_drafter`: the model folder's own, the trained one in the cache, the shipped one that fits), and the
folder opened for the Engine's backend (one sequence: a ``SharedKvProposer``; batched: ``SlotDrafters``), whose
hidden rows carry what the drafter reads (:func:`drafter_features`: a drafter with fused features reads residual
streams too, so the backend is opened with them)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import attrs

from ortspec.adapters.engine.cache import drafter_dir
from ortspec.adapters.engine.shipped import shipped_drafter
from ortspec.backends.onnx import BackendConfig, ModelFolder

T = TypeVar("T")


def open_drafter(
    folder: ModelFolder, drafter: str | os.PathLike[str] | bool | None, open_at: Callable[[Path], T]
) -> T | None:
    """``open_at(path)`` for the drafter folder ``drafter`` asks for, or None for none: a path is opened (its
    ``DrafterError`` raised); ``False`` is none; ``True`` is the one found beside the model
    (:func:`find_drafter`; ``DrafterError`` when there is none or it does not fit); ``None`` is that one if any,
    one that does not fit (or a shipped one that cannot be materialised) being skipped with a warning."""
    from ortspec.backends.onnx.drafter import DrafterError

    if drafter is False:
        return None
    if drafter not in (None, True):
        return open_at(Path(drafter))  # type: ignore[arg-type]
    try:
        found = find_drafter(folder.path)
        if found is None:
            if drafter is True:
                raise DrafterError(
                    f"no drafter found for {folder.path}; train one with: ortspec train-drafter --model {folder.path}"
                )
            return None
        return open_at(found)
    except DrafterError as exc:
        if drafter is True:
            raise
        warnings.warn(f"not using the drafter found for {folder.path}: {exc}", RuntimeWarning, stacklevel=3)
        return None


def drafter_features(folder: ModelFolder, drafter: str | os.PathLike[str] | bool | None) -> tuple[int, ...]:
    """The layers whose residual streams the drafter ``drafter`` asks for (as :func:`open_drafter` resolves it)
    reads beside the final hidden state (its folder's fused features), for ``BackendConfig.hidden_features``;
    ``()`` when it reads the final hidden state alone, or there is none, or it cannot be read (then
    :func:`open_drafter` says why)."""
    from ortspec.backends.onnx.drafter import DrafterError, DrafterFolder

    if drafter is False:
        return ()
    try:
        path = Path(drafter) if drafter not in (None, True) else find_drafter(folder.path)  # type: ignore[arg-type]
        fusion = DrafterFolder.load(path).fusion if path is not None else None
    except DrafterError:
        return ()
    return fusion.layers if fusion is not None else ()


def with_drafter_features(config: BackendConfig | None, features: tuple[int, ...]) -> BackendConfig | None:
    """``config`` with ``hidden_features`` the drafter's when it has any and the config names none (a config that
    names others keeps them; the drafter then refuses the target, naming both)."""
    if not features or (config is not None and config.hidden_features):
        return config
    return attrs.evolve(config if config is not None else BackendConfig(), hidden_features=features)


def find_drafter(model_dir: str | os.PathLike[str]) -> Path | None:
    """The drafter folder that goes with ``model_dir``, the first of: ``model_dir/drafter`` if it holds a
    ``drafter.json``; the trained one in the cache (``cache.drafter_dir``, where ``ortspec train-drafter`` puts it)
    if it does; the shipped drafter whose recorded target fingerprint fits the folder, materialised in the cache
    (``shipped.shipped_drafter``); None otherwise. ``DrafterError`` if a fitting shipped drafter cannot be
    materialised."""
    for candidate in (Path(model_dir).expanduser() / "drafter", drafter_dir(model_dir)):
        if (candidate / "drafter.json").is_file():
            return candidate
    return shipped_drafter(Path(model_dir).expanduser())
