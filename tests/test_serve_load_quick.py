"""``python -m bench.serve_load``: its quick mode end to end on the tiny model (a real server subprocess, the default
configuration), and its pieces on synthetic outcomes (the configuration table, options, summaries, ratios against
the baseline, the markdown)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from bench.serve_load import SERVER_CONFIGS, default_configs, parse_args  # noqa: E402
from bench.serve_load_report import (  # noqa: E402
    Outcome,
    Prompt,
    batch_histogram_means,
    failures,
    markdown,
    ratios,
    summarize_load,
)


def test_quick_run_checks_every_stream_on_every_configuration(tiny_model_dir, tmp_path):
    """Concurrent streams equal to their references, an overload served or refused with 429 + Retry-After and
    nothing else, the next turn of a conversation reusing the first's KV, results written."""
    from bench.serve_load import main

    assert main(["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve_load.json").read_text())
    configs = default_configs()
    assert [s["config"] for s in result["servers"]] == configs
    assert [(r["config"], r["concurrency"]) for r in result["load"]] == [(c, 4) for c in configs]
    for row in result["load"]:
        assert row["errors"] == 0 and row["text_equals_reference"] == f"{row['requests']}/{row['requests']}"
        assert row["peak_rss_mib"] >= row["rss_after_mib"] > 0 and row["server_cpu_s"] >= 0
    over = result["overload"]  # how many are refused depends on how fast the tiny model serves the first ones
    assert over["refused_429"] == over["refused_429_with_retry_after"] and over["other_errors"] == 0
    assert over["served"] + over["refused_429"] == over["requests"] == over["capacity"] + 4
    assert over["served"] >= over["capacity"] // 2
    assert all(r["second_turn_cached_tokens"] > 0 for r in result["prefix_reuse"]["conversations"])
    assert "# `ortspec serve` under load" in (tmp_path / "serve_load.md").read_text()


def test_configuration_table_and_options():
    assert SERVER_CONFIGS["batched"].cli_args(cores=2) == ["--max-batch", "16", "--threads", "2"]
    assert list(SERVER_CONFIGS) == ["batched", "batched-unbudgeted", "ray", "ray-2"]  # the worker design is retired
    assert default_configs() == ["batched"]
    assert SERVER_CONFIGS["batched-unbudgeted"].cli_args(2)[-2:] == ["--prefill-budget", "none"]
    assert SERVER_CONFIGS["ray"].cli_args(2)[:3] == ["--ray", "--replicas", "1"]
    assert parse_args(["--configs", "batched,ray"]).baseline == "batched"
    assert parse_args(["--configs", "ray", "--baseline", "ray"]).baseline == "ray"

    args = parse_args(["--concurrency", "64,16,32"])
    assert args.concurrency == [16, 32, 64] and args.max_queue == 64 and args.configs == ["batched"]
    quick = parse_args(["--quick", "--requests", "2", "--max-prompt-tokens=1000"])
    assert quick.concurrency == [4] and quick.requests == 2 and quick.configs == ["batched"] and quick.max_queue == 4
    assert quick.max_prompt_tokens == 1000 and quick.conversation_tokens == 120  # given wins, even as the default
    for argv in (["--max-queue", "8"], ["--configs", "x"], ["--configs", "workers"], ["--baseline", "x"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def _outcomes(times: list[list[float]], text: str = "ab") -> list[Outcome]:
    """One completed stream per list of chunk times (seconds after a start at 0), each chunk one token."""
    return [
        Outcome("p", text=text, finish="stop", start=0.0, first=t[0], chunk_times=t, completion_tokens=len(t))
        for t in times
    ]


def _result(rows: list[dict]) -> dict:
    result = {
        "command": "python -m bench.serve_load",
        "machine": {"date_utc": "d", "cpu": "c", "cores": {"usable": 2}, "memory_gib": 1, "python": "py"}
        | {"background_load_cores": 0, "versions": {}},
        "settings": {"model": "m", "ttft_target": 0.2, "concurrency": [16], "requests": 1},
        "servers": [
            {"config": "batched", "command": ["ortspec", "serve"], "slots": 16, "max_queue": 16}
            | {"ready_s": 1.0, "ready_rss_mib": 100.0}
        ],
        "in_process_baseline": {"threads": 2, "completion_tokens": 2, "seconds": 1, "tokens_per_s": 2}
        | {"other_processes_cores": 0},
        "prompts": [{"name": "p", "prompt_tokens": 5, "max_tokens": 2}],
        "conversation_sources": ["textwrap.py"],
        "prefix_reuse": {"config": "batched", "median_ratio": 0.1, "conversations": []}
        | {"cpu": {"server_cores": 1, "client_cores": 0, "other_cores": 0}},
        "load": rows,
        "peak_rss_scope": "phase",
        "ratios": ratios(rows),
        "overload": {"config": "batched", "capacity": 32, "requests": 48, "served": 32, "refused_429": 16}
        | {"refused_429_with_retry_after": 16, "other_errors": 0, "served_text_consistent_with_reference": "32/32"}
        | {"cpu": {"server_cores": 1, "client_cores": 0, "other_cores": 0}},
    }
    result["failures"] = failures(result)
    result["passed"] = not result["failures"]
    return result


def test_summaries_ratios_and_markdown():
    prompts = {"p": Prompt("p", [], 2, 5, reference="ab", reference_finish="stop")}
    extra = {"peak_rss_mib": 200.0, "rss_after_mib": 150.0, "server_cpu_s": 3.0, "batch_histogram_means": {}}
    extra["cpu"] = {"server_cores": 1.5, "client_cores": 0.1, "other_cores": 0.2}
    batched = {"config": "batched", "concurrency": 16} | extra
    batched |= summarize_load(_outcomes([[0.1, 0.2], [0.1, 0.3]]), 1.0, prompts)
    batched["batch_histogram_means"] = batch_histogram_means(
        {"ortspec_batch_rows_sum": 10.0, "ortspec_batch_rows_count": 2.0},
        {"ortspec_batch_rows_sum": 50.0, "ortspec_batch_rows_count": 7.0, "ortspec_target_passes_total": 9.0},
    )
    assert batched["batch_histogram_means"] == {"ortspec_batch_rows": 8.0}
    ray = {"config": "ray", "concurrency": 16} | extra
    ray |= summarize_load(_outcomes([[0.4, 0.5]], text="ab") + _outcomes([[0.6, 0.9]], text="x"), 4.0, prompts)
    assert (batched["tokens_per_s"], ray["tokens_per_s"]) == (4.0, 1.0)
    assert (batched["ttft_ms_p50"], ray["ttft_ms_p50"]) == (100.0, 500.0)
    assert ray["text_equals_reference"] == "1/2" and ray["mismatched_prompts"] == ["p"]

    assert ratios([batched, ray]) == [
        {"config": "ray", "baseline": "batched", "concurrency": 16, "tokens_per_s": 0.25, "ttft_p50": 5.0}
        | {"peak_rss": 1.0}  # the same synthetic memory on both rows
    ]
    result = _result([batched, ray])
    assert result["failures"] == ["text differs from the reference for ['p'], ray at 16 clients"]
    text = markdown(result)
    assert "| ray ÷ batched | 16 | 0.25 | 5.0 | 1.0 |" in text and "batch_rows 8.0" in text
    assert "| ray | 16 | 2 | 0 | 1/2 |" in text and "Verdict: FAIL" in text

    alone = _result([batched])
    assert "No ratios" in markdown(alone) and alone["passed"]
