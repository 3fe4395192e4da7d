"""What identifies a target model folder for a shared-KV drafter trained on it (recorded in the drafter's
``drafter.json`` under ``ortspec.target``), and the one rule for whether a drafter fits a folder."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# fingerprint key -> what it is, in words (the shape first: a difference there is named before the hash's)
DIFFERENCES = {
    "vocab_size": "vocabulary",
    "hidden_size": "hidden size",
    "num_layers": "layer count",
    "config_sha256": "genai_config.json",
    "data_bytes": "weight bytes",
}


def target_fingerprint(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What identifies a target folder for a drafter trained on it: its name, its shape (``vocab_size``,
    ``hidden_size``, ``num_layers`` from ``genai_config.json``), the SHA-256 of its ``genai_config.json`` and the
    byte size of the decoder's external data (cheap; a folder rebuilt from the same weights has the same
    fingerprint; a different model of the same shape and size is not told apart)."""
    path = Path(folder)
    raw = (path / "genai_config.json").read_bytes()
    model = json.loads(raw).get("model", {})
    decoder = model.get("decoder", {})
    model_name = decoder.get("filename", "model.onnx")
    data = [p for p in path.iterdir() if p.name.startswith(model_name) and p.name != model_name]
    return {
        "name": path.name,
        "vocab_size": model.get("vocab_size"),
        "hidden_size": decoder.get("hidden_size"),
        "num_layers": decoder.get("num_hidden_layers"),
        "config_sha256": hashlib.sha256(raw).hexdigest(),
        "data_bytes": sum(p.stat().st_size for p in data),
    }


def fingerprint_differences(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """What differs between a drafter's ``recorded`` target fingerprint and a folder's ``actual`` one
    (:func:`target_fingerprint`), in words, the shape first: e.g. ``"vocabulary: 49152 recorded, 384 here"``,
    ``"genai_config.json differs"`` (the folder's name does not count; a key the record lacks is not compared);
    empty when the drafter fits the folder."""
    out = []
    for key, what in DIFFERENCES.items():
        if key in recorded and recorded[key] != actual.get(key):
            if key == "config_sha256":
                out.append(f"{what} differs")
            else:
                out.append(f"{what}: {recorded[key]} recorded, {actual.get(key)} here")
    return out
