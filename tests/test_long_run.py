"""The short version of ``scripts/long_run.py`` (seconds): on a tiny model with a 3,072-token context, a
2,500-token generation (greedy and speculative) keeps its memory flat, and back-to-back generations leak nothing.
Speed over a long generation (wall time against raw greedy decoding's) is the script's to measure and bound (its
run uses 20,000 tokens and the 15% bound). A guard on the fake backend, in thread CPU time (not wall time), catches
per-step costs that grow with the history (a copy of the whole token history per step, a search of the whole
context)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from ortspec import Options, PromptLookup, generate
from ortspec.backends.fake import FakeBackend, FakeModel

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "long_run.py"


def _long_run():
    spec = importlib.util.spec_from_file_location("long_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def long_run():
    return _long_run()


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory, long_run):  # tiny_model_dir: skip where the builder is missing
    return long_run.long_context_model(2500, tmp_path_factory.mktemp("long") / "tiny-3072")


def test_a_long_generation_keeps_memory_flat_and_back_to_back_runs_leak_nothing(long_run, long_model):
    figures = long_run.measure(long_model, tokens=2500, generations=100, repeats=1, log=lambda m: None)
    for name in ("greedy", "speculative"):
        f = figures[name]
        assert f["rss_growth"] < long_run.MEMORY_TOLERANCE_MB, (name, f)
    back_to_back = figures["back_to_back"]
    (_, rss0, objects0, blocks0), (_, rss1, objects1, blocks1) = back_to_back["half"], back_to_back["end"]
    assert rss1 - rss0 < 1.0 and objects1 - objects0 <= 100 and blocks1 - blocks0 <= 100, back_to_back
    section = long_run.render(figures, "test")
    assert section.startswith(long_run.BEGIN) and section.endswith(long_run.END) and "growth vs greedy" in section


def _per_token_cpu_us(proposer, tokens: int) -> tuple[float, float]:
    backend = FakeBackend(FakeModel(vocab_size=384, seed=1), max_length=tokens + 8)
    marks: list[float] = []
    generate(backend, [5, 6, 7], Options(max_tokens=tokens, stop=("zzzzq",)), proposer, draft_width=4,
             callback=lambda *_: marks.append(time.thread_time()),
             detokenize=lambda ids: "".join(chr(97 + i % 26) for i in ids))  # fmt: skip
    return (marks[1001] - marks[1]) / 1000 * 1e6, (marks[-1] - marks[-1001]) / 1000 * 1e6


@pytest.mark.parametrize("proposer", [None, PromptLookup(ngram=3, max_draft=16)], ids=["greedy", "prompt-lookup"])
def test_driver_and_core_cost_per_token_does_not_grow_with_the_history(proposer):
    """20,000 tokens on the fake backend (whose own cost per pass is constant): the last thousand tokens cost
    about what the first thousand did (least of two runs; bound 2x for noise: a history copied every step made it
    7x, a byte search of the whole context 2.3x)."""
    runs = [_per_token_cpu_us(proposer, 20_000) for _ in range(2)]
    first, last = min(r[0] for r in runs), min(r[1] for r in runs)
    assert last < 2.0 * first, (first, last)
