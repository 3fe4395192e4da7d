"""The benchmarks of bench/ that need the real model import, parse their command lines and name their result files
under docs/bench/; ``bench.suffix replay``, which needs no model, runs on a small recorded stream."""

from __future__ import annotations

import importlib
import json
import random

import pytest

MODULES = {
    "bench.batch_pass_cost": [],
    "bench.concurrent_streams": [],
    "bench.structured_outputs": [],
    "bench.quantization": ["settings"],
    "bench.suffix": ["stream"],
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_help_names_the_default_result_file(name, capsys):
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        module.main([*MODULES[name], "--help"])
    assert exit_.value.code == 0
    assert "docs/bench/" in capsys.readouterr().out


def test_suffix_replay_counts_passes_and_writes_its_report(tmp_path, capsys):
    from bench import suffix

    rng = random.Random(0)
    shared = [rng.randrange(100, 400) for _ in range(40)]  # every answer starts the same: later ones draft it
    prompts = [[rng.randrange(100, 400) for _ in range(20)] for _ in range(3)]
    outputs = [shared + [rng.randrange(100, 400) for _ in range(5)] for _ in range(3)]
    streams = tmp_path / "streams.json"
    streams.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
    out = tmp_path / "replay.md"
    assert suffix.main(["replay", "--streams", str(streams), "--context", "200", "--out", str(out)]) == 0
    report = out.read_text()
    assert report == capsys.readouterr().out.rstrip("\n") + "\n"
    first_table = report.split("At a", 1)[0]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in first_table.splitlines()}
    ours = rows["ortspec suffix (default rule: factor 2)"]
    ceiling = next(cells for label, cells in rows.items() if label.startswith("ceiling"))
    tokens = sum(map(len, outputs))
    # the cache lets the second and third answers copy the shared start: fewer passes than tokens
    assert int(ceiling[1]) <= int(ours[1]) < tokens
    assert "At a 200-token context" in report


def test_llamacpp_is_reported_missing_or_refuses_a_folder_that_is_not_its_model(tiny_model_dir):
    """The llama.cpp peer is optional: without ``llama-cpp-python`` it is missing, with the reason; with it, a folder
    whose vocabulary is not the GGUF's (the tiny model's) is refused, not run."""
    from bench.peers import make_peer

    runner, why = make_peer("llamacpp", tiny_model_dir, threads=1)
    assert runner is None
    assert "llama_cpp is not importable" in why or "is not this folder's model" in why, why
