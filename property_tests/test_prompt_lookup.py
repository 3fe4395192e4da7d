"""PromptLookup against a reference written from its docstring: longest suffix first, the most recent earlier
occurrence, the copy running on past the end of the context (LZ77-style). Ids run to 2**24 so that the byte
search's token alignment is exercised (an id's bytes can match across two neighbouring ids)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec.core import DraftContext, PromptLookup
from property_tests.conftest import examples


def lookup_reference(context: list[int], width: int, ngram: int, max_draft: int, min_ngram: int) -> tuple[int, ...]:
    limit = min(width, max_draft)
    if limit < 1 or len(context) < 2:
        return ()
    for n in range(min(ngram, len(context) - 1), min_ngram - 1, -1):
        suffix = context[-n:]
        # The most recent occurrence that ends before the last token (so that at least one token follows it).
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                first, out = start + n, []
                while len(out) < limit:
                    i = first + len(out)
                    out.append(context[i] if i < len(context) else out[i - len(context)])
                return tuple(out)
    return ()


# Ids whose bytes overlap: 0x01010101, 0x00000101, ... make misaligned byte matches likely.
BYTEY_IDS = [0, 1, 0x0101, 0x010101, 0x01010101, 0x0100, 0x010000, 0x01000000, 0x00FF00FF, 0xFF00, 255, 256]


@st.composite
def contexts(draw) -> list[int]:
    alphabet = draw(st.sampled_from(["bytey", "small", "wide"]))
    ids = {"bytey": st.sampled_from(BYTEY_IDS), "small": st.integers(0, 5), "wide": st.integers(0, 2**24)}[alphabet]
    if draw(st.booleans()):
        motif = draw(st.lists(ids, min_size=1, max_size=5))
        return draw(st.lists(ids, max_size=6)) + motif * draw(st.integers(1, 5)) + draw(st.lists(ids, max_size=3))
    return draw(st.lists(ids, max_size=40))


@settings(max_examples=examples(1500))
@given(contexts(), st.integers(0, 40), st.integers(1, 6), st.integers(1, 32), st.data())
def test_prompt_lookup_equals_its_reference(context, width, ngram, max_draft, data):
    min_ngram = data.draw(st.integers(1, ngram), label="min_ngram")
    proposer = PromptLookup(ngram=ngram, max_draft=max_draft, min_ngram=min_ngram)
    want = lookup_reference(context, width, ngram, max_draft, min_ngram)
    assert proposer.propose(DraftContext(context, width)) == want


@settings(max_examples=examples(600))
@given(contexts(), st.lists(st.tuples(st.integers(0, 12), st.lists(st.sampled_from(BYTEY_IDS + [2, 3]), max_size=6))),
       st.integers(1, 6), st.integers(1, 16))  # fmt: skip
def test_prompt_lookup_on_growing_shared_contexts_equals_its_reference(prompt, moves, ngram, width):
    """The driver passes ``Shared`` contexts that grow step by step (and the same proposer sees other generations
    and older values extended again): the bytes it keeps between calls never change what it proposes."""
    from ortspec.core.tokens import Shared

    proposer = PromptLookup(ngram=ngram, max_draft=16)
    head = tuple(prompt)
    values = [Shared[int]()]
    for back, tokens in moves:
        # extend the newest value, or an older one (a branch: its storage is copied), then look up from it
        base = values[max(0, len(values) - 1 - back)]
        grown = base.extended(tokens)
        values.append(grown)
        for value in (grown, base):
            context = value.with_head(head)
            assert context == head + tuple(value)
            want = lookup_reference(list(context), width, ngram, 16, 1)
            assert proposer.propose(DraftContext(context, width)) == want
    other = Shared([5, 5, 5]).with_head((5, 5))  # another generation: new storage and head
    assert proposer.propose(DraftContext(other, width)) == lookup_reference([5] * 5, width, ngram, 16, 1)
