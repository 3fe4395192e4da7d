"""``python -m bench.batch_scaling --quick`` runs end to end (tiny model, embedded configurations) and writes its
report; every configuration gives every record the same tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="the tiny model builder needs the convert extra",
)
def test_quick_batch_scaling_writes_its_report(tmp_path):
    from bench.batch_scaling import main

    assert main(["--quick", "--repeat", "1", "--wait-quiet", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "batch-scaling.json").read_text(encoding="utf-8"))
    assert result["identical"] and [r["config"] for r in result["runs"]] == ["embedded 1x2", "embedded 2x1"]
    assert all(r["records"] == 8 and r["errors"] == 0 and r["tokens"] > 0 for r in result["runs"])
    md = (tmp_path / "batch-scaling.md").read_text(encoding="utf-8")
    assert "| embedded 2x1 |" in md and "## Scaling to N nodes" in md


def test_uneven_load_names_the_pairs_whose_background_differs():
    from bench.batch_scaling import uneven_load

    def run(config, repeat, others):
        return {"config": config, "repeat": repeat, "background_cores_before": others}

    runs = [
        run("embedded 1x2", 1, 2.0),
        run("embedded 2x1", 1, 0.1),
        run("ray 1x2", 1, 1.5),
        run("embedded 2x1", 2, None),
        run("embedded 1x2", 2, 0.0),
    ]
    found = uneven_load(runs, "embedded 1x2")
    assert found == ["embedded 2x1 #1 (others 0.10) vs embedded 1x2 #1 (2.00)"]
    assert uneven_load(runs, "embedded 1x2", threshold=0.4) == found + [
        "ray 1x2 #1 (others 1.50) vs embedded 1x2 #1 (2.00)"
    ]
