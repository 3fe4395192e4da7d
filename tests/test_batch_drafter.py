"""The shared-KV drafter in batches: ``OrtBatchBackend`` keeps the hidden states a row asks for (and only those),
a slot's drafter (``SlotDrafters``) reads that slot's KV and hidden state and drafts what the same request drafts
alone on a one-sequence backend, the batch driver names a sequence's slot in each of its draft contexts (and keeps
the hidden states of a sequence submitted with ``reads_target_state``), and ``generate_many`` with ``"shared-kv"``
and ``"auto"`` gives each request what it gives alone (greedy and seeded sampling, rows joining and leaving), on an
Engine opened either way. Tiny random models and a random drafter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortspec import BatchDriver, BatchRow, DraftContext, Options, PromptLookup
from ortspec.backends.base import BackendError
from ortspec.backends.fake import FakeBatchBackend, FakeModel
from ortspec.backends.onnx import BackendConfig, OrtBackend, OrtBatchBackend

CONFIG = BackendConfig(threads=1, max_length=128)


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    pytest.importorskip("onnx")
    from tests.support.drafters import make_random_drafter

    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("drafter") / "d", seed=1, draft_vocab=300)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, n)]


# ----------------------------------------------------------------------------------------------------------------
# The driver names each sequence's slot in its draft contexts (fake backend)
# ----------------------------------------------------------------------------------------------------------------


class RecordingBatch(FakeBatchBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[BatchRow] = []

    def run_pass(self, rows):
        self.rows.extend(rows)
        return super().run_pass(rows)


def test_the_driver_names_the_slot_its_sequence_takes_in_each_draft_context():
    backend = RecordingBatch(FakeModel(vocab_size=32, seed=3, markov=4.0), 2, 64)
    driver = BatchDriver(backend, prefill_chunk=4)
    asked: list[tuple[int, int | None]] = []  # (sequence, the slot its draft context names)

    class SlotReader:  # reads its sequence's slot (as a draft head does); drafts by prompt lookup
        def __init__(self, index: int) -> None:
            self.index = index

        def propose(self, context: DraftContext) -> tuple[int, ...]:
            asked.append((self.index, context.slot))
            return PromptLookup(ngram=2).propose(context)

    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4, 5], [6, 7, 6, 7, 6, 7, 6]]
    plain = [driver.submit(p, Options(max_tokens=6 + i)) for i, p in enumerate(prompts)]
    driver.run()
    rows_plain = list(backend.rows)
    sequences = [
        driver.submit(p, Options(max_tokens=6 + i), SlotReader(i), draft_width=3, reads_target_state=True)
        for i, p in enumerate(prompts)
    ]
    assert asked == []  # nothing is asked before admission
    driver.run()
    # each sequence is asked with its own slot only, the third with the slot it took when one was freed
    assert [(i, s.slot) for i, s in enumerate(sequences)] == sorted(set(asked))
    assert sequences[2].slot in (sequences[0].slot, sequences[1].slot)
    for done, reference in zip(sequences, plain, strict=True):
        assert done.result().token_ids == reference.result().token_ids
    assert sum(s.result().stats.proposed_tokens for s in sequences) > 0
    rows = backend.rows[len(rows_plain) :]
    assert not any(row.hidden_states for row in rows_plain)  # a plain sequence's rows never ask for them
    decode_rows = [row for row in rows if row.last_logits is None]
    assert decode_rows and all(row.hidden_states for row in decode_rows)
    chunks = [row for row in rows if row.last_logits == 1]  # prompt chunks: only a prompt's last one asks
    assert any(row.hidden_states for row in chunks) and not all(row.hidden_states for row in chunks)


def test_a_proposer_that_fails_in_its_slot_fails_its_sequence_only():
    backend = FakeBatchBackend(FakeModel(vocab_size=32, seed=3), 2, 64)
    driver = BatchDriver(backend)

    class Refuse:
        def propose(self, context: DraftContext) -> tuple[int, ...]:
            raise RuntimeError(f"no drafter for slot {context.slot}")

    failed = driver.submit([1, 2, 3], Options(max_tokens=4), Refuse(), reads_target_state=True)
    fine = driver.submit([1, 2, 3], Options(max_tokens=4))
    driver.run()
    assert failed.error is not None and "no drafter for slot" in str(failed.error.__cause__)
    assert fine.error is None and len(fine.result().token_ids) == 4


# ----------------------------------------------------------------------------------------------------------------
# OrtBatchBackend: hidden states kept per slot, KV addresses per slot
# ----------------------------------------------------------------------------------------------------------------


def test_a_row_keeps_the_hidden_states_it_asks_for_as_the_backend_alone_computes_them(tiny_model_dir):
    batch = OrtBatchBackend.from_folder(tiny_model_dir, CONFIG, slots=3)
    single = OrtBackend.from_folder(tiny_model_dir, CONFIG)
    vocab = batch.vocab_size
    a, b = prompt_ids(9, vocab, 0), prompt_ids(6, vocab, 1)
    # two prefill lengths: two runs in one pass (the first run's states must survive the second)
    batch.run_pass([BatchRow(1, a, 0, last_logits=1, hidden_states=True), BatchRow(2, b, 0, last_logits=1)])
    single.reset()
    single.decode_verify(a, 0)
    np.testing.assert_allclose(batch.hidden_row(1, 8), single.hidden_at(8), atol=1e-5)
    with pytest.raises(BackendError, match="kept the hidden states of positions"):
        batch.hidden_row(1, 7)  # a prompt chunk keeps its last position's only
    with pytest.raises(BackendError):
        batch.hidden_row(2, 5)  # its row did not ask
    batch.run_pass([BatchRow(1, (5, 6, 7), 9, hidden_states=True), BatchRow(2, (8,), 6, hidden_states=True)])
    single.decode_verify([5, 6, 7], 9)
    for position in (9, 10, 11):
        np.testing.assert_allclose(batch.hidden_row(1, position), single.hidden_at(position), atol=1e-5)
    batch.rewind(1, 10)
    batch.hidden_row(1, 9)
    with pytest.raises(BackendError):
        batch.hidden_row(1, 10)  # past the slot's length
    batch.run_pass([BatchRow(1, (4,), 10)])
    with pytest.raises(BackendError):
        batch.hidden_row(1, 10)  # the slot's last row did not ask: nothing stale is served
    assert batch.kv_pointer(2, 1, "value", 1) == batch.values[1][2, 1].ctypes.data
    with pytest.raises(ValueError):
        batch.kv_pointer(4, 0, "key", 0)
    lone = batch.lone()  # the lone slot keeps its rows' states (for the Engine's drafter)
    lone.decode(a, 0)
    single.reset()
    single.decode(a, 0)
    np.testing.assert_allclose(batch.hidden_row(batch.slots, 8), single.hidden_at(8), atol=1e-5)


def test_each_slots_drafter_reads_its_own_slot(tiny_model_dir, drafter_dir):
    """Two different contexts in slots 0 and 2 (slot 1 idle between them): each slot's drafter drafts what the same
    context drafts alone on a one-sequence backend; reading another slot's KV or hidden state would not."""
    from ortspec.backends.onnx.drafter import SharedKvProposer
    from ortspec.backends.onnx.slot_drafters import SlotDrafters

    batch = OrtBatchBackend.from_folder(tiny_model_dir, CONFIG, slots=3)
    drafters = SlotDrafters.open(batch, drafter_dir)
    single = OrtBackend.from_folder(tiny_model_dir, CONFIG)
    alone = SharedKvProposer.open(single, drafter_dir)
    contexts = {0: prompt_ids(12, batch.vocab_size, 3), 2: prompt_ids(12, batch.vocab_size, 4)}
    # the driver's promise: the KV of every context token but the last, the last row computed the one before
    batch.run_pass([BatchRow(s, c[:-1], 0, last_logits=1, hidden_states=True) for s, c in contexts.items()])
    expected = {}
    for slot, context in contexts.items():
        single.reset()
        single.decode(context[:-1], 0)
        expected[slot] = alone.propose(DraftContext(context, 4, slot=0))
        assert alone.propose(DraftContext(context, 4)) == ()  # no slot: the target holds no state for it
    assert expected[0] != expected[2] and all(len(d) == 4 for d in expected.values())
    for slot, context in contexts.items():
        assert drafters.for_slot(slot).propose(DraftContext(context, 4, slot=slot)) == expected[slot]
        assert drafters.propose(DraftContext(context, 4, slot=slot)) == expected[slot]  # the slot the context names
        assert drafters.propose(DraftContext(context, 4)) == ()
    # and after a verify row in each slot (the states of a later position, within the row)
    batch.run_pass([BatchRow(s, (c[-1], 5, 6), 11, hidden_states=True) for s, c in contexts.items()])
    for slot, context in contexts.items():
        batch.rewind(slot, 12)
        single.reset()
        single.decode_verify([*context, 5], 0)
        single.rewind(12)
        want = alone.propose(DraftContext([*context, 5], 4, slot=0))
        assert drafters.propose(DraftContext([*context, 5], 4, slot=slot)) == want
    assert drafters.for_slot(2) is drafters.for_slot(2) and drafters.for_slot(2).session is drafters.lone().session


# ----------------------------------------------------------------------------------------------------------------
# End to end: generate_many with the drafter == each request alone
# ----------------------------------------------------------------------------------------------------------------

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return an iterator over the values",
    "def merge(a, b): return a + b",
    "Split the string at the first separator",
]
MAX_TOKENS = (10, 26, 17, 21)  # rows leave at different passes, the last prompts join freed slots


def batched_equals_alone(engine, speculative: str, width, sampling: dict) -> list:
    from ortspec.adapters.engine.options import GenerationOptions

    options = [
        GenerationOptions(
            max_tokens=m, ignore_eos=True, speculative=speculative, draft_width=width, **sampling
        )  # fmt: skip
        for m in MAX_TOKENS
    ]
    results = engine.generate_requests([engine.request(p, o) for p, o in zip(PROMPTS, options, strict=True)])
    for prompt, option, result in zip(PROMPTS, options, results, strict=True):
        plain = engine.generate(prompt, max_tokens=option.max_tokens, ignore_eos=True, **sampling)
        assert result.token_ids == plain.token_ids and result.text == plain.text
        assert result.finish_reason == plain.finish_reason
    return results


@pytest.fixture(scope="module")
def engine(tiny_model_dir, drafter_dir):
    from ortspec.adapters.engine import Engine

    return Engine.from_dir(tiny_model_dir, CONFIG, drafter=drafter_dir, batch_slots=2)  # four requests join and leave


@pytest.mark.parametrize("speculative", ["shared-kv", "auto"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_batched_drafter_generations_are_each_request_alone(engine, speculative, sampling):
    for width in ("auto", 3):
        results = batched_equals_alone(engine, speculative, width, sampling)
        if speculative == "shared-kv" and width == 3:
            assert all(r.stats.proposed_tokens > 0 for r in results)  # the slots' drafters drafted
            for prompt, result in zip(PROMPTS, results, strict=True):  # the same drafts as alone
                alone = engine.generate(
                    prompt, max_tokens=len(result.token_ids), ignore_eos=True, speculative=speculative,
                    draft_width=width, **sampling,
                )  # fmt: skip
                assert result.stats == alone.stats


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}])
def test_drafter_trees_batched_and_alone_are_each_request_alone(engine, sampling):
    """With ``branches`` (the head's runners-up as sibling leaves) and a budget that grants nodes, tree rows run
    batched and alone, and every request still gets what plain decoding gives it alone."""
    from ortspec.core import FixedWidth
    from ortspec.core.width import TreeBudget

    batch, trees = engine.batch, []
    run_pass = batch.run_pass

    def recording(rows):
        trees.extend(row.parents for row in rows if row.parents is not None)
        return run_pass(rows)

    engine.drafter.branches, batch.run_pass = 3, recording
    try:
        assert all(engine.drafter.for_slot(slot).branches == 3 for slot in range(batch.slots))
        policy = FixedWidth(3, tree=TreeBudget((1.0,) * 25))  # flat costs: every node pays
        batched_equals_alone(engine, "shared-kv", policy, sampling)
        assert trees and any(len(parents) > 3 for parents in trees)
        trees.clear()
        plain = engine.generate(PROMPTS[1], max_tokens=24, ignore_eos=True, **sampling)
        alone = engine.generate(
            PROMPTS[1], max_tokens=24, ignore_eos=True, speculative="shared-kv", draft_width=policy, **sampling
        )
        assert alone.token_ids == plain.token_ids and trees
        batched_equals_alone(engine, "auto", "auto", sampling)
    finally:
        engine.drafter.branches, batch.run_pass = 1, run_pass


def assert_drafts_per_slot(engine) -> None:
    """``engine`` (opened batched) drafts with the drafters of its slots (``SlotDrafters``), and its requests that
    draft with them (``"shared-kv"``, ``"auto"``) are submitted reading their slot's target state; the others not."""
    from ortspec.adapters.engine.options import GenerationOptions
    from ortspec.backends.onnx.slot_drafters import SlotDrafters

    assert isinstance(engine.drafter, SlotDrafters) and engine.drafter.batch is engine.batch
    for speculative, reads in (("shared-kv", True), ("auto", True), ("prompt-lookup", False), (None, False)):
        request = engine.request(PROMPTS[0], GenerationOptions(max_tokens=4, speculative=speculative, draft_width=3))
        assert request.reads_target_state is reads, speculative


def test_an_engine_opened_for_batching_runs_the_drafter_alone_and_batched(tiny_model_dir, drafter_dir):
    from ortspec.adapters.engine import Engine

    engine = Engine.from_dir(tiny_model_dir, CONFIG, drafter=drafter_dir, batch_slots=2)
    assert_drafts_per_slot(engine)
    assert engine.lone_slot == engine.batch.slots  # its one-sequence view is the batch's lone slot
    assert engine.drafter.for_slot(1) is not engine.drafter.for_slot(engine.lone_slot)
    plain = engine.generate(PROMPTS[0], max_tokens=20, ignore_eos=True)
    alone = engine.generate(PROMPTS[0], max_tokens=20, ignore_eos=True, speculative="shared-kv", draft_width=3)
    assert alone.token_ids == plain.token_ids and alone.stats.proposed_tokens > 0
    batched_equals_alone(engine, "auto", "auto", {})
    assert Engine.from_dir(tiny_model_dir, CONFIG, drafter=False, batch_slots=2).drafter is None


def test_drafter_calls_from_many_threads_share_passes_each_as_alone(tiny_model_dir, drafter_dir):
    import concurrent.futures

    from ortspec.adapters.engine import Engine

    with Engine.from_dir(tiny_model_dir, CONFIG, drafter=drafter_dir) as one:
        alone = [one.generate(p, max_tokens=16, ignore_eos=True) for p in PROMPTS]
    with Engine.from_dir(tiny_model_dir, CONFIG, drafter=drafter_dir, batch_slots=2) as engine:
        calls = [dict(speculative=s, draft_width=w) for s, w in (("shared-kv", 3), ("auto", "auto"))] * 2
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(
                pool.map(
                    lambda pc: engine.generate(pc[0], max_tokens=16, ignore_eos=True, **pc[1]),
                    zip(PROMPTS, calls, strict=True),
                )
            )
        assert engine.scheduler.ended == len(PROMPTS)  # every call ran on the Engine's one scheduler
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]
    assert sum(r.stats.proposed_tokens for r in results[::2]) > 0  # the slots' drafters drafted


# ----------------------------------------------------------------------------------------------------------------
# The server: its batched Engine opens the drafter and serves "auto" and "shared-kv"
# ----------------------------------------------------------------------------------------------------------------


def test_the_batched_server_serves_the_drafter_and_each_request_gets_its_text_alone(tiny_model_dir, drafter_dir):
    pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")
    import threading

    import httpx

    from ortspec.adapters.engine import Engine
    from ortspec.adapters.serve.app import create_app
    from ortspec.adapters.serve.run import load_serving, serve_in_thread
    from ortspec.adapters.serve.settings import ServerSettings
    from ortspec.core.checks import ArgumentError

    reference = Engine.from_dir(tiny_model_dir, CONFIG, drafter=False)
    with load_serving(tiny_model_dir, CONFIG, max_batch=2, drafter=False) as without:
        with pytest.raises(ArgumentError, match="needs a shared-KV drafter"):
            create_app(without, ServerSettings(model_name="tiny", speculative="shared-kv"))
    serving = load_serving(tiny_model_dir, CONFIG, max_batch=2, drafter=drafter_dir)
    assert_drafts_per_slot(serving)
    requests = [
        {"prompt": PROMPTS[0], "max_tokens": 14},
        {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0.8, "seed": 3},
        {"prompt": PROMPTS[2], "max_tokens": 9},  # waits for a slot: two slots, three requests
    ]
    for speculative in ("auto", "shared-kv"):
        app = create_app(serving, ServerSettings(model_name="tiny", speculative=speculative))
        out: list[httpx.Response | None] = [None] * len(requests)
        with serve_in_thread(app) as url:

            def send(i: int, url: str = url, out: list = out) -> None:
                out[i] = httpx.post(url + "/v1/completions", json={"model": "tiny", **requests[i]}, timeout=120)

            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for request, response in zip(requests, out, strict=True):
            assert response is not None and response.status_code == 200, response and response.text
            options = {k: v for k, v in request.items() if k != "prompt"}
            assert response.json()["choices"][0]["text"] == reference.generate(request["prompt"], **options).text
            assert response.json()["ortspec"]["speculative"] is True
    serving.close()


# ----------------------------------------------------------------------------------------------------------------
# The batch job: a worker's batched Engine opens the drafter; records with "auto" and "shared-kv"
# ----------------------------------------------------------------------------------------------------------------


def test_a_batch_workers_records_use_the_drafter_and_each_line_is_the_record_alone(tiny_model_dir, drafter_dir):
    import json

    from ortspec.adapters.batch.records import option_fields, parse_record
    from ortspec.adapters.batch.worker import BatchWorker, WorkerSettings

    defaults = {"speculative": "auto", "chat": False, "ignore_eos": True}
    records = [
        {"id": i, "prompt": prompt, "max_tokens": m, **({"speculative": "shared-kv"} if i % 2 else {})}
        for i, (prompt, m) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True))
    ]
    fields = option_fields()
    tasks = [parse_record(json.dumps(r), n, defaults, fields) for n, r in enumerate(records, start=1)]
    batched = BatchWorker(
        tiny_model_dir, WorkerSettings(threads=1, defaults=defaults, max_batch=2, drafter=drafter_dir)
    )
    alone = BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=defaults, drafter=drafter_dir))
    assert_drafts_per_slot(batched.engine)
    assert batched.note is None
    for task in tasks:
        batched.submit(task)  # type: ignore[arg-type]
    lines = {}
    while batched.held:
        for task, record, _ in batched.advance():
            lines[task.key] = record
    for task in tasks:  # the same line but its stats (speculation is priced by the pass it joins)
        line, reference = dict(lines[task.key]), dict(alone.run(task)[0])  # type: ignore[arg-type]
        assert "error" not in line and line.pop("stats") and reference.pop("stats") and line == reference


def test_tree_branches_reach_every_surface(tiny_model_dir, drafter_dir, tmp_path):
    """``tree_branches`` (``Engine.from_dir``, the Engine's attribute, ``--tree-branches`` on every command that
    opens an Engine, the batch job and the server's loader) sets the suffix lookup's branches and every slot's
    drafter's; a value below 1 is refused naming it."""
    from ortspec.adapters.batch import BatchError, BatchJob, run_batch
    from ortspec.adapters.batch.records import option_fields, parse_record
    from ortspec.adapters.batch.worker import WorkerSettings
    from ortspec.adapters.cli.main import build_parser
    from ortspec.adapters.engine import Engine
    from ortspec.core.checks import ArgumentError

    parser = build_parser()
    for argv in (["generate", "x"], ["demo"], ["bench"], ["serve"], ["batch", "in.jsonl", "out.jsonl"]):
        assert parser.parse_args(argv).tree_branches == 1
        assert parser.parse_args([*argv, "--tree-branches", "3"]).tree_branches == 3
    with Engine.from_dir(tiny_model_dir, CONFIG, drafter=drafter_dir, batch_slots=2, tree_branches=3) as engine:
        assert engine.tree_branches == 3 and engine.suffix_rule.branches == 3
        assert all(engine.drafter.for_slot(slot).branches == 3 for slot in (0, 1, engine.lone_slot))
        with pytest.raises(ArgumentError, match="tree_branches"):
            engine.tree_branches = 0
        engine.tree_branches = 1
        assert engine.suffix_rule.branches == 1 and engine.drafter.for_slot(0).branches == 1
    with pytest.raises(ArgumentError, match="tree_branches"):
        Engine.from_dir(tiny_model_dir, CONFIG, drafter=False, tree_branches=0)
    job = BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tree_branches=2)
    task = parse_record('{"id": 1, "prompt": "x"}', 1, {}, option_fields())
    assert WorkerSettings.of(job, 1, {}, [task]).tree_branches == 2
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    with pytest.raises(BatchError, match="tree_branches"):
        run_batch(BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tree_branches=0), progress=False)
    pytest.importorskip("uvicorn")
    from ortspec.adapters.serve.run import load_serving

    with load_serving(tiny_model_dir, CONFIG, max_batch=1, drafter=False, tree_branches=2) as served:
        assert served.tree_branches == 2
