"""Hypothesis strategies: fake models, prompts, options, proposers and detokenizers."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
from hypothesis import strategies as st

from ortspec.backends.fake import FakeModel
from ortspec.core import AdditiveWidth, CostAwareWidth, Options, PromptLookup

# Token i decodes to PIECES[i % len(PIECES)]: ASCII words and the three bytes of U+20AC, so that text arrives in
# partial characters and stop strings can span tokens.
PIECES: tuple[bytes, ...] = (
    b"a",
    b"b",
    b" ",
    b"ab",
    b"ba",
    b"\xe2",
    b"\x82",
    b"\xac",
    b"E",
    b"N",
    b"D",
    b"\n",
    b"xy",
    b"z",
    b"",
    b"END",
)


def detokenize(ids: Sequence[int]) -> str:
    return b"".join(PIECES[i % len(PIECES)] for i in ids).decode("utf-8", errors="replace")


@st.composite
def fake_models(draw) -> FakeModel:
    vocab = draw(st.integers(2, 48))
    eos_id = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    return FakeModel(
        vocab_size=vocab,
        seed=draw(st.integers(0, 2**32 - 1)),
        markov=draw(st.sampled_from([0.0, 0.5, 2.0, 6.0])),
        noise=draw(st.sampled_from([0.05, 0.5, 1.0])),
        tie_rate=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6])),
        near_tie_gap=draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.1])),
        eos_id=eos_id,
        eos_rate=draw(st.sampled_from([0.0, 0.0, 0.02, 0.1])) if eos_id is not None else 0.0,
    )


@st.composite
def prompts(draw, vocab: int) -> tuple[int, ...]:
    ids = st.integers(0, vocab - 1)
    if draw(st.booleans()):  # repetitive: a motif repeated, so prompt lookup has something to find
        motif = draw(st.lists(ids, min_size=1, max_size=6))
        reps = draw(st.integers(1, 6))
        tail = draw(st.lists(ids, max_size=4))
        return tuple(motif * reps + tail)
    return tuple(draw(st.lists(ids, min_size=1, max_size=30)))


def _slices(seq: Sequence, max_len: int):
    """A strategy for a non-empty contiguous slice of ``seq`` of at most ``max_len`` items."""
    n = len(seq)
    return st.integers(0, n - 1).flatmap(
        lambda i: st.integers(i + 1, min(n, i + max_len)).map(lambda j: tuple(seq[i:j]))
    )


@st.composite
def options_for(draw, model: FakeModel, prompt: tuple[int, ...]) -> tuple[Options, bool]:
    """Options whose stop rules are drawn from the true greedy continuation, so they fire (often mid-block)."""
    max_new = draw(st.one_of(st.integers(1, 8), st.integers(9, 70)))
    continuation = model.greedy(prompt, max_new)
    text = detokenize(continuation)
    eos: set[int] = set()
    if draw(st.booleans()):
        eos = set(draw(st.lists(st.integers(0, model.vocab_size - 1), max_size=2)))
    if model.eos_id is not None and draw(st.booleans()):
        eos.add(model.eos_id)
    stop_sequences = []
    if draw(st.booleans()):
        stop_sequences = draw(st.lists(_slices(continuation, 3), max_size=2))
    stop_strings: list[str] = []
    if draw(st.booleans()) and text:
        stop_strings = [s for s in draw(st.lists(_slices(text, 4), max_size=3)) if "".join(s)]
        stop_strings = ["".join(s) for s in stop_strings]
    max_context = None
    if draw(st.booleans()):
        max_context = len(prompt) + draw(st.integers(0, max_new + 2))
    use_text = bool(stop_strings) or draw(st.booleans())
    options = Options(
        max_new_tokens=max_new,
        eos_token_ids=eos,
        stop_token_sequences=stop_sequences,
        stop_strings=stop_strings,
        max_context=max_context,
        top_logprobs=draw(st.sampled_from([0, 0, 1, 3])),
        tie_margin=draw(st.sampled_from([0.0, 0.0, 1e-5, 1e-2, 0.3])),
    )
    return options, use_text


@attrs.frozen
class OracleProposer:
    """Drafts the model's true greedy continuation (every draft token is accepted unless a rule stops first)."""

    model: FakeModel

    def propose(self, context, width):
        return tuple(self.model.greedy(context, width))


@attrs.frozen
class AdversarialProposer:
    """Drafts arbitrary in-vocabulary tokens, a deterministic function of the context, sometimes too many, and
    sometimes a correct prefix followed by garbage."""

    model: FakeModel
    seed: int
    overshoot: int

    def propose(self, context, width):
        rng = np.random.default_rng([self.seed, len(context), int(context[-1])])
        n = int(rng.integers(0, width + self.overshoot + 1))
        good = int(rng.integers(0, n + 1))
        head = self.model.greedy(context, good) if good else []
        tail = rng.integers(0, self.model.vocab_size, size=n - good).tolist()
        return list(head + tail)  # a list, not a tuple: the driver must accept any sequence


class EmptyProposer:
    def propose(self, context, width):
        return ()


@st.composite
def proposers_for(draw, model: FakeModel):
    kind = draw(st.sampled_from(["lookup", "lookup", "oracle", "adversarial", "empty"]))
    if kind == "lookup":
        ngram = draw(st.integers(1, 5))
        return PromptLookup(ngram=ngram, max_draft=draw(st.integers(1, 12)), min_ngram=draw(st.integers(1, ngram)))
    if kind == "oracle":
        return OracleProposer(model)
    if kind == "adversarial":
        return AdversarialProposer(model, draw(st.integers(0, 2**31)), draw(st.integers(0, 5)))
    return EmptyProposer()


def width_policies():
    """A fixed width, the cost-aware policy with an arbitrary cost curve, or the +2/-1 schedule."""
    costs = st.lists(st.floats(0.5, 4.0), min_size=1, max_size=12).map(lambda c: (1.0, *c))
    cost_aware = st.builds(
        CostAwareWidth,
        pass_costs=costs,
        decay=st.floats(0.0, 1.0),
        probe_every=st.integers(1, 10),
        probe_width=st.integers(1, 4),
    )
    additive = st.builds(
        AdditiveWidth,
        current=st.integers(1, 6),
        maximum=st.integers(6, 12),
        grow=st.integers(0, 3),
        shrink=st.integers(0, 3),
    )
    return st.one_of(st.integers(1, 12), st.integers(1, 12), cost_aware, additive)
