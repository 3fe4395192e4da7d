"""The one proposer protocol: what a ``DraftContext`` carries to a proposer, and the rules that read it (the slot a
draft head needs, the pass's price, the sampled request's picker), alone, behind forced tokens and in a batch."""

from __future__ import annotations

import attrs

from ortspec import BatchDriver, DraftContext, LookupOrDraft, Options, PromptLookup, Sampling
from ortspec.backends.fake import FakeBatchBackend, FakeModel
from ortspec.core.forced import ForcedTokens
from ortspec.core.sampling import DraftPicker
from ortspec.core.width import CostAwareWidth, FixedWidth, asked_width, width_policy
from ortspec.speculation import Speculation
from tests.support.grammars import FakeGrammar

MODEL = FakeModel(vocab_size=32, seed=3, markov=4.0)


@attrs.define
class Recording:
    """A proposer that records every context it is asked with and drafts ``draft`` (cut to the width)."""

    draft: tuple[int, ...] = (5, 6, 7)
    contexts: list[DraftContext] = attrs.field(factory=list)

    def propose(self, context: DraftContext) -> tuple[int, ...]:
        self.contexts.append(context)
        return self.draft[: context.width]


def test_after_drafted_tokens_the_context_has_no_target_state() -> None:
    picker = DraftPicker(Sampling(temperature=0.7, seed=1), 2)
    context = DraftContext((1, 2, 3), 5, 0.5, slot=3, picker=picker)
    after = context.after((9, 8))
    assert after == DraftContext((1, 2, 3, 9, 8), 3, 0.5, slot=None, picker=picker)
    assert context.slot == 3  # a frozen value: the original is unchanged


def test_behind_forced_tokens_the_inner_proposer_is_asked_without_a_slot() -> None:
    # state 0 forces 4 then 5; after them the grammar lets 1 or 2 follow, then ends
    grammar = FakeGrammar(32, (((4, 1),), ((5, 2),), ((1, 3), (2, 3)), ()), frozenset({3}))
    inner = Recording(draft=(1,))
    forced = ForcedTokens(grammar, 2, inner)
    assert forced.propose(DraftContext((10, 11), 4, slot=0)) == (4, 5, 1)
    assert inner.contexts[-1] == DraftContext((10, 11, 4, 5), 2, slot=None)
    # nothing forced (the grammar's choice): the inner proposer gets the context as it is, slot and all
    assert forced.propose(DraftContext((10, 11, 4, 5), 4, slot=0)) == (1,)
    assert inner.contexts[-1] == DraftContext((10, 11, 4, 5), 4, slot=0)


def _auto_preferring_the_drafter(drafter: Recording) -> LookupOrDraft:
    """``"auto"`` whose lookup has earned less than its drafter (both pay)."""
    costs = (1.0, 1.01, 1.02, 1.03, 1.04)
    poor = CostAwareWidth(costs, successes=5.0, trials=10.0)
    rich = CostAwareWidth(costs, successes=9.5, trials=10.0)
    assert poor.width() > 0 and poor.expected_rate(poor.best_width()) < rich.expected_rate(rich.best_width())
    return LookupOrDraft(PromptLookup(ngram=2, max_draft=4), drafter).priced(poor, rich)


def test_auto_drafts_with_the_lookup_where_the_target_holds_no_state() -> None:
    drafter = Recording(draft=(30, 31, 30, 31))
    auto = _auto_preferring_the_drafter(drafter)
    tokens = (7, 8, 9, 7, 8)  # the lookup continues with 9, 7, 8, ...
    assert auto.propose(DraftContext(tokens, 4, slot=0)) == (30, 31, 30, 31)
    assert len(drafter.contexts) == 1
    lookup_draft = auto.propose(DraftContext(tokens, 4, slot=None))
    assert lookup_draft and lookup_draft[0] == 9
    assert len(drafter.contexts) == 1  # not asked: a draft head could not draft there


def test_auto_hands_the_drafter_the_context_at_its_own_width() -> None:
    drafter = Recording(draft=(30, 31, 30, 31))
    auto = _auto_preferring_the_drafter(drafter)
    picker = DraftPicker(Sampling(temperature=0.7, seed=1), 1)
    auto.propose(DraftContext((7, 1, 2), 4, 0.9, slot=2, picker=picker))
    asked = drafter.contexts[-1]
    assert (asked.tokens, asked.plain_cost, asked.slot, asked.picker) == ((7, 1, 2), 0.9, 2, picker)
    assert 1 <= asked.width <= 4


def test_a_sampled_sequence_drafts_with_its_picker_and_a_greedy_one_without() -> None:
    proposer = Recording()
    backend = FakeBatchBackend(MODEL, 2, 128)
    driver = BatchDriver(backend)
    sampled = Options(max_tokens=6, sampling=Sampling(temperature=0.8, seed=5))
    greedy = Options(max_tokens=6)
    a = driver.submit([1, 2, 3], sampled, proposer, draft_width=3)
    b = driver.submit([4, 5, 6, 7], greedy, proposer, draft_width=3)
    driver.run()
    assert a.result().finish_reason and b.result().finish_reason
    prompts = {3: a, 4: b}
    for context in proposer.contexts:
        sequence = next(s for n, s in prompts.items() if tuple(context.tokens[:n]) == tuple(s.state.prompt_tokens))
        assert context.slot == sequence.slot  # the slot the sequence holds
        assert 1 <= context.width <= 3
        if sequence is a:
            assert context.picker == DraftPicker(sampled.sampling, 3)
        else:
            assert context.picker is None
    assert {c.slot for c in proposer.contexts} == {a.slot, b.slot}
    assert a.slot != b.slot


def test_a_learner_learns_only_from_the_steps_it_drafted_for() -> None:
    @attrs.frozen
    class Counting:
        seen: int = 0

        def propose(self, context: DraftContext) -> tuple[int, ...]:
            return ()

        def observe(self, context: DraftContext, draft: object, accepted: int) -> Counting:
            return Counting(self.seen + 1)

    speculation = Speculation(Counting(), FixedWidth(2))
    assert speculation.observe(None, (), 0).proposer == Counting(0)  # not asked: width 0, or no proposer
    assert speculation.observe(DraftContext((1, 2), 2), (), 0).proposer == Counting(1)


def test_a_width_policy_asks_by_the_pass_price() -> None:
    assert width_policy(3) == FixedWidth(3)
    policy = CostAwareWidth((1.0, 1.02, 1.04, 1.06), successes=9.0, trials=10.0)
    assert width_policy(policy) is policy
    assert asked_width(FixedWidth(3), 0.01) == 3
    assert asked_width(policy, 1.0) == policy.width_at(1.0) == policy.width()
    assert asked_width(policy, 0.01) == policy.width_at(0.01) < policy.width()
