"""Example-based tests of the prompt-lookup proposer (``ortspec.core.proposers``)."""

from __future__ import annotations

import attrs
import pytest

from ortspec.core import CostAwareWidth, LookupOrDraft
from ortspec.core.proposers import DraftContext, Learner, PromptLookup, Proposer


def test_is_a_proposer():
    assert isinstance(PromptLookup(), Proposer)


def test_defaults():
    p = PromptLookup()
    assert (p.ngram, p.max_draft, p.min_ngram) == (3, 8, 1)


def test_proposes_what_followed_the_suffix():
    ctx = [5, 6, 7, 8, 9, 5, 6]
    assert PromptLookup(ngram=2).propose(DraftContext(ctx, 5)) == (7, 8, 9, 5, 6)


def test_most_recent_earlier_match_wins():
    # (1, 2) occurs at 0 (followed by 3) and at 3 (followed by 4): the later one wins.
    ctx = [1, 2, 3, 1, 2, 4, 1, 2]
    assert PromptLookup(ngram=2, min_ngram=2).propose(DraftContext(ctx, 3)) == (4, 1, 2)


def test_longest_ngram_is_tried_first():
    # 3-gram (1, 2, 3) matches at 0 -> (10, 3, 11, ...); the 1-gram (3) matches more recently at 4 -> (11, ...).
    ctx = [1, 2, 3, 10, 3, 11, 1, 2, 3]
    assert PromptLookup(ngram=3).propose(DraftContext(ctx, 4)) == (10, 3, 11, 1)
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 4)) == (11, 1, 2, 3)


def test_falls_back_to_shorter_ngrams_down_to_min_ngram():
    ctx = [1, 2, 3, 9, 7, 3]  # (7, 3) and (9, 7, 3) never occurred earlier; (3,) did at 2
    assert PromptLookup(ngram=3).propose(DraftContext(ctx, 3)) == (9, 7, 3)
    assert PromptLookup(ngram=3, min_ngram=2).propose(DraftContext(ctx, 3)) == ()
    ctx2 = [4, 7, 3, 1, 7, 3]  # (7, 3) at 1; (1, 7, 3) nowhere earlier
    assert PromptLookup(ngram=3, min_ngram=2).propose(DraftContext(ctx2, 3)) == (1, 7, 3)


def test_a_longer_match_beats_a_more_recent_shorter_one():
    ctx = [8, 9, 1, 5, 9, 2, 8, 9]  # (8, 9) at 0 -> (1, ...); (9,) most recently at 4 -> (2, ...)
    assert PromptLookup(ngram=2).propose(DraftContext(ctx, 3)) == (1, 5, 9)


def test_never_more_than_width():
    ctx = [1, 2, 3, 4, 5, 6, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 2)) == (2, 3)
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 1)) == (2,)


def test_never_more_than_max_draft():
    ctx = [1, 2, 3, 4, 5, 6, 1]
    assert PromptLookup(ngram=1, max_draft=3).propose(DraftContext(ctx, 100)) == (2, 3, 4)
    assert PromptLookup(ngram=1, max_draft=3).propose(DraftContext(ctx, 2)) == (2, 3)


def test_copy_runs_on_past_the_end_of_the_context():
    # The match is 3 tokens back: the 3-token period (2, 3, 1) repeats, LZ77-style, to fill the width.
    ctx = [1, 2, 3, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 8)) == (2, 3, 1, 2, 3, 1, 2, 3)
    assert PromptLookup(ngram=1, max_draft=5).propose(DraftContext(ctx, 8)) == (2, 3, 1, 2, 3)


def test_copy_forward_two_token_period():
    ctx = [7, 1, 2, 1, 2]  # (1, 2) most recently 2 tokens back
    assert PromptLookup(ngram=2).propose(DraftContext(ctx, 6)) == (1, 2, 1, 2, 1, 2)


def test_copy_forward_run_of_one_token():
    assert PromptLookup(ngram=3).propose(DraftContext([9, 4, 4, 4, 4], 5)) == (4, 4, 4, 4, 4)


def test_copy_forward_only_when_the_context_runs_out():
    # Enough tokens follow the match: plain copy, no repetition.
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 8)) == (2, 3, 4, 5, 6, 7, 8, 1)


def test_empty_when_nothing_matches():
    assert PromptLookup().propose(DraftContext([1, 2, 3, 4, 5], 8)) == ()


def test_empty_for_width_zero_or_negative():
    ctx = [1, 2, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 0)) == ()
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, -3)) == ()


def test_empty_for_a_context_shorter_than_two():
    assert PromptLookup().propose(DraftContext([], 8)) == ()
    assert PromptLookup().propose(DraftContext([5], 8)) == ()


def test_two_token_context():
    assert PromptLookup(ngram=3).propose(DraftContext([5, 5], 3)) == (5, 5, 5)
    assert PromptLookup(ngram=3).propose(DraftContext([5, 6], 8)) == ()


def test_the_suffix_itself_is_not_a_match():
    # The only occurrence of (7, 8) is the suffix: nothing follows it.
    assert PromptLookup(ngram=2, min_ngram=2).propose(DraftContext([1, 2, 7, 8], 8)) == ()


def test_token_aligned_only_single_token():
    # 256 is bytes 00 01 00 00 and 0 is 00 00 00 00: the bytes of token 1 (01 00 00 00) appear at byte offset 1,
    # straddling two tokens. That is not an occurrence of token 1.
    assert PromptLookup(ngram=1).propose(DraftContext([256, 0, 5, 1], 8)) == ()


def test_token_aligned_match_behind_a_misaligned_one():
    # The misaligned "1" inside (256, 0) is more recent than the real 1 at index 0: the real one must be found.
    ctx = [1, 7, 256, 0, 9, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 5)) == (7, 256, 0, 9, 1)


def test_token_aligned_context_starting_1_256():
    # [1, 256, 0, 3, 1]: token 1 (01 00 00 00) also appears at byte 5, inside (256, 0) = 00 01 00 00 00 00 00 00.
    # That misaligned hit is more recent than the real 1 at index 0 and must be skipped.
    ctx = [1, 256, 0, 3, 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx, 4)) == (256, 0, 3, 1)
    assert PromptLookup(ngram=1).propose(DraftContext([3, 256, 0, 1], 4)) == ()


def test_token_aligned_only_two_gram():
    # Needle (1, 256) = 01 00 00 00 00 01 00 00. In (256, 1, 256, 0, ...) bytes 00 01 00 00 01 00 00 00 00 01 00 00,
    # it occurs at byte 4 (aligned: tokens 1..2). Build a context where only a misaligned occurrence exists.
    # (65536, 1) = 00 00 01 00 | 01 00 00 00 ; needle (1, 0) = 01 00 00 00 00 00 00 00 appears misaligned in
    # (256, 0, 0) = 00 01 00 00 | 00 00 00 00 | 00 00 00 00 at byte 1.
    ctx = [256, 0, 0, 3, 1, 0]
    assert PromptLookup(ngram=2, min_ngram=2).propose(DraftContext(ctx, 8)) == ()
    ctx2 = [1, 0, 42, 256, 0, 0, 3, 1, 0]
    assert PromptLookup(ngram=2, min_ngram=2).propose(DraftContext(ctx2, 7)) == (42, 256, 0, 0, 3, 1, 0)


def test_large_ids():
    ctx = [49151, 2**31, 7, 49151, 2**31]
    assert PromptLookup(ngram=2).propose(DraftContext(ctx, 3)) == (7, 49151, 2**31)
    assert PromptLookup(ngram=2).propose(DraftContext(ctx, 5)) == (7, 49151, 2**31, 7, 49151)
    ctx2 = [2**32 - 1, 1, 2**32 - 1]
    assert PromptLookup(ngram=1).propose(DraftContext(ctx2, 2)) == (1, 2**32 - 1)
    # 49151 = 0x0000BFFF: no false match against neighbouring 0xBF/0xFF bytes.
    assert PromptLookup(ngram=1).propose(DraftContext([0xBFFF00, 0xFF, 49151], 8)) == ()


def test_overlapping_matches():
    # (1, 1) occurs most recently at 1, overlapping the suffix at 2.
    assert PromptLookup(ngram=2).propose(DraftContext([1, 1, 1, 1], 3)) == (1, 1, 1)
    # (1, 2, 1) occurs at 0, overlapping the suffix at 2.
    assert PromptLookup(ngram=3).propose(DraftContext([1, 2, 1, 2, 1], 4)) == (2, 1, 2, 1)
    assert PromptLookup(ngram=2, min_ngram=2).propose(DraftContext([3, 3, 3], 2)) == (3, 3)


def test_accepts_list_and_tuple_and_returns_a_tuple():
    ctx = [4, 5, 6, 4, 5]
    a = PromptLookup(ngram=2).propose(DraftContext(ctx, 3))
    b = PromptLookup(ngram=2).propose(DraftContext(tuple(ctx), 3))
    assert a == b == (6, 4, 5)
    assert isinstance(a, tuple) and isinstance(b, tuple)


def test_ngram_longer_than_context_is_clamped():
    assert PromptLookup(ngram=10).propose(DraftContext([3, 4, 3], 2)) == (4, 3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ngram": 0}, "ngram"),
        ({"ngram": -1}, "ngram"),
        ({"ngram": True}, "ngram"),
        ({"ngram": 2.0}, "ngram"),
        ({"max_draft": 0}, "max_draft"),
        ({"max_draft": None}, "max_draft"),
        ({"min_ngram": 0}, "min_ngram"),
    ],
)
def test_bad_parameters(kwargs, field):
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1"):
        PromptLookup(**kwargs)


def test_min_ngram_above_ngram():
    with pytest.raises(ValueError, match=r"min_ngram \(3\) must not exceed ngram \(2\)"):
        PromptLookup(ngram=2, min_ngram=3)
    assert PromptLookup(ngram=2, min_ngram=2).min_ngram == 2


def test_is_frozen():
    p = PromptLookup()
    with pytest.raises(AttributeError):
        p.ngram = 4  # type: ignore[misc]


def _truth(position: int) -> int:
    """The "target's" token at a position of an open-ended walk: no bigram of it repeats in 300."""
    return (position * position * 37 + 11 * position) % 997


class _Oracle:
    """A model that drafts the walk's own tokens."""

    def propose(self, context):
        return [_truth(len(context.tokens) + i) for i in range(context.width)]


class _Wrong:
    """A model whose every draft token is wrong."""

    def propose(self, context):
        return [1000 + i for i in range(context.width)]


def _drive(context: list[int], auto: LookupOrDraft, steps: int, next_token) -> LookupOrDraft:
    """``steps`` verified drafts of ``auto`` on ``context`` (extended in place), the target's pick at a position
    being ``next_token(tokens before it)``."""
    for _ in range(steps):
        before = DraftContext(tuple(context), 4, slot=0)  # the target holds the context's state: all may draft
        draft = auto.propose(before)
        accepted = 0
        for t in draft:  # the driver's rule: commit the agreeing prefix, then the target's own pick
            if t != next_token(context):
                break
            context.append(t)
            accepted += 1
        context.append(next_token(context))
        auto = auto.observe(before, draft, accepted)
    return auto


def test_auto_learns_which_source_pays():
    """``LookupOrDraft`` keeps, per source, what its drafts earned: a drafter that knows the text wins over prompt
    lookup's short matches that keep failing, and prompt lookup wins on text that repeats itself."""
    truth, Oracle, drive = _truth, _Oracle, _drive
    costs = (1.0, 1.1, 1.2, 1.3, 1.4)

    # open-ended text: the walk never repeats a 3-gram early, so lookup only has short matches, which fail
    auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), Oracle())
    auto = auto.priced(CostAwareWidth(costs), CostAwareWidth(costs, draft_cost=0.05))
    context = [5, 11, 5, 23, 11, 31]
    auto = drive(context, auto, 30, lambda c: truth(len(c)))
    assert auto.drafter_drafts > 3 * auto.lookup_drafts
    assert auto.drafter_policy.acceptance() > auto.weak_lookup_policy.acceptance()

    # text that copies itself: a period-6 loop; lookup matches and is right, the drafter (the walk) is wrong
    loop = [1, 2, 3, 4, 5, 6]
    auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), Oracle())
    auto = auto.priced(CostAwareWidth(costs), CostAwareWidth(costs, draft_cost=0.05))
    context = loop * 2
    auto = drive(context, auto, 30, lambda c: loop[len(c) % 6])
    assert auto.lookup_drafts > 3 * auto.drafter_drafts


def test_auto_learns_which_model_pays():
    """With both a drafter and a draft model, each learns from its own drafts: the cheaper drafter drafts first,
    and the draft model (priced at a costlier step) takes over where the drafter keeps failing and it does not;
    where the drafter knows the text, the draft model is tried once the drafter's misses bring it down, at most."""
    costs = (1.0, 1.1, 1.2, 1.3, 1.4)

    def auto(drafter, draft_model):
        value = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), drafter, draft_model=draft_model)
        return value.priced(
            CostAwareWidth(costs), CostAwareWidth(costs, draft_cost=0.05), CostAwareWidth(costs, draft_cost=0.3)
        )

    knows_more = _drive([5, 11, 5, 23, 11, 31], auto(_Wrong(), _Oracle()), 30, lambda c: _truth(len(c)))
    assert knows_more.draft_model_drafts > 3 * knows_more.drafter_drafts
    knows_less = _drive([5, 11, 5, 23, 11, 31], auto(_Oracle(), _Wrong()), 30, lambda c: _truth(len(c)))
    assert knows_less.drafter_drafts > 3 * knows_less.draft_model_drafts
    alone = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), None, draft_model=_Oracle())  # no drafter
    alone = _drive([5, 11, 5, 23, 11, 31], alone.priced(CostAwareWidth(costs), None), 30, lambda c: _truth(len(c)))
    assert alone.draft_model_drafts > 3 * alone.lookup_drafts and alone.drafter_drafts == 0
    with pytest.raises(ValueError, match="drafter or a draft_model"):
        LookupOrDraft(PromptLookup(), None)


def test_a_source_that_reads_before_it_drafts_is_probed_by_its_price():
    """A draft model reads the context it has not read before it drafts (``CostAwareWidth.read_cost``, ``unread``):
    a probe pays that catch-up, so probes are spaced by their expected loss (at most ``PROBE_SHARE`` of the time);
    a source whose catch-up has grown past what that share buys is not probed again, while a source that reads
    nothing probes every ``probe_every`` steps as before. After its own draft, only the bonus (and the last draft
    token when all were accepted) is unread; tokens another source drafted count as unread."""
    from ortspec.core.width import PROBE_SHARE

    costs = (1.0, 1.1, 1.2, 1.3, 1.4)
    idle = CostAwareWidth(costs, successes=0.0, trials=10.0, draft_cost=0.6)  # drafts never pay
    assert idle.catch_up() == 0.0 and idle.probe_interval() == pytest.approx(idle.probe_loss() / PROBE_SHARE)
    assert idle.probe_loss() == pytest.approx(1.2 + 2 * 0.6 - 1.0)  # its pass and 2 draft tokens for 1 token
    lookup = CostAwareWidth(costs, successes=0.0, trials=10.0)  # a cheap probe: spaced by probe_every
    assert lookup.probe_interval() == lookup.probe_every
    reader = attrs.evolve(idle, read_cost=0.1, unread=50)
    assert reader.catch_up() == pytest.approx(4.9)  # every unread token but the last, which the draft feeds
    assert reader.probe_loss() == pytest.approx(idle.probe_loss() + 4.9)
    assert reader.probe_interval() == pytest.approx(reader.probe_loss() / PROBE_SHARE)
    assert reader.probe_interval() > 4 * idle.probe_interval()
    # idling: one more unread token per plain step, so the next probe only moves away
    steps = 0
    while reader.width() == 0 and steps < 1000:
        reader, steps = reader.observe(0, 0), steps + 1
    assert steps == 1000 and reader.unread == 1050
    # a cheap read is probed again, later the more it has to read
    cheap = attrs.evolve(idle, read_cost=0.001, unread=0)
    for _ in range(200):
        cheap = cheap.observe(cheap.width(), 0) if cheap.width() else cheap.observe(0, 0)
    assert cheap.unread < 200
    # after its own draft: the bonus token is unread, and the last draft token too when every one was accepted
    assert reader.observe(3, 1).unread == 1 and reader.observe(3, 3).unread == 2
    assert reader.behind(5).unread == reader.unread + 5
    with pytest.raises(ValueError, match="read_cost must be a finite number"):
        CostAwareWidth(costs, read_cost=-1.0)


def test_auto_counts_what_other_sources_drafted_as_unread_by_the_draft_model():
    costs = (1.0, 1.1, 1.2, 1.3, 1.4)
    auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), None, draft_model=_Wrong())
    auto = auto.priced(CostAwareWidth(costs), None, CostAwareWidth(costs, draft_cost=0.3, read_cost=0.1))
    copies = DraftContext([1, 2, 3, 4, 5, 6, 1, 2, 3], 4, slot=0)  # a strong match: the lookup drafts
    draft = auto.propose(copies)
    assert draft[:1] == (4,) and auto.observe(copies, draft, 1).draft_model_policy.unread == 2
    fresh = DraftContext([7, 8, 9, 10, 11], 4, slot=0)  # no match: the draft model drafts (and learns it)
    drafted = auto.propose(fresh)
    assert drafted and auto.observe(fresh, drafted, 0).draft_model_policy.unread == 1


def test_auto_fades_with_the_price_of_a_plain_step():
    """In a batched pass a plain step is one more cheap row: ``LookupOrDraft.propose`` sizes each source's draft
    with its policy's ``width_at(context.plain_cost)``, so both sources stop drafting when a plain step costs little,
    and draft as alone at a plain step's full price (the context's default ``plain_cost``, 1.0)."""

    class Counting:
        def propose(self, context):
            return tuple(range(context.width))

    costs = (1.0, 1.1, 1.2, 1.3, 1.4)
    auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), Counting())
    auto = auto.priced(CostAwareWidth(costs), CostAwareWidth(costs, draft_cost=0.05))
    assert isinstance(auto, Proposer) and isinstance(auto, Learner)
    copies = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # lookup has a strong match
    fresh = [7, 8, 9, 10, 11]  # no match: the drafter drafts
    for context in (copies, fresh):
        assert len(auto.propose(DraftContext(context, 4, slot=0))) > 0
        assert auto.propose(DraftContext(context, 4, 1.0, slot=0)) == auto.propose(DraftContext(context, 4, slot=0))
        assert auto.propose(DraftContext(context, 4, 0.05, slot=0)) == ()


def _starved_auto(drafter) -> LookupOrDraft:
    """``auto`` whose strong-match policy has seen only misses and whose drafter's has seen only hits: the drafter
    wins every choice until the strong policy learns otherwise."""
    costs = (1.0, 1.1, 1.2, 1.3, 1.4)
    strong, drafter_policy = CostAwareWidth(costs), CostAwareWidth(costs, draft_cost=0.05)
    for _ in range(8):
        strong, drafter_policy = strong.observe(4, 0), drafter_policy.observe(4, 4)
    return LookupOrDraft(PromptLookup(ngram=3, max_draft=8), drafter).priced(strong, drafter_policy)


def test_auto_scores_a_strong_match_the_drafter_beat():
    """When the drafter drafts over a strong match, the match's draft is scored at the next ``observe`` against what
    the step committed, and the strong policy observes it as a verified draft: its agreeing prefix, a miss after it;
    all accepted when it agreed with every committed token (what followed is unknown); nothing when nothing was
    committed. A weak match is not scored."""

    class Silent:
        def propose(self, context):
            return ()

    auto = _starved_auto(Silent())
    context = (1, 2, 3, 4, 5, 6, 9, 1, 2, 3)  # strong match (1, 2, 3): the lookup drafts 4, 5, 6, 9, 1, 2, 3, 4
    assert auto._choose(DraftContext(context, 8, slot=0))[0] == "drafter"
    # the drafter's step committed 4 and then its own pick
    after = auto.observe(DraftContext(context, 8, slot=0), (4, 5), 1)
    assert after.shadow == (len(context), (4, 5, 6, 9, 1, 2, 3, 4))
    strong = auto.lookup_policy
    for committed, proposed, agreed in [((4, 7), 8, 1), ((4, 5), 2, 2), ((), None, None)]:
        scored = after.observe(DraftContext(context + committed, 8, slot=0), (), 0)
        want = strong if proposed is None else strong.observe(proposed, agreed)
        assert scored.lookup_policy == want, committed
    weak = auto.observe(DraftContext((1, 2, 7, 8, 2), 8, slot=0), (), 0)  # (2,) matches: weak, no shadow
    assert weak.shadow is None


def test_auto_lets_a_starved_strong_match_take_over():
    """A strong-match policy that has seen only misses is not stuck behind the drafter: on text that copies itself
    (a period-6 loop, which the drafter gets one token of each time), its shadow drafts prove it right and lookup
    takes over."""
    loop = [1, 2, 3, 4, 5, 6]

    class FirstOnly:  # right about the next token, then wrong
        def propose(self, context):
            return (loop[len(context.tokens) % 6], *([99] * (context.width - 1)))[: context.width]

    auto = _starved_auto(FirstOnly())
    context = loop * 2
    assert auto._choose(DraftContext(tuple(context), 4, slot=0))[0] == "drafter"
    for _ in range(30):
        before = DraftContext(tuple(context), 4, slot=0)
        draft = auto.propose(before)
        accepted = 0
        for t in draft:
            if t != loop[len(context) % 6]:
                break
            context.append(t)
            accepted += 1
        context.append(loop[len(context) % 6])
        auto = auto.observe(before, draft, accepted)
    assert auto.lookup_drafts > 2 * auto.drafter_drafts


def test_auto_drafts_by_lookup_where_the_target_holds_no_state():
    """Where the target holds no state for the context (``DraftContext.slot`` None: after tokens drafted in front,
    or a context no slot holds) a draft head cannot draft, so the lookup drafts whenever it has a draft, even where
    the drafter would win; without a lookup draft the drafter is asked, with the context as given (its slot, its
    picker), capped at its policy's width."""
    asked: list[DraftContext] = []

    class Recording:
        def propose(self, context):
            asked.append(context)
            return tuple(range(context.width))

    costs = (1.0, 1.1, 1.2, 1.3, 1.4)
    drafter_policy = CostAwareWidth(costs, draft_cost=0.05)
    for _ in range(8):
        drafter_policy = drafter_policy.observe(4, 4)
    auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=8), Recording())
    auto = auto.priced(CostAwareWidth(costs), drafter_policy)  # lookup untried, the drafter always right
    copies = (1, 2, 3, 4, 5, 6, 9, 1, 2, 3)  # strong match (1, 2, 3): the lookup drafts 4, 5, 6, 9
    assert auto._choose(DraftContext(copies, 4, slot=0))[0] == "drafter"
    assert auto.propose(DraftContext(copies, 4, slot=0)) == (0, 1, 2, 3)
    assert asked == [DraftContext(copies, 4, slot=0)]
    asked.clear()
    assert auto._choose(DraftContext(copies, 4))[0] == "strong"
    width = auto.lookup_policy.width_at(1.0)  # the lookup's draft, as wide as its own policy allows
    assert width > 0 and auto.propose(DraftContext(copies, 4)) == (4, 5, 6, 9)[:width]
    assert asked == []
    fresh = (7, 8, 9, 10, 11)  # no match: the drafter is asked, slot or none
    assert auto.propose(DraftContext(fresh, 4)) == (0, 1, 2, 3)
    assert asked == [DraftContext(fresh, 4)]
