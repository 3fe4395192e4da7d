"""Coupled drafting under seeded sampling (``core.sampling.DraftPicker``, the ``picker`` of each ``DraftContext``,
which ``Speculation.of`` builds when the request samples): a draft model that picks its drafts with the target's own
rule, from its own distribution, changes nothing a request outputs, alone or in a batch, however far its
distribution is from the target's; and with the target's own distribution, every coupled draft is the target's
pick, so every draft token is accepted. That last property is the one a wrong coupling breaks (another uniform
index, other processors, a penalty context without the draft so far).

The drafters are fake: a ``FakeModel``'s rows, ``equal`` (the target's), ``close`` (small noise), ``far`` (noise as
large as the logits), ``adversarial`` (the row negated: the least likely tokens drafted first) or ``nonfinite`` (a
NaN now and then, where drafting must stop).
"""

from __future__ import annotations

import zlib

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import BatchDriver, Generation, generate
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.core import DraftContext, FixedWidth, LookupOrDraft, Options, PromptLookup
from ortspec.core.sampling import DraftPicker, Sampling
from property_tests.conftest import examples
from property_tests.strategies import Scenario, fake_models, scenarios

UNBOUNDED = 4096  # the capacity of a backend that does not bound the context
KINDS = ("equal", "close", "far", "adversarial", "nonfinite")


@attrs.frozen
class FakeDraftModel:
    """A draft model over a ``FakeModel``'s vocabulary: its row after a context is the target's, perturbed by
    ``kind`` (deterministically, from the context). Greedy (a context without a picker) it drafts its argmax;
    coupled (the context's ``picker``), that picker's picks. ``calls`` records the picker of each proposal."""

    model: FakeModel
    kind: str
    seed: int = 0
    calls: list = attrs.field(factory=list, eq=False)

    def row(self, context) -> np.ndarray:
        row = self.model.logits_for(context)
        if self.kind == "equal":
            return row
        if self.kind == "adversarial":
            return -row
        rng = np.random.default_rng([self.seed, len(context), zlib.crc32(np.asarray(context, np.int64).tobytes())])
        if self.kind == "nonfinite":
            if rng.integers(0, 4) == 0:
                row[rng.integers(0, row.shape[0])] = np.nan
            return row
        scale = 0.05 if self.kind == "close" else float(np.std(row) + 1.0)
        return (row + rng.standard_normal(row.shape[0]).astype(np.float32) * np.float32(scale)).astype(np.float32)

    def propose(self, draft_context: DraftContext):
        self.calls.append(draft_context.picker)
        context = tuple(draft_context.tokens)
        picks = draft_context.picker.after(context) if draft_context.picker is not None else None
        draft: list[int] = []
        for _ in range(draft_context.width):
            row = self.row(context + tuple(draft))
            if picks is None:
                draft.append(int(np.argmax(row)))
                continue
            pick = picks.pick(row, draft)
            if pick is None:
                break
            draft.append(pick.token)
        return tuple(draft)


def same_output(got, want) -> None:
    assert (got.token_ids, got.text, got.finish_reason, got.stop_matched) == (
        want.token_ids, want.text, want.finish_reason, want.stop_matched,
    )  # fmt: skip


def plain(sc: Scenario, options: Options | None = None, capacity: int | None = None):
    backend = FakeBackend(sc.model, capacity or sc.capacity)
    return generate(backend, sc.prompt, options or sc.options, detokenize=sc.detokenize)


@settings(max_examples=examples(120))
@given(scenarios(), st.sampled_from(KINDS), st.integers(1, 8), st.booleans(), st.data())
def test_a_coupled_draft_model_keeps_the_output_exact(sc, kind, width, auto, data):
    """Whatever the draft model's distribution, the output is plain decoding's (greedy scenarios too, where the
    draft model is not coupled); through ``LookupOrDraft`` (``"auto"``) as well."""
    drafter = FakeDraftModel(sc.model, kind, data.draw(st.integers(0, 2**16), label="noise seed"))
    proposer = LookupOrDraft(PromptLookup(), drafter) if auto else drafter
    generation = Generation(FakeBackend(sc.model, sc.capacity), sc.prompt, sc.options, proposer,
                            draft_width=width, detokenize=sc.detokenize)  # fmt: skip
    spec = generation.run()
    same_output(spec, plain(sc))
    sampling = sc.options.sampling.temperature > 0
    # coupled exactly when the request samples: every proposal carries the request's one pick rule, or none
    want = DraftPicker(sc.options.sampling, len(sc.prompt)) if sampling else None
    assert all(picker == want for picker in drafter.calls)
    if sampling:
        event(f"coupled {kind}: accepted {'some' if spec.stats.accepted_tokens else 'none'}")


def no_early_end(sc: Scenario) -> Options:
    """The scenario's options with nothing that ends a generation inside a draft block but the budget (no EOS, no
    stop, no context bound, no tie guard): every draft token accepted is then committed."""
    return attrs.evolve(sc.options, eos_token_ids=(), stop=(), max_context=None, tie_margin=0.0)


@settings(max_examples=examples(120))
@given(scenarios(mode="sampling"), st.integers(1, 8))
def test_drafting_with_the_targets_distribution_is_always_accepted(sc, width):
    """Coupled to the request's sampling, a draft model whose rows are the target's drafts exactly the target's
    picks: every proposed token is accepted (100% acceptance under sampling, penalties and filters included)."""
    options = no_early_end(sc)
    drafter = FakeDraftModel(sc.model, "equal")
    spec = generate(FakeBackend(sc.model, UNBOUNDED), sc.prompt, options, drafter, draft_width=width)
    assert spec.token_ids == plain(sc, options, UNBOUNDED).token_ids
    s = spec.stats
    assert s.accepted_tokens == s.proposed_tokens
    if options.max_tokens > 2:  # the first token comes from the prompt pass, the last may not be drafted
        assert s.proposed_tokens > 0


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.0}, {"repetition_penalty": 2.0}], ids=str
)
def test_a_coupled_draft_is_penalised_for_the_tokens_drafted_before_it(penalty):
    """The example the property above may not draw: with a penalty strong enough to move a pick, a coupled draft
    token sees the draft tokens before it as the verify row does, so a draft model with the target's rows is
    always accepted (a coupling that leaves the draft so far out of the penalty is rejected on 5 to 19 of ~25)."""
    model = FakeModel(vocab_size=16, seed=3, markov=4.0)
    options = Options(max_tokens=24, sampling=Sampling(temperature=0.8, seed=0, **penalty))
    spec = generate(FakeBackend(model, UNBOUNDED), (1, 2, 3), options, FakeDraftModel(model, "equal"), draft_width=6)
    assert spec.token_ids == generate(FakeBackend(model, UNBOUNDED), (1, 2, 3), options).token_ids
    assert spec.stats.accepted_tokens == spec.stats.proposed_tokens > 0


@st.composite
def batches(draw):
    """One model and 2-5 requests to it, each with its own draft model kind and width."""
    model = draw(fake_models())
    requests = [
        (draw(scenarios(model=model)), draw(st.sampled_from(KINDS)), draw(st.integers(1, 6)))
        for _ in range(draw(st.integers(2, 5)))
    ]
    return model, requests, draw(st.integers(1, len(requests)))


@settings(max_examples=examples(50))
@given(batches())
def test_coupled_draft_models_in_a_batch_keep_each_output_exact(batch):
    """In a batch, each sequence's draft model is coupled to its own request (its seed, its prompt, its index):
    each output is its plain decoding alone, and a draft model with the target's rows is always accepted."""
    model, requests, slots = batch
    driver = BatchDriver(FakeBatchBackend(model, slots), prefill_budget=None)
    sequences = []
    for sc, kind, width in requests:
        options = attrs.evolve(no_early_end(sc) if kind == "equal" else sc.options, max_context=None)
        drafter = FakeDraftModel(model, kind)
        sequence = driver.submit(sc.prompt, options, drafter, draft_width=FixedWidth(width), detokenize=sc.detokenize)
        sequences.append((sc, options, kind, drafter, sequence))
    driver.run()
    for sc, options, kind, drafter, sequence in sequences:
        got = sequence.result()
        same_output(got, plain(sc, options, UNBOUNDED))
        want = DraftPicker(options.sampling, len(sc.prompt)) if options.sampling.temperature > 0 else None
        assert all(picker == want for picker in drafter.calls)  # its own request's pick rule, or none
        if kind == "equal" and options.sampling.temperature > 0:
            assert got.stats.accepted_tokens == got.stats.proposed_tokens
