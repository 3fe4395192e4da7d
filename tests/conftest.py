"""Shared fixtures: a tiny random-weight model folder (same layout as the real one) and the real SmolLM2 folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _builder_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "onnx", "onnxruntime_genai"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with GQA, built by the onnxruntime-genai builder, with a small BPE tokenizer."""
    if not _builder_available():
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    from ortspec.adapters.convert import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-shared") / "tiny-fp32")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct fp32, converted on first use into the ortspec cache (about a minute), then reused."""
    from ortspec.adapters.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir("fp32")
    if not is_complete(folder):
        if not _builder_available():
            pytest.skip("converting the real model needs the convert extra: pip install 'ortspec[convert]'")
        convert_smollm2(folder, "fp32")
    return folder


@pytest.fixture(scope="session")
def real_engine(real_model_dir):
    from ortspec.adapters.engine import Engine

    return Engine.from_dir(real_model_dir, threads=2)


class GreedyReplay:
    """A proposer that drafts a known greedy continuation: ``prompt + greedy`` is the whole sequence, and at any
    context that is a prefix of it, the next ``width`` tokens of it are proposed (every one correct), except that
    with ``wrong_every = n`` each n-th drafted position gets a wrong id (partial acceptance). It makes a random tiny
    model speculate, which prompt lookup on its text rarely does."""

    def __init__(self, prompt, greedy, vocab_size, wrong_every=0):
        self.sequence = [*prompt, *greedy]
        self.vocab_size, self.wrong_every = vocab_size, wrong_every

    def propose(self, context, width):
        n = len(context)
        if list(context) != self.sequence[:n]:
            return ()
        draft = self.sequence[n : n + width]
        if self.wrong_every:
            draft = [(t + 1) % self.vocab_size if (n + i) % self.wrong_every == 0 else t for i, t in enumerate(draft)]
        return tuple(draft)
