"""What reaches a draft model under a sampled generation: ``Speculation.of`` builds the target's seeded pick rule
(``core.sampling.DraftPicker``) when the request samples, and every draft's ``DraftContext`` carries it (``picker``),
through ``ForcedTokens`` and ``LookupOrDraft``, to the draft model that drafts with it; greedy requests carry none,
and proposers that copy the context draft as they do without it."""

from __future__ import annotations

import attrs
import numpy as np

from ortspec import Speculation
from ortspec.core import DecodeState, DraftContext, ForcedTokens, LookupOrDraft, Options, PromptLookup, Sampling
from ortspec.core.sampling import DraftPicker, StepContext
from tests.support.grammars import FakeGrammar

SAMPLED = Options(sampling=Sampling(temperature=0.7, seed=5))


@attrs.define
class Drafter:
    """A draft model that records the context of each draft it was asked for (and drafts nothing)."""

    asked: list[DraftContext] = attrs.Factory(list)

    def propose(self, context: DraftContext) -> tuple[int, ...]:
        self.asked.append(context)
        return ()


def _asked_picker(options: Options, proposer, prompt=(1, 2, 3, 4)) -> DraftPicker | None:
    """The picker of the one draft ``Speculation`` asks ``proposer`` for at the start of a generation."""
    state = DecodeState.start(prompt, options, vocab_size=16)
    speculation = Speculation.of(proposer, 4, state)
    context, _ = speculation.draft(state, 16, slot=0)
    assert context is not None and context.picker == speculation.picker
    return context.picker


def test_a_draft_model_is_coupled_only_when_the_request_samples():
    drafter = Drafter()
    assert _asked_picker(SAMPLED, drafter) == DraftPicker(SAMPLED.sampling, 4)
    assert drafter.asked[-1].picker == DraftPicker(SAMPLED.sampling, 4)
    for greedy in (Options(), Options(sampling=Sampling(repetition_penalty=1.3, seed=5))):
        assert _asked_picker(greedy, drafter) is None  # greedy drafting stays the draft model's argmax
        assert drafter.asked[-1].picker is None
    state = DecodeState.start((1, 2, 3), SAMPLED, vocab_size=16)
    assert Speculation.of(None, 4, state).draft(state, 16, slot=0) == (None, ())  # nothing to couple
    lookup, context = PromptLookup(), (1, 2, 3, 1, 2)  # a proposer that copies the context ignores the picker
    picker = DraftPicker(SAMPLED.sampling, 3)
    assert lookup.propose(DraftContext(context, 4, picker=picker)) == lookup.propose(DraftContext(context, 4)) != ()


def test_wrappers_pass_the_picker_to_the_draft_model_they_hold():
    picker = DraftPicker(SAMPLED.sampling, 3)
    drafter = Drafter()
    auto = LookupOrDraft(PromptLookup(), drafter)
    assert auto.propose(DraftContext((1, 2, 3), 4, slot=0, picker=picker)) == ()  # no match: the drafter drafts
    assert drafter.asked == [DraftContext((1, 2, 3), 4, slot=0, picker=picker)]
    assert auto.lookup == PromptLookup()
    drafter.asked.clear()
    free = FakeGrammar(8, ((),), frozenset({0}))  # nothing forced: the inner drafter gets the context as it is
    assert ForcedTokens(free, 3, drafter).propose(DraftContext((1, 2, 3), 4, slot=0, picker=picker)) == ()
    assert drafter.asked == [DraftContext((1, 2, 3), 4, slot=0, picker=picker)]
    drafter.asked.clear()
    forcing = FakeGrammar(8, (((5, 1),), ((6, 2),), ((1, 2), (2, 2))), frozenset({2}))  # forces 5, 6 first
    assert ForcedTokens(forcing, 3, drafter).propose(DraftContext((1, 2, 3), 4, slot=0, picker=picker)) == (5, 6)
    assert drafter.asked == [DraftContext((1, 2, 3, 5, 6), 2, slot=None, picker=picker)]  # after them, no slot


def test_a_draft_pick_is_the_verify_pass_pick_at_the_same_position():
    """``DraftPicker.after(context).pick(row, drafted)`` is the pick of the verify pass over the draft (the core's
    ``StepContext`` of prompt and generated tokens) at row ``len(drafted)``, for any row."""
    sampling = Sampling(temperature=1.3, top_p=0.9, repetition_penalty=1.4, frequency_penalty=0.5, seed=99)
    prompt, generated, drafted = (3, 1, 4), (1, 5, 9, 2), (6, 5)
    picks = DraftPicker(sampling, len(prompt)).after((*prompt, *generated))
    verify = StepContext(sampling, prompt, generated)
    rng = np.random.default_rng(0)
    for _ in range(50):
        row = rng.standard_normal(12).astype("float32") * 3
        for k in range(len(drafted) + 1):
            got = picks.pick(row, drafted[:k])
            want = verify.pick(row, k, drafted[:k], margin=False, top_n=0)
            assert got is not None and got.token == want.token
    assert picks.pick(np.full(12, float("nan"), "float32"), ()) is None  # drafting stops there


def test_the_batch_driver_couples_the_draft_model_of_each_sampled_request():
    """A draft model that reads its sequence's slot (submitted with ``reads_target_state``) is asked, at every draft,
    with the context naming that slot and carrying that request's pick rule (its seed, its prompt) when it samples;
    a greedy request's contexts carry none."""
    from ortspec import BatchDriver
    from ortspec.backends.fake import FakeBatchBackend, FakeModel

    drafter = Drafter()
    driver = BatchDriver(FakeBatchBackend(FakeModel(vocab_size=16), 2))
    sampled = Options(max_tokens=3, sampling=Sampling(temperature=0.9, seed=8))
    a = driver.submit([1, 2, 3], sampled, drafter, draft_width=2, reads_target_state=True)
    b = driver.submit([4, 5], Options(max_tokens=3), drafter, draft_width=2, reads_target_state=True)
    driver.run()
    assert a.done and b.done and a.slot is not None and b.slot is not None and a.slot != b.slot
    by_prompt = {tuple(c.tokens[:2]): c for c in drafter.asked}
    assert set(by_prompt) == {(1, 2), (4, 5)}
    for context in drafter.asked:
        if tuple(context.tokens[:3]) == (1, 2, 3):
            assert (context.slot, context.picker) == (a.slot, DraftPicker(sampled.sampling, 3))
        else:
            assert (context.slot, context.picker) == (b.slot, None)
