"""Draft proposers: pure functions of a draft's context that guess the next tokens.

A proposer is any object with ``propose(context: DraftContext) -> tuple[int, ...] | DraftTree``, the one protocol
the driver calls: a chain of draft tokens, or a tree of candidate continuations that share prefixes
(``core/tree.py``), verified in one pass where the backend runs tree rows (elsewhere, its first branch is). The
context is one frozen value: the tokens (the prompt, then every committed token), the width (the most tokens a
chain, or a tree's depth, the step can use: the driver has capped it by the remaining token budget and context), a
tree's node budget, the price of a plain step in the pass the draft joins, the slot whose target state a draft head
reads, and the target's own seeded pick rule when the generation samples. A proposer may return fewer tokens, or
none; the driver cuts anything longer (a tree to its first ``tree_budget`` nodes, none deeper than ``width``) and
rejects ids outside the vocabulary, so a wrong guess costs speed, never correctness.

A proposer that learns from what the target accepted is a frozen value too (``Learner``): after each verified draft
the driver replaces it with ``observe(context, draft, accepted)``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from .checks import int_at_least
from .sampling import DraftPicker
from .tokens import Shared
from .tree import DraftTree

# The most draft tokens any built-in proposer drafts in one pass (prompt lookup's default, the width policies' cap).
MAX_DRAFT = 16


@attrs.frozen
class DraftContext:
    """What a proposer drafts after.

    ``tokens``: the prompt followed by every committed token (perhaps followed by tokens drafted in front of this
    proposer: see ``after``). ``width``: the most draft tokens the step can use (>= 1). ``plain_cost``: what one
    plain step costs in the pass the draft joins, relative to a plain step alone (1.0 alone; less in a batched
    pass: ``core.width.mean_row_cost``). ``slot``: the batch backend's slot
    whose target state is exactly that of ``tokens`` (the KV of every token but the last, and the hidden state that
    predicted the last), which a draft head reads; None when the target holds no state for these tokens (they run
    past what it processed), and a proposer that reads the target then drafts nothing. ``picker``: the target's own
    seeded pick rule (``core.sampling.DraftPicker``) when the generation samples, None when it is greedy; a proposer
    that drafts from a distribution of its own (a draft model) picks each draft token with it, so that its drafts
    are the tokens the target will pick where the two distributions are close. ``nodes``: the most nodes a tree draft
    may have, where the backend verifies trees (None where it does not: a tree is cut to its first branch, so a
    proposer need not grow one); a width policy grants more than ``width`` where the pass prices them
    (``core.width.TreeWidth``), and a tree proposer drafts its first branch ``width`` deep and the other branches in
    the rest (``tree_budget``). ``sequence``: which sequence the draft is for, stable for its
    whole generation (the batch slot it holds; None when the caller names none), kept by ``after``: what a proposer
    that keeps state of its own per sequence (a separate draft model's KV: ``backends/draft_model.py``) keys it
    on, where ``slot`` (the target's state) may be None. ``token_cost``: what each draft token costs where the pass
    runs a draft row beside the others (None: it runs as a pass of its own; ``core.width.pass_cost``)."""

    tokens: Sequence[int]
    width: int
    plain_cost: float = 1.0
    slot: int | None = None
    picker: DraftPicker | None = None
    nodes: int | None = None
    sequence: int | None = None
    token_cost: float | None = None

    @property
    def tree_budget(self) -> int:
        """The most nodes a tree draft may have: ``nodes``, or ``width`` when None (never less than ``width``)."""
        return self.width if self.nodes is None else max(self.nodes, self.width)

    def after(self, drafted: Sequence[int]) -> DraftContext:
        """The context of a proposer that drafts after ``drafted`` (tokens drafted in front of it, fewer than
        ``width``): the tokens with them appended, the width (and node budget) left, and no target state (the
        target has not processed them); ``sequence`` is kept."""
        n = len(drafted)
        nodes = None if self.nodes is None else self.nodes - n
        return attrs.evolve(self, tokens=(*self.tokens, *drafted), width=self.width - n, slot=None, nodes=nodes)


@runtime_checkable
class Proposer(Protocol):
    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """Up to ``context.width`` token ids that probably follow ``context.tokens``, or a ``DraftTree`` of up to
        ``context.tree_budget`` nodes, at most ``context.width`` deep, whose paths probably do."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A proposer whose choices learn from what the target accepted, as a frozen value (like a width policy):
    ``propose`` stays a pure function of the value and the context; after each step it was asked to draft for, the
    driver replaces the value with ``observe(context, draft, accepted)`` (the context it was asked with, the draft
    as verified, possibly empty, a chain or a tree, and how many of its tokens were committed)."""

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree: ...

    def observe(self, context: DraftContext, draft: Sequence[int] | DraftTree, accepted: int) -> Learner: ...


@attrs.frozen
class PromptLookup:
    """Prompt-lookup (n-gram) drafting: find the context's last ``n`` tokens earlier in the context and propose
    what followed them there.

    ``ngram`` is the longest suffix tried; shorter ones are tried down to ``min_ngram``. Among the earlier
    occurrences of a suffix the most recent wins. At most ``max_draft`` tokens (and at most ``width``) are
    proposed; the empty tuple means no match. The copy runs on past the end of the context the way an LZ77
    back-reference does (a match 2 tokens back proposes the 2-token period repeated), so runs and short cycles
    fill the whole width. With ``branches`` > 1 the continuations of that many most recent occurrences of the
    matched suffix, each up to ``width`` tokens, are drafted as one ``DraftTree`` (``DraftTree.merged``: the most
    recent first, at most ``context.tree_budget`` nodes), or as a chain when they agree; a backend that cannot
    verify trees verifies its first branch, the one-branch draft.

    Cost. A ``Shared`` context (what the driver passes; core/tokens.py) carries an index of its n-grams
    (``NgramIndex``, attached to the token history's storage and extended by each step's new tokens), so a call
    costs O(new tokens + log occurrences), whatever the length of the history. Any other sequence, or a context the
    index does not cover yet, is searched as bytes (``bytes.rfind``, in C), O(context) per call. The value holds
    no state: one ``PromptLookup`` serves any number of generations, in any threads.
    """

    ngram: int = attrs.field(default=3, validator=int_at_least(1))
    max_draft: int = attrs.field(default=8, validator=int_at_least(1))
    min_ngram: int = attrs.field(default=1, validator=int_at_least(1))
    branches: int = attrs.field(default=1, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed ngram ({self.ngram})")

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        if self.branches == 1:
            return self.match(context.tokens, context.width)[0]
        limit = min(context.width, self.max_draft)
        if limit < 1 or len(context.tokens) < 2:
            return ()
        starts = self.occurrences(context.tokens, self.branches)
        branches = [_copy_forward(context.tokens, start, limit) for start in starts]
        tree = DraftTree.merged(branches, context.tree_budget)
        return tree.tokens if tree.is_chain else tree

    def occurrences(self, context_tokens: Sequence[int], count: int) -> list[int]:
        """The positions right after the ``count`` most recent earlier occurrences (most recent first) of the
        longest context suffix, of ``ngram`` down to ``min_ngram`` tokens, that occurs earlier at all; [] when none
        does."""
        n_ctx = len(context_tokens)
        if isinstance(context_tokens, Shared):
            index = ngram_index(context_tokens, self.min_ngram, self.ngram)
            if index.covers(n_ctx):
                for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
                    found = index.recent_before(n, context_tokens[n_ctx - n :], n_ctx, count)
                    if found:
                        return found
                return []
        data = array("I", context_tokens).tobytes()
        for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
            hits = _recent_hits(data, n, count)
            if hits:
                return hits
        return []

    def match(self, context_tokens: Sequence[int], width: int) -> tuple[tuple[int, ...], int]:
        """``propose``'s draft after ``context_tokens`` (at most ``width`` tokens) and the length of the context
        suffix it matched (0 with no draft): what ``LookupOrDraft`` weighs against a drafter."""
        n_ctx = len(context_tokens)
        limit = min(width, self.max_draft)
        if limit < 1 or n_ctx < 2:
            return (), 0
        if isinstance(context_tokens, Shared):
            index = ngram_index(context_tokens, self.min_ngram, self.ngram)
            if index.covers(n_ctx):
                for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
                    after = index.last_before(n, context_tokens[n_ctx - n :], n_ctx)
                    if after is not None:
                        return _copy_forward(context_tokens, after, limit), n
                return (), 0
        # Search the context as bytes (4 per token): bytes.rfind runs in C. A hit must be token-aligned and must
        # end before the last token, so that at least one token follows it.
        data = array("I", context_tokens).tobytes()
        for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
            hits = _recent_hits(data, n, 1)
            if hits:
                return _copy_forward(context_tokens, hits[0], limit), n
        return (), 0


def ngram_index(tokens: Shared[int], shortest: int, longest: int) -> NgramIndex:
    """The index of ``tokens``' n-grams of ``shortest`` to ``longest`` tokens: derived from its storage (one per
    storage, head and lengths; ``Shared.derived``), so every proposer asking for the same lengths shares it and each
    step extends it by the new tokens only. It may cover more or fewer tokens than ``tokens`` holds: check
    ``covers``."""

    def build(head: tuple[int, ...], items: Sequence[int]) -> NgramIndex:
        index = NgramIndex(head, range(shortest, longest + 1))
        index.follow([], items)
        return index

    return tokens.derived(("ngrams", shortest, longest), build)


class NgramIndex:
    """Where each n-gram of a token history occurred: for each length, ``{n-gram: [the position right after each
    occurrence, ascending]}`` over the history ``head + items``. Append-only, so it answers for every prefix of the
    history it covers; it is derived data of a ``Shared`` storage (``Shared.derived``), written only by the
    storage's extender (``follow``)."""

    __slots__ = ("head", "tables", "covered", "_tail")

    def __init__(self, head: tuple[int, ...], lengths: range) -> None:
        self.head = head
        self.tables: dict[int, dict[int, list[int]]] = {n: {} for n in lengths}
        self.covered = 0  # n-grams ending before history position `covered` are indexed
        self._tail: list[int] = []  # the last indexed tokens (up to the longest n), for the next n-grams

    def covers(self, context_len: int) -> bool:
        """True when every n-gram that ends before the last of ``context_len`` tokens is indexed."""
        return self.covered >= context_len - 1

    def last_before(self, n: int, suffix: Sequence[int], context_len: int) -> int | None:
        """The position right after the most recent occurrence of ``suffix`` (``n`` tokens) that ends before the
        last of the first ``context_len`` history tokens; None when there is none."""
        recent = self.recent_before(n, suffix, context_len, 1)
        return recent[0] if recent else None

    def recent_before(self, n: int, suffix: Sequence[int], context_len: int, count: int) -> list[int]:
        """``last_before`` for the ``count`` most recent occurrences (fewer when there are fewer), most recent
        first."""
        positions = self.tables[n].get(_ngram_key(suffix))
        if not positions:
            return []
        end = bisect_right(positions, context_len - 1)
        return positions[max(end - count, 0) : end][::-1]

    def first_between(self, n: int, ngram: Sequence[int], lo: int, hi: int) -> int | None:
        """The position right after the first occurrence of ``ngram`` (``n`` tokens) whose position right after
        it lies in ``[lo, hi]``; None when there is none (or the range is empty)."""
        positions = self.tables[n].get(_ngram_key(ngram))
        if not positions or lo > hi:
            return None
        at = bisect_left(positions, lo)
        return positions[at] if at < len(positions) and positions[at] <= hi else None

    def follow(self, items: Sequence[int], new: Sequence[int]) -> None:
        """Index the n-grams that end in the history ``head + items + new`` at or after ``covered``."""
        h = len(self.head)
        if self.covered < h:
            self._add([*self.head[self.covered :], *items, *new])
        else:
            self._add([*items[self.covered - h :], *new])

    def _add(self, tokens: Sequence[int]) -> None:
        """Index the n-grams ending at each of ``tokens``, the history's tokens from position ``covered`` on."""
        longest = max(self.tables)
        tail = self._tail
        for token in tokens:
            tail.append(int(token))
            if len(tail) > longest:
                del tail[0]
            self.covered += 1  # the n-grams ending at position covered - 1: the next token is at `covered`
            for n, table in self.tables.items():
                if len(tail) >= n:
                    table.setdefault(_ngram_key(tail[-n:]), []).append(self.covered)


def _ngram_key(ids: Sequence[int]) -> int:
    """One int for a run of ids (each < 2**32), as a dict key smaller than a tuple."""
    key = 0
    for t in ids:
        key = (key << 32) | int(t)
    return key


def _recent_hits(data: bytes, n: int, count: int) -> list[int]:
    """Search a context as bytes (4 per token; ``bytes.rfind`` runs in C) for its last ``n`` tokens earlier in it:
    the positions right after the ``count`` most recent token-aligned hits that end before the last token (so at
    least one token follows each), most recent first."""
    needle, end = data[-4 * n :], len(data) - 4
    found: list[int] = []
    while len(found) < count and (at := data.rfind(needle, 0, end)) >= 0:
        if at % 4 == 0:
            found.append(at // 4 + n)
        end = at + 4 * n - 1
    return found


def _copy_forward(context: Sequence[int], first: int, count: int) -> tuple[int, ...]:
    """``count`` tokens copied from ``context[first:]``, continuing into the copied tokens themselves."""
    n_ctx = len(context)
    out = list(context[first : first + count])
    period = n_ctx - first
    while len(out) < count:
        out.append(out[len(out) - period])
    return tuple(out)
