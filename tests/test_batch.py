"""``ortspec batch`` on this machine (one worker in this process, or worker processes): records, errors, resumption
after a kill, replay of sampled records, the drafter opened only when a record drafts with it, and every output
equal to what the Engine gives for the same record in this process (tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ortspec.adapters.batch import BatchError, BatchJob, run_batch
from ortspec.adapters.batch.local import plan_threads
from ortspec.adapters.batch.output import prepare_output
from ortspec.adapters.batch.records import option_fields, parse_record, read_input
from ortspec.adapters.batch.worker import BatchWorker, WorkerSettings, needs_drafter
from ortspec.adapters.cli.main import main as cli_main
from ortspec.adapters.hosts import available_cores
from ortspec.core import PromptLookup

LOOKUP_TEXT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"

RECORDS = [
    {"id": "greedy", "prompt": LOOKUP_TEXT, "max_tokens": 24, "ignore_eos": True},
    {"id": "chat", "messages": [{"role": "user", "content": "hello there, how are you?"}], "max_tokens": 16},
    {"id": 7, "prompt": [5, 17, 33, 5, 17, 33, 5, 17], "max_tokens": 12, "ignore_eos": True},
    {"id": "seeded", "prompt": "abc abc abc abc", "temperature": 0.9, "top_p": 0.9, "seed": 1234, "max_tokens": 20},
    {"id": "penalties", "prompt": "one two three", "temperature": 0.7, "top_k": 20, "seed": 5, "max_tokens": 16,
     "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {"12": 3.0}},
    {"id": "stop", "prompt": LOOKUP_TEXT, "stop": ["o"], "max_tokens": 30, "ignore_eos": True},
    {"id": "logprobs", "prompt": "lazy dog", "max_tokens": 6, "top_logprobs": 2, "speculative": None},
    {"id": "wide", "prompt": LOOKUP_TEXT, "max_tokens": 20, "draft_width": 3, "ignore_eos": True},
]  # fmt: skip
# The job's defaults: what the CLI's defaults give (prompt lookup, cost-aware width), chat off.
# A fixed width, so a batched record's whole line (its stats too) is what the record gives alone: the cost-aware
# "auto" width is priced by the batch's load, which changes its widths (stats), never its output (that is proved by
# property_tests/test_batching.py, with and without a cost curve).
DEFAULTS = {"speculative": PromptLookup(ngram=3, max_draft=16, min_ngram=1), "chat": False, "draft_width": 8}
BAD_LINES = [
    ('{"id": "typo", "prompt": "x", "max_token": 5}', "unknown field 'max_token'"),
    ('{"id": "zero", "prompt": "x", "max_tokens": 0}', "max_tokens must be an int >= 1"),
    ('{"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "exactly one of"),
    ('{"id": "neither"}', "exactly one of"),
    ('{"id": "hot", "prompt": "x", "temperature": -1}', "temperature"),
    ('{"id": "bias", "prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias: key 'abc'"),
    ('{"id": "spec", "prompt": "x", "speculative": "magic"}', "speculative='magic'"),
    ('{"id": "chat-ids", "prompt": [1, 2, 3], "max_tokens": 4, "chat": true}', "chat=True needs a text prompt"),
    ("{not json", "not valid JSON"),
    ('["a list"]', "not a JSON object"),
    ('{"prompt": "no id"}', "has no 'id'"),
    ('{"id": 1.5, "prompt": "x"}', "'id' must be"),
]


def write_jsonl(path: Path, records, extra_lines=()) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def read_output(path: Path) -> dict:
    """Output lines by id (or by line number for id-less errors); every key once."""
    out: dict = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        key = json.dumps(r["id"]) if r["id"] is not None else f"#line {r['line']}"
        assert key not in out, f"{key} written twice"
        out[key] = r
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("batch") / "in.jsonl", RECORDS, [line for line, _ in BAD_LINES])


@pytest.fixture(scope="module")
def embedded_run(tiny_model_dir, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch-out") / "out.jsonl"
    summary = run_batch(
        BatchJob(dataset, out, model=tiny_model_dir, workers=2, threads=1, options=DEFAULTS), progress=False
    )
    return out, summary


# -- records, without a model ----------------------------------------------------------------------------------


def test_parse_record_converts_and_names_problems():
    fields = option_fields()
    task = parse_record('{"id": "a", "prompt": "hi", "logit_bias": {"7": -2.5}, "stop": [[1, 2]]}', 3, {}, fields)
    assert task.id == "a" and task.line == 3 and task.options == {"logit_bias": {7: -2.5}, "stop": [[1, 2]]}
    assert parse_record('{"id": 2, "prompt": "x", "speculative": "none"}', 1, {}, fields).options["speculative"] is None
    for line, expected in BAD_LINES:
        record = parse_record(line, 9, {}, fields)
        if expected.startswith("chat=True") or expected == "temperature":  # the Engine finds these (in the worker)
            continue
        assert isinstance(record, dict) and expected in record["error"], (line, record)
        assert record["line"] == 9


def test_duplicate_ids_are_refused_before_anything_runs(tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": 1, "prompt": "y"}, {"id": "a", "prompt": "z"}]
    )
    with pytest.raises(BatchError, match=r'duplicate id: "a" \(lines 1 and 3\)'):
        read_input(src, {}, option_fields())
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchError, match="duplicate"):
        run_batch(BatchJob(src, out, model=tmp_path / "no-model"), progress=False)
    assert not out.exists()
    # 1 and "1" are different ids
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"id": 1, "prompt": "x"}, {"id": "1", "prompt": "y"}])
    assert len(read_input(ok, {}, option_fields())[0]) == 2


def test_prepare_output_cuts_a_partial_last_line_and_can_drop_errors(tmp_path):
    out = tmp_path / "out.jsonl"
    good = [{"id": "a", "text": "x"}, {"id": None, "line": 4, "error": "bad"}, {"id": 2, "line": 5, "error": "e"}]
    out.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good) + b'{"id": "b", "te')
    state = prepare_output(out)
    assert state.repaired_bytes == len(b'{"id": "b", "te')
    assert state.done == {'"a"', "#line 4", "2"} and state.errors == {"#line 4", "2"}
    assert out.read_bytes().endswith(b"\n") and len(out.read_text().splitlines()) == 3
    state = prepare_output(out, retry_errors=True)
    assert state.done == {'"a"'} and [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a"]
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(BatchError, match="line 2 is not JSON"):
        prepare_output(out)


def test_workers_times_threads_may_not_exceed_the_cores(tmp_path, capsys):
    assert plan_threads(2, None, 8) == 4 and plan_threads(3, None, 2 * 3 + 1) == 2 and plan_threads(1, 2, 2) == 2
    with pytest.raises(BatchError, match=r"2 workers x 2 threads = 4 intra-op threads, more than the 2 cores"):
        plan_threads(2, 2, 2)
    with pytest.raises(BatchError, match="3 workers need at least 3 cores"):
        plan_threads(3, 1, 2)
    cores = len(available_cores())
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    assert cli_main(["batch", str(src), str(tmp_path / "o.jsonl"), "--workers", "1", "--threads", str(cores + 1)]) == 2
    assert f"more than the {cores} cores" in capsys.readouterr().err
    assert cli_main(["batch", "--ray", str(src), str(tmp_path / "o.jsonl")]) == 2  # --ray swallowed INPUT
    assert "put --ray after INPUT OUTPUT" in capsys.readouterr().err


def test_the_drafter_is_opened_only_when_a_record_drafts_with_it(tmp_path):
    """``auto`` and ``shared-kv`` draft with the drafter, as the job's default or a record's own ``speculative``;
    a run whose records all decode plainly, by a lookup or by their own proposer opens none (``drafter=False``),
    and warms nothing when none speculates."""
    fields = option_fields()
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])

    def settings(default, *record_values):
        defaults = {"speculative": default}
        records = [{"id": i, "prompt": "x", **({} if v is ... else {"speculative": v})} for i, v in
                   enumerate(record_values)]  # fmt: skip
        tasks = [parse_record(json.dumps(r), n, defaults, fields) for n, r in enumerate(records, start=1)]
        job = BatchJob(src, tmp_path / "out.jsonl", drafter="some/drafter")
        return WorkerSettings.of(job, 1, defaults, tasks)  # type: ignore[arg-type]

    assert settings("auto", ...).drafter == "some/drafter"
    assert settings("suffix", ..., "shared-kv").drafter == "some/drafter"  # one record asks for it
    assert settings("suffix", ..., "prompt-lookup", None).drafter is False
    assert settings("auto", "suffix", None).drafter is False  # every record overrides the default
    assert settings("auto").drafter is False  # nothing left to run (resumed)
    assert settings(PromptLookup(), ...).drafter is False  # a proposer object drafts by itself
    assert settings(None, None, ...).warm is False and settings(None, "suffix").warm is True
    assert not needs_drafter({"speculative": "auto"}, [])


def test_one_worker_runs_in_this_process(tiny_model_dir, tmp_path):
    """The default (one worker): no worker process; the records run on an Engine of this process."""
    import multiprocessing

    class Pids:
        def __init__(self):
            self.seen = set()

        def propose(self, draft_context):
            self.seen.add(os.getpid())
            return ()

    pids = Pids()
    options = {"speculative": pids, "draft_width": 4, "ignore_eos": True}  # a fixed width: every step drafts
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"record {i}", "max_tokens": 3} for i in range(3)])
    summary = run_batch(
        BatchJob(src, tmp_path / "out.jsonl", model=tiny_model_dir, threads=1, options=options),
        progress=False,
    )
    # three records: three slots (sized from the work)
    assert summary.written == 3 and summary.errors == 0 and summary.slots == 3 and len(summary.load_s) == 1
    assert pids.seen == {os.getpid()} and not multiprocessing.active_children()


def test_missing_ray_extra_is_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    with pytest.raises(BatchError, match=r"pip install 'ortspec\[ray\]'"):
        run_batch(BatchJob(src, tmp_path / "out.jsonl", model=tmp_path, ray="local"), progress=False)


# -- end to end on the tiny model --------------------------------------------------------------------------------


def test_every_record_equals_the_engine_in_this_process(tiny_model_dir, embedded_run):
    out, summary = embedded_run
    got = read_output(out)
    assert summary.written == len(RECORDS) + len(BAD_LINES) and summary.lost == 0
    assert summary.errors == len(BAD_LINES) and summary.tokens == sum(
        len(r["token_ids"]) for r in got.values() if "text" in r
    )
    # what the same records give through one Engine here, with the same defaults and threads
    fields = option_fields()
    with BatchWorker(tiny_model_dir, WorkerSettings(threads=1, defaults=DEFAULTS)) as worker:
        for number, record in enumerate(RECORDS, start=1):
            expected, _ = worker.run(parse_record(json.dumps(record), number, DEFAULTS, fields))
            assert got[json.dumps(record["id"])] == expected, record["id"]
    for r in got.values():
        if "error" not in r:
            assert r["finish_reason_openai"] in ("stop", "length") and set(r["stats"]) == {
                "steps",
                "proposed",
                "accepted",
            }
    assert got['"stop"']["finish_reason"] == "stop_sequence" and got['"stop"']["stop_matched"] == "o"
    assert got['"seeded"']["seed"] == 1234 and got['"greedy"']["seed"] is None
    assert len(got['"logprobs"']["logprobs"]) == len(got['"logprobs"']["token_ids"])


def test_speculation_happened_and_bad_records_name_their_problem(embedded_run):
    got = read_output(embedded_run[0])
    assert got['"greedy"']["stats"]["proposed"] > 0, got['"greedy"']["stats"]
    errors = [r for r in got.values() if "error" in r]
    assert len(errors) == len(BAD_LINES)
    messages = " | ".join(r["error"] for r in errors)
    for _, expected in BAD_LINES:
        assert expected in messages, expected
    assert all(isinstance(r["line"], int) for r in errors)


def test_default_speculation_equals_plain_decoding(tiny_model_dir, dataset, embedded_run, tmp_path):
    plain = tmp_path / "plain.jsonl"
    options = {**DEFAULTS, "speculative": "none"}
    run_batch(BatchJob(dataset, plain, model=tiny_model_dir, workers=1, threads=1, options=options), progress=False)
    spec, base = read_output(embedded_run[0]), read_output(plain)
    assert spec.keys() == base.keys()
    for key in spec:
        a, b = spec[key], base[key]
        if "error" in a:
            assert a == b
        else:
            assert (a["token_ids"], a["text"], a["finish_reason"], a["seed"]) == (
                b["token_ids"], b["text"], b["finish_reason"], b["seed"]
            ), key  # fmt: skip


def test_sampled_record_without_seed_reports_one_that_replays(tiny_model_dir, tmp_path):
    record = {"id": "s", "prompt": "abc abc abc abc", "temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
    src = write_jsonl(tmp_path / "in.jsonl", [record, {**record, "id": "s2"}])
    first = read_output(run_and_path(src, tmp_path / "a.jsonl", tiny_model_dir))
    seed = first['"s"']["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**64 and seed != first['"s2"']["seed"]
    replay = write_jsonl(tmp_path / "replay.jsonl", [{**record, "seed": seed}])
    again = read_output(run_and_path(replay, tmp_path / "b.jsonl", tiny_model_dir))['"s"']
    assert again["token_ids"] == first['"s"']["token_ids"] and again["seed"] == seed


def run_and_path(src: Path, out: Path, model: Path, **kwargs) -> Path:
    run_batch(BatchJob(src, out, model=model, workers=1, threads=1, **kwargs), progress=False)
    return out


class CrashOn:
    """A proposer that kills its process when the context starts with ``ids`` (a record that kills its worker)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def propose(self, draft_context):
        if list(draft_context.tokens[: len(self.ids)]) == self.ids:
            os._exit(3)
        return ()


def test_a_record_that_kills_its_worker_is_an_error_line(tiny_model_dir, tmp_path):
    """The killer (the longest prompt, so handed out first) shares its batched worker with two other records: all
    three run again alone, and only the killer gets the error line."""
    from ortspec.adapters.engine.tokenizer import Tokenizer

    ids = Tokenizer.from_folder(tiny_model_dir).encode("crash here please")
    records = [
        {"id": i, "prompt": "crash here please" if i == 2 else f"fine {i} fine", "max_tokens": 6} for i in range(5)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    options = {"speculative": CrashOn(ids), "draft_width": 4}
    summary = run_batch(BatchJob(src, out, model=tiny_model_dir, workers=2, threads=1, options=options), progress=False)
    got = read_output(out)
    assert len(got) == 5 and summary.errors == 1
    assert "worker process died (exit code 3)" in got["2"]["error"]
    assert all("text" in got[str(i)] for i in (0, 1, 3, 4))


class KillRunOn:
    """Prompt lookup (``lookup``), except in the record whose context starts with ``ids``: there it SIGKILLs its
    process group (the whole batch run, parent and workers), as a kill in the middle of a run would."""

    def __init__(self, ids, lookup):
        self.ids, self.lookup = list(ids), lookup

    def propose(self, draft_context):
        if list(draft_context.tokens[: len(self.ids)]) == self.ids:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return self.lookup.propose(draft_context)


KILLED_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_batch import DEFAULTS, KillRunOn
from ortspec.adapters.batch import BatchJob, run_batch
from ortspec.adapters.engine.tokenizer import Tokenizer
src, out, model, prompt = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
killer = KillRunOn(Tokenizer.from_folder(model).encode(prompt), DEFAULTS["speculative"])
options = {**DEFAULTS, "draft_width": 4, "speculative": killer}
run_batch(BatchJob(src, out, model=model, workers=1, threads=1, max_batch=1, options=options), progress=False)
"""


def test_resume_after_a_kill(tiny_model_dir, tmp_path):
    """SIGKILL a run of one slot (``max_batch=1``, its worker in its process) in the middle of its fifth record,
    leave a half-written line as a kill mid-write would, rerun (16 slots, the default): every record once, each
    equal to an uninterrupted run's. The kill comes from the fifth record's first draft, so the first four records
    (longest prompt first: r23 to r20) are in OUTPUT: a worker of one slot is handed its next record only after
    the last one is written. (A batched run killed mid-job: ``test_batch_slots.py``.)"""
    records = [
        {"id": f"r{i}", "prompt": f"{i} " + LOOKUP_TEXT[: 20 + 3 * i], "max_tokens": 150, "ignore_eos": True}
        for i in range(24)
    ]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    options = {**DEFAULTS, "draft_width": 4}  # a fixed width: every step drafts, so the killer's propose runs
    args = [str(Path(__file__).parent), str(src), str(out), str(tiny_model_dir), records[19]["prompt"]]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], start_new_session=True, capture_output=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert [json.loads(line)["id"] for line in out.read_bytes().splitlines()] == ["r23", "r22", "r21", "r20"]
    with open(out, "ab") as f:
        f.write(b'{"id": "r19", "text": "half a li')
    notes: list[str] = []
    summary = run_batch(BatchJob(src, out, model=tiny_model_dir, workers=1, threads=1, options=options),
                        progress=False, log=notes.append)  # fmt: skip
    assert any("partial line" in n for n in notes) and any("4 of 24" in n for n in notes), notes
    assert summary.skipped == 4 and summary.written == len(records) - 4
    resumed = read_output(out)
    clean = read_output(run_and_path(src, tmp_path / "clean.jsonl", tiny_model_dir, options=options))
    assert resumed.keys() == clean.keys() and len(resumed) == len(records)
    for key in clean:
        assert resumed[key] == clean[key], key


def test_the_backend_config_opens_every_worker_and_threads_are_the_jobs(tmp_path):
    from ortspec.backends.onnx import BackendConfig

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    with pytest.raises(BatchError, match="backend.threads"):
        run_batch(BatchJob(src, tmp_path / "out.jsonl", backend=BackendConfig(threads=2)), progress=False)
    with pytest.raises(BatchError, match="backend must be a BackendConfig"):
        run_batch(BatchJob(src, tmp_path / "out.jsonl", backend="cuda"), progress=False)  # type: ignore[arg-type]
    with pytest.raises(BatchError, match="prefill_budget must be an int >= 1, got 0"):
        run_batch(BatchJob(src, tmp_path / "out.jsonl", prefill_budget=0), progress=False)


def same_record(line: dict, reference: dict) -> bool:
    """The record alone: every field equal, the logprobs' values within float32 rounding (a row's logits in a batched
    run differ from its logits alone in the last bits: tests/test_ort_batch.py's ROW_TOLERANCE)."""
    line, reference = dict(line), dict(reference)
    ours, theirs = line.pop("logprobs", None), reference.pop("logprobs", None)
    if (ours is None) != (theirs is None) or line != reference:
        return False
    return ours is None or _numbers(ours) == pytest.approx(_numbers(theirs), rel=1e-5, abs=1e-5)


def _numbers(value) -> list:
    """Every number in a nested JSON value, in order (the token ids too: approx of an int is itself)."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value]
