"""The benchmark suite's quick mode runs end to end on a tiny model and writes its three result files; the sampled
column (ortspec and ORT GenAI sampling, plain and speculative, one seed per prompt) is exercised too."""

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
    from bench.engines import ORTSPEC_ENGINES, SAMPLED_ORTSPEC_ENGINES, prompt_seed
    from bench.suite import main

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
    assert n_prompts == 10  # 2 prompts in each of the 5 categories, the repetitive stream's included
    for engine in ORTSPEC_ENGINES[1:]:
        ident = result["identity"][engine]
        assert ident["compared"] == n_prompts
        assert ident["identical"] == n_prompts, result["mismatches"]
    ortspec_runs = [r for r in result["runs"] if r["engine"] in ORTSPEC_ENGINES]
    assert len(ortspec_runs) == n_prompts * len(ORTSPEC_ENGINES)
    assert all(r.get("error") is None and r["new_tokens"] > 0 for r in ortspec_runs)

    # sampled: speculative sampling equals plain sampling at the same seed on every prompt (not greedy's tokens),
    # every sampled run got its prompt's seed, and sampling did change the output somewhere
    sampling = result["sampling"]
    assert sampling["options"] == {"temperature": 0.7, "top_p": 0.9}
    assert len(sampling["seeds"]) == n_prompts
    assert all(seed == prompt_seed(w) for w, seed in sampling["seeds"].items())
    ident = result["identity"]["ortspec-lookup-adaptive-sampled"]
    assert ident["reference"] == "ortspec-sampled"
    assert ident["compared"] == n_prompts
    assert ident["identical"] == n_prompts, result["mismatches"]
    sampled_runs = [r for r in result["runs"] if r["engine"] in SAMPLED_ORTSPEC_ENGINES]
    assert len(sampled_runs) == n_prompts * len(SAMPLED_ORTSPEC_ENGINES)
    assert all(r.get("error") is None and r["new_tokens"] > 0 for r in sampled_runs)
    assert all(r["extra"]["seed"] == sampling["seeds"][r["workload"]] for r in sampled_runs)
    assert sum(r["proposed"] for r in sampled_runs if r["engine"] == "ortspec-lookup-adaptive-sampled") > 0
    greedy = {r["workload"]: r["token_ids"] for r in result["runs"] if r["engine"] == "ortspec-greedy"}
    plain = {r["workload"]: r["token_ids"] for r in result["runs"] if r["engine"] == "ortspec-sampled"}
    assert any(plain[w] != greedy[w] for w in greedy)
    ratio = result["summary"]["ratios"]["sampled_spec_vs_sampled_plain_e2e"]["ortspec-lookup-adaptive-sampled"]
    assert ratio["all"]["n"] == n_prompts
    assert [(t["category"], t["target_at_least"]) for t in sampling["targets"]] == [
        ("code_edit", 1.3),
        ("open_ended", 0.97),
        ("code_edit", 1.3),
    ]

    # missing peers are reported, not faked; the ones present ran on every prompt
    for name in ("ortgenai", "ortgenai-ngram", "onnx_genai", "ortgenai-sampled", "ortgenai-ngram-sampled"):
        runs = [r for r in result["runs"] if r["engine"] == name]
        assert (name in result["missing"]) != (len(runs) == n_prompts)
    # ORT GenAI's sampled n-gram is compared with its own plain sampling at the same seed (a fact, no target)
    if "ortgenai-ngram-sampled" not in result["missing"] and "ortgenai-sampled" not in result["missing"]:
        peer = result["identity"]["ortgenai-ngram-sampled"]
        assert peer["reference"] == "ortgenai-sampled" and peer["compared"] == n_prompts
        peer_runs = [
            r for r in result["runs"] if r["engine"].startswith("ortgenai") and r["engine"].endswith("sampled")
        ]
        assert all(r["extra"]["search_options"]["random_seed"] == sampling["seeds"][r["workload"]] for r in peer_runs)

    # the physical-limit context and the cost curve are there
    curve = result["cost_curve"]["curve"]
    assert len(curve) == 17 and curve[0] == 1.0
    assert result["physical"]["weights"]["bytes_per_step"] > 0
    assert set(result["overhead"]["engines"]) == {
        "ortspec-greedy",
        "ortspec-lookup-w8",
        "ortspec-sampled-all-filters",
        "ortspec-lookup-w8-sampled-all-filters",
    }
    assert result["overhead"]["engines"]["ortspec-sampled-all-filters"]["target_pct_of_decode_step"] == 2.0
    md = md_path.read_text(encoding="utf-8")
    for category in ("code_edit", "summarize", "qa_context", "open_ended", "repetitive"):
        assert f"## {category}" in md
    assert "## Sampled" in md and "sampled speculation ÷ plain sampling on code_edit" in md


def test_each_setting_drafts_from_its_own_suffix_cache_never_from_its_own_output():
    """``OrtspecEngine.cache_for``: a prompt's first run records into the setting's cache; a later run of the same
    prompt (``--repeat``, a retried group, the overhead runs) starts from what the first run saw, in a fork."""
    from bench.engines import OrtspecEngine

    setting = OrtspecEngine("ortspec-suffix", engine=None, make_proposer=None, draft_width=8, description={})
    other = OrtspecEngine("ortspec-auto", engine=None, make_proposer=None, draft_width=8, description={})
    assert setting.suffix_cache is not other.suffix_cache
    first = setting.cache_for([1, 2, 3])
    assert first is setting.suffix_cache
    first.add([1, 2, 3], [7, 8, 9])  # what the first run's finish records
    assert setting.cache_for([4, 5]) is setting.suffix_cache  # the next prompt drafts from it
    again = setting.cache_for([1, 2, 3])
    assert again is not setting.suffix_cache and again.tokens == 0  # not its own output
    again.add([1, 2, 3], [7, 8, 9])
    assert setting.suffix_cache.tokens == first.tokens == 3 + 3 + 1  # the fork recorded apart
