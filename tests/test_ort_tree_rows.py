"""Token-tree rows on ``OrtBatchBackend`` (``BackendConfig(tree_rows=True)``: the graph rewritten by
``backends/onnx/tree_rewrite.py``): a tree row gives each node the logits of its path run alone as a chain, the
accepted path's KV moved into place continues as plain decoding would, chain passes on the rewritten graph equal the
file's, and ``BatchDriver`` with a proposer that drafts trees gives every request what ``generate`` gives it alone,
greedy and seeded, moving paths that are not the first branch."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec import BatchDriver, BatchRow, DraftTree, Options, Sampling, generate
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig, OrtBackend, OrtBatchBackend

ROW_TOLERANCE = 1e-5  # float32 max abs difference: a tree row against the same path run alone (tests/test_ort_batch.py)
MAX_LENGTH = 64
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 20, 21], [3]]
# node j's parent (-1: the pending token): two roots, a node with two children, a chain of three under the second
PARENTS = (-1, 0, -1, 2, 2, 4, 5)


@pytest.fixture(scope="module")
def config():
    return BackendConfig(threads=1, max_length=MAX_LENGTH, tree_rows=False)


@pytest.fixture(scope="module")
def single(tiny_model_dir, config):
    return OrtBackend.from_folder(tiny_model_dir, config)


@pytest.fixture()
def trees(tiny_model_dir, config):
    return OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=MAX_LENGTH, tree_rows=True))


def alone(single: OrtBackend, context: list[int]) -> np.ndarray:
    """The logits row after ``context`` decoded alone."""
    single.reset()
    return single.decode_verify(context, 0)[-1].copy()


def path_of(parents: tuple[int, ...], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_a_tree_row_gives_each_node_its_paths_logits(trees, single):
    assert trees.tree_rows
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, trees.vocab_size, 10).tolist()
    nodes = rng.integers(0, trees.vocab_size, len(PARENTS)).tolist()
    trees.run_pass([BatchRow(1, prompt, 0)])
    pending = int(rng.integers(0, trees.vocab_size))
    out = trees.run_pass([BatchRow(1, (pending, *nodes), len(prompt), parents=PARENTS)])[0]
    assert out.shape == (len(PARENTS) + 1, trees.vocab_size)
    assert np.abs(out[0] - alone(single, [*prompt, pending])).max() <= ROW_TOLERANCE
    for j in range(len(PARENTS)):
        context = [*prompt, pending, *(nodes[i] for i in path_of(PARENTS, j))]
        assert np.abs(out[j + 1] - alone(single, context)).max() <= ROW_TOLERANCE, f"node {j}"
    assert trees.current_len(1) == len(prompt) + 1 + len(PARENTS)


def test_a_tree_row_shares_a_run_with_other_rows_and_each_row_gets_its_own_logits(trees, single):
    """With ragged runs, a tree row beside a plain decode, a chain verify and another tree (its own bias each) is one
    session run whose every row gives what that row's path gives alone."""
    assert trees.ragged_rows
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, trees.vocab_size, n).tolist() for n in (10, 6, 9, 4)]
    for slot, prompt in enumerate(prompts):
        trees.run_pass([BatchRow(slot, prompt, 0)])
    other = (-1, -1, 1)  # a second tree of another shape: two roots, the second with a child
    drafts = [rng.integers(0, trees.vocab_size, n).tolist() for n in (len(PARENTS), 0, 3, len(other))]
    pending = rng.integers(0, trees.vocab_size, 4).tolist()
    parents = [PARENTS, None, None, other]
    rows = [
        BatchRow(slot, (pending[slot], *drafts[slot]), len(prompts[slot]), parents=parents[slot]) for slot in range(4)
    ]
    runs = trees.runs
    out = trees.run_pass(rows)
    assert trees.runs == runs + 1
    for slot in range(4):
        shape = parents[slot] if parents[slot] is not None else tuple(range(-1, len(drafts[slot]) - 1))
        for j in range(-1, len(drafts[slot])):
            path = [] if j < 0 else [drafts[slot][i] for i in path_of(shape, j)]
            expected = alone(single, [*prompts[slot], pending[slot], *path])
            assert np.abs(out[slot][j + 1] - expected).max() <= ROW_TOLERANCE, f"slot {slot} row {j + 1}"


def test_the_kept_path_continues_as_plain_decoding(trees, single):
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, trees.vocab_size, 7).tolist()
    nodes = rng.integers(0, trees.vocab_size, len(PARENTS)).tolist()
    trees.run_pass([BatchRow(0, prompt, 0)])
    trees.run_pass([BatchRow(0, (4, *nodes), len(prompt), parents=PARENTS)])
    kept = (2, 4, 5)  # the second root's branch: every node out of place
    trees.keep_path(0, len(prompt), kept)
    trees.rewind(0, len(prompt) + 1 + len(kept))
    nxt = int(rng.integers(0, trees.vocab_size))
    out = trees.run_pass([BatchRow(0, (nxt,), trees.current_len(0))])[0]
    context = [*prompt, 4, *(nodes[i] for i in kept), nxt]
    assert np.abs(out[0] - alone(single, context)).max() <= ROW_TOLERANCE


def test_chain_passes_on_the_rewritten_graph_equal_the_files(trees, tiny_model_dir, config):
    plain = OrtBatchBackend.from_folder(tiny_model_dir, config, slots=trees.slots)
    assert not plain.tree_rows
    rng = np.random.default_rng(3)
    for _ in range(12):
        rows = []
        for slot in range(trees.slots):
            new = int(rng.choice([1, 1, 3, 6]))
            if trees.current_len(slot) + new > MAX_LENGTH:
                trees.reset(slot)
                plain.reset(slot)
            rows.append(BatchRow(slot, rng.integers(0, trees.vocab_size, new).tolist(), trees.current_len(slot)))
        for ours, theirs in zip(trees.run_pass(rows), plain.run_pass(rows), strict=True):
            assert np.abs(ours - theirs).max() <= ROW_TOLERANCE


class OracleTree:
    """Drafts a tree around the continuation it was told (the request's plain output): a wrong branch first, then
    the true tokens below a sibling that is wrong, so the accepted path is never the first branch."""

    def __init__(self, prompt: list[int], output: list[int], vocab: int) -> None:
        self.prompt, self.output, self.vocab = prompt, output, vocab

    def propose(self, context):
        done = len(context.tokens) - len(self.prompt)
        true = self.output[done : done + 3]
        true += [(t + 7) % self.vocab for t in range(3 - len(true))]
        wrong = [(t + 1) % self.vocab for t in true]
        tokens = (wrong[0], wrong[1], true[0], wrong[1], true[1], true[2], true[2])
        return DraftTree(tokens, PARENTS)


@pytest.mark.parametrize(
    "options",
    [Options(max_tokens=12), Options(max_tokens=12, sampling=Sampling(temperature=0.8, seed=7))],
    ids=["greedy", "seeded"],
)
def test_the_batch_driver_with_tree_drafts_equals_generate_alone(trees, single, options):
    moved = []
    keep_path = trees.keep_path

    def recording(slot, start, nodes):
        moved.append(tuple(nodes))
        keep_path(slot, start, nodes)

    trees.keep_path = recording
    driver = BatchDriver(trees, prefill_chunk=5)
    expected = [list(generate(single, prompt, options).token_ids) for prompt in PROMPTS]
    sequences = [
        driver.submit(prompt, options, OracleTree(prompt, out, trees.vocab_size), draft_width=len(PARENTS))
        for prompt, out in zip(PROMPTS, expected, strict=True)
    ]
    driver.run()
    for sequence, out in zip(sequences, expected, strict=True):
        assert list(sequence.result().token_ids) == out
    assert any(len(path) >= 2 for path in moved)  # paths off the first branch were accepted and moved
    assert driver.passes < sum(len(out) for out in expected)  # several tokens per pass


@pytest.fixture(scope="module")
def single_trees(tiny_model_dir):
    return OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=MAX_LENGTH, tree_rows=True))


def test_the_one_sequence_backend_runs_a_tree_and_keeps_its_path(single_trees, single):
    """``OrtBackend`` opened with ``tree_rows=True`` (the dynamic binding: the CPU here, CUDA the same way): a tree
    pass gives each node its path's logits, chain passes on the rewritten graph give the file's, and the kept path
    continues as plain decoding."""
    backend = single_trees
    assert backend.tree_rows and not single.tree_rows
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, backend.vocab_size, 9).tolist()
    backend.reset()
    first = backend.decode_verify(prompt, 0)
    assert np.abs(first[-1] - alone(single, prompt)).max() <= ROW_TOLERANCE  # a chain pass: the file's logits
    nodes = rng.integers(0, backend.vocab_size, len(PARENTS)).tolist()
    out = backend.verify_tree((4, *nodes), PARENTS, len(prompt))
    assert out.shape == (len(PARENTS) + 1, backend.vocab_size)
    assert np.abs(out[0] - alone(single, [*prompt, 4])).max() <= ROW_TOLERANCE
    for j in range(len(PARENTS)):
        context = [*prompt, 4, *(nodes[i] for i in path_of(PARENTS, j))]
        assert np.abs(out[j + 1] - alone(single, context)).max() <= ROW_TOLERANCE, f"node {j}"
    kept = (2, 4, 5)  # the second root's branch
    backend.keep_path(len(prompt), kept)
    backend.rewind(len(prompt) + 1 + len(kept))
    nxt = int(rng.integers(0, backend.vocab_size))
    after = backend.decode([nxt], backend.current_len())
    assert np.abs(after - alone(single, [*prompt, 4, *(nodes[i] for i in kept), nxt])).max() <= ROW_TOLERANCE
    with pytest.raises(BackendError, match="position 0"):
        backend.reset() or backend.verify_tree((1, 2, 3), (-1, -1), 0)
    with pytest.raises(BackendError, match="parents"):
        backend.verify_tree((1, 2, 3), (-1,), 0)


@pytest.mark.parametrize(
    "options",
    [Options(max_tokens=12), Options(max_tokens=12, sampling=Sampling(temperature=0.8, seed=7))],
    ids=["greedy", "seeded"],
)
def test_generate_with_tree_drafts_on_the_one_sequence_backend_is_plain_decoding(single_trees, single, options):
    for prompt in PROMPTS:
        expected = list(generate(single, prompt, options).token_ids)
        proposer = OracleTree(prompt, expected, single.vocab_size)
        got = generate(single_trees, prompt, options, proposer, draft_width=len(PARENTS))
        assert list(got.token_ids) == expected
        assert got.stats.steps < len(expected)  # several tokens per pass


def test_tree_rows_are_refused_where_they_cannot_run(trees, tiny_model_dir, config):
    with pytest.raises(BackendError, match="position 0"):
        trees.run_pass([BatchRow(0, (1, 2, 3), 0, parents=(-1, -1))])
    plain = OrtBatchBackend.from_folder(tiny_model_dir, config, slots=2)
    plain.run_pass([BatchRow(0, (1, 2), 0)])
    with pytest.raises(BackendError, match="token tree"):
        plain.run_pass([BatchRow(0, (1, 2, 3), 2, parents=(-1, -1))])
    with pytest.raises(ValueError, match="static-shape binding"):
        OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, tree_rows=True, static_shapes=True))
    trees.run_pass([BatchRow(0, (1, 2, 3), 0)])
    with pytest.raises(BackendError):
        trees.keep_path(0, 1, (1, 0))  # not a path: decreasing


def test_the_batch_backend_takes_tree_rows_where_the_graph_allows_unless_told_not_to(tiny_model_dir):
    assert OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, max_length=MAX_LENGTH)).tree_rows
    assert OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1)).current_len() == 0  # None: not refused
