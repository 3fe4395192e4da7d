"""``python -m bench.throughput --quick`` runs end to end on a tiny model (every column, two requests per decoding)
and writes its report; every ortspec output equals the same request decoded alone."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="the tiny model builder needs the convert extra",
)
def test_quick_throughput_writes_its_report(tmp_path):
    from bench.throughput import main
    from tests.support.models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-fp32", context=2048)
    out = tmp_path / "throughput.md"
    argv = ["--quick", "--precision", "fp32", "--model", str(model), "--prompts", "2", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    result = report["precisions"]["fp32"]
    columns = {(r["mode"], r["column"]) for r in result["summary"]}
    assert columns == {
        *((mode, column) for mode in ("greedy", "sampled") for column in (
            "ortspec alone", "ortspec batched, plain", "ortspec batched, prompt lookup", "ORT GenAI batched, batch 8"
        )),
        ("greedy", "ortspec batch"),
    }  # fmt: skip
    for key, identity in result["identity"].items():
        assert identity["total"] == 2
        assert "ORT GenAI" in key or identity["identical"] == 2, (key, identity)
    assert all(r["tokens"] == result["requests"][r["mode"]]["new_tokens"] > 0 for r in result["summary"])
    text = out.read_text(encoding="utf-8")
    assert "| greedy | ortspec batched, plain |" in text and "python -m bench.throughput --quick" in text


def test_first_difference_and_spread():
    from bench.throughput_dataset import spread
    from bench.throughput_report import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert spread(list(range(8)), 4) == [0, 2, 4, 6]
    assert spread(list(range(3)), 8) == [0, 1, 2]
