"""Which proposers the driver couples to a sampled generation (``core.proposers.coupling``) and what reaches them:
a draft model (``Couplable``) when the request samples, through ``ForcedTokens`` and ``LookupOrDraft``; greedy
requests and proposers that copy the context are left as they are."""

from __future__ import annotations

import attrs
import numpy as np

from ortspec.core import ForcedTokens, LookupOrDraft, Options, PromptLookup, Sampling
from ortspec.core.proposers import Couplable, coupling
from ortspec.core.sampling import DraftPicker, StepContext
from tests.support.grammars import FakeGrammar

SAMPLED = Options(sampling=Sampling(temperature=0.7, seed=5))


@attrs.frozen
class Drafter:
    """A draft model that records the picker it was coupled with."""

    picker: DraftPicker | None = None

    def propose(self, context_tokens, width):
        return ()

    def coupled(self, picker: DraftPicker) -> Drafter:
        return Drafter(picker)


def test_a_draft_model_is_coupled_only_when_the_request_samples():
    drafter = Drafter()
    assert isinstance(drafter, Couplable)
    assert coupling(drafter, SAMPLED, 4) == Drafter(DraftPicker(SAMPLED.sampling, 4))
    for greedy in (Options(), Options(sampling=Sampling(repetition_penalty=1.3, seed=5))):
        assert coupling(drafter, greedy, 4) is drafter  # greedy drafting stays the draft model's argmax
    assert coupling(None, SAMPLED, 4) is None
    lookup = PromptLookup()
    assert not isinstance(lookup, Couplable) and coupling(lookup, SAMPLED, 4) is lookup


def test_wrappers_couple_the_draft_model_they_hold():
    auto = coupling(LookupOrDraft(PromptLookup(), Drafter()), SAMPLED, 3)
    assert isinstance(auto, LookupOrDraft) and auto.drafter == Drafter(DraftPicker(SAMPLED.sampling, 3))
    assert auto.lookup == PromptLookup()
    grammar = FakeGrammar(8, ((),), frozenset({0}))
    forced = coupling(ForcedTokens(grammar, 3, Drafter()), SAMPLED, 3)
    assert isinstance(forced, ForcedTokens) and forced.inner == Drafter(DraftPicker(SAMPLED.sampling, 3))
    unchanged = LookupOrDraft(PromptLookup(), PromptLookup())
    assert coupling(unchanged, SAMPLED, 3) is unchanged


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


def test_the_batch_driver_couples_the_proposer_a_slot_binds():
    """A ``SlotProposer``'s draft model, bound when its sequence takes a slot, is coupled to that request's sampling
    (its seed, its prompt); a greedy request's is not."""
    from ortspec import BatchDriver, SlotProposer
    from ortspec.backends.fake import FakeBatchBackend, FakeModel

    coupled: list[tuple[int, DraftPicker]] = []

    @attrs.frozen
    class SlotDrafter:
        slot: int

        def propose(self, context_tokens, width):
            return ()

        def coupled(self, picker: DraftPicker) -> SlotDrafter:
            coupled.append((self.slot, picker))
            return self

    driver = BatchDriver(FakeBatchBackend(FakeModel(vocab_size=16), 2))
    sampled = Options(max_tokens=3, sampling=Sampling(temperature=0.9, seed=8))
    a = driver.submit([1, 2, 3], sampled, SlotProposer(SlotDrafter), draft_width=2)
    b = driver.submit([4, 5], Options(max_tokens=3), SlotProposer(SlotDrafter), draft_width=2)
    driver.run()
    assert a.done and b.done
    assert coupled == [(a.slot, DraftPicker(sampled.sampling, 3))]
