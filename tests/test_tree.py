"""Example-based tests of token-tree drafts: the ``DraftTree`` value and its attention rule (``core/tree.py``), the
core's accept rule over a tree (``core/state.py``), the fake backend's tree rows and compaction
(``backends/fake.py``), the protocol checks (``backends/base.py``) and the driver's use of them
(``ortspec/sequence.py``). The Hypothesis property is ``property_tests/test_trees.py``."""

from __future__ import annotations

import numpy as np
import pytest

import ortspec.backends.fake as fake_module
from ortspec import BatchDriver, Generation, generate
from ortspec.backends.base import BackendError, BatchRow, OneSlot, check_batch, runs_trees
from ortspec.backends.fake import FakeBackend, FakeBatchBackend, FakeModel
from ortspec.core import DraftContext, ForcedTokens, LookupOrDraft, Options, PromptLookup, Sampling
from ortspec.core.state import DecodeState, check_draft, draft_budget, step, step_from_picks, take_draft
from ortspec.core.tokens import Shared
from ortspec.core.tree import DraftTree, tree_mask, walk
from ortspec.core.width import FixedWidth, TreeBudget
from tests.support.grammars import FakeGrammar

V = 16
PROMPT = (1, 2, 3)


def onehot(pick: int, v: int = V) -> np.ndarray:
    row = np.zeros(v, dtype=np.float32)
    row[pick] = 5.0
    return row


def start(**options) -> DecodeState:
    return DecodeState.start(PROMPT, Options(**{"max_tokens": 20, **options}))


# --------------------------------------------------------------------------------------------------------------
# The value


def test_a_tree_knows_its_shape():
    #        root
    #      /  |   \
    #     0:4 1:5  2:4
    #     |        |
    #     3:6      4:7
    #              |
    #              5:8
    tree = DraftTree((4, 5, 4, 6, 7, 8), (-1, -1, -1, 0, 2, 4))
    assert len(tree) == 6
    assert tree.depths == (0, 0, 0, 1, 1, 2)
    assert tree.children(-1) == (0, 1, 2) and tree.children(0) == (3,) and tree.children(2) == (4,)
    assert tree.children(5) == ()
    assert tree.child_with(-1, 4) == 0  # the lowest-index child of that token
    assert tree.child_with(-1, 9) is None
    assert tree.path(5) == (2, 4, 5) and tree.path(-1) == ()
    assert tree.before(0) == () and tree.before(6) == (4, 7, 8)  # row 6 is node 5's
    assert not tree.is_chain
    assert tree.first_branch() == DraftTree.chain((4, 6))
    assert tree.cut(3) == DraftTree((4, 5, 4), (-1, -1, -1)) and tree.cut(99) is tree and len(tree.cut(-1)) == 0
    with pytest.raises(IndexError):
        tree.children(6)


def test_a_chain_is_the_tree_with_one_branch():
    chain = DraftTree.chain((7, 8, 9))
    assert chain.parents == (-1, 0, 1) and chain.depths == (0, 1, 2) and chain.is_chain
    assert DraftTree((), ()).is_chain and DraftTree.chain(()) == DraftTree((), ())
    assert chain.first_branch() == chain


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ((1, 2), (-1, 1), "node 1's parent is 1"),
        ((1,), (0,), "node 0's parent is 0"),
        ((1, 2), (-1, -2), "node 1's parent is -2"),
        ((1, 2), (-1,), "2 tokens but 1 parents"),
        ((1, -3), (-1, 0), "-3 is not a token id"),
        ((1, 2.0), (-1, 0), "2.0 is not a token id"),
        ((1, 2), (-1, 0.5), "parents\\[1\\] = 0.5 is not an int"),
    ],
)
def test_a_tree_that_is_not_one_is_refused_with_the_reason(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents)


def test_a_tree_drafted_after_a_prefix_and_split_back():
    tree = DraftTree((4, 5, 6), (-1, -1, 0))
    grafted = tree.after((8, 9))
    assert grafted == DraftTree((8, 9, 4, 5, 6), (-1, 0, 1, 1, 2))
    assert grafted.below(2) == tree and tree.after(()) == tree and tree.below(0) == tree
    assert grafted.cut(4).below(2) == tree.cut(2)
    with pytest.raises(ValueError, match="not a chain"):
        DraftTree((4, 5, 6), (-1, -1, 0)).below(1)


def test_the_mask_lets_a_row_see_itself_and_its_ancestors_only():
    mask = tree_mask((-1, -1, 0, 2))  # rows: pending, node 0, node 1, node 2 (child of 0), node 3 (child of 2)
    want = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],  # node 1 does not see its earlier sibling, node 0
            [1, 1, 0, 1, 0],
            [1, 1, 0, 1, 1],
        ],
        dtype=bool,
    )
    assert mask.dtype == bool and np.array_equal(mask, want)
    assert np.array_equal(tree_mask((-1, 0, 1)), np.tril(np.ones((4, 4), dtype=bool)))  # a chain: causal
    assert tree_mask(()).shape == (1, 1)
    with pytest.raises(ValueError, match="parent"):
        tree_mask((-1, 3))


# --------------------------------------------------------------------------------------------------------------
# The accept rule


def test_the_walk_follows_the_lowest_index_child_that_matches():
    tree = DraftTree((4, 5, 4, 6), (-1, -1, -1, 2))
    picks = {0: 4, 1: 9, 2: 0, 3: 6, 4: 1}  # row 1 is node 0's, row 3 node 2's
    walked = walk(tree, picks.__getitem__)
    assert walked.candidates == [4, 9] and walked.path == (0,) and walked.rows == (0, 1)


def test_a_step_accepts_along_the_branch_the_picks_take():
    # The continuation is on the second branch: node 1 (4), node 2 (6), node 3 (7); node 0 is a wrong guess.
    tree = DraftTree((5, 4, 6, 7), (-1, -1, 1, 2))
    s = start()
    rows = np.stack([onehot(9), onehot(6), onehot(7), onehot(8)])
    outcome = step(s, onehot(4), rows, tree)
    assert [c.token_id for c in outcome.commits] == [4, 6, 7, 8]
    assert outcome.accepted == 3 and outcome.kept_nodes == (1, 2, 3)
    assert outcome.rewind_to == s.kv_len + 4 == outcome.state.kv_len
    assert outcome.state.stats.proposed_tokens == 4 and outcome.state.stats.accepted_tokens == 3
    same = step_from_picks(s, [4, 9, 6, 7, 8], tree, vocab_size=V)
    assert same == outcome


def test_duplicate_siblings_are_walked_through_the_lowest_index_one():
    # Node 0 and node 2 both hold 4; only node 2 has children. The walk takes node 0, whatever node 2's subtree holds.
    tree = DraftTree((4, 5, 4, 6), (-1, -1, -1, 2))
    s = start()
    rows = np.stack([onehot(9), onehot(0), onehot(6), onehot(1)])
    outcome = step(s, onehot(4), rows, tree)
    assert [c.token_id for c in outcome.commits] == [4, 9]
    assert outcome.accepted == 1 and outcome.kept_nodes == (0,)


def test_a_sampled_path_through_a_tree_is_picked_as_the_same_chain_is():
    # Seeded sampling with a penalty: each pick reads its index (the depth) and the draft tokens before it (the path).
    s = start(sampling=Sampling(temperature=1.0, seed=11, repetition_penalty=1.3), top_logprobs=2)
    rng = np.random.default_rng(4)
    base, path_rows = rng.standard_normal(V).astype(np.float32), rng.standard_normal((3, V)).astype(np.float32)
    chain: list[int] = []
    for k in range(3):  # the target's own picks, so the chain is accepted whole
        chain.append(step(s, base, path_rows[:k] if k else None, tuple(chain)).commits[k].token_id)
    want = step(s, base, path_rows, tuple(chain))
    assert want.accepted == 3
    wrong = [(t + 1) % V for t in chain]
    # node 0: a wrong guess; nodes 1, 3, 4: the chain; node 2: a wrong child of node 1
    tree = DraftTree((wrong[0], chain[0], wrong[1], chain[1], chain[2]), (-1, -1, 1, 1, 3))
    rows = rng.standard_normal((5, V)).astype(np.float32)
    rows[[1, 3, 4]] = path_rows
    got = step(s, base, rows, tree)
    assert got.commits == want.commits and got.state.generated_tokens == want.state.generated_tokens
    assert got.accepted == 3 and got.kept_nodes == (1, 3, 4)


def test_kept_nodes_stop_below_the_kv_the_step_keeps():
    tree = DraftTree((5, 4, 6), (-1, -1, 1))
    s = start(eos_token_ids={6})  # the EOS token is accepted: the step ends there, with no bonus token
    outcome = step(s, onehot(4), np.stack([onehot(9), onehot(6), onehot(7)]), tree)
    assert [c.token_id for c in outcome.commits] == [4, 6]
    assert outcome.accepted == 2 and outcome.kept_nodes == (1,)
    assert outcome.rewind_to == s.kv_len + 1 + len(outcome.kept_nodes)
    nothing = step(s, onehot(7), np.stack([onehot(9), onehot(6), onehot(7)]), tree)  # no child matches
    assert nothing.accepted == 0 and nothing.kept_nodes == ()


def test_a_chain_step_keeps_its_nodes_in_place():
    outcome = step(start(), onehot(4), np.stack([onehot(5), onehot(6)]), (4, 5))
    assert outcome.kept_nodes == (0, 1) and outcome.accepted == 2


def test_a_tree_is_bounded_by_the_budget_in_nodes():
    s = start(max_tokens=4)  # budget: 3
    assert draft_budget(s) == 3
    assert check_draft(s, DraftTree((4, 5, 6), (-1, -1, -1)), V) == DraftTree((4, 5, 6), (-1, -1, -1))
    with pytest.raises(ValueError, match="a draft tree of 4 nodes exceeds this step's budget of 3"):
        check_draft(s, DraftTree((4, 5, 6, 7), (-1, -1, -1, -1)), V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_draft(s, DraftTree((4, V), (-1, -1)), V)


def test_taking_a_tree_cuts_it_by_nodes_and_reduces_it_where_trees_do_not_run():
    s = start()
    tree = DraftTree((4, 5, 6, 7, 8), (-1, -1, 0, 2, 1))
    assert take_draft(s, tree, 3, V, trees=True) == DraftTree((4, 5, 6), (-1, -1, 0))
    assert take_draft(s, tree, 8, V) == (4, 6, 7)  # the first branch, as a chain
    assert take_draft(s, tree, 2, V) == (4, 6)
    assert take_draft(s, tree, 1, V, trees=True) == (4,)  # one branch left: the chain it is
    assert take_draft(s, DraftTree((), ()), 4, V, trees=True) == ()


# --------------------------------------------------------------------------------------------------------------
# The fake backend's tree rows


@pytest.fixture
def model():
    return FakeModel(vocab_size=32, seed=5, markov=0.5)


CONTEXT = (3, 1, 4, 1, 5)
TREE = DraftTree((7, 8, 7, 9, 2, 6), (-1, -1, -1, 0, 2, 4))


def test_each_tree_row_is_the_row_of_its_path_alone(model):
    backend = FakeBackend(model)
    backend.decode(CONTEXT[:-1], 0)
    rows = backend.verify_tree((CONTEXT[-1], *TREE.tokens), TREE.parents, len(CONTEXT) - 1)
    assert rows.shape == (len(TREE) + 1, 32) and rows.dtype == np.float32
    assert backend.current_len() == len(CONTEXT) + len(TREE)
    np.testing.assert_array_equal(rows[0], model.logits_for(CONTEXT))
    for j in range(len(TREE)):
        np.testing.assert_array_equal(rows[j + 1], model.logits_for((*CONTEXT, *TREE.before(j + 1))))


def test_a_mask_that_lets_a_node_see_its_sibling_changes_its_row(model, monkeypatch):
    backend = FakeBackend(model)
    backend.decode(CONTEXT[:-1], 0)
    right = backend.verify_tree((CONTEXT[-1], *TREE.tokens), TREE.parents, len(CONTEXT) - 1)

    def sees_a_sibling(parents):
        mask = tree_mask(parents)
        mask[3, 1] = True  # node 2 (row 3) sees node 0 (row 1), its earlier sibling
        return mask

    monkeypatch.setattr(fake_module, "tree_mask", sees_a_sibling)
    backend.rewind(len(CONTEXT) - 1)
    wrong = backend.verify_tree((CONTEXT[-1], *TREE.tokens), TREE.parents, len(CONTEXT) - 1)
    changed = [a for a in range(len(TREE) + 1) if not np.array_equal(right[a], wrong[a])]
    assert 3 in changed
    np.testing.assert_array_equal(right[:3], wrong[:3])  # the rows that do not see node 2 are unchanged


def test_keeping_a_path_leaves_the_kv_plain_decoding_writes(model):
    backend = FakeBackend(model)
    base = len(CONTEXT) - 1
    backend.decode(CONTEXT[:-1], 0)
    backend.verify_tree((CONTEXT[-1], *TREE.tokens), TREE.parents, base)
    backend.keep_path(base, (2, 4, 5))  # tokens 7, 2, 6
    backend.rewind(base + 4)
    plain = FakeBackend(model)
    plain.decode((*CONTEXT, 7, 2, 6), 0)
    assert backend.resident_tokens() == plain.resident_tokens()
    assert backend.resident_hashes() == plain.resident_hashes()
    np.testing.assert_array_equal(backend.decode([3], base + 4), plain.decode([3], base + 4))


@pytest.mark.parametrize(
    "start_at, nodes, message",
    [(4, (2, 1), "strictly increasing"), (4, (0, 6), "cannot be kept"), (-1, (0,), "not a position")],
)
def test_a_path_that_is_not_one_is_refused_and_nothing_moves(model, start_at, nodes, message):
    backend = FakeBackend(model)
    backend.decode(CONTEXT[:-1], 0)
    backend.verify_tree((CONTEXT[-1], *TREE.tokens), TREE.parents, len(CONTEXT) - 1)
    before = (backend.resident_tokens(), backend.resident_hashes())
    with pytest.raises(BackendError, match=message):
        backend.keep_path(start_at, nodes)
    assert (backend.resident_tokens(), backend.resident_hashes()) == before


def test_a_tree_row_goes_only_to_a_backend_that_runs_trees(model):
    row = BatchRow(0, (1, 2, 3), 0, parents=(-1, -1))
    assert runs_trees(FakeBatchBackend(model, 2)) and not runs_trees(FakeBatchBackend(model, 2, tree_rows=False))
    with pytest.raises(BackendError, match="token tree, which this backend does not run"):
        check_batch([row], FakeBatchBackend(model, 2, tree_rows=False))
    with pytest.raises(BackendError, match="token tree, which this backend does not run"):
        OneSlot(FakeBackend(model, tree_rows=False)).run_pass([row])
    with pytest.raises(BackendError, match="2 nodes after the pending token but 1 parents"):
        check_batch([BatchRow(0, (1, 2, 3), 0, parents=(-1,))], FakeBatchBackend(model, 2))
    with pytest.raises(BackendError, match="node 1's parent is 1"):
        check_batch([BatchRow(0, (1, 2, 3), 0, parents=(-1, 1))], FakeBatchBackend(model, 2))
    with pytest.raises(BackendError, match="last_logits None"):
        check_batch([BatchRow(0, (1, 2, 3), 0, last_logits=1, parents=(-1, -1))], FakeBatchBackend(model, 2))


def test_one_slot_runs_a_tree_row_as_logits_or_picks(model):
    backend = FakeBackend(model, picks_on_device=True)
    slot = OneSlot(backend)
    assert slot.tree_rows
    slot.run_pass([BatchRow(0, CONTEXT[:-1], 0)])
    tokens = (CONTEXT[-1], *TREE.tokens)
    (rows,) = slot.run_pass([BatchRow(0, tokens, len(CONTEXT) - 1, parents=TREE.parents)])
    slot.rewind(0, len(CONTEXT) - 1)
    (picks,) = slot.run_pass([BatchRow(0, tokens, len(CONTEXT) - 1, picks=True, parents=TREE.parents)])
    assert np.array_equal(picks.ids, np.argmax(rows, axis=1))
    slot.keep_path(0, len(CONTEXT) - 1, (1,))
    assert backend.resident_tokens()[len(CONTEXT)] == TREE.tokens[1]


# --------------------------------------------------------------------------------------------------------------
# The driver


class TreeOfGuesses:
    """A tree whose first branch is wrong and whose second holds the true continuation (greedy): the tree row is
    needed to accept anything, and the accepted path is never in place."""

    def __init__(self, model: FakeModel) -> None:
        self.model = model

    def propose(self, context: DraftContext):
        truth = self.model.greedy(context.tokens, 3)
        wrong = (truth[0] + 1) % self.model.vocab_size
        return DraftTree((wrong, truth[0], truth[1], truth[2]), (-1, -1, 1, 2))


class RecordingBatchBackend(FakeBatchBackend):
    """Records every row and every ``keep_path`` call; checks before each pass that every slot with a row holds the
    KV plain decoding writes for its resident tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[BatchRow] = []
        self.kept: list[tuple[int, int, tuple[int, ...]]] = []

    def run_pass(self, rows):
        for row in rows:
            slot = self.slot_backend(row.slot)
            assert slot.resident_hashes() == self.model.context_hashes(slot.resident_tokens())
        self.rows.extend(rows)
        return super().run_pass(rows)

    def keep_path(self, slot, start, nodes):
        self.kept.append((slot, start, tuple(nodes)))
        super().keep_path(slot, start, nodes)


@pytest.mark.parametrize("tree_rows", [True, False])
def test_the_driver_verifies_a_tree_whole_or_its_first_branch(model, tree_rows):
    prompt, options = (3, 1, 4, 1, 5, 9), Options(max_tokens=12)
    backend = RecordingBatchBackend(model, 2, tree_rows=tree_rows)
    driver = BatchDriver(backend)
    tree_seq = driver.submit(prompt, options, TreeOfGuesses(model), draft_width=4)
    plain_seq = driver.submit(prompt[:3], options)
    driver.run()
    assert tree_seq.result().token_ids == tuple(model.greedy(prompt, 12))
    assert plain_seq.result().token_ids == tuple(model.greedy(prompt[:3], 12))
    decode_rows = [r for r in backend.rows if r.slot == tree_seq.slot and r.position >= len(prompt)]
    if tree_rows:
        assert all(r.parents == (-1, -1, 1, 2) for r in decode_rows if len(r.tokens) == 5)
        assert backend.kept and all(nodes[0] == 1 for _, _, nodes in backend.kept)
        assert tree_seq.result().stats.accepted_tokens > 0
    else:  # the first branch alone: one wrong token, never accepted
        assert all(r.parents is None and len(r.tokens) <= 2 for r in decode_rows)
        assert not backend.kept and tree_seq.result().stats.accepted_tokens == 0


@pytest.mark.parametrize("tree_rows", [True, False])
def test_a_lone_generation_takes_a_tree_or_its_first_branch(model, tree_rows):
    prompt, options = (2, 7, 1, 8), Options(max_tokens=15)
    backend = FakeBackend(model, picks_on_device=True, tree_rows=tree_rows)
    run = Generation(backend, prompt, options, TreeOfGuesses(model), draft_width=8)
    result = run.run()
    assert result.token_ids == generate(FakeBackend(model), prompt, options).token_ids
    assert (result.stats.accepted_tokens > 0) == tree_rows
    assert backend.resident_hashes() == model.context_hashes(backend.resident_tokens())


def test_forced_tokens_hang_an_inner_tree_below_them():
    grammar = FakeGrammar(V, (((3, 1),), ((4, 0), (5, 0), (6, 0))), frozenset({1}))  # 3 is forced first

    class Inner:
        def __init__(self) -> None:
            self.seen = None

        def propose(self, context):
            return DraftTree((5, 6, 4), (-1, -1, 0))

        def observe(self, context, draft, accepted):
            self.seen = (tuple(context.tokens), draft, accepted)
            return self

    inner = Inner()
    forced = ForcedTokens(grammar, 2, inner)
    context = DraftContext((1, 2), 8)
    tree = forced.propose(context)
    assert tree == DraftTree((3, 5, 6, 4), (-1, 0, 0, 1))
    forced.observe(context, tree, 2)
    assert inner.seen == ((1, 2, 3), DraftTree((5, 6, 4), (-1, -1, 0)), 1)


def test_auto_cuts_a_drafters_tree_to_its_width():
    class Drafter:
        def propose(self, context):
            return DraftTree((1, 2, 3, 4, 5), (-1, -1, 0, 1, 2))

    auto = LookupOrDraft(PromptLookup(), Drafter())
    assert auto.propose(DraftContext((7, 8, 9), 3, slot=0)) == DraftTree((1, 2, 3), (-1, -1, 0))


def test_auto_sizes_each_sources_tree_by_that_sources_budget_and_teaches_it_alone():
    from ortspec.core import CostAwareWidth

    class Drafter:
        def __init__(self):
            self.asked = []

        def propose(self, context):
            self.asked.append(context.nodes)
            return DraftTree((1, 2, 3, 4, 5, 6, 7, 8), (-1, 0, 1, -1, -1, 0, 1, 2))

    flat = (1.0,) * 17
    drafter = Drafter()
    granting = CostAwareWidth(flat, tree=TreeBudget(flat, max_branches=2, branch_tokens=8.0))
    auto = LookupOrDraft(PromptLookup(), drafter).priced(CostAwareWidth(flat), granting)
    context = DraftContext((7, 8, 9), 3, slot=0, nodes=16)
    draft = auto.propose(context)
    assert drafter.asked == [6] and draft == DraftTree((1, 2, 3, 4, 5, 6), (-1, 0, 1, -1, -1, 0))  # 2 x the width
    learned = auto.observe(context, draft.first_branch().tokens, 1).observe_tree(3, 1, 3, 1)
    assert learned.drafted_by == "drafter_policy" and learned.lookup_policy == auto.lookup_policy
    assert learned.drafter_policy.tree != auto.drafter_policy.tree
    assert learned.drafter_policy.tree == auto.drafter_policy.tree.observe(3, 1, 3, 1)
    # where the backend runs no trees the context grants no nodes, and the drafter is asked without them
    auto.propose(DraftContext((7, 8, 9), 3, slot=0))
    assert drafter.asked[-1] is None


def test_merged_keeps_the_first_branch_whole_and_spreads_the_rest_level_by_level():
    tree = DraftTree.merged([(1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9)], 6)
    assert tree == DraftTree((1, 2, 3, 4, 7, 8), (-1, 0, 1, 2, -1, 4))  # (1, 2) shared; then each level in order
    assert tree.first_branch().tokens == (1, 2, 3, 4)
    assert DraftTree.merged([(1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9)], 8).tokens == (1, 2, 3, 4, 7, 8, 5, 9)
    assert DraftTree.merged([(1, 2, 3, 4)], 3) == DraftTree.chain((1, 2, 3))
    assert DraftTree.merged([(1, 2), (3, 4), (5, 6)], 2) == DraftTree.chain((1, 2))
    assert DraftTree.merged([(1, 2), (3, 4), (5, 6)], 4) == DraftTree((1, 2, 3, 5), (-1, 0, -1, -1))
    assert len(DraftTree.merged([(1, 2), (1, 2)], 8)) == 2 and len(DraftTree.merged([], 4)) == 0


# the suffix (1, 2, 3) occurs three times before the end, followed by 9 9, 7 7 and 5 5
BRANCHY = (1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3, 5, 5, 1, 2, 3)


@pytest.mark.parametrize("shared", [False, True])
def test_prompt_lookup_with_branches_drafts_the_recent_occurrences_as_a_tree(shared):
    context = Shared.of(BRANCHY) if shared else BRANCHY
    tree = PromptLookup(branches=3).propose(DraftContext(context, 2, nodes=6))
    assert tree == DraftTree((5, 5, 7, 9, 7, 9), (-1, 0, -1, -1, 2, 3))  # the first branch whole, then level by level
    assert tree.first_branch().tokens == PromptLookup().propose(DraftContext(context, 2))
    # without a node budget beyond the width, the first branch fills it: the chain
    assert PromptLookup(branches=3).propose(DraftContext(context, 6)) == PromptLookup().propose(
        DraftContext(context, 6)
    )
    agreeing = (4, 5, 6, 4, 5, 6, 4, 5)  # every occurrence of (4, 5) continues alike: a chain
    assert PromptLookup(branches=3).propose(DraftContext(agreeing, 3)) == PromptLookup().propose(
        DraftContext(agreeing, 3)
    )
    assert PromptLookup(branches=3).propose(DraftContext((1, 2, 3), 4)) == ()


@pytest.mark.parametrize("tree_rows", [True, False])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, seed=3)], ids=["greedy", "seeded"])
def test_prompt_lookup_with_branches_equals_plain_decoding(model, tree_rows, sampling):
    options = Options(max_tokens=24, sampling=sampling)
    backend = RecordingBatchBackend(model, 2, tree_rows=tree_rows)
    driver = BatchDriver(backend)
    prompts = [BRANCHY, (2, 7, 1, 8, 2, 7, 1, 8, 2, 7)]
    width = FixedWidth(6, tree=TreeBudget((1.0,) * 25))  # flat costs: every node pays
    sequences = [driver.submit(p, options, PromptLookup(branches=3), draft_width=width) for p in prompts]
    driver.run()
    for prompt, sequence in zip(prompts, sequences, strict=True):
        assert sequence.result().token_ids == generate(FakeBackend(model), prompt, options).token_ids
    assert any(r.parents is not None for r in backend.rows) == tree_rows


def test_within_keeps_the_first_nodes_above_a_depth_and_renumbers_their_parents():
    tree = DraftTree((1, 2, 3, 4, 5, 6), (-1, 0, 1, -1, 3, 4))
    assert tree.within(6, 2) == DraftTree((1, 2, 4, 5), (-1, 0, -1, 2))
    assert tree.within(3, 9) == tree.cut(3) and tree.within(9, 9) is tree and len(tree.within(4, 0)) == 0
    assert tree.first_branch_nodes() == (0, 1, 2)


def test_with_siblings_hangs_the_likeliest_candidates_beside_the_chain():
    chain = (10, 11, 12)
    siblings = [[(20, 0.3), (21, 0.1)], [(22, 0.2), (11, 0.9)], [(23, 0.05)], [(24, 0.25)], [(25, 0.9)]]
    tree = DraftTree.with_siblings(chain, siblings, 6)
    # the chain first; then by chance: 20 (0.3) beside 10, 22 (0.2) beside 11, 21 (0.1); 11 duplicates the chain's
    # own token at depth 1, and depths 3 and 4 are below the chain (a child of its last node would lengthen it)
    assert tree == DraftTree((10, 11, 12, 20, 22, 21), (-1, 0, 1, -1, 0, -1))
    assert tree.first_branch().tokens == chain
    assert DraftTree.with_siblings(chain, siblings, 2) == DraftTree.chain((10, 11))
    twins = [[(5, 0.5), (5, 0.4), (7, 0.3), (6, 0.1)]]  # a repeated candidate, and the chain's own token
    assert DraftTree.with_siblings((7,), twins, 4) == DraftTree((7, 5, 6), (-1,) * 3)
    assert len(DraftTree.with_siblings((), [[(5, 0.5)]], 4)) == 0
    assert DraftTree.with_siblings(chain, [], 8) == DraftTree.chain(chain)
