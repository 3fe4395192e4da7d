"""``ortspec batch`` on the Engine's one scheduler (``--max-batch``, ``BatchJob.max_batch``): each worker keeps up to
``max_batch`` records decoding together and the next joins as soon as a slot frees; every record's line is what
the record gives alone (``BatchWorker.run`` on a worker of one slot), errors included, and a record that cannot
start gets its error line at once; a record's own fields beat the job's defaults; a killed run resumes;
``max_batch=1`` is an Engine of one slot, and a folder that cannot batch runs one record at a time and says why
(tiny model)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from test_batch import BAD_LINES, DEFAULTS, LOOKUP_TEXT, RECORDS, read_output, same_record, write_jsonl

from ortspec.adapters.batch import BatchJob, run_batch
from ortspec.adapters.batch.records import Task, option_fields, parse_record
from ortspec.adapters.batch.worker import BatchWorker, WorkerSettings
from ortspec.adapters.cli.batch import job_of
from ortspec.adapters.cli.main import build_parser
from ortspec.backends.onnx import BackendConfig
from ortspec.batch_driver import Phase

# Lines the Engine refuses (not the record reader): they fail when submitted, with the Engine's message (the tiny
# model's context holds 256 tokens).
ENGINE_CHECKED = [line for line, expected in BAD_LINES if expected == "chat=True needs a text prompt"] + [
    json.dumps({"id": "long", "prompt": [5] * 300, "max_tokens": 4})
]


class FailAfter:
    """Prompt lookup that raises once the context is ``extra`` tokens past a prompt of ``prompt_len`` tokens (a
    record that fails midway); the same for every run, so its error line is the same alone and batched."""

    def __init__(self, prompt_len: int, extra: int) -> None:
        self.limit = prompt_len + extra
        self.lookup = DEFAULTS["speculative"]

    def propose(self, draft_context):
        if len(draft_context.tokens) >= self.limit:
            raise ValueError("the drafter broke")
        return self.lookup.propose(draft_context)

    def __repr__(self) -> str:
        return f"FailAfter({self.limit})"


def tasks(tiny_model_dir: Path) -> list[Task]:
    """Every record of ``RECORDS`` (mixed options: greedy, seeded sampling, penalties, stops, logprobs, widths),
    the two lines only the Engine refuses, and a record whose proposer fails midway."""
    from ortspec.adapters.engine.tokenizer import Tokenizer

    fields = option_fields()
    lines = [json.dumps(r) for r in RECORDS] + ENGINE_CHECKED
    parsed = [parse_record(line, number, DEFAULTS, fields) for number, line in enumerate(lines, start=1)]
    assert all(isinstance(t, Task) for t in parsed)
    prompt = "fail " + LOOKUP_TEXT
    failing = FailAfter(len(Tokenizer.from_folder(tiny_model_dir).encode(prompt)), 6)
    options = {"speculative": failing, "max_tokens": 30, "ignore_eos": True}
    return [*parsed, Task(id="fails", line=99, prompt=prompt, options=options, size=len(prompt))]  # type: ignore[list-item]


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """A worker of one slot (``max_batch=1``): each record alone."""
    with BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=DEFAULTS)) as worker:
        yield worker


def watch(worker: BatchWorker) -> list[set[int]]:
    """After each of the worker's passes, the records holding a slot (by their scheduled requests' ids), from the
    pass thread: the worker's requests are collected as its Engine submits them."""
    submitted: list = []
    submit = worker.engine.submit

    def collect(request, **kwargs):
        submitted.append(submit(request, **kwargs))
        return submitted[-1]

    worker.engine.submit = collect  # type: ignore[method-assign]
    snapshots: list[set[int]] = []
    running = (Phase.PREFILL, Phase.DECODING)
    worker.engine.scheduler.observe(
        lambda _: snapshots.append(
            {id(r) for r in list(submitted) if r.sequence is not None and r.sequence.phase in running}
        )
    )
    return snapshots


def drain(worker: BatchWorker) -> dict:
    """Advance ``worker`` until it holds nothing: its lines by task key."""
    lines = {}
    while worker.held:
        for task, record, metrics in worker.advance(timeout=60):
            assert task.key not in lines
            lines[task.key] = (record, metrics)
    return lines


def test_each_line_is_the_record_alone_and_slots_refill_as_they_free(tiny_model_dir, alone):
    # a tiny prompt-token budget per pass: the records' prompts are prefilled a few tokens a pass, first come first
    settings = WorkerSettings(threads=1, defaults=DEFAULTS, max_batch=3, prefill_budget=5)
    with BatchWorker(tiny_model_dir, settings) as worker:
        assert worker.slots == 3 and worker.note is None and worker.engine.prefill_budget == 5
        snapshots = watch(worker)
        todo = tasks(tiny_model_dir)
        for task in todo:
            worker.submit(task)
        lines = drain(worker)
        passes = worker.engine.scheduler.passes
    assert len(lines) == len(todo)  # more records than slots: every one written once
    for task in todo:
        assert same_record(lines[task.key][0], alone.run(task)[0]), task.id
    errors = {task.id: lines[task.key][0]["error"] for task in todo if "error" in lines[task.key][0]}
    assert set(errors) == {"long", "chat-ids", "fails"}, errors
    assert "the drafter broke" in errors["fails"] and lines['"fails"'][0]["partial"]["token_ids"]
    # at most 3 at once; a record joined while one that started with it was still running (not in waves)
    assert max(len(s) for s in snapshots) == 3
    first = next(s for s in snapshots if s)
    assert any(len(s) == 3 and s & first and s != first for s in snapshots), snapshots
    steps = sum(m["steps"] for _, m in lines.values() if m["ok"])
    assert passes < steps  # the passes were shared


def test_a_records_own_fields_beat_the_jobs_defaults(tiny_model_dir):
    """The job drafts with prompt lookup and asks for 5 tokens; a record that says ``speculative: null`` and 9
    tokens gets plain decoding and 9 tokens, beside a record that takes the defaults."""
    defaults = {**DEFAULTS, "max_tokens": 5, "ignore_eos": True}
    own = {"id": "own", "prompt": LOOKUP_TEXT, "speculative": None, "max_tokens": 9}
    taken = {"id": "defaults", "prompt": LOOKUP_TEXT}
    fields = option_fields()
    todo = [parse_record(json.dumps(r), n, defaults, fields) for n, r in enumerate([own, taken], start=1)]
    with BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=defaults, max_batch=2)) as worker:
        for task in todo:
            worker.submit(task)  # type: ignore[arg-type]
        lines = {key: record for key, (record, _) in drain(worker).items()}
    assert len(lines['"own"']["token_ids"]) == 9 and lines['"own"']["stats"]["proposed"] == 0
    assert len(lines['"defaults"']["token_ids"]) == 5 and lines['"defaults"']["stats"]["proposed"] > 0


def test_max_batch_1_is_an_engine_of_one_slot_and_a_refused_record_answers_at_once(tiny_model_dir, alone):
    assert alone.slots == 1 and alone.note is None and alone.engine.batch.slots == 1
    task = tasks(tiny_model_dir)[0]
    alone.submit(task)
    [(done, record, metrics)] = alone.advance(timeout=60)
    assert done is task and record == alone.run(task)[0] and metrics["ok"]
    refused = parse_record(ENGINE_CHECKED[-1], 5, DEFAULTS, option_fields())  # its prompt is past the context
    assert isinstance(refused, Task)
    alone.submit(refused)
    [(done, record, metrics)] = alone.advance(timeout=0)  # its line is ready: no pass ran for it
    assert done is refused and "context" in record["error"] and not metrics["ok"] and not alone.held
    assert alone.advance(timeout=0) == []  # nothing held: no wait
    parser = build_parser()
    assert job_of(parser.parse_args(["batch", "in.jsonl", "out.jsonl"])).max_batch is None  # sized from the work
    assert job_of(parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--max-batch", "1"])).max_batch == 1
    job = job_of(parser.parse_args(["batch", "in.jsonl", "out.jsonl"]))
    assert job.prefill_budget == 512 and WorkerSettings.of(job, 1, {}, []).prefill_budget == 512
    job = job_of(parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--prefill-budget", "none"]))
    assert job.prefill_budget is None and WorkerSettings.of(job, 1, {}, []).prefill_budget is None


def test_a_folder_that_cannot_batch_runs_one_at_a_time_and_says_why_once(tiny_model_dir, tmp_path):
    backend = BackendConfig(share_buffer=False)  # OrtBatchBackend refuses: buffer sharing off
    settings = WorkerSettings(threads=1, defaults=DEFAULTS, backend=backend, max_batch=4)
    with BatchWorker(tiny_model_dir, settings) as worker:
        assert worker.slots == 1
        assert worker.note is not None and "buffer sharing is off" in worker.note
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:4])
    notes: list[str] = []
    job = BatchJob(src, tmp_path / "out.jsonl", model=tiny_model_dir, workers=2, threads=1, backend=backend,
                   options=DEFAULTS)  # fmt: skip
    summary = run_batch(job, progress=False, log=notes.append)
    assert summary.written == 4 and summary.errors == 0 and summary.slots == 1
    assert [n for n in notes if "one sequence at a time" in n] == [worker.note]


KILLED_BATCHED_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_batch import DEFAULTS
from ortspec.adapters.batch import BatchJob, run_batch
from ortspec.adapters.batch.output import BatchOutput
src, out, model, kill_after = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
write = BatchOutput.write
def write_then_kill(self, record, metrics=None):
    write(self, record, metrics)
    if self.summary.written == kill_after:  # the whole run (parent and workers), records in flight
        os.killpg(os.getpgrp(), signal.SIGKILL)
BatchOutput.write = write_then_kill
run_batch(BatchJob(src, out, model=model, workers=1, threads=1, max_batch=4, options=DEFAULTS), progress=False)
"""


def test_a_batched_run_killed_mid_job_resumes(tiny_model_dir, alone, tmp_path):
    """SIGKILL a batched run (one worker in its process, 4 slots) right after its fifth line, while the worker
    holds more records, leave a half-written line, rerun: every record once, each what it gives alone."""
    records = [
        {"id": f"r{i}", "prompt": f"{i} " + LOOKUP_TEXT[: 20 + 3 * i], "max_tokens": 8 + 5 * (i % 5),
         "ignore_eos": True, "draft_width": 4}
        for i in range(12)
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    args = [str(Path(__file__).parent), str(src), str(out), str(tiny_model_dir), "5"]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_BATCHED_RUN, *args], start_new_session=True, capture_output=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert len(out.read_bytes().splitlines()) == 5
    with open(out, "ab") as f:
        f.write(b'{"id": "r0", "text": "half a li')
    notes: list[str] = []
    job = BatchJob(src, out, model=tiny_model_dir, workers=1, threads=1, max_batch=4, options=DEFAULTS)
    summary = run_batch(job, progress=False, log=notes.append)
    assert any("partial line" in n for n in notes) and any("5 of 12" in n for n in notes), notes
    assert summary.skipped == 5 and summary.written == 7 and summary.errors == 0
    resumed = read_output(out)
    assert len(resumed) == len(records)
    for number, record in enumerate(records, start=1):
        expected, _ = alone.run(parse_record(json.dumps(record), number, DEFAULTS, option_fields()))
        assert resumed[json.dumps(record["id"])] == expected, record["id"]


def test_without_max_batch_each_worker_gets_slots_for_its_share_of_the_records(tiny_model_dir, tmp_path):
    from ortspec.adapters.batch.worker import AUTO_MAX_BATCH, planned_slots

    job = BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=tiny_model_dir, threads=1)
    some = tasks(tiny_model_dir)[:5]
    assert WorkerSettings.of(job, 1, {}, some).max_batch == 5  # five records: five slots
    assert WorkerSettings.of(attrs.evolve(job, workers=2), 1, {}, some).max_batch == 3  # each worker's share, up
    assert WorkerSettings.of(attrs.evolve(job, max_batch=2), 1, {}, some).max_batch == 2  # the job's own
    assert WorkerSettings.of(job, 1, {}, []).max_batch == 1
    assert planned_slots(None, 10 * AUTO_MAX_BATCH, 1) == AUTO_MAX_BATCH  # many records: the measured cap
    assert planned_slots(None, 10 * AUTO_MAX_BATCH, 4) == AUTO_MAX_BATCH
    assert planned_slots(7, 1, 1) == 7


def test_without_max_length_each_slot_holds_what_the_records_need_and_every_line_is_the_same(tmp_path):
    from ortspec.adapters.batch.worker import KV_FLOOR, KV_ROUND, planned_length
    from ortspec.adapters.engine.tokenizer import PromptReader, Tokenizer
    from ortspec.backends.onnx import ModelFolder
    from tests.support.models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny-2k", context=2048)  # the batched default: 2048 positions per slot
    fields = option_fields()
    records = [
        {"id": "short", "prompt": "Repeat: the cat sat on the mat.", "max_tokens": 700},
        {"id": "chat", "messages": [{"role": "user", "content": LOOKUP_TEXT}], "max_tokens": 40},
        {"id": "bad", "prompt": [10**9], "max_tokens": 4},  # refused by its worker, not by the plan
    ]
    some = [parse_record(json.dumps(r), n, {}, fields) for n, r in enumerate(records, start=1)]
    reader = PromptReader(Tokenizer.from_folder(model), ModelFolder.load(model).vocab_size)
    needs = [len(reader.prompt_ids(some[0].prompt)) + 700, len(reader.prompt_ids(some[1].prompt, chat=True)) + 40]
    expected = -(-max(needs) // KV_ROUND) * KV_ROUND
    assert KV_FLOOR <= expected < 2048
    job = BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=model, threads=1)
    sized = WorkerSettings.of(job, 1, {}, some, model)
    assert sized.backend.max_length == planned_length(model, {}, some) == expected
    assert WorkerSettings.of(job, 1, {}, some).backend.max_length is None  # no folder here (Ray): the default
    given = attrs.evolve(job, backend=BackendConfig(max_length=1024))
    assert WorkerSettings.of(given, 1, {}, some, model).backend.max_length == 1024  # the job's own
    long = parse_record(json.dumps({"id": "long", "prompt": "x", "max_tokens": 5000}), 4, {}, fields)
    assert planned_length(model, {}, [long]) == 2048  # never past the default: refused or cut alike
    assert planned_length(model, {}, [some[2]]) is None
    full = attrs.evolve(sized, backend=BackendConfig())
    with BatchWorker(model, sized) as small, BatchWorker(model, full) as large:
        assert small.engine.batch.max_length == expected and large.engine.batch.max_length == 2048
        for task in some:
            assert small.run(task)[0] == large.run(task)[0], task.id
