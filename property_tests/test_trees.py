"""Token-tree drafts are exact: whatever tree a proposer drafts, the output is plain decoding's, and after every step
the KV cache holds exactly what plain decoding's holds.

A tree proposer (``TreeProposer``, a deterministic function of the context) drafts adversarial tries: random shapes
and tokens; the plain continuation (under the scenario's pick rules, greedy or seeded sampling) planted along one
branch from the root to a random depth, at random places among the other nodes, so it is rarely the first branch;
twins of the continuation's next token under the same parent, before or after it (duplicate siblings: the walk
takes the lowest-index one, whose subtree may be wrong); EOS ids and tokens of the continuation on wrong branches;
branches that run on past an EOS or a stop; empty trees; trees of exactly the width, and trees past it (the driver
cuts them by node count). The scenarios (``strategies.scenarios``) vary the endings, stop strings and sequences,
``max_tokens`` and the context limit, the pick rules and the tie guard; one in eight is constrained by a fake
grammar, whose forced tokens are drafted in front of the tree (``ForcedTokens`` hangs the tree below them).

Alone (``Generation`` on a ``FakeBackend`` that runs tree rows, or one that does not, where the driver verifies the
first branch), on the logits path and the device-picks path: tokens, text, finish reason, matched stop, logprobs and
streamed deltas equal plain decoding's, no pass writes a position that could not be committed, and before every
pass, and at the end, the backend's KV (each position's token and the context its entry was computed in, the fake's
model of a KV entry) is plain decoding's for the same tokens, a prefix of plain decoding's output. In a batch
(``BatchDriver`` on a ``FakeBatchBackend``, whose passes run draft rows beside the others or not, so tree budgets
are priced alone or at the batch's costs), tree-drafting sequences share passes with chain-drafting and plain ones;
after every pass each running sequence's slot holds plain decoding's KV, and every output is its request's alone.
"""

from __future__ import annotations

import attrs
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ortspec import BatchDriver, Generation, GenerationError
from ortspec.backends.fake import FakeBackend, FakeBatchBackend
from ortspec.batch_driver import Phase
from ortspec.core.forced import forcing
from ortspec.core.tree import DraftTree
from property_tests.conftest import examples
from property_tests.strategies import (
    OracleProposer,
    Scenario,
    fake_grammars,
    fake_models,
    proposers_for,
    scenarios,
    width_policies,
)

UNBOUNDED = 4096
SHAPES = ("hidden", "hidden", "hidden", "twins", "full", "bushy", "empty")


@attrs.frozen
class TreeProposer:
    """An adversarial tree after each context (module docstring), drawn from a generator seeded by ``seed`` and the
    context. ``shape``: ``hidden`` (the continuation among random nodes), ``twins`` (as ``hidden``, with many
    duplicate siblings), ``full`` (exactly ``width + overshoot`` nodes), ``bushy`` (few, repeated tokens, so
    shared prefixes abound), ``empty``. ``eos``: ids to draft on wrong branches now and then."""

    oracle: OracleProposer
    seed: int
    shape: str
    overshoot: int
    eos: tuple[int, ...] = ()

    def propose(self, context):
        tokens = context.tokens
        if self.shape == "empty":
            return DraftTree((), ())
        rng = np.random.default_rng([self.seed, len(tokens), int(tokens[-1])])
        most = context.tree_budget + self.overshoot
        size = most if self.shape == "full" else int(rng.integers(min(2, most), most + 1))
        truth = list(self.oracle.continuation(tokens, int(rng.integers(0, size))))  # leaves room for a branch
        vocab = self.oracle.model.vocab_size
        alphabet = rng.integers(0, vocab, size=3) if self.shape == "bushy" else None
        ids: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        on_truth = [-1]  # the nodes holding the continuation so far (-1: the root)
        for j in range(size):
            need = len(truth) - (len(on_truth) - 1)
            if need and rng.random() < need / (size - j):  # spread the continuation over the whole tree
                parent, token = on_truth[-1], truth[len(on_truth) - 1]
                on_truth.append(j)
            else:
                parent, token = self._decoy(rng, j, on_truth, truth, depth, vocab, alphabet)
            ids.append(int(token))
            parents.append(parent)
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return DraftTree(ids, parents)

    def _decoy(self, rng, j, on_truth, truth, depth, vocab, alphabet):
        """A node that is not the continuation's next: a twin of it, the continuation's token at a wrong place, an
        EOS, or any token, under a node of the continuation or any earlier node."""
        twins = 0.6 if self.shape == "twins" else 0.2
        parent = int(rng.choice(on_truth)) if rng.random() < 0.5 else int(rng.integers(-1, j))
        d = 0 if parent < 0 else depth[parent] + 1
        roll = rng.random()
        if parent in on_truth and on_truth.index(parent) < len(truth) and roll < twins:
            return parent, truth[on_truth.index(parent)]  # the twin of the continuation's next node here
        if roll < twins + 0.15 and d < len(truth):
            return parent, truth[d]  # the continuation's token at this depth, on another branch
        if self.eos and roll > 0.9:
            return parent, int(rng.choice(self.eos))
        return parent, int(rng.choice(alphabet) if alphabet is not None else rng.integers(0, vocab))


def widths():
    """A fixed width of 2 to 16 (a tree needs two nodes), or any of the width policies."""
    return st.one_of(st.integers(2, 16), width_policies())


@st.composite
def tree_proposers(draw, sc: Scenario) -> TreeProposer:
    eos = tuple(sorted(sc.options.eos_token_ids))
    return TreeProposer(
        OracleProposer(sc.model, sc.rules, len(sc.prompt)),
        draw(st.integers(0, 2**31), label="tree seed"),
        draw(st.sampled_from(SHAPES), label="tree shape"),
        draw(st.sampled_from([0, 0, 0, 1, 3, 8]), label="overshoot"),
        eos,
    )


def check_kv(backend: FakeBackend, want: tuple[int, ...]) -> None:
    """The backend's KV is plain decoding's for a prefix of ``want`` (the prompt and plain decoding's output)."""
    resident = backend.resident_tokens()
    assert resident == want[: len(resident)], (resident, want)
    assert backend.resident_hashes() == backend.model.context_hashes(resident)


class KvCheckingBackend(FakeBackend):
    """A ``FakeBackend`` that checks its KV (``check_kv``) before every pass and counts its tree passes."""

    want: tuple[int, ...] = ()
    tree_passes = 0
    moved = 0

    def _run(self, tokens, position, what):
        check_kv(self, self.want)
        return super()._run(tokens, position, what)

    def verify_tree(self, tokens, parents, base):
        check_kv(self, self.want)
        self.tree_passes += 1
        return super().verify_tree(tokens, parents, base)

    def keep_path(self, start, nodes):
        self.moved += 1
        super().keep_path(start, nodes)


@attrs.frozen
class Outcome:
    tokens: tuple[int, ...]
    text: str
    finish_reason: object
    stop_matched: object
    logprobs: object
    stream: tuple
    error: type | None


def decode(backend: FakeBackend, sc: Scenario, options, proposer, width) -> Outcome:
    stream: list = []
    error = None
    try:
        generation = Generation(backend, sc.prompt, options, proposer, draft_width=width, detokenize=sc.detokenize)
        for commit in generation:
            stream.append((commit.token_id, commit.text))
        result = generation.result()
    except GenerationError as exc:
        result, error = exc.partial, type(exc.__cause__)
    return Outcome(
        tuple(result.token_ids), result.text, result.finish_reason, result.stop_matched, result.logprobs,
        tuple(stream), error,
    )  # fmt: skip


def constrained(sc: Scenario, data) -> Scenario:
    """One scenario in eight gets a fake grammar."""
    if data.draw(st.integers(0, 7), label="grammar?") != 0:
        return sc
    grammar = data.draw(fake_grammars(sc.model.vocab_size, sc.options.eos_token_ids), label="grammar")
    return attrs.evolve(sc, options=attrs.evolve(sc.options, grammar=grammar))


@settings(max_examples=examples(160))
@given(scenarios(), st.data())
def test_a_tree_drafting_generation_is_plain_decoding(sc, data):
    sc = constrained(sc, data)
    proposer = data.draw(tree_proposers(sc), label="proposer")
    tree_rows = data.draw(st.sampled_from([True, True, True, True, False]), label="tree rows")
    picks = sc.options.top_logprobs == 0 and data.draw(st.booleans(), label="device picks")
    width = data.draw(widths(), label="width")
    plain = decode(FakeBackend(sc.model, sc.capacity), sc, sc.options, None, 1)

    backend = KvCheckingBackend(sc.model, sc.capacity, picks_on_device=picks, tree_rows=tree_rows)
    backend.want = (*sc.prompt, *plain.tokens)
    spec = decode(backend, sc, sc.options, forcing(proposer, sc.options, len(sc.prompt)), width)
    check_kv(backend, backend.want)
    assert spec == plain
    limit = min(sc.options.max_context or sc.capacity, sc.capacity, len(sc.prompt) + sc.options.max_tokens)
    assert backend.peak_len <= limit - 1  # no pass wrote a position that could not be committed
    if backend.tree_passes:
        event("a tree row was verified")
    if backend.moved:
        event("an accepted path was moved into place")
    if not tree_rows:
        assert backend.tree_passes == 0
    event(f"ended by {spec.finish_reason or spec.error}")


class KvCheckingBatchBackend(FakeBatchBackend):
    """Counts tree rows and the paths kept out of place."""

    tree_rows_run = 0
    moved = 0

    def run_pass(self, rows):
        self.tree_rows_run += sum(row.parents is not None for row in rows)
        return super().run_pass(rows)

    def keep_path(self, slot, start, nodes):
        self.moved += 1
        super().keep_path(slot, start, nodes)


@st.composite
def batches(draw):
    model = draw(fake_models())
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        sc = draw(scenarios(model=model))
        sc = attrs.evolve(sc, options=folded(sc))
        kind = draw(st.sampled_from(["tree", "tree", "chain", "plain"]))
        if kind == "tree":
            proposer = draw(tree_proposers(sc))
        else:
            proposer = draw(proposers_for(model, sc.rules, len(sc.prompt))) if kind == "chain" else None
        requests.append((sc, proposer, draw(widths()), draw(st.integers(0, 6))))
    return model, requests, draw(st.integers(1, 3)), draw(st.sampled_from([True, True, False])), draw(st.booleans())


def folded(sc: Scenario):
    """The scenario's options with its capacity folded into ``max_context``: one backend serves every slot."""
    if sc.capacity >= UNBOUNDED:
        return sc.options
    return attrs.evolve(sc.options, max_context=min(sc.capacity, sc.options.max_context or sc.capacity))


@settings(max_examples=examples(60))
@given(batches())
def test_tree_drafting_sequences_in_a_batch_are_plain_decoding(batch):
    model, requests, slots, tree_rows, ragged = batch
    plain = [decode(FakeBackend(model, UNBOUNDED), sc, sc.options, None, 1) for sc, *_ in requests]
    backend = KvCheckingBatchBackend(model, slots, UNBOUNDED, tree_rows=tree_rows, ragged_rows=ragged)
    driver = BatchDriver(backend, prefill_chunk=8)
    sequences: dict[int, object] = {}
    tick = 0
    while True:
        for i, (sc, proposer, width, join_at) in enumerate(requests):
            if i not in sequences and join_at <= tick:
                sequences[i] = driver.submit(sc.prompt, sc.options, proposer, draft_width=width,
                                             detokenize=sc.detokenize)  # fmt: skip
        if not driver.step() and len(sequences) == len(requests):
            break
        tick += 1
        for i, sequence in sequences.items():  # after every pass: each running slot holds plain decoding's KV
            if sequence.slot is not None and sequence in driver.running:
                slot = backend.slot_backend(sequence.slot)
                check_kv(slot, (*requests[i][0].prompt, *plain[i].tokens))
                if sequence.phase is Phase.DECODING:
                    assert slot.current_len() == sequence.state.kv_len
    for i in range(len(requests)):
        result, error = sequences[i].result(), sequences[i].error
        got = (tuple(result.token_ids), result.text, result.finish_reason, result.stop_matched, result.logprobs)
        want = plain[i]
        assert got == (want.tokens, want.text, want.finish_reason, want.stop_matched, want.logprobs)
        assert (error is None) == (want.error is None)
    if backend.tree_rows_run:
        event("a batch pass carried a tree row")
    if backend.moved:
        event("an accepted path was moved into place")
    if not tree_rows:
        assert backend.tree_rows_run == 0
