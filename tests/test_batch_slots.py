"""``ortspec batch`` on the batch driver (``--max-batch``, ``BatchJob.max_batch``): each worker keeps up to
``max_batch`` records decoding together and the next joins as soon as a slot frees; every record's line is what
``Engine.generate`` gives that record alone (``BatchWorker.run``, the one-at-a-time path), errors included; a
killed batched run resumes; ``max_batch=1`` and a folder that cannot batch take the one-at-a-time path (tiny
model)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_batch import BAD_LINES, DEFAULTS, LOOKUP_TEXT, RECORDS, read_output, write_jsonl

from ortspec.adapters.batch import BatchJob, run_batch
from ortspec.adapters.batch.command import _job
from ortspec.adapters.batch.records import Task, option_fields, parse_record
from ortspec.adapters.batch.worker import BatchWorker, WorkerSettings
from ortspec.adapters.cli.main import build_parser
from ortspec.backends.onnx import BackendConfig

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

    def propose(self, context, width):
        if len(context) >= self.limit:
            raise ValueError("the drafter broke")
        return self.lookup.propose(context, width)

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
    """The one-at-a-time path (``max_batch=1``): one ``Engine.generate`` per record."""
    return BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=DEFAULTS))


def drain(worker: BatchWorker, snapshots: list | None = None) -> dict:
    """Advance ``worker`` until it holds nothing: its lines by task key (``snapshots``: the driver's running
    sequences after each pass)."""
    lines = {}
    while worker.held:
        for task, record, metrics in worker.advance():
            assert task.key not in lines
            lines[task.key] = (record, metrics)
        if snapshots is not None and worker.batched is not None:
            snapshots.append({id(s) for s in worker.batched.driver.running})
    return lines


def test_each_line_is_the_record_alone_and_slots_refill_as_they_free(tiny_model_dir, alone):
    # a tiny prompt-token budget per pass: the records' prompts are prefilled a few tokens a pass, first come first
    settings = WorkerSettings(threads=1, defaults=DEFAULTS, max_batch=3, prefill_budget=5)
    worker = BatchWorker(tiny_model_dir, settings)
    assert worker.slots == 3 and worker.note is None
    assert worker.batched is not None and worker.batched.driver.prefill_budget == 5
    todo = tasks(tiny_model_dir)
    for task in todo:
        worker.submit(task)
    snapshots: list[set[int]] = []
    lines = drain(worker, snapshots)
    assert len(lines) == len(todo)  # more records than slots: every one written once
    for task in todo:
        assert lines[task.key][0] == alone.run(task)[0], task.id
    errors = {task.id: lines[task.key][0]["error"] for task in todo if "error" in lines[task.key][0]}
    assert set(errors) == {"long", "chat-ids", "fails"}, errors
    assert "the drafter broke" in errors["fails"] and lines['"fails"'][0]["partial"]["token_ids"]
    # at most 3 at once; a record joined while one that started with it was still running (not in waves)
    assert max(len(s) for s in snapshots) == 3
    first = snapshots[0]
    assert any(len(s) == 3 and s & first and s != first for s in snapshots), snapshots
    steps = sum(m["steps"] for _, m in lines.values() if m["ok"])
    assert worker.batched is not None and worker.batched.driver.passes < steps  # the passes were shared


def test_max_batch_1_is_the_one_at_a_time_path(tiny_model_dir, alone):
    assert alone.batched is None and alone.slots == 1 and alone.note is None
    task = tasks(tiny_model_dir)[0]
    alone.submit(task)
    [(done, record, metrics)] = alone.advance()
    assert done is task and record == alone.run(task)[0] and metrics["ok"]
    assert alone.engine._batch is None  # no batch backend was opened
    parser = build_parser()
    assert _job(parser.parse_args(["batch", "in.jsonl", "out.jsonl"])).max_batch == 16
    assert _job(parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--max-batch", "1"])).max_batch == 1
    job = _job(parser.parse_args(["batch", "in.jsonl", "out.jsonl"]))
    assert job.prefill_budget == 512 and WorkerSettings.of(job, 1, {}).prefill_budget == 512
    job = _job(parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--prefill-budget", "none"]))
    assert job.prefill_budget is None and WorkerSettings.of(job, 1, {}).prefill_budget is None


def test_a_folder_that_cannot_batch_runs_one_at_a_time_and_says_why_once(tiny_model_dir, tmp_path):
    backend = BackendConfig(share_buffer=False)  # OrtBatchBackend refuses: buffer sharing off
    worker = BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=DEFAULTS, backend=backend, max_batch=4))
    assert worker.batched is None and worker.slots == 1
    assert worker.note is not None and "buffer sharing is off" in worker.note
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:4])
    notes: list[str] = []
    job = BatchJob(src, tmp_path / "out.jsonl", model=tiny_model_dir, workers=2, threads=1, backend=backend,
                   options=DEFAULTS)  # fmt: skip
    summary = run_batch(job, progress=False, log=notes.append)
    assert summary.written == 4 and summary.errors == 0 and summary.slots == 1
    assert [n for n in notes if "cannot run batched" in n] == [worker.note]


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
    """SIGKILL a batched run (4 slots) right after its fifth line, while the worker holds more records, leave a
    half-written line, rerun: every record once, each what ``Engine.generate`` gives it alone."""
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
