"""The throughput benchmark's columns, each one run over its requests (``ColumnRun``: wall seconds, generated
tokens, outputs): ortspec alone and batched (one Engine's scheduler), ``ortspec batch`` end to end as a subprocess,
and ONNX Runtime GenAI's static batches."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.batch_scaling import outputs as batch_outputs
from bench.peer_ortgenai import OrtGenAIRunner
from bench.throughput_dataset import Request
from bench.workloads import encode_chat
from ortspec import Engine
from ortspec.adapters.engine.engine import DEFAULT_SLOTS
from ortspec.adapters.engine.options import GenerationOptions
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.driver import GenerateResult

SPECULATION = {"plain": None, "prompt lookup": "prompt-lookup"}  # column name -> Engine's `speculative`
WARMUP_REQUESTS = DEFAULT_SLOTS  # requests of the batched warm-up (4 tokens each), one batch backend's slots


@attrs.frozen
class ColumnRun:
    """One column's run over the requests: wall ``seconds``, generated ``tokens`` (each request's own number),
    ``outputs`` (request id -> new token ids) and facts of the run (``extra``)."""

    column: str
    mode: str
    seconds: float
    tokens: int
    outputs: Mapping[str, list[int]]
    extra: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# --------------------------------------------------------------------------
# ortspec: alone and batched
# --------------------------------------------------------------------------


def generate_batched(engine: Engine, requests: Sequence[tuple[Any, GenerationOptions]]) -> list[GenerateResult]:
    """``Engine.generate_many`` with each request's own options (its number of tokens and seed): every request
    made ready (``Engine.request``) and run at once on the Engine's one scheduler (``Engine.generate_requests``),
    as ``ortspec batch`` and the server submit theirs."""
    return engine.generate_requests([engine.request(prompt, options) for prompt, options in requests])


def _ortspec_run(
    column: str, mode: str, requests: Sequence[Request], run: Callable[[], list[GenerateResult]]
) -> ColumnRun:
    t0 = time.perf_counter()
    results = run()
    seconds = time.perf_counter() - t0
    proposed = sum(r.stats.proposed_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return ColumnRun(
        column,
        mode,
        seconds,
        sum(len(r.token_ids) for r in results),
        {q.id: list(r.token_ids) for q, r in zip(requests, results, strict=True)},
        {"proposed": proposed, "accepted": accepted, "steps": sum(r.stats.steps for r in results)},
    )


def run_alone(engine: Engine, requests: Sequence[Request], mode: str) -> ColumnRun:
    """Every request decoded alone, plainly, one after another: the reference."""

    def run() -> list[GenerateResult]:
        return [engine.generate(list(q.messages), speculative=None, **q.options(mode)) for q in requests]

    return _ortspec_run("ortspec alone", mode, requests, run)


def run_batched(engine: Engine, requests: Sequence[Request], mode: str, speculation: str) -> ColumnRun:
    speculative = SPECULATION[speculation]

    def run() -> list[GenerateResult]:
        batch = [(list(q.messages), GenerationOptions(**q.options(mode), speculative=speculative)) for q in requests]
        return generate_batched(engine, batch)

    return _ortspec_run(f"ortspec batched, {speculation}", mode, requests, run)


def warm_up(engine: Engine, batched: Engine, requests: Sequence[Request]) -> None:
    """What the timed runs should not pay: pass shapes allocated and the verify and batch decode costs measured
    (prompt lookup's width), on the first ``WARMUP_REQUESTS`` requests at 4 tokens batched; one request alone."""
    head = [list(q.messages) for q in requests[:WARMUP_REQUESTS]]
    for speculative in SPECULATION.values():
        generate_batched(batched, [(p, GenerationOptions(max_tokens=4, speculative=speculative)) for p in head])
    engine.generate(head[0], max_tokens=4)


# --------------------------------------------------------------------------
# `ortspec batch` end to end, as a subprocess
# --------------------------------------------------------------------------


def cli_command() -> list[str]:
    """The ``ortspec`` command, run by this Python (so it is the ortspec this benchmark imports)."""
    return [sys.executable, "-m", "ortspec.adapters.cli"]


def batch_args(threads: int) -> tuple[str, ...]:
    """The arguments of the ``ortspec batch`` column beside INPUT OUTPUT and ``--model``: the command's defaults,
    with every engine's ``threads``."""
    return ("--threads", str(threads))


def run_batch_command(model_dir: Path, requests: Sequence[Request], mode: str, threads: int, tmp: Path) -> ColumnRun:
    """``ortspec batch INPUT OUTPUT --model DIR`` + ``batch_args(threads)`` on the requests as JSONL; wall time from
    the start of the command to its exit."""
    src, out = tmp / f"batch-{mode}.jsonl", tmp / f"batch-{mode}-out.jsonl"
    out.unlink(missing_ok=True)
    with open(src, "w", encoding="utf-8") as f:
        for q in requests:
            f.write(json.dumps({"id": q.id, "messages": list(q.messages), **q.options(mode)}) + "\n")
    args = batch_args(threads)
    command = [*cli_command(), "batch", str(src), str(out), "--model", str(model_dir), *args, "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    found = batch_outputs(out)
    errors = {k: v for k, v in found.items() if isinstance(v, str)}
    if errors:
        raise RuntimeError(f"ortspec batch failed records: {errors}")
    outputs = {k: v for k, v in found.items() if not isinstance(v, str)}
    tokens = sum(len(v) for v in outputs.values())
    facts = {"arguments": list(args), **job_times(done.stderr)}
    return ColumnRun("ortspec batch", mode, seconds, tokens, outputs, facts)


def job_times(stderr: str) -> dict[str, float]:
    """From ``ortspec batch``'s summary line: ``job_s``, the job's own wall time (reading the input to the last
    line; the command's seconds less this are the process start), and ``load_s``, its Engine's load and warm-up."""
    found = {}
    job = re.search(r"tokens in ([0-9.]+) s:", stderr)
    load = re.search(r"model load and warm-up ([0-9.]+) s", stderr)
    if job:
        found["job_s"] = float(job.group(1))
    if load:
        found["load_s"] = float(load.group(1))
    return found


# --------------------------------------------------------------------------
# ONNX Runtime GenAI, static batches
# --------------------------------------------------------------------------


def run_genai(
    runner: OrtGenAIRunner, requests: Sequence[Request], batch: int, mode: str, tokenizer: Tokenizer
) -> ColumnRun:
    """Consecutive groups of ``batch`` requests, one ``run_batch`` each (sampled: the group's first request's
    seed); the seconds are the batches' own (prompt ids in hand to the last token), summed."""
    seconds, steps, outputs = 0.0, 0, {}
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        ids = [encode_chat(q.messages, tokenizer) for q in group]
        seed = group[0].seed if mode == "sampled" else None
        done = runner.run_batch(ids, max(q.max_tokens for q in group), seed=seed)
        seconds += done.seconds
        steps += done.steps
        outputs.update({q.id: row[: q.max_tokens] for q, row in zip(group, done.rows, strict=True)})
    tokens = sum(q.max_tokens for q in requests)
    return ColumnRun(f"ORT GenAI batched, batch {batch}", mode, seconds, tokens, outputs, {"steps": steps})
