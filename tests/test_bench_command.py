"""``python -m bench``, the one command behind the README's numbers: its quick mode runs every step end to end on
tiny models (the n-gram grid on the tuning split, the suite and the slots benchmark on the evaluation split, the
README's tables written into a copy), and the grid chooses the setting with the best geometric mean."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ngram_grid

ROOT = Path(__file__).resolve().parent.parent


def _run(setting: str, category: str, tok_s: float) -> dict:
    return {"setting": setting, "category": category, "tok_s": tok_s}


def test_the_grid_chooses_the_best_geometric_mean_over_categories() -> None:
    runs = [
        _run("greedy", "a", 10.0),
        _run("greedy", "b", 10.0),
        # the fastest on one category, slow on the other: loses to the even one
        _run("ngram 2, draft 4", "a", 40.0),
        _run("ngram 2, draft 4", "b", 2.0),
        _run("ngram 3, draft 8", "a", 15.0),
        _run("ngram 3, draft 8", "a", 13.0),
        _run("ngram 3, draft 8", "a", 14.0),
        _run("ngram 3, draft 8", "b", 12.0),
    ]
    summary = ngram_grid.summarize(runs, ("a", "b"))
    assert summary["best"] == "ngram 3, draft 8"
    row = summary["table"]["ngram 3, draft 8"]
    assert row["median_tok_s"] == {"a": 14.0, "b": 12.0}
    assert row["geomean_tok_s"] == pytest.approx((14.0 * 12.0) ** 0.5)
    assert row["vs_greedy"] == pytest.approx(row["geomean_tok_s"] / 10.0)


def _builder_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "onnx", "onnxruntime_genai"))


@pytest.mark.skipif(not _builder_available(), reason="the tiny models need torch, transformers, onnx and ORT GenAI")
def test_the_quick_command_runs_every_step_and_touches_nothing_in_the_repository() -> None:
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    done = subprocess.run([sys.executable, "-m", "bench", "--quick"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    for step in ("bench.ngram_grid", "bench.suite", "bench.slots", "readme_numbers.py"):
        assert step in done.stderr
    assert "--split evaluation" in done.stderr and "--ngram " in done.stderr
    assert "wrote the numbers of" in done.stdout
    after = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before


def test_an_unknown_step_is_refused_by_name(capsys) -> None:
    from bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["--steps", "suite,plots"])
    assert "plots" in capsys.readouterr().err


def test_the_grid_results_name_the_chosen_setting(tmp_path) -> None:
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"best": {"setting": "ngram 4, draft 16", "ngram_size": 4, "max_draft_tokens": 16}}))
    assert ngram_grid.best_setting(path) == (4, 16)
