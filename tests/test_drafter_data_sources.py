"""The drafter's training prompts share no source text with the benchmark's prompts, either split: a drafter
measured by ``bench`` is never measured on text it was trained on."""

from __future__ import annotations

import itertools
import re

from bench.workloads import CATEGORIES, build_workloads
from ortspec.adapters.tools.drafter_data import grounded_texts, training_prompts

_SENTENCE = re.compile(r"(?<=[.!?:])\s+")


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _sentences(text: str, shortest: int = 60) -> set[str]:
    return {s for s in (_normalised(p) for p in _SENTENCE.split(text)) if len(s) >= shortest}


def test_no_training_sentence_is_in_a_benchmark_prompt():
    # both splits of every category, more prompts than any benchmark run takes
    benchmark = _normalised(
        "\n".join(m["content"] for w in build_workloads(24, categories=CATEGORIES) for m in w.messages)
    )
    training = set().union(*(_sentences(text) for _, text in itertools.islice(training_prompts(0), 4000)))
    assert len(training) > 500  # the grounded prompts are there to check
    shared = sorted(s for s in training if s in benchmark)
    assert not shared, f"{len(shared)} training sentences are benchmark text, e.g. {shared[:3]}"


def test_grounded_texts_are_paragraphs_of_english():
    texts = grounded_texts()
    assert len(texts) > 100 and all(len(t) > 200 for t in texts)
    assert texts == grounded_texts()  # the same on every run
