"""Suffix drafting (``speculative="suffix"``): the longest match of the context's tail, in the request's own context
and in a snapshot of earlier requests' outputs, continued by the path that most often followed it.

The idea is SuffixDecoding's (a suffix structure over what was seen; the draft follows the most frequent
continuation; its length adapts to how long the match is and how sure the continuation is). The structure here is
not a tree: each source is a token sequence with an n-gram index (``proposers.NgramIndex``, which grows by each new
token only), and a match is found from the occurrences of the context's last few tokens:

    anchor     the longest n-gram (``anchor`` tokens down to 1) ending the context that occurred before: its
               ``occurrences`` most recent occurrences are the candidates
    match      each candidate's match length m: how many tokens before it equal the context's tail (up to
               ``max_match``)
    level L    for each distinct m (longest first, up to ``levels`` of them), the occurrences matching at least L
               tokens: those of the context's last L tokens among the candidates
    path       from those occurrences, token by token: the token that followed most of the live ones (ties: the most
               recent); p *= its count / live count; the occurrences that disagree die; stop when p < ``min_prob``,
               at ``floor(spec_factor * L)`` tokens, at ``max_draft`` or at the width
    score      the sum of p over the path's tokens (the expected number of accepted tokens if p were exact)

The draft is the best-scoring path over every level of both sources (the context, then the snapshot; ties go to
the longer match), except after an edit:

    resync     when the context's own best match is shorter than ``resync_match`` tokens, the text may be a copy that
               an edit interrupted (an identifier renamed, a line changed, as a code edit writes). For d = 1 to
               ``resync_back``: the context up to d tokens from its end matched at least ``resync_match`` tokens
               ending at an earlier position q (its most recent such occurrence among the ``occurrences`` latest of
               its last ``anchor`` tokens); the first one found aligns the copy at q. The draft is what follows the
               first occurrence of the context's last tokens (``anchor`` down to 1) at or after q, up to
               ``resync_reach`` tokens past q + d: the copy resumes after the edit. Its match length is the aligned
               one, its probabilities 1. Only the context is resynced (a snapshot's documents are not). What it
               changes, measured: ``docs/bench/suffix-resync.md``.

A context candidate may continue past the context's end into the draft itself (a repeat of a period, as
``PromptLookup`` does); a snapshot candidate stops at the end of its document.

``SuffixSnapshot`` is the across-request part: documents (recent outputs, each after the last tokens of its prompt)
in one ``Shared`` corpus, each followed by ``SEPARATOR``; adding one is O(its length) (the corpus and its index
grow in place) and gives a new value, the old one unchanged: a request drafts from the snapshot it started with,
whatever is added later. Past ``max_tokens`` the oldest documents go, down to ``keep`` of the cap, in one rebuild.

Everything here is pure: the drafts are a function of the value, the snapshot and the context. Whatever they are,
the core verifies every draft token, so the output never depends on them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from .checks import int_at_least, number_in
from .proposers import MAX_DRAFT, DraftContext, NgramIndex, ngram_index
from .tokens import Shared
from .tree import DraftTree

# Ends each document of a snapshot's corpus: no context holds it (ids are below the vocabulary size, < 2**32 - 1),
# so no match crosses it, and no draft contains it.
SEPARATOR = 0xFFFF_FFFF


@attrs.frozen
class DraftRule:
    """How long a match is looked for and how far a draft follows it (the module docstring's rule): ``anchor``, the
    longest n-gram looked up for candidates; ``occurrences``, the most recent candidates per source; ``max_match``,
    the longest match measured (tokens); ``levels``, the match lengths tried per source; ``spec_factor``, a draft
    holds at most floor(spec_factor x match length) tokens; ``min_prob``, the path stops when its probability drops
    below it; ``max_draft``, the most tokens of any draft; ``resync_back`` (0: never), ``resync_match`` and
    ``resync_reach``: the resync after an edit (the module docstring); ``branches``, the most continuations a tree
    draft holds where the context grants one (``SuffixProposer.propose``; 1: always a chain)."""

    anchor: int = attrs.field(default=3, validator=int_at_least(1))
    occurrences: int = attrs.field(default=32, validator=int_at_least(1))
    max_match: int = attrs.field(default=32, validator=int_at_least(1))
    levels: int = attrs.field(default=4, validator=int_at_least(1))
    spec_factor: float = attrs.field(default=2.0, validator=number_in(0, MAX_DRAFT, low_open=True))
    min_prob: float = attrs.field(default=0.1, validator=number_in(0, 1))
    max_draft: int = attrs.field(default=MAX_DRAFT, validator=int_at_least(1))
    resync_back: int = attrs.field(default=8, validator=int_at_least(0))
    resync_match: int = attrs.field(default=6, validator=int_at_least(1))
    resync_reach: int = attrs.field(default=32, validator=int_at_least(0))
    branches: int = attrs.field(default=1, validator=int_at_least(1))


@attrs.frozen
class Scored:
    """A candidate draft: its tokens, its score (the sum of its path probabilities) and its match length; and where
    it came from: ``occurrences``, the positions (most recent first) right after the matches of the context's tail
    that its source holds (every anchored one: the matches it follows and the shorter ones), in the context
    (``in_context``) or in the snapshot's corpus."""

    draft: tuple[int, ...]
    score: float
    matched: int
    occurrences: tuple[int, ...] = ()
    in_context: bool = True

    def beats(self, other: Scored) -> bool:
        return (self.score, self.matched) > (other.score, other.matched)


NO_DRAFT = Scored((), 0.0, 0)


@attrs.frozen(eq=False)
class SuffixSnapshot:
    """Recent documents (token ids, oldest first) as one corpus, each followed by ``SEPARATOR``: an immutable value.

    ``corpus`` is a ``Shared`` view, so ``with_document`` appends in place when this is the newest value and other
    values keep seeing exactly what they held. ``starts``: where each document begins in the corpus. ``max_tokens``:
    the cap on the corpus (separators included); ``keep``: the fraction of it kept when the cap is passed (the
    oldest documents go, and the corpus is rebuilt once: O(what is kept), amortized over ``(1 - keep) *
    max_tokens`` added tokens). A document longer than the kept size keeps its last tokens. Compared by identity
    (comparing corpora would cost their length).
    """

    max_tokens: int = attrs.field(default=65536, validator=int_at_least(2))
    keep: float = attrs.field(default=0.75, validator=number_in(0, 1))
    anchor: int = attrs.field(default=3, validator=int_at_least(1))  # the n-gram lengths indexed: 1..anchor
    corpus: Shared[int] = attrs.field(factory=Shared)
    starts: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        self.index()  # built now, by whoever makes the value, not by the first request that drafts from it

    def index(self) -> NgramIndex:
        """The corpus's n-gram index (covers at least the corpus)."""
        return ngram_index(self.corpus, 1, self.anchor)

    @property
    def documents(self) -> int:
        return len(self.starts)

    def __len__(self) -> int:
        return len(self.corpus)

    def with_document(self, tokens: Iterable[int]) -> SuffixSnapshot:
        """This snapshot with ``tokens`` added as its newest document (ids must be < ``SEPARATOR``); over the cap,
        without the oldest documents."""
        doc = [int(t) for t in tokens]
        if not doc:
            return self
        kept_size = max(int(self.max_tokens * self.keep), 2)
        doc = doc[-(kept_size - 1) :]
        if len(self.corpus) + len(doc) + 1 <= self.max_tokens:
            starts = (*self.starts, len(self.corpus))
            return attrs.evolve(self, corpus=self.corpus.extended([*doc, SEPARATOR]), starts=starts)
        budget = kept_size - len(doc) - 1
        first = next((i for i, s in enumerate(self.starts) if len(self.corpus) - s <= budget), len(self.starts))
        cut = self.starts[first] if first < len(self.starts) else len(self.corpus)
        kept = [*self.corpus[cut:], *doc, SEPARATOR]
        starts = (*(s - cut for s in self.starts[first:]), len(self.corpus) - cut)
        return attrs.evolve(self, corpus=Shared(kept), starts=starts)


@attrs.frozen
class SuffixProposer:
    """``speculative="suffix"``'s proposer: the best path of the context's own suffix matches and of ``cache``'s (a
    request's snapshot of earlier outputs; None: the context alone), by ``rule`` (the module docstring). Stateless
    and pure: one value serves a request from start to end, in any thread.

    Cost per call: O(anchor + levels * occurrences * (max_match + max_draft)) token comparisons per source, whatever
    the context's length, plus the index's O(1) per new token (it lives in the token history, ``Shared.derived``,
    shared with ``PromptLookup``'s when the lengths agree). A context that is not a ``Shared`` sequence is indexed
    from scratch on each call (O(context)).
    """

    rule: DraftRule = DraftRule()
    cache: SuffixSnapshot | None = None

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """The best path (``scored``); where the context grants more nodes than it holds (``DraftContext.nodes``,
        set where the backend verifies trees) and the rule allows ``branches`` > 1, a ``DraftTree`` of it and the
        other continuations of the matches it follows (each up to ``width`` tokens, the most frequent first, then
        the most recent; ``DraftTree.merged``), or the chain when they agree."""
        return self.branched(context, self.scored(context.tokens, context.width))

    def branched(self, context: DraftContext, best: Scored) -> tuple[int, ...] | DraftTree:
        """``propose``'s answer from ``best``, this proposer's ``scored(context.tokens, context.width)``."""
        budget = context.tree_budget
        if context.nodes is None or self.rule.branches == 1 or budget <= len(best.draft) or len(best.occurrences) < 2:
            return best.draft
        tokens, end, context_end = self._source(context.tokens, best.in_context)
        continuations: dict[tuple[int, ...], int] = {}
        for p in best.occurrences:
            branch: list[int] = []
            while (
                len(branch) < context.width
                and (t := _token_at(tokens, p + len(branch), end, branch, context_end)) is not None
            ):
                branch.append(t)
            if branch:
                continuations[tuple(branch)] = continuations.get(tuple(branch), 0) + 1
        ranked = sorted(continuations, key=lambda c: -continuations[c])[: self.rule.branches - 1]  # stable: recency
        tree = DraftTree.merged([best.draft, *ranked], budget)
        return tree.tokens if tree.is_chain else tree

    def _source(self, context_tokens: Sequence[int], in_context: bool) -> tuple[Sequence[int], int, int | None]:
        """``(tokens, end, context_end)`` of a source for ``_token_at``: the context's, or the snapshot corpus's."""
        if in_context or self.cache is None:
            n_ctx = len(context_tokens)
            return _Context.of(context_tokens, self.rule.anchor).tokens, n_ctx, n_ctx
        return _corpus_tokens(self.cache.corpus), len(self.cache), None

    def match(self, context_tokens: Sequence[int], width: int) -> tuple[tuple[int, ...], int]:
        """``propose``'s draft after ``context_tokens`` (at most ``width`` tokens) and the length of the match it
        follows (0 with no draft): what ``LookupOrDraft`` reads of a lookup."""
        best = self.scored(context_tokens, width)
        return best.draft, best.matched

    def scored(self, context_tokens: Sequence[int], width: int) -> Scored:
        """The best-scoring draft of both sources (``NO_DRAFT`` when neither has one)."""
        limit = min(width, self.rule.max_draft)
        n_ctx = len(context_tokens)
        if limit < 1 or n_ctx < 1:
            return NO_DRAFT
        context = _Context.of(context_tokens, self.rule.anchor)
        tail = context.tail(min(self.rule.max_match, n_ctx))
        best = _best(context.tokens, context.index, n_ctx, tail, limit, self.rule, context_end=n_ctx)
        if best.matched < self.rule.resync_match:
            resynced = _resynced(context.tokens, context.index, n_ctx, limit, self.rule)
            if resynced.draft:
                best = resynced
        cache = self.cache
        if cache is not None and len(cache) and cache.anchor >= self.rule.anchor:
            corpus_tokens = _corpus_tokens(cache.corpus)
            found = _best(corpus_tokens, cache.index(), len(cache), tail, limit, self.rule, context_end=None)
            if found.beats(best):
                best = found
        return best


@attrs.frozen
class _Context:
    """A context as a flat token list whose first ``end`` tokens are the context (O(1) for a ``Shared`` without a
    head: its storage, which a longer value may have extended; a copy otherwise) and its index."""

    tokens: Sequence[int]
    end: int
    index: NgramIndex

    @classmethod
    def of(cls, context: Sequence[int], anchor: int) -> _Context:
        n = len(context)
        if isinstance(context, Shared):
            index = ngram_index(context, 1, anchor)
            if index.covers(n):
                head, items, _ = context.parts()
                return cls(items if not head else [*head, *items[: n - len(head)]], n, index)
        tokens = list(context)
        index = NgramIndex((), range(1, anchor + 1))
        index.follow([], tokens)
        return cls(tokens, n, index)

    def tail(self, length: int) -> list[int]:
        """The context's last ``length`` tokens, last first."""
        tokens, end = self.tokens, self.end
        return [tokens[end - 1 - i] for i in range(length)]


def _corpus_tokens(corpus: Shared[int]) -> Sequence[int]:
    head, items, _ = corpus.parts()
    return items if not head else [*head, *items]


def _best(
    tokens: Sequence[int],
    index: NgramIndex,
    end: int,
    tail: Sequence[int],
    limit: int,
    rule: DraftRule,
    context_end: int | None,
) -> Scored:
    """The best path in one source: ``tokens[:end]`` (the source's tokens; more may follow, unseen), ``tail`` the
    context's last tokens, last first. ``context_end``: the source is the context itself, whose candidates may
    continue into the draft past ``end``; None: a corpus, whose candidates stop at its end or a separator."""
    candidates: list[int] = []
    anchored = 0
    for n in range(min(rule.anchor, len(tail)), 0, -1):
        ngram = tail[n - 1 :: -1]
        candidates = index.recent_before(n, ngram, end, rule.occurrences)
        if candidates:
            anchored = n
            break
    if not candidates:
        return NO_DRAFT
    lengths = [_match_length(tokens, p, tail, anchored, rule.max_match) for p in candidates]
    best = NO_DRAFT
    for level in sorted(set(lengths), reverse=True)[: rule.levels]:
        live = [p for p, m in zip(candidates, lengths, strict=True) if m >= level]
        cap = min(limit, math.floor(rule.spec_factor * level))
        found = _path(tokens, live, end, cap, rule.min_prob, level, context_end)
        if found.beats(best):
            best = found
    return attrs.evolve(best, occurrences=tuple(candidates)) if best.draft else best


def _resynced(tokens: Sequence[int], index: NgramIndex, end: int, limit: int, rule: DraftRule) -> Scored:
    """The context's copy resumed after an edit (the module docstring's resync); ``NO_DRAFT`` when no earlier
    stretch aligns or the context's last tokens do not occur after it."""
    for back in range(1, rule.resync_back + 1):
        aligned = end - back  # the context up to here matched an earlier stretch?
        n = min(rule.anchor, aligned)
        if n < 1 or aligned < rule.resync_match:
            break
        before = [tokens[aligned - 1 - i] for i in range(min(rule.max_match, aligned))]  # last first
        for q in index.recent_before(n, before[n - 1 :: -1], aligned, rule.occurrences):
            matched = _match_length(tokens, q, before, n, rule.max_match)
            if matched >= rule.resync_match:
                return _resumed(tokens, index, end, q, q + back + rule.resync_reach, matched, limit, rule)
    return NO_DRAFT


def _resumed(
    tokens: Sequence[int], index: NgramIndex, end: int, lo: int, hi: int, matched: int, limit: int, rule: DraftRule
) -> Scored:
    """The path after the first occurrence of the context's last tokens (``anchor`` down to 1) ending in
    ``[lo, hi]``, its match length ``matched``."""
    for n in range(min(rule.anchor, end), 0, -1):
        ngram = [tokens[i] for i in range(end - n, end)]
        found = index.first_between(n, ngram, max(lo, n), min(hi, end - 1))
        if found is not None:
            cap = min(limit, math.floor(rule.spec_factor * matched))
            return _path(tokens, [found], end, cap, rule.min_prob, matched, context_end=end)
    return NO_DRAFT


def _match_length(tokens: Sequence[int], after: int, tail: Sequence[int], known: int, cap: int) -> int:
    """How many tokens before position ``after`` equal the context's tail (``tail``, last first), up to ``cap``;
    the first ``known`` are known to."""
    m = known
    top = min(cap, len(tail), after)
    while m < top and tokens[after - 1 - m] == tail[m]:
        m += 1
    return m


def _path(
    tokens: Sequence[int],
    live: list[int],
    end: int,
    cap: int,
    min_prob: float,
    matched: int,
    context_end: int | None,
) -> Scored:
    """The most frequent continuation of the occurrences ending right before each of ``live`` (most recent first),
    token by token, while its probability stays at least ``min_prob`` (the module docstring's path)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    live_at_start = live
    while len(draft) < cap and live:
        step = len(draft)
        counts: dict[int, int] = {}
        for p in live:
            t = _token_at(tokens, p + step, end, draft, context_end)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # first of the most frequent: the most recent (dicts keep order)
        prob *= counts[token] / len(live)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        live = [p for p in live if _token_at(tokens, p + step, end, draft[:-1], context_end) == token]
    return Scored(tuple(draft), score, matched if draft else 0, tuple(live_at_start), context_end is not None)


def _token_at(tokens: Sequence[int], i: int, end: int, draft: Sequence[int], context_end: int | None) -> int | None:
    """The source's token at ``i``: past ``end``, the context's draft so far (a context source) or nothing; None
    for a separator."""
    if i < end:
        t = tokens[i]
        return None if t == SEPARATOR else t
    if context_end is not None and i - end < len(draft):
        return draft[i - end]
    return None
