"""A separate draft model (``backends.draft_model.DraftModelProposer``, ``speculative="draft-model"``) on fake
backends: whatever the draft model, its output is plain decoding's token for token, alone (``Generation``) and in a
batch (``BatchDriver``), greedy and under seeded sampling (where it drafts with the request's own pick rule); and it
never re-reads a token its slot holds (after a rewind, it feeds only what follows the longest common prefix).

The draft models are ``FakeBatchBackend``s (``DraftBackend``): over the target's own model (every draft its pick),
over another model of the same vocabulary (other seed and Markov weight), or adversarial: one whose every row puts
EOS on top, one whose rows are the target's negated (it drafts the least likely token everywhere), and one that raises
after a drawn number of passes (it then drafts nothing more in that slot, and the request still ends exactly). Each
test drafts with the draft model alone or through ``"auto"`` (``LookupOrDraft``: per draft, prompt lookup or the draft
model, whichever has earned more on drawn prices), where the draft model's slot falls behind while lookup drafts.
"""

from __future__ import annotations

import warnings

import attrs
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import BatchDriver, Generation
from ortspec.backends.base import BackendError
from ortspec.backends.draft_model import DraftModelProposer
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.core import CostAwareWidth, DraftContext, FixedWidth, LookupOrDraft, Options, PromptLookup
from ortspec.core.forced import ForcedTokens
from ortspec.core.sampling import DraftPicker, Sampling
from property_tests.conftest import examples
from property_tests.strategies import fake_grammars, fake_models, scenarios
from property_tests.test_coupled_drafting import UNBOUNDED, no_early_end, plain, same_output

KINDS = ("target", "other", "eos", "disagree", "raise")


class DraftBackend(FakeBatchBackend):
    """A draft model: a ``FakeBatchBackend`` whose rows ``kind`` changes (``"eos"``: EOS on top of every row;
    ``"disagree"``: every row negated), raising ``fault`` from its pass ``fail_at + 1`` on (None: never). It
    counts the tokens fed to it (``fed``) and the *re-reads*: a row that starts, at the position a rewind (or reset)
    just cut its slot back to, with the very token that was there. A one-token row that does (``refed_last``) is
    the one allowed case: a context that is a prefix of what the slot holds (a new sequence whose prompt the last
    one's tokens start with, a draft token the tie guard rejected though the target picked it) needs the logits
    after its last token, which no pass kept."""

    def __init__(self, model: FakeModel, slots: int, max_length: int, kind: str = "model", eos: int = 0,
                 fail_at: int | None = None, fault: type[Exception] = RuntimeError) -> None:  # fmt: skip
        super().__init__(model, slots, max_length, tree_rows=False)
        self.kind, self.eos, self.fail_at, self.fault = kind, eos, fail_at, fault
        self.calls = self.fed = self.rereads = self.refed_last = 0
        self._dropped: dict[int, tuple[int, tuple[int, ...]]] = {}

    def rewind(self, slot: int, length: int) -> None:
        self._dropped[slot] = (length, self.slot_backend(slot).resident_tokens()[length:])
        super().rewind(slot, length)

    def reset(self, slot: int) -> None:
        self._dropped[slot] = (0, self.slot_backend(slot).resident_tokens())
        super().reset(slot)

    def run_pass(self, rows):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise self.fault("the draft model crashed")
        for row in rows:
            at, dropped = self._dropped.pop(row.slot, (-1, ()))
            if at == row.position and dropped[:1] == row.tokens[:1]:
                if len(row.tokens) == 1:
                    self.refed_last += 1
                else:
                    self.rereads += 1
            self.fed += len(row.tokens)
        out = super().run_pass(rows)
        if self.kind == "eos":
            for logits in out:
                logits[:, self.eos] = logits.max(axis=1) + 1.0
        elif self.kind == "disagree":
            out = [-logits for logits in out]
        return out


@st.composite
def draft_models(draw, target: FakeModel, slots: int, options: Options):
    """A draft model of ``target``'s vocabulary with ``slots`` slots, of a drawn kind, and its proposer (its drafts
    end at ``options``' EOS ids, or not)."""
    kind = draw(st.sampled_from(KINDS))
    max_length = draw(st.sampled_from((UNBOUNDED, UNBOUNDED, 24)))  # 24: long contexts get no draft
    model = target
    if kind == "other":
        model = FakeModel(vocab_size=target.vocab_size, seed=draw(st.integers(0, 2**32 - 1)),
                          markov=draw(st.sampled_from((0.5, 2.0, 6.0))))  # fmt: skip
    eos = target.eos_id if target.eos_id is not None else draw(st.integers(0, target.vocab_size - 1))
    fail_at = draw(st.integers(0, 12)) if kind == "raise" else None
    fault = draw(st.sampled_from((RuntimeError, BackendError, MemoryError)))
    backend = DraftBackend(model, slots, max_length, kind, eos, fail_at, fault)
    stop_ids = options.eos_token_ids if draw(st.booleans()) else ()
    chunk = draw(st.sampled_from((None, None, 1, 3)))
    return kind, backend, DraftModelProposer(backend, target.vocab_size, stop_ids=stop_ids,
                                             max_draft=draw(st.integers(1, 16)), prefill_chunk=chunk)  # fmt: skip


def through_auto(draw, proposer: DraftModelProposer) -> DraftModelProposer | LookupOrDraft:
    """``proposer`` as it is, or as ``"auto"``'s draft model beside a prompt lookup, each priced on a verify cost
    curve with the draft model's step at a drawn price (so either may win the draws)."""
    if not draw(st.booleans(), label="through auto"):
        return proposer
    costs = tuple(1.0 + 0.1 * k for k in range(proposer.max_draft + 1))
    step = draw(st.sampled_from((0.0, 0.2, 1.5)), label="draft model's step")
    auto = LookupOrDraft(PromptLookup(ngram=draw(st.integers(1, 3))), None, draft_model=proposer)
    return auto.priced(CostAwareWidth(costs), None, CostAwareWidth(costs, draft_cost=step))


def check_draft_model(kind: str, backend: DraftBackend, proposer: DraftModelProposer) -> None:
    """What every run checks of its draft model: no re-reads, and a failure only where one was planted."""
    assert backend.rereads == 0
    assert backend.fed == proposer.tokens_fed
    assert not proposer.broken or kind == "raise"
    event(f"draft model {kind}: {'broken' if proposer.broken else 'whole'}")


@settings(max_examples=examples(150))
@given(scenarios(), st.integers(1, 8), st.booleans(), st.data())
def test_a_draft_model_keeps_a_lone_generation_exact(sc, width, constrained, data):
    """Alone (a batch of one on ``OneSlot``: the sequence is slot 0), whatever the draft model, the output is
    plain decoding's; under a grammar too, drafting after the grammar's forced tokens (``ForcedTokens``: a context
    with no ``slot`` but the sequence's ``sequence``)."""
    kind, backend, proposer = data.draw(draft_models(sc.model, 1, sc.options), label="draft model")
    drafts, options = through_auto(data.draw, proposer), sc.options
    if constrained:
        grammar = data.draw(fake_grammars(sc.model.vocab_size, sc.options.eos_token_ids), label="grammar")
        drafts, options = ForcedTokens(grammar, len(sc.prompt), drafts), attrs.evolve(options, grammar=grammar)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a planted failure warns
        generation = Generation(FakeBackend(sc.model, sc.capacity), sc.prompt, options, drafts,
                                draft_width=width, detokenize=sc.detokenize)  # fmt: skip
        spec = generation.run()
    same_output(spec, plain(sc, options))
    check_draft_model(kind, backend, proposer)
    if kind == "raise" and backend.calls > (backend.fail_at or 0):
        assert proposer.broken == {0: f"{backend.fault.__name__}: the draft model crashed"}


@settings(max_examples=examples(120))
@given(scenarios(mode="sampling"), st.integers(1, 8))
def test_the_targets_own_model_as_draft_model_is_always_accepted(sc, width):
    """With the target's own rows, a draft model coupled to the request (greedy: its argmax; sampled: the target's
    pick rule) drafts exactly the target's picks: every draft token is accepted, and the slot is fed each token
    of the output once (the bonus token after each pass; the last accepted one too when the whole draft was)."""
    options = no_early_end(sc)
    backend = DraftBackend(sc.model, 1, UNBOUNDED)
    proposer = DraftModelProposer(backend, sc.model.vocab_size)
    spec = Generation(FakeBackend(sc.model, UNBOUNDED), sc.prompt, options, proposer, draft_width=width).run()
    assert spec.token_ids == plain(sc, options, UNBOUNDED).token_ids
    assert spec.stats.accepted_tokens == spec.stats.proposed_tokens
    if options.max_tokens > 2:
        assert spec.stats.proposed_tokens > 0
    assert backend.rereads == backend.refed_last == 0
    # every token the slot holds was fed once: the prompt and the output but its last tokens (never fed)
    held = proposer.held(0)
    assert held == (*sc.prompt, *spec.token_ids)[: len(held)] and backend.fed == len(held)


@st.composite
def batches(draw):
    """One model, 2-5 requests to it (each with its own width), the slots, and a draft model for them."""
    model = draw(fake_models())
    requests = [(draw(scenarios(model=model)), draw(st.integers(1, 6))) for _ in range(draw(st.integers(2, 5)))]
    slots = draw(st.integers(1, len(requests)))
    kind, backend, proposer = draw(draft_models(model, slots, requests[0][0].options))
    return model, requests, slots, (kind, backend, proposer, through_auto(draw, proposer)), draw(st.booleans())


@settings(max_examples=examples(60))
@given(batches())
def test_a_draft_model_keeps_each_sequence_of_a_batch_exact(batch):
    """In a batch, each sequence drafts in the draft slot of its own slot (a later sequence in a freed slot keeps
    what it shares with the one before): each output is its plain decoding alone, and no token is re-read."""
    model, requests, slots, (kind, backend, proposer, drafts), prefix_reuse = batch
    driver = BatchDriver(FakeBatchBackend(model, slots), prefill_budget=None, prefix_reuse=prefix_reuse)
    sequences = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for sc, width in requests:
            options = attrs.evolve(sc.options, max_context=None)
            sequence = driver.submit(sc.prompt, options, drafts, draft_width=FixedWidth(width),
                                     detokenize=sc.detokenize)  # fmt: skip
            sequences.append((sc, options, sequence))
        driver.run()
    for sc, options, sequence in sequences:
        same_output(sequence.result(), plain(sc, options, UNBOUNDED))
    check_draft_model(kind, backend, proposer)


def test_behind_forced_tokens_it_drafts_in_its_sequences_slot() -> None:
    """``DraftContext.after`` drops ``slot`` but keeps ``sequence``: the draft model drafts after tokens drafted in
    front of it, in the sequence's own slot, feeding only them and the context's new tokens."""
    model = FakeModel(vocab_size=32, seed=3, markov=4.0)
    backend = DraftBackend(model, 2, UNBOUNDED)
    proposer = DraftModelProposer(backend, 32)
    context = DraftContext((1, 2, 3), 4, slot=1, sequence=1)
    first = proposer.propose(context)
    assert first == tuple(model.greedy((1, 2, 3), 4)) and backend.fed == 3 + 3
    behind = context.after((7, 8))
    assert behind.slot is None and behind.sequence == 1
    assert proposer.propose(behind) == tuple(model.greedy((1, 2, 3, 7, 8), 2))
    assert proposer.held(1) == (1, 2, 3, 7, 8, model.greedy((1, 2, 3, 7, 8), 1)[0])
    assert proposer.held(0) == () and backend.rereads == backend.refed_last == 0
    assert proposer.propose(DraftContext((1, 2, 3), 4)) == ()  # no sequence, no slot: nothing to key on


def test_a_sampled_draft_is_the_targets_pick_rule_on_the_draft_rows() -> None:
    """Coupled: each draft token is ``DraftPicker``'s pick on the draft model's row after the draft so far."""
    target, draft_model = FakeModel(vocab_size=40, seed=1), FakeModel(vocab_size=40, seed=9, markov=3.0)
    picker = DraftPicker(Sampling(temperature=0.9, top_p=0.9, seed=4, presence_penalty=0.5), 2)
    proposer = DraftModelProposer(FakeBatchBackend(draft_model, 1), target.vocab_size)
    context = (5, 6, 7, 8)
    draft = proposer.propose(DraftContext(context, 5, slot=0, picker=picker))
    picks, want = picker.after(context), []
    for _ in range(5):
        pick = picks.pick(draft_model.logits_for(context + tuple(want)), want)
        assert pick is not None
        want.append(pick.token)
    assert draft == tuple(want)


def test_the_draft_rows_are_read_over_the_targets_vocabulary() -> None:
    """A wider draft vocabulary is cut to the target's (its extra ids are never drafted); a narrower one is padded
    with ``-inf``."""
    wide = FakeModel(vocab_size=64, seed=2)
    proposer = DraftModelProposer(FakeBatchBackend(wide, 1), 16)
    context = (1, 2, 3)
    draft = proposer.propose(DraftContext(context, 6, slot=0))
    assert draft and all(t < 16 for t in draft)
    assert draft[0] == int(np.argmax(wide.logits_for(context)[:16]))
    narrow = DraftModelProposer(FakeBatchBackend(FakeModel(vocab_size=8, seed=2), 1), 16)
    assert all(t < 8 for t in narrow.propose(DraftContext(context, 6, slot=0)))
    assert narrow.propose(DraftContext((1, 12, 3), 6, slot=0)) == ()  # a context id the draft model lacks
