"""The drafters shipped with the package (``ortspec/drafters/<name>/``, package data) and how one becomes a
drafter folder an Engine opens.

A shipped folder is a drafter folder (``ortspec.backends.onnx.drafter``'s contract) without its largest file, the
target's input-embedding table (float32 ``[V, H]``): that table is the target's own, so ``drafter.json`` names its
source instead (``ortspec.input_embedding``: ``source`` ``"target"``, the table the target graph's input Gather reads,
its ``shape`` and ``sha256``). :func:`shipped_drafter` picks the shipped folder whose recorded target fingerprint
(config hash and weight size) fits a model folder, and on first use materialises it into the user cache
(``drafters/shipped-<name>-<config hash>``): its files, plus the table read out of the model folder's graph and
checked against the recorded shape and hash. A model no shipped drafter fits simply has none (None, no warning).
:func:`package_drafter` makes a shipped folder out of a trained one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ortspec.adapters.engine.cache import cache_root
from ortspec.backends.onnx import ModelFolder
from ortspec.backends.onnx.drafter import DrafterError
from ortspec.backends.onnx.fingerprint import fingerprint_differences, target_fingerprint

METADATA = "drafter.json"
TABLE_SOURCE = "target"


def shipped_root() -> Path:
    """The folder of the shipped drafters (``ortspec/drafters`` in the installed package)."""
    from importlib.resources import files

    return Path(str(files("ortspec").joinpath("drafters")))


def _metadata(folder: Path) -> dict[str, Any]:
    return json.loads((folder / METADATA).read_text(encoding="utf-8"))


def shipped_drafter(model_dir: str | os.PathLike[str]) -> Path | None:
    """The materialised drafter folder of the shipped drafter that fits ``model_dir`` (its recorded target
    fingerprint equals the folder's), materialised now if it is not yet; None when none fits. Raises
    ``DrafterError`` when the table read from the model folder is not the one recorded."""
    root = shipped_root()
    if not root.is_dir():
        return None
    actual = target_fingerprint(model_dir)
    for folder in sorted(p for p in root.iterdir() if (p / METADATA).is_file()):
        recorded = _metadata(folder).get("ortspec", {}).get("target")
        if recorded and not fingerprint_differences(recorded, actual):
            return materialise(folder, model_dir)
    return None


def materialise(shipped: Path, model_dir: str | os.PathLike[str]) -> Path:
    """The complete drafter folder of the shipped folder ``shipped`` for the model folder ``model_dir``, in the user
    cache: kept if it holds the same ``drafter.json`` already, else written (into a temporary sibling, renamed into
    place when complete)."""
    meta_bytes = (shipped / METADATA).read_bytes()
    meta = json.loads(meta_bytes)
    expected = meta["ortspec"]["target"]["config_sha256"][:12]
    dest = cache_root() / "drafters" / f"shipped-{shipped.name}-{expected}"
    table_name = meta["speculative"]["input_embedding"]
    if (dest / METADATA).is_file() and (dest / METADATA).read_bytes() == meta_bytes and (dest / table_name).is_file():
        return dest
    from ortspec.adapters.engine.folders import replace_folder

    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        for path in shipped.iterdir():
            if path.is_file():
                shutil.copyfile(path, staged / path.name)
        target_table(model_dir, meta["ortspec"]["input_embedding"]).tofile(staged / table_name)
        return replace_folder(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def target_table(model_dir: str | os.PathLike[str], source: dict[str, Any]) -> np.ndarray:
    """The target's input-embedding table as a shipped drafter's ``ortspec.input_embedding`` describes it (``source``
    ``"target"``, ``shape`` ``[V, H]``, ``sha256`` of its little-endian float32 bytes), read from ``model_dir``'s
    graph; ``DrafterError`` naming the graph if it differs."""
    from ortspec.adapters.engine.target_tables import TargetTables

    folder = ModelFolder.load(model_dir)
    if source.get("source") != TABLE_SOURCE:
        raise DrafterError(f"unknown input_embedding source {source.get('source')!r} (expected {TABLE_SOURCE!r})")
    table = np.ascontiguousarray(TargetTables(folder).embedding(), dtype="<f4")
    shape = [int(n) for n in source["shape"]]
    if list(table.shape) != shape:
        raise DrafterError(
            f"{folder.model_path}: the input-embedding table is {list(table.shape)}, the shipped drafter "
            f"expects {shape}"
        )
    if hashlib.sha256(table.tobytes()).hexdigest() != source["sha256"]:
        raise DrafterError(f"{folder.model_path}: the input-embedding table differs from the shipped drafter's")
    return table


def package_drafter(trained: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Write the shipped form of the trained drafter folder ``trained`` into ``dest`` (created; a previous shipped
    form there is replaced whole): every file but the input-embedding table, whose shape and hash ``drafter.json``
    records instead (``ortspec.input_embedding``)."""
    src, out = Path(trained), Path(dest)
    meta = _metadata(src)
    table_name = meta["speculative"]["input_embedding"]
    rows_by_width = np.fromfile(src / table_name, dtype="<f4")
    hidden = int(meta["speculative"]["backbone_hidden_size"])
    meta["ortspec"]["input_embedding"] = {
        "source": TABLE_SOURCE,
        "shape": [len(rows_by_width) // hidden, hidden],
        "sha256": hashlib.sha256(rows_by_width.tobytes()).hexdigest(),
    }
    if out.exists() and any(out.iterdir()):
        if not (out / METADATA).is_file():
            raise FileExistsError(f"{out} is not empty and holds no {METADATA}; not replacing it")
        shutil.rmtree(out)  # a previous shipped form: replaced whole, so no stale file stays
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in (table_name, METADATA):
            shutil.copyfile(path, out / path.name)
    (out / METADATA).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return out
