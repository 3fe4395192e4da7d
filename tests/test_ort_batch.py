"""``OrtBatchBackend`` (backends/onnx/batch.py): each row of a batched pass answers what ``OrtBackend`` gives the
same sequence alone, over batch sizes, mixed lengths and token counts, idle slots and rewinds; and ``BatchDriver``
on it gives what ``generate`` gives each request alone. Every wait is on pass counts, never on time.

Batch invariance, measured on the tiny model (float32, CPU, one thread): a row's logits in a batch differ from the
same sequence's alone by at most ~1.5e-6 (a batch changes the matmuls' blocking, so not always exactly 0); the
tests assert ``ROW_TOLERANCE``. Every test runs on both layouts of a pass: ``ragged`` (the graph takes each row's
query length, so one session run carries rows of any lengths: ``ragged_rewrite.py``) and ``split`` (the file's
attention: multi-token rows after a past run alone)."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec import BatchBackend, BatchDriver, BatchRow, Options, PromptLookup, Sampling, generate
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig, OrtBackend, OrtBatchBackend
from ortspec.backends.onnx.pass_inputs import RUN_ROWS, pass_groups, ragged_groups

ROW_TOLERANCE = 1e-5  # float32 max abs difference, batch row vs the sequence alone
MAX_LENGTH = 64


@pytest.fixture(scope="module", params=[None, False], ids=["ragged", "split"])
def config(request):
    return BackendConfig(threads=1, max_length=MAX_LENGTH, ragged_rows=request.param)


@pytest.fixture(scope="module")
def single(tiny_model_dir, config):
    return OrtBackend.from_folder(tiny_model_dir, config)


@pytest.fixture()
def batch(tiny_model_dir, config):
    return OrtBatchBackend.from_folder(tiny_model_dir, config, slots=4)


def alone_rows(single: OrtBackend, context: list[int], new: int) -> np.ndarray:
    """The logits rows of the last ``new`` tokens of ``context``, decoded alone: the past in one pass, then them."""
    single.reset()
    base = len(context) - new
    if base:
        single.decode_verify(context[:base], 0)
    return single.decode_verify(context[base:], base).copy()


def test_it_is_a_batch_backend_and_groups_a_pass_into_the_runs_its_graph_accepts(batch):
    assert isinstance(batch, BatchBackend)
    rows = [BatchRow(0, (1,), 0), BatchRow(1, (2, 3), 0), BatchRow(2, (4, 5), 0), BatchRow(3, (5, 6, 7), 0)]
    later = [BatchRow(0, (1,), 1), BatchRow(1, (2, 3), 2), BatchRow(2, (4,), 2), BatchRow(3, (5,), 3)]
    if batch.graph.query_lengths_name is None:
        # prefill rows of one length share a run; other lengths run apart; a multi-token row after a past alone
        assert [[row.slot for row in group.rows] for group in pass_groups(rows)] == [[0], [1, 2], [3]]
        assert [group.idle_at_zero for group in pass_groups(rows)] == [False, True, True]
        assert [[row.slot for row in group.rows] for group in pass_groups(later)] == [[0, 2, 3], [1]]
        runs = [3, 5]
    else:  # any rows share a run, right-padded to the widest, where that costs less than another run
        assert [[row.slot for row in group.rows] for group in ragged_groups(rows, MAX_LENGTH)] == [[0, 1, 2, 3]]
        assert [[row.slot for row in group.rows] for group in ragged_groups(later, MAX_LENGTH)] == [[0, 2, 3, 1]]
        runs = [1, 2]
    batch.run_pass(rows)
    assert batch.runs == runs[0]
    batch.run_pass(later)
    assert batch.runs == runs[1]
    assert [batch.current_len(slot) for slot in range(4)] == [2, 4, 3, 4]


def test_ragged_groups_pad_only_where_a_run_costs_more():
    decodes = [BatchRow(slot, (1,), 10) for slot in range(3)]
    chunk = BatchRow(3, tuple(range(2 * RUN_ROWS)), 10)  # padding the decodes to its width costs more than a run
    groups = ragged_groups([chunk, *decodes], MAX_LENGTH)
    assert [[row.slot for row in group.rows] for group in groups] == [[0, 1, 2], [3]]
    verify = BatchRow(3, (1, 2, 3), 10)  # a short draft pads the decodes for less than a run
    assert [[row.slot for row in g.rows] for g in ragged_groups([verify, *decodes], MAX_LENGTH)] == [[0, 1, 2, 3]]
    # a row that cannot fit the run's width at its position, and one as wide as the slots, run apart
    late = BatchRow(0, (1,), MAX_LENGTH - 2)
    groups = ragged_groups([late, BatchRow(1, (1, 2, 3), 0)], MAX_LENGTH)
    assert [[row.slot for row in group.rows] for group in groups] == [[0], [1]]
    full = BatchRow(2, tuple(range(MAX_LENGTH)), 0)
    assert [[row.slot for row in g.rows] for g in ragged_groups([full, *decodes[:2]], MAX_LENGTH)] == [[0, 1], [2]]


def test_each_row_equals_the_sequence_alone_over_random_batches(batch, single):
    rng = np.random.default_rng(0)
    contexts: dict[int, list[int]] = {slot: [] for slot in range(batch.slots)}
    worst = 0.0
    sizes = set()
    for _ in range(40):
        chosen = [int(s) for s in rng.permutation(batch.slots)[: int(rng.integers(1, batch.slots + 1))]]
        rows = []
        for slot in chosen:
            new = int(rng.choice([1, 1, 2, 3, 5, 9]))  # decodes, drafts and prompt chunks in one pass
            if batch.current_len(slot) + new > MAX_LENGTH:
                batch.reset(slot)
                contexts[slot] = []
            last = None if rng.random() < 0.6 else int(rng.integers(1, new + 2))  # some rows read their last few
            tokens = rng.integers(0, batch.vocab_size, new).tolist()
            rows.append(BatchRow(slot, tokens, batch.current_len(slot), last_logits=last))
        sizes.add(len(rows))
        outputs = batch.run_pass(rows)
        for row, out in zip(rows, outputs, strict=True):
            contexts[row.slot] += row.tokens
            expected = alone_rows(single, contexts[row.slot], len(row.tokens))[-row.logits_rows :]
            assert out.shape == expected.shape
            worst = max(worst, float(np.abs(out - expected).max()))
        slot = int(rng.integers(0, batch.slots))
        if batch.current_len(slot) > 1 and rng.random() < 0.5:  # a rejected draft: its own rewind
            keep = int(rng.integers(1, batch.current_len(slot)))
            batch.rewind(slot, keep)
            contexts[slot] = contexts[slot][:keep]
    assert sizes == {1, 2, 3, 4}
    assert batch.graph.keep_name is not None  # the LM head ran over the rows' last positions only
    print(f"max abs difference batch row vs alone: {worst:.3g}")
    assert worst <= ROW_TOLERANCE


def test_an_idle_slot_keeps_its_resident_kv_even_when_full(batch, single):
    full = list(range(1, MAX_LENGTH + 1))  # slot 1 is full: an idle row's padding must start below its length
    batch.run_pass([BatchRow(1, full, 0)])
    kept = [buffer[1].copy() for buffer in (*batch.keys, *batch.values)]
    batch.run_pass([BatchRow(0, (3, 4, 5), 0), BatchRow(2, (6, 7), 0)])  # a prefill run over slot 1 (from 0)
    batch.run_pass([BatchRow(0, (8,), 3), BatchRow(2, (9,), 2)])  # a decode run over slot 1 (from its end)
    for before, buffer in zip(kept, (*batch.keys, *batch.values), strict=True):
        np.testing.assert_array_equal(buffer[1], before)
    batch.rewind(1, MAX_LENGTH - 1)
    out = batch.run_pass([BatchRow(1, (10,), MAX_LENGTH - 1)])[0]
    assert np.abs(out - alone_rows(single, [*full[:-1], 10], 1)).max() <= ROW_TOLERANCE


def test_a_bad_batch_or_setting_is_refused(batch, tiny_model_dir, config):
    with pytest.raises(BackendError, match="position"):
        batch.run_pass([BatchRow(0, (1,), 3)])
    with pytest.raises(BackendError, match="rewind"):
        batch.rewind(0, 1)
    assert batch.runs == 0 and batch.current_len(0) == 0
    with pytest.raises(ValueError, match="CPU only"):
        OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(provider="cuda"))
    with pytest.raises(ValueError, match="static"):
        OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(static_shapes=True))
    with pytest.raises(BackendError, match="sharing is off"):
        OrtBatchBackend.from_folder(tiny_model_dir, BackendConfig(threads=1, share_buffer=False))
    with pytest.raises(ValueError, match="slots"):
        OrtBatchBackend.from_folder(tiny_model_dir, config, slots=0)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 20, 21], [3]]


@pytest.mark.parametrize(
    "options",
    [Options(max_tokens=12), Options(max_tokens=12, sampling=Sampling(temperature=0.8, seed=7))],
    ids=["greedy", "seeded"],
)
def test_the_batch_driver_on_it_equals_generate_alone(tiny_model_dir, config, single, options):
    backend = OrtBatchBackend.from_folder(tiny_model_dir, config, slots=3)  # 4 prompts: one waits for a slot
    driver = BatchDriver(backend, prefill_chunk=5)  # prompts prefilled in chunks beside the decoding
    sequences = [driver.submit(prompt, options, PromptLookup(), draft_width=3) for prompt in PROMPTS]
    driver.run()
    for prompt, sequence in zip(PROMPTS, sequences, strict=True):
        assert sequence.result().token_ids == generate(single, prompt, options, PromptLookup(), draft_width=3).token_ids
    assert 0 < driver.passes <= backend.runs  # a driver pass is one or more session runs


def test_a_next_turn_on_its_first_turns_slot_equals_the_request_alone(tiny_model_dir, config, single):
    backend = OrtBatchBackend.from_folder(tiny_model_dir, config, slots=3)
    driver = BatchDriver(backend, prefill_chunk=4)
    options = Options(max_tokens=8)
    firsts = [driver.submit(prompt, options) for prompt in PROMPTS[:2]]
    driver.run()
    turns = [
        [*prompt, *first.result().token_ids, 30, 31, 32] for prompt, first in zip(PROMPTS[:2], firsts, strict=True)
    ]
    # the next turns prefill from their reused prefixes (each chunk a run of its own) beside a new prompt's run from
    # position 0, which binds the resident slots too
    seconds = [driver.submit(turn, options, PromptLookup(), draft_width=3) for turn in turns]
    new = driver.submit(PROMPTS[2], options)
    driver.run()
    for prompt, turn, first, second in zip(PROMPTS[:2], turns, firsts, seconds, strict=True):
        assert second.slot == first.slot and second.result().cached_prompt_tokens == len(prompt) + 8 - 1
        assert second.result().token_ids == generate(single, turn, options, PromptLookup(), draft_width=3).token_ids
    assert new.slot == 2 and new.result().token_ids == generate(single, PROMPTS[2], options).token_ids
    # what the driver remembers of a slot is its KV: rows after it are the rows of that context alone
    for slot in range(3):
        resident = list(driver.resident_tokens(slot))
        out = backend.run_pass([BatchRow(slot, (33, 34), len(resident))])[0]
        assert np.abs(out - alone_rows(single, [*resident, 33, 34], 2)).max() <= ROW_TOLERANCE


@pytest.mark.real_model
def test_real_model_batch_rows_and_outputs_equal_alone(real_model_dir):
    from ortspec.adapters.engine.tokenizer import Tokenizer

    config = BackendConfig(threads=2, max_length=512)
    single = OrtBackend.from_folder(real_model_dir, config)
    backend = OrtBatchBackend.from_folder(real_model_dir, config, slots=4)
    tokenizer = Tokenizer.from_folder(real_model_dir)
    questions = ["What is the capital of France?", "Count from one to ten.", "Name three colours.", "Say hi."]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
        for question in questions
    ]
    options = Options(max_tokens=24, eos_token_ids=frozenset())
    driver = BatchDriver(backend, prefill_chunk=16)
    sequences = [driver.submit(prompt, options, PromptLookup(), draft_width=4) for prompt in prompts]
    driver.run()
    for prompt, sequence in zip(prompts, sequences, strict=True):
        assert sequence.result().token_ids == generate(single, prompt, options, PromptLookup(), draft_width=4).token_ids
    # one batched decode run of four rows against each row alone
    contexts = [[*prompts[slot], *sequences[slot].result().token_ids] for slot in range(4)]
    for slot in range(4):
        backend.reset(slot)
        backend.run_pass([BatchRow(slot, contexts[slot], 0)])
    rows = [BatchRow(slot, (7,), len(contexts[slot])) for slot in range(4)]
    worst = max(
        float(np.abs(out - alone_rows(single, [*contexts[row.slot], 7], 1)).max())
        for row, out in zip(rows, [o.copy() for o in backend.run_pass(rows)], strict=True)
    )
    print(f"real model: max abs difference batch row vs alone: {worst:.3g}")
    assert worst <= 1e-4


def test_the_lone_slot_is_a_backend_beside_the_slots_on_the_same_session(batch, single, tiny_model_dir, config):
    """``OrtBatchBackend.lone()``: the one-sequence protocol on a KV cache no pass can name; its rows equal the
    sequence alone, and passes over the slots, even from another thread at the same time, leave it as it was."""
    import threading

    from ortspec.backends.base import Backend

    lone = batch.lone()
    assert isinstance(lone, Backend) and lone is batch.lone() and lone.max_length == batch.max_length
    with pytest.raises(BackendError, match="slot 4"):
        batch.run_pass([BatchRow(batch.slots, (1,), 0)])  # the lone slot is not one of the pass's slots
    context = list(range(3, 30))
    out = lone.decode(context[:20], 0)
    np.testing.assert_allclose(out, alone_rows(single, context[:20], 1)[-1], atol=ROW_TOLERANCE)
    rows = lone.decode_verify(context[20:], 20).copy()
    np.testing.assert_allclose(rows, alone_rows(single, context, 7), atol=ROW_TOLERANCE)
    with pytest.raises(BackendError, match="past"):
        lone.decode([1], 3)
    lone.rewind(20)
    done = threading.Event()

    def passes() -> None:  # the other slots busy meanwhile
        for n in range(30):
            batch.run_pass([BatchRow(s, (n % 7,), batch.current_len(s)) for s in range(batch.slots)])
        done.set()

    worker = threading.Thread(target=passes)
    worker.start()
    again = [lone.decode_verify(context[20:], 20).copy() for _ in range(5) if not lone.rewind(20)]
    worker.join()
    assert done.is_set() and lone.current_len() == 27
    for rows_again in again:
        np.testing.assert_array_equal(rows_again, rows)


def test_an_engine_has_one_session_and_its_measurements_run_on_the_lone_slot(tiny_model_dir):
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import OrtBackend
    from ortspec.backends.onnx.config import SLOT_LENGTH
    from ortspec.backends.onnx.drafter import DrafterError

    alone = OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1))
    batched = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=2)
    assert batched.backend is batched.batch.lone() and batched.batch.slots == 2
    assert batched.backend.max_length == min(alone.max_length, SLOT_LENGTH)
    options = dict(max_tokens=12, temperature=0.8, seed=3)
    plain = Engine(alone, batched.tokenizer, eos_token_ids=batched.eos_token_ids)  # one sequence: OneSlot
    assert plain.batch.slots == 1 and plain.backend is alone
    assert batched.generate("a b c a b", **options).token_ids == plain.generate("a b c a b", **options).token_ids
    many = batched.generate_many(["a b c a b", "x y"], **options)
    assert [r.token_ids for r in many] == [plain.generate(p, **options).token_ids for p in ["a b c a b", "x y"]]
    with pytest.raises(DrafterError, match="no drafter found"):  # a batched Engine runs a drafter, when it has one
        Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=2, drafter=True)


def test_a_batched_slot_defaults_to_at_most_slot_length_positions():
    from ortspec.backends.onnx.config import SLOT_LENGTH

    config = BackendConfig()
    assert config.capacity(8192) == 8192 and config.capacity(8192, batched=True) == SLOT_LENGTH
    assert config.capacity(512, batched=True) == 512
    assert BackendConfig(max_length=4096).capacity(8192, batched=True) == 4096
