"""``python -m bench.cost_growth --quick`` runs end to end on a tiny model and writes its JSON and markdown: a row
for every batch size, context and prompt of the quick plan (the context at the model's length measured one below
it, and said so), each with both ceilings and a fraction of the lower one in (0, 1.5]; and the model's FLOPs and
bytes follow from its shapes."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="the tiny model builder needs the convert extra",
)
def test_quick_cost_growth_writes_every_row_with_its_ceilings(tmp_path):
    from bench.cost_growth import QUICK, QUICK_CONTEXT, main

    out = tmp_path / "cost-growth.json"
    assert main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    contexts = [min(c, QUICK_CONTEXT - 1) for c in QUICK.contexts]
    assert [r["batch"] for r in report["batch"]] == list(QUICK.batches)
    assert [r["context"] for r in report["context"]] == contexts
    assert [r["prompt"] for r in report["prefill"]] == list(QUICK.prompts)
    assert report["notes"] == [f"context {QUICK_CONTEXT} measured at {QUICK_CONTEXT - 1}: the model's length is 512"]
    for row in (*report["batch"], *report["context"], *report["prefill"]):
        assert row["pass_ms"] > 0 and row["compute_ceiling_tok_s"] > 0 and row["memory_ceiling_tok_s"] > 0
        assert 0 < row["fraction"] <= 1.5, row
        lower = min(row["compute_ceiling_tok_s"], row["memory_ceiling_tok_s"])
        assert row["fraction"] == pytest.approx(row["tokens_per_s"] / lower, rel=1e-2)
    assert all(r["peak_rss_mib"] > 0 for r in report["batch"])
    for key in ("machine", "date_utc", "commit", "versions", "load", "memory_bandwidth", "flop_rate"):
        assert report[key], key
    assert set(report["load"]) >= {"before_cores", "during", "after_cores", "disturbed"}
    text = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "## Batch size" in text and "## Context" in text and "## Prefill" in text
    assert f"| {QUICK_CONTEXT - 1} |" in text and "Limits: context 512 measured at 511" in text


def test_flops_and_bytes_of_a_pass_follow_the_models_shapes():
    from bench.cost_growth import Ceilings, ModelCost

    cost = ModelCost(body_flops=100, head_flops=10, weight_bytes=1000, attention_width=2, layers=3, kv_values=4,
                     shape=(8, 16))  # fmt: skip
    # one token after 5 positions attends to 6: 4 x 6 x width 2 x 3 layers
    assert cost.pass_flops(1, 1, 5, 1) == 100 + 10 + 4 * 6 * 2 * 3
    # a prompt of 3 at 0, the LM head on its last position: positions attend to 1, 2, 3
    assert cost.pass_flops(1, 3, 0, 1) == 3 * 100 + 10 + 4 * 6 * 2 * 3
    assert cost.pass_flops(2, 1, 5, 1) == 2 * cost.pass_flops(1, 1, 5, 1)
    assert cost.pass_bytes(2, 5, 4) == 1000 + 2 * 5 * 4 * 4
    # the rate at M rows is the best at M or fewer: a dip at 4 is the test's noise
    ceilings = Ceilings(cost, {"1": 1.0, "2": 3.0, "4": 0.5}, bandwidth_gb_s=1.0)
    assert ceilings.rate(1) == 1.0 and ceilings.rate(4) == 3.0
    row = ceilings.annotate({"tokens_per_s": 1e6}, rows=1, tokens=1, context=5, head_rows=1, kv_itemsize=4)
    assert row["bound"] == "memory" and row["memory_ceiling_tok_s"] == pytest.approx(1e9 / (1000 + 5 * 4 * 4))
