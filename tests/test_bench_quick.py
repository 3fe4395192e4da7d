"""The benchmark suite's quick mode runs end to end on a tiny model and writes its three result files."""

from __future__ import annotations

import importlib.util
import json

import pytest


def _builder_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "onnx", "onnxruntime_genai"))


@pytest.mark.skipif(
    not _builder_available(), reason="the tiny model builder needs torch, transformers, onnx and onnxruntime_genai"
)
def test_quick_suite_writes_results(tmp_path):
    from bench.suite import ORTSPEC_ENGINES, main

    assert main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    json_path = tmp_path / "results-quick.json"
    md_path = tmp_path / "results-quick.md"
    png_path = tmp_path / "tokens_per_second-quick.png"
    assert json_path.is_file() and md_path.is_file()
    result = json.loads(json_path.read_text(encoding="utf-8"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert png_path.is_file() and png_path.stat().st_size > 0
    else:
        assert "plot_error" in result

    # every ortspec setting ran on every prompt and produced greedy's tokens exactly
    assert result["config"]["quick"] is True
    n_prompts = result["workloads"]["count"]
    assert n_prompts == 8
    for engine in ORTSPEC_ENGINES[1:]:
        ident = result["identity"][engine]
        assert ident["compared"] == n_prompts
        assert ident["identical"] == n_prompts, result["mismatches"]
    ortspec_runs = [r for r in result["runs"] if r["engine"] in ORTSPEC_ENGINES]
    assert len(ortspec_runs) == n_prompts * len(ORTSPEC_ENGINES)
    assert all(r.get("error") is None and r["new_tokens"] > 0 for r in ortspec_runs)

    # missing peers are reported, not faked; the ones present ran on every prompt
    for name in ("ortgenai", "ortgenai-ngram", "onnx_genai"):
        runs = [r for r in result["runs"] if r["engine"] == name]
        assert (name in result["missing"]) != (len(runs) == n_prompts)

    # the physical-limit context and the cost curve are there
    curve = result["cost_curve"]["curve"]
    assert len(curve) == 17 and curve[0] == 1.0
    assert result["physical"]["weights"]["bytes_per_step"] > 0
    assert set(result["overhead"]["engines"]) == {"ortspec-greedy", "ortspec-lookup-w8"}
    md = md_path.read_text(encoding="utf-8")
    for category in ("code_edit", "summarize", "qa_context", "open_ended"):
        assert f"## {category}" in md
