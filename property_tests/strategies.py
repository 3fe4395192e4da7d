"""Hypothesis strategies aimed at the places where speculative decoding goes wrong.

A scenario first decides how the generation should end (EOS, a stop sequence, a stop string, the token budget,
the context limit, or nothing in particular) and at which token, reads the model's true continuation (plain
decoding under the scenario's pick rules: greedy, greedy with penalties and biases, or seeded sampling) and
plants that rule at that token, so most generations end where a draft block is in flight. Proposers range from an
oracle (every draft accepted) through a noisy oracle (a correct prefix, then garbage) and prompt lookup to
arbitrary tokens. Vocabularies run from 2 ids to thousands, widths to 32, detokenizers are byte-level (multi-byte
characters split across tokens) or SentencePiece-like (non-concatenative), and the picks path of a device
backend is used as often as the logits path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np
from hypothesis import strategies as st

from ortspec.backends.fake import FakeModel
from ortspec.core import AdditiveWidth, CostAwareWidth, Options, PromptLookup, Sampling
from ortspec.core.width import FixedWidth, TreeBudget
from property_tests.reference import PickRules, PlainDecoder, ReferenceError, plain_continuation
from tests.support.grammars import FakeGrammar

# Byte-level pieces: ASCII words and the bytes of 2-, 3- and 4-byte characters (é, €, 中, 𝄞), alone and glued to
# ASCII, so text arrives in partial characters and stop strings span tokens.
BYTE_PIECES: tuple[bytes, ...] = (
    b"a", b"b", b" ", b"ab", b"ba", b"\xe2", b"\x82", b"\xac", b"E", b"N", b"D", b"\n", b"xy", b"z", b"", b"END",
    b"\xc3", b"\xa9", b"\xe4\xb8", b"\xad", b"\xf0\x9d", b"\x84\x9e", b"a\xc3", b"\xa9b", b"\xe2\x82\xac",
    b"stop", b"s", b"to", b"p ", b".", b"\xf0", b"\x9d\x84\x9e",
)  # fmt: skip
# SentencePiece-like pieces: "▁" is a space, and the text of a sequence drops its leading space.
SP_PIECES: tuple[str, ...] = (
    "▁a", "b", "▁", "▁ab", "c", "é", "▁€", "中", "▁stop", "s", "top", "▁END", "x", "", "▁▁", ".", "\n", "▁z",
)  # fmt: skip


def byte_detokenize(ids: Sequence[int]) -> str:
    return b"".join(BYTE_PIECES[i % len(BYTE_PIECES)] for i in ids).decode("utf-8", errors="replace")


def sentencepiece_detokenize(ids: Sequence[int]) -> str:
    text = "".join(SP_PIECES[i % len(SP_PIECES)] for i in ids).replace("▁", " ")
    return text[1:] if text.startswith(" ") else text


@functools.lru_cache(maxsize=1024, typed=True)  # typed: (0, 1) and (0.0, 1.0) are different strategies
def _sampled(*values):
    """``st.sampled_from(values)``, built once per tuple of values: a strategy built afresh at every draw is
    validated afresh too, which cost the suite more than its own work (the draws are the same)."""
    return st.sampled_from(values)


@functools.lru_cache(maxsize=4096)
def _integers(low: int, high: int):
    """``st.integers(low, high)``, built once per bounds (as ``_sampled``)."""
    return st.integers(low, high)


@functools.lru_cache(maxsize=4096)
def _built(factory, *args):
    """``factory(*args)`` (a strategy of this module), built once per arguments (as ``_sampled``)."""
    return factory(*args)


DETOKENIZERS = {"bytes": byte_detokenize, "sentencepiece": sentencepiece_detokenize}
END_KINDS = ("stop_string", "stop_sequence", "context", "max_tokens", "eos", "free")


@st.composite
def fake_models(draw, nonfinite: bool = False) -> FakeModel:
    size = draw(_sampled("small", "small", "small", "hundreds", "thousands"))
    vocab = draw({"small": _integers(2, 48), "hundreds": _integers(200, 600), "thousands": _integers(1000, 5000)}[size])
    eos_id = draw(st.one_of(st.none(), _integers(0, vocab - 1)))
    return FakeModel(
        vocab_size=vocab,
        seed=draw(_integers(0, 2**32 - 1)),
        markov=draw(_sampled(0.0, 0.5, 2.0, 6.0, 6.0)),
        noise=draw(_sampled(0.05, 0.5, 1.0)),
        tie_rate=draw(_sampled(0.0, 0.0, 0.2, 0.6)),
        near_tie_gap=draw(_sampled(0.0, 1e-6, 1e-3, 0.1)),
        eos_id=eos_id,
        eos_rate=draw(_sampled(0.0, 0.0, 0.02, 0.1)) if eos_id is not None else 0.0,
        nonfinite_rate=draw(_sampled(0.0, 0.0, 0.0, 0.03)) if nonfinite else 0.0,
    )


@st.composite
def prompts(draw, vocab: int) -> tuple[int, ...]:
    ids = _integers(0, vocab - 1)
    if draw(st.booleans()):  # repetitive: a motif repeated, so prompt lookup has something to find
        motif = draw(st.lists(ids, min_size=1, max_size=6))
        reps = draw(_integers(1, 6))
        tail = draw(st.lists(ids, max_size=4))
        return tuple(motif * reps + tail)
    return tuple(draw(st.lists(ids, min_size=1, max_size=30)))


@st.composite
def fake_grammars(draw, vocab: int, eos: frozenset[int]) -> FakeGrammar:
    """Up to 6 states; each allows no token, one (a forced token), a few, or many, each to a drawn state; never an
    EOS id (a grammar's tokens are text)."""
    n = draw(st.integers(1, 6))
    ids = [t for t in range(vocab) if t not in eos]
    token = st.sampled_from(ids) if ids else st.nothing()
    transitions = []
    for _ in range(n):
        kind = draw(st.sampled_from(["few", "few", "one", "one", "many", "none"]))
        if kind == "none" or not ids:
            tokens: list[int] = []
        elif kind == "one":
            tokens = [draw(token)]
        elif kind == "few":
            tokens = draw(st.lists(token, min_size=1, max_size=min(len(ids), 5), unique=True))
        else:
            many = min(len(ids), 8)
            tokens = ids if len(ids) <= 64 else draw(st.lists(token, min_size=many, max_size=64, unique=True))
        transitions.append(tuple(sorted((t, draw(st.integers(0, n - 1))) for t in tokens)))
    accepting = frozenset(s for s in range(n) if not transitions[s] or draw(st.integers(0, 3)) == 0)
    return FakeGrammar(vocab, tuple(transitions), accepting)


@attrs.frozen
class Scenario:
    model: FakeModel
    prompt: tuple[int, ...]
    options: Options
    detokenizer: str | None  # a key of DETOKENIZERS, or None for no text
    capacity: int
    planned_end: str  # one of END_KINDS: the rule planted at token `planned_at`
    planned_at: int
    rules: PickRules = PickRules()

    @property
    def detokenize(self):
        return DETOKENIZERS[self.detokenizer] if self.detokenizer else None


def _token_spans(ids: Sequence[int], detokenize) -> list[tuple[int, int]]:
    """For each token, the (start, end) of the text it completes, by prefix decoding."""
    spans, prev = [], 0
    for n in range(1, len(ids) + 1):
        text = detokenize(ids[:n])
        if text.endswith("\ufffd") and n < len(ids):
            spans.append((prev, prev))
            continue
        spans.append((prev, len(text)))
        prev = len(text)
    return spans


@st.composite
def pick_rules(draw, vocab: int, mode: str) -> PickRules:
    """Greedy (``mode="greedy"``: mostly plain, sometimes with penalties and biases) or seeded sampling with any
    filters and penalties (``mode="sampling"``)."""

    def penalties_and_bias() -> dict:
        bias = draw(st.lists(st.tuples(_integers(0, vocab - 1), _sampled(-100.0, -2.0, 1.5, 5.0)),
                             max_size=3))  # fmt: skip
        return dict(
            repetition_penalty=draw(_sampled(1.0, 1.0, 1.3, 0.8, 2.0)),
            presence_penalty=draw(_sampled(0.0, 0.0, 0.5, -0.5)),
            frequency_penalty=draw(_sampled(0.0, 0.0, 0.3, 1.0)),
            logit_bias=tuple(sorted(dict(bias).items())),
        )

    if mode == "greedy":
        return PickRules() if draw(_integers(0, 3)) < 3 else PickRules(**penalties_and_bias())
    return PickRules(
        temperature=draw(st.one_of(_sampled(0.7, 1.0, 0.3, 1.5, 2.0), st.floats(0.01, 2.0))),
        top_k=draw(_sampled(0, 0, 1, 2, 5, 20)),
        top_p=draw(_sampled(1.0, 1.0, 0.9, 0.5, 0.1)),
        min_p=draw(_sampled(0.0, 0.0, 0.05, 0.3)),
        seed=draw(_integers(0, 2**64 - 1)),
        **(penalties_and_bias() if draw(st.booleans()) else {}),
    )


@st.composite
def scenarios(
    draw,
    end: str | None = None,
    nonfinite: bool = False,
    mode: str | None = None,
    model: FakeModel | None = None,
    prompt: tuple[int, ...] | None = None,
    max_new: tuple[int, int] | None = None,
) -> Scenario:
    """A model, a prompt and options with one rule planted at a drawn token: ``end`` (one of ``END_KINDS``), or
    a kind drawn evenly when None; pick rules of ``mode`` ("greedy" or "sampling"; drawn when None). ``model``:
    this model instead of a drawn one (several requests to one model); ``prompt``: this prompt instead of a drawn
    one (e.g. the next turn of an earlier request); ``max_new``: the token budget's bounds instead of the drawn
    ones (the rule is planted within it, and only that much of the continuation is decoded)."""
    model = model if model is not None else draw(_built(fake_models, nonfinite))
    prompt = prompt if prompt is not None else draw(_built(prompts, model.vocab_size))
    # Hypothesis favours the first option and small integers; they are chosen so that its simplest examples
    # still reach deep into a generation (a medium budget, a rule planted late, a wide oracle draft).
    budgets = _sampled((9, 48), (49, 80), (9, 48), (1, 8)) if max_new is None else st.just(max_new)
    max_new = draw(budgets.flatmap(lambda r: _integers(*r)))
    if mode is None:
        mode = draw(_sampled("greedy", "sampling"))
    rules = draw(_built(pick_rules, model.vocab_size, mode))
    try:
        continuation = plain_continuation(model.after, prompt, max_new, rules)
    except ReferenceError:  # a non-finite row: plant rules on the model's argmax chain instead
        continuation = model.greedy(prompt, max_new)
    if end is None:  # an even spread (sampled_from would favour the first kind heavily)
        end = END_KINDS[draw(_integers(0, 2**20)) % len(END_KINDS)]
    # The token at which the planted rule fires: mostly late, so that a draft block is in flight.
    if draw(_integers(0, 5)) < 5:
        at = max(0, max_new - 2 - draw(_integers(0, max(0, max_new - 5))))
    else:
        at = draw(_integers(0, max_new - 1))
    detokenizer = draw(_sampled(None, "bytes", "bytes", "sentencepiece"))
    if end == "stop_string" and detokenizer is None:
        detokenizer = "bytes"
    detokenize = DETOKENIZERS[detokenizer] if detokenizer else None

    eos: set[int] = set()
    stop_sequences: list[tuple[int, ...]] = []
    stop_strings: list[str] = []
    max_context = None
    capacity = 4096
    if end == "eos":
        # A token whose first occurrence is at or after `at` (else the first one), so EOS fires late.
        late = [t for t in dict.fromkeys(continuation) if continuation.index(t) >= at]
        eos.add(draw(st.sampled_from(late)) if late else continuation[at])
    elif end == "stop_sequence":
        # The shortest n-gram ending at `at` that does not occur earlier.
        for n in range(min(draw(_integers(1, 3)), at + 1), at + 2):
            seq = tuple(continuation[at + 1 - n : at + 1])
            if all(tuple(continuation[i : i + n]) != seq for i in range(at + 1 - n)):
                break
        stop_sequences.append(seq)
    elif end == "stop_string":
        text = detokenize(continuation)
        spans = _token_spans(continuation, detokenize)
        last = spans[at][1] if spans[at][1] > 0 else len(text)
        if last > 0:
            # The shortest substring (from a drawn length up) ending at `last` whose first occurrence ends there.
            for length in range(draw(_integers(1, min(16, last))), last + 1):
                if text.find(text[last - length : last]) == last - length:
                    break
            stop_strings.append(text[last - length : last])
            # Half the time a second stop string, listed after the first, that ends one character earlier in the
            # text of the same token: the earliest completion must win, not the first listed.
            first_char = spans[at][0]
            if last - 1 > first_char and draw(st.booleans()):
                end2 = last - 1
                for length2 in range(draw(_integers(1, min(8, end2))), end2 + 1):
                    if text.find(text[end2 - length2 : end2]) == end2 - length2:
                        stop_strings.append(text[end2 - length2 : end2])
                        break
    elif end == "max_tokens":
        max_new = at + 1
    elif end == "context":
        limit = len(prompt) + at + 1
        how = draw(_sampled("max_context", "capacity", "both"))
        if how in ("max_context", "both"):
            max_context = limit
        if how in ("capacity", "both"):
            capacity = limit + (draw(_integers(0, 3)) if how == "both" else 0)
    # Unplanned rules now and then, so that rules also compete.
    if draw(_integers(0, 4)) == 4:
        eos.update(draw(st.lists(_integers(0, model.vocab_size - 1), max_size=2)))
    if model.eos_id is not None and draw(_integers(0, 3)) == 3:
        eos.add(model.eos_id)
    if detokenize is not None and draw(_integers(0, 4)) == 4:
        stop_strings.append(draw(_sampled("END", "stop", "€", "a b", "\n", "中", "zz", "b.")))
    if draw(_integers(0, 5)) == 5:
        stop_sequences.append(tuple(draw(st.lists(_integers(0, model.vocab_size - 1), min_size=1, max_size=2))))
    options = Options(
        max_tokens=max_new,
        eos_token_ids=eos,
        stop=[*stop_sequences, *stop_strings],
        max_context=max_context,
        top_logprobs=draw(_sampled(0, 0, 0, 1, 3)),
        tie_margin=draw(_sampled(0.0, 0.0, 0.0, 0.0, 1e-5, 1e-2, 0.3)),
        sampling=rules_as_sampling(rules),
    )
    return Scenario(model, prompt, options, detokenizer, capacity, end, at, rules)


def rules_as_sampling(rules: PickRules) -> Sampling:
    """The core's ``Sampling`` for ``rules``."""
    return Sampling(
        temperature=rules.temperature, top_k=rules.top_k, top_p=rules.top_p, min_p=rules.min_p, seed=rules.seed,
        repetition_penalty=rules.repetition_penalty, presence_penalty=rules.presence_penalty,
        frequency_penalty=rules.frequency_penalty, logit_bias=rules.logit_bias,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Proposers


@attrs.frozen
class OracleProposer:
    """Drafts the true continuation under the pick rules (every draft token is accepted unless a rule stops
    first, or the continuation meets a non-finite row, where it stops drafting)."""

    model: FakeModel
    rules: PickRules = PickRules()
    prompt_len: int = 0  # the generated tokens' index (the sampler's position) counts from here
    # The continuation decoded so far: [the context it starts after, its PlainDecoder, stopped at a non-finite row].
    # A generation's contexts walk along it, so each token is decoded once, not once per proposal.
    _path: list = attrs.field(factory=lambda: [(), None, False], eq=False, repr=False)

    def continuation(self, context, n):
        context = tuple(context)
        base, decoder, stopped = self._path
        walked = context[len(base) :]
        if decoder is None or context[: len(base)] != base or tuple(decoder.tokens[: len(walked)]) != walked:
            base, decoder, stopped = context, PlainDecoder(self.model.after, context[: self.prompt_len], self.rules,
                                                           context[self.prompt_len :]), False  # fmt: skip
            walked = ()
        while not stopped and len(decoder.tokens) < len(walked) + n:
            try:
                decoder.next()
            except ReferenceError:  # a non-finite row: the tokens before it
                stopped = True
        self._path[:] = [base, decoder, stopped]
        return decoder.tokens[len(walked) : len(walked) + n]

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        return tuple(self.continuation(context, width))


@attrs.frozen
class NoisyOracleProposer:
    """Half the time the true continuation, else a correct prefix of a length that depends on the context
    followed by arbitrary tokens: full and partial acceptance."""

    oracle: OracleProposer
    seed: int

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        rng = np.random.default_rng([self.seed, len(context), int(context[-1])])
        good = width if rng.integers(0, 2) else int(rng.integers(0, width + 1))
        tail = rng.integers(0, self.oracle.model.vocab_size, size=width - good).tolist()
        return self.oracle.continuation(context, good) + tail


@attrs.frozen
class AdversarialProposer:
    """Arbitrary in-vocabulary tokens, a deterministic function of the context, sometimes more than the width
    (the driver truncates), as a list or a numpy array."""

    model: FakeModel
    seed: int
    overshoot: int

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        rng = np.random.default_rng([self.seed, len(context), int(context[-1])])
        n = int(rng.integers(0, width + self.overshoot + 1))
        tokens = rng.integers(0, self.model.vocab_size, size=n)
        return tokens if n % 2 else tokens.tolist()


class EmptyProposer:
    def propose(self, draft_context):
        return ()


@st.composite
def proposers_for(draw, model: FakeModel, rules: PickRules | None = None, prompt_len: int = 0):
    rules = rules if rules is not None else PickRules()
    kind = draw(_sampled(*["oracle"] * 8, *["noisy"] * 3, *["lookup"] * 2, "adversarial", "empty"))
    if kind == "lookup":
        ngram = draw(_integers(1, 5))
        return PromptLookup(ngram=ngram, max_draft=draw(_integers(1, 32)), min_ngram=draw(_integers(1, ngram)))
    if kind == "oracle":
        return OracleProposer(model, rules, prompt_len)
    if kind == "noisy":
        return NoisyOracleProposer(OracleProposer(model, rules, prompt_len), draw(_integers(0, 2**31)))
    if kind == "adversarial":
        return AdversarialProposer(model, draw(_integers(0, 2**31)), draw(_integers(0, 5)))
    return EmptyProposer()


@attrs.frozen
class FaultyProposer:
    """A proposer that goes wrong at its ``at``-th call: it raises, or returns ids that are not a draft."""

    model: FakeModel
    at: int
    fault: str  # "raise", "out_of_range", "negative", "not_int"
    calls: list = attrs.field(factory=list, eq=False)

    def propose(self, draft_context):
        context, width = draft_context.tokens, draft_context.width
        self.calls.append(len(context))
        if len(self.calls) <= self.at:
            return tuple(self.model.greedy(context, width))
        if self.fault == "raise":
            raise RuntimeError("the drafter crashed")
        bad = {"out_of_range": self.model.vocab_size, "negative": -1, "not_int": 1.5}[self.fault]
        return (bad,)


@functools.cache
def width_policies():
    """A fixed width up to 32, the cost-aware policy with an arbitrary cost curve, or the +2/-1 schedule; the first
    two sometimes with a tree budget (``TreeBudget``) that grants trees nodes beyond their width."""
    costs = st.lists(st.floats(0.5, 4.0), min_size=1, max_size=32).map(lambda c: (1.0, *c))
    trees = st.one_of(
        st.none(),
        st.builds(
            TreeBudget,
            pass_costs=costs,
            max_branches=_integers(1, 5),
            decay=st.floats(0.0, 1.0),
            branch_tokens=st.floats(0.0, 8.0),
            probe_every=_integers(1, 10),
        ),
    )
    cost_aware = st.builds(
        CostAwareWidth,
        pass_costs=costs,
        decay=st.floats(0.0, 1.0),
        probe_every=_integers(1, 10),
        probe_width=_integers(1, 4),
        draft_cost=st.floats(0.0, 2.0),
        tree=trees,
        read_cost=st.floats(0.0, 1.0),
        unread=_integers(0, 2000),
    )
    fixed = st.builds(FixedWidth, _integers(1, 32), tree=trees)
    additive = st.builds(
        AdditiveWidth,
        current=_integers(1, 6),
        maximum=_integers(6, 32),
        grow=_integers(0, 3),
        shrink=_integers(0, 3),
    )
    kind = _sampled("medium", "wide", "narrow", "medium", "cost-aware", "additive", "fixed")
    return kind.flatmap(
        lambda k: {"medium": _integers(4, 12), "wide": _integers(1, 32), "narrow": _integers(1, 3),
                   "cost-aware": cost_aware, "additive": additive, "fixed": fixed}[k]
    )  # fmt: skip
