"""bench.gpu and the replay pricing it uses: the CPU smoke run of the GPU benchmark (``--shape tiny --provider
cpu``), the committed replay inputs, and the pricing on the device-picks path."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import gpu, gpu_measure, gpu_report
from bench.replay import PRICED_SETTINGS, _settings, load_inputs, price, replay

REPO = Path(__file__).resolve().parent.parent
INPUTS = REPO / "bench" / "data" / "replay-fp32.json"
RESULTS = REPO / "bench" / "data" / "suite-results-fp32.json"


def test_replay_inputs_hold_the_suites_greedy_records():
    inputs = load_inputs(INPUTS)
    results = json.loads(RESULTS.read_text())
    greedy = {r["workload"]: r for r in results["runs"] if r["engine"] == "ortspec-greedy"}
    assert len(inputs["records"]) == len(greedy) == 32
    for rec in inputs["records"]:
        run = greedy[rec["workload"]]
        assert len(rec["prompt_ids"]) == run["prompt_tokens"] and rec["token_ids"] == run["token_ids"]
        assert rec["category"] == run["category"]
    assert inputs["cpu_cost_curve"] == results["cost_curve"]["curve"]


def test_pricing_on_the_picks_path_equals_the_rows_path():
    inputs = load_inputs(INPUTS)
    costs = inputs["cpu_cost_curve"]
    records = [r for r in inputs["records"] if r["category"] == "code_edit"][:2]
    prompts = {r["workload"]: r["prompt_ids"] for r in records}
    settings = {name: _settings(costs)[name] for name in PRICED_SETTINGS}
    rows = replay(records, prompts, settings, costs, inputs["vocab_size"])  # logits rows, as the suite's replay
    picks = price(inputs, costs, categories=["code_edit"], limit=2)["code_edit"]  # device picks
    for name in PRICED_SETTINGS:
        assert picks[name]["decode_speedup"] == pytest.approx(rows[name][0])
        assert picks[name]["tokens_per_pass"] == pytest.approx(rows[name][1])


def test_pricing_in_seconds_adds_the_host_time():
    inputs = load_inputs(INPUTS)
    costs = inputs["cpu_cost_curve"]
    step = 0.001
    result = price(inputs, costs, categories=["open_ended", "code_edit"], limit=2, pass_s=[c * step for c in costs])
    for entry in result.values():
        greedy = entry["greedy"]
        # one pass per token and some host time per pass: a little under 1000 tok/s
        assert 500 < greedy["expected_tok_s"] < 1000 and greedy["host_us_per_pass"] > 0
        for name in PRICED_SETTINGS:
            item = entry[name]
            assert item["expected_tok_s"] > 0 and item["host_us_per_pass"] > 0
            # host time is paid per pass: it moves the ratio toward (greedy passes x greedy host time) / (speculative
            # passes x speculative host time), up or down, but not far from the pass costs' ratio at 1 ms passes
            assert 0.5 * item["decode_speedup"] < item["speedup_with_host"] < 2 * item["decode_speedup"]


def test_targets_are_judged_only_where_measured():
    def mode(rate, ratio, code, open_, same=True):
        return {
            "greedy": {"decode_tok_s": rate},
            "verify8_over_decode": ratio,
            "priced": {
                "code_edit": {gpu_report.PRICED: {"speedup_with_host": code}},
                "open_ended": {gpu_report.PRICED: {"speedup_with_host": open_}},
            },
            "identity": {"oracle_drafts_identical": same, "prompt_lookup_identical": True},
        }

    report = {
        "machine": {"provider": "cuda"},
        "models": {
            "qwen2.5-0.5b-int4-cuda": {
                "shape": "qwen2.5-0.5b",
                "precision": "int4",
                "modes": {"graphs": mode(800.0, 1.1, 1.6, 0.99)},
            },
            "smollm2-135m-fp16-cuda": {
                "shape": "smollm2-135m",
                "precision": "fp16",
                "modes": {"eager": mode(300.0, 1.3, 1.2, 0.9, same=False), "static": {"error": "x"}},
            },
        },
    }
    rows = gpu_report.targets(report)
    greedy = [r for r in rows if r["target"].startswith("greedy")]
    assert [(r["where"], r["met"]) for r in greedy] == [("qwen2.5-0.5b-int4-cuda graphs", True)]
    smol = {r["target"]: r["met"] for r in rows if r["where"] == "smollm2-135m-fp16-cuda eager"}
    assert smol == {
        "verify(8)/decode <= 1.2": False,
        "priced speculative / greedy on code_edit >= 1.5": False,
        "priced speculative / greedy on open_ended >= 0.97": False,
        "speculative == greedy": False,
    }
    assert all(r["met"] for r in rows if r["where"].startswith("qwen"))


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="building the tiny model needs the convert extra",
)
def test_gpu_bench_smoke_run_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    argv = [
        "--shape",
        "tiny",
        "--provider",
        "cpu",
        "--out",
        str(out),
        "--models-dir",
        str(tmp_path / "models"),
        "--prompt-tokens",
        "48",
        "--new-tokens",
        "24",
        "--repeats",
        "1",
        "--cost-repeats",
        "2",
        "--replay-limit",
        "1",
        "--threads",
        "1",
        "--label",
        "smoke",
    ]
    assert gpu.main(argv) == 0
    report = json.loads((out / "gpu-bench-smoke.json").read_text())
    assert report["machine"]["provider"] == "cpu" and report["machine"]["date_utc"]
    model = report["models"]["tiny-fp32-cpu"]
    assert model["build_s"] is not None and set(model["modes"]) == {"eager", "static"}
    for result in model["modes"].values():
        assert "error" not in result, result
        assert result["greedy"]["new_tokens"] == 24 and result["greedy"]["decode_tok_s"] > 0
        assert len(result["costs"]["curve"]) == gpu_measure.KMAX + 1 and result["costs"]["curve"][0] == 1.0
        assert result["identity"]["oracle_drafts_identical"] and result["identity"]["prompt_lookup_identical"]
        assert set(result["priced"]) == {"code_edit", "summarize", "qa_context", "open_ended"}
        assert result["step_us"]["greedy_pass"]["passes"] > 0 and result["step_us"]["verify9_pass"]["run"] > 0
    genai = model["ortgenai"]["cpu"]
    assert "skipped" in genai or genai["decode_tok_s"] > 0
    markdown = (out / "gpu-bench-smoke.md").read_text()
    assert "## tiny-fp32-cpu" in markdown and "## Targets" in markdown and "Speculation priced" in markdown
