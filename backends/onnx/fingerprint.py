"""What identifies a target model folder for a shared-KV drafter trained on it (recorded in the drafter's
``drafter.json`` under ``ortspec.target``), and the one rule for whether a drafter fits a folder."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def target_fingerprint(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What identifies a target folder for a drafter trained on it: its name, the SHA-256 of its
    ``genai_config.json`` and the byte size of the decoder's external data (cheap; a folder rebuilt from the same
    weights has the same fingerprint; a different model of the same shape and size is not told apart)."""
    path = Path(folder)
    config = json.loads((path / "genai_config.json").read_text(encoding="utf-8"))
    model_name = config.get("model", {}).get("decoder", {}).get("filename", "model.onnx")
    data = [p for p in path.iterdir() if p.name.startswith(model_name) and p.name != model_name]
    return {
        "name": path.name,
        "config_sha256": hashlib.sha256((path / "genai_config.json").read_bytes()).hexdigest(),
        "data_bytes": sum(p.stat().st_size for p in data),
    }


def fingerprint_differences(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """The keys on which a drafter's ``recorded`` target fingerprint and a folder's ``actual`` one
    (:func:`target_fingerprint`) differ: ``config_sha256`` and ``data_bytes`` (the folder's name does not count);
    empty when the drafter fits the folder."""
    return [k for k in ("config_sha256", "data_bytes") if k in recorded and recorded[k] != actual.get(k)]
