"""``python -m bench.slots``: the dataset's two splits, and the report it writes from its runs (the runs themselves
are the benchmark's, measured on the quiet machine; here they are made up)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import slots
from bench.throughput_columns import ColumnRun
from bench.throughput_dataset import load_dataset, split


def test_the_splits_halve_every_kind_and_share_no_request_or_source() -> None:
    dataset = load_dataset()
    tuning, evaluation = split(dataset, "tuning"), split(dataset, "evaluation")
    assert len(tuning) + len(evaluation) == len(dataset) and len(tuning) == len(evaluation)
    assert not {q.id for q in tuning} & {q.id for q in evaluation}
    for kind in {q.kind for q in dataset}:
        assert sum(q.kind == kind for q in tuning) == sum(q.kind == kind for q in evaluation)
    raw = json.loads((Path(__file__).resolve().parents[1] / "bench/data/throughput-prompts.json").read_text())
    source = {r["id"]: r["source"] for r in raw["records"]}
    assert not {source[q.id] for q in tuning} & {source[q.id] for q in evaluation}


def _run(column: str, seconds: float, outputs: dict[str, list[int]]) -> ColumnRun:
    return ColumnRun(column, "greedy", seconds, sum(len(v) for v in outputs.values()), outputs)


def test_the_report_gives_medians_spreads_ratios_and_whether_every_output_agreed(tmp_path) -> None:
    same = {"a": [1, 2], "b": [3, 4]}
    runs = [
        _run("ortspec 8 slots", 2.0, same),
        _run("ORT GenAI batched, batch 8", 4.0, same),
        _run("ortspec 8 slots", 1.0, same),
        _run("ORT GenAI batched, batch 8", 2.0, {"a": [1, 2], "b": [3, 5]}),
        _run("ortspec 8 slots", 4.0, same),
        _run("ORT GenAI batched, batch 8", 1.0, same),
    ]

    def measure(args, requests, tmp):
        assert len(requests) == 32 and args.sizes == [8] and args.repeats == 3
        return {"model_dir": "m", "runs": runs, "missing": {}, "prompt_tokens": 10, "new_tokens": 4}

    out = tmp_path / "slots.md"
    assert slots.main(["--sizes", "8", "--out", str(out)], measure_fn=measure) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {row["column"]: row for row in data["summary"]}
    assert rows["ortspec 8 slots"]["median"] == 2.0 and rows["ortspec 8 slots"]["min"] == 1.0
    assert rows["ortspec 8 slots"]["max"] == 4.0 and rows["ortspec 8 slots"]["vs_best_genai"] == 1.0
    assert data["identity"]["ortspec_identical"] and data["identity"]["genai_equal"] == 5
    assert data["split"] == "tuning" and "| ortspec 8 slots | 3 | 2.0 | 1.0–4.0 | 1.00x |" in out.read_text()

    runs.append(_run("ortspec 16 slots", 1.0, {"a": [1, 2], "b": [9]}))
    assert slots.main(["--sizes", "8", "--out", str(out)], measure_fn=measure) == 1  # an output differs
    assert "**NO**" in out.read_text()


def test_the_batch_commands_seconds_are_split_from_its_summary_line() -> None:
    from bench.throughput_columns import job_times

    line = (
        "ortspec batch: 32 records written (0 errors), 0 already done; 3107 tokens in 50.0 s: 0.64 records/s, "
        "62.1 tok/s (embedded, 1 x 2 threads, 16 slots each, model load and warm-up 4.0 s)"
    )
    assert job_times("noise\n" + line + "\n") == {"job_s": 50.0, "load_s": 4.0}
    runs = [
        ColumnRun("ortspec batch", "greedy", seconds, 10, {}, {"job_s": seconds - 3.0, "load_s": 4.0})
        for seconds in (60.0, 58.0, 62.0)
    ]
    text = "\n".join(slots._job_lines(runs))
    assert "process start 3.0 s, model load and warm-up 4.0 s, the records 53.0 s" in text
    assert slots._job_lines([_run("ortspec batch", 1.0, {})]) == []
