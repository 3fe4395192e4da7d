"""``ortspec batch`` resumes from its OUTPUT: a rerun skips every record already there (results and error lines
alike, unless ``retry_errors``), cuts off a partial last line, and runs only what is missing. No model is needed:
every record here is either already in OUTPUT or a bad input line (whose error line needs no worker), so a run
that wrongly tries to generate fails for want of the model folder."""

from __future__ import annotations

import json
from pathlib import Path

from ortspec.adapters.batch import BatchJob, run_batch

RECORDS = [
    {"id": "a", "prompt": "hello", "max_tokens": 4},
    {"id": 1, "prompt": "one", "max_tokens": 4},
    {"id": "1", "prompt": "one as a string", "max_tokens": 4},  # another id than 1
]
BAD_LINE = '{"id": "typo", "prompt": "x", "max_token": 5}'
NO_ID_LINE = '{"prompt": "no id"}'


def write_input(path: Path) -> Path:
    lines = [json.dumps(r) for r in RECORDS] + [BAD_LINE, NO_ID_LINE]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def finished_output() -> list[dict]:
    """What a finished run wrote for ``write_input``'s file (in completion order): two results, one record whose
    generation failed, and the two bad lines' error records."""
    return [
        {"id": "1", "text": "x", "token_ids": [1], "finish_reason": "max_tokens"},
        {"id": "typo", "line": 4, "error": "unknown field 'max_token'"},
        {"id": 1, "line": 2, "error": "worker process died (exit code 3)"},
        {"id": None, "line": 5, "error": "line 5 has no 'id'"},
        {"id": "a", "text": "y", "token_ids": [2], "finish_reason": "max_tokens"},
    ]


def encode(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode("utf-8") + b"\n" for r in records)


def test_a_rerun_over_a_finished_output_runs_and_writes_nothing(tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    out.write_bytes(encode(finished_output()))
    notes: list[str] = []
    summary = run_batch(BatchJob(src, out, model=tmp_path / "no-model"), progress=False, log=notes.append)
    assert (summary.records, summary.skipped, summary.written, summary.lost) == (5, 5, 0, 0)
    assert out.read_bytes() == encode(finished_output())  # the error lines stay: retrying them is asked for
    assert any("5 of 5 records are already in" in n for n in notes), notes


def test_a_partial_last_line_is_cut_off_and_its_record_written_again(tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    done = [r for r in finished_output() if r["id"] != "typo"]
    out.write_bytes(encode(done) + b'{"id": "typo", "li')  # killed while writing the bad line's error record
    notes: list[str] = []
    summary = run_batch(BatchJob(src, out, model=tmp_path / "no-model"), progress=False, log=notes.append)
    assert (summary.skipped, summary.written, summary.errors) == (4, 1, 1)
    assert any("partial line" in n for n in notes), notes
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and out.read_bytes().startswith(encode(done))
    written = [json.loads(line) for line in lines[:-1]]
    assert len(written) == 5 and written[-1]["id"] == "typo" and "max_token" in written[-1]["error"]
