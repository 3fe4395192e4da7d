"""Dataset throughput (issue 19, "Measure"): ortspec batched, and ``ortspec batch`` end to end, against ONNX Runtime
GenAI.

    python -m bench.throughput [--precision fp32|int4|both] [--prompts N] [--threads T] [--quick] [--out FILE.md]

The dataset is ``bench/data/throughput-prompts.json`` (``DATASET``): 64 chat prompts (the 32 of
``bench.generate_many`` and 32 more of the same four kinds with prompts of at most 500 tokens), each with its own
number of new tokens drawn once in 64..128 (``random.Random(DATASET_SEED)``); ``--export-dataset`` rebuilds it
from ``bench.workloads`` with the default model's tokenizer. Every request ignores EOS, so each does exactly its
number of tokens whatever the engine, and is decoded greedily or by seeded sampling (``bench.engines.SAMPLING``,
temperature 0.7 and top_p 0.9, the seed ``bench.engines.prompt_seed`` of the request's id).

Columns, each one run over its plan's requests (``PLANS``) on the same model folder and intra-op thread count
(``--threads``); tokens/s = generated tokens ÷ wall seconds of the run:

``ortspec alone``                   ``Engine.generate`` one request after another, plain decoding: the reference
                                    every ortspec output is compared with (greedy once, sampled once).
``ortspec batched, plain``          continuous batching (the Engine's one scheduler over its batch backend,
``ortspec batched, prompt lookup``  ``Engine.generate_requests``), speculation off / prompt lookup.
``ortspec batch``                   the command end to end (``batch_args``: its defaults, so one Engine in its
                                    process, 16 records at once, ``speculative="auto"``, with ``--threads``) as a
                                    subprocess on the requests as JSONL; its wall time includes starting the
                                    command and loading the model (seconds, of minutes).
``ORT GenAI batched, batch B``      ``OrtGenAIRunner.run_batch`` on consecutive groups of B requests in dataset
                                    order (static batches, right-padded as ORT GenAI pads): every row runs to its
                                    group's largest number of new tokens; tokens/s counts each request's own
                                    number only.

Each ortspec column's outputs (token ids) are compared with the same requests decoded alone (identical/total, and
each mismatch with its first differing position); ORT GenAI's greedy outputs too, as information. The ratios
printed are each ortspec column ÷ the best ORT GenAI batched column of the same decoding. ``PLANS`` says which
columns each precision runs (int4 is cut to fit the time budget; the report says so); its last section picks the
precision whose best exact batched column is fastest.

Results go to ``--out`` (default docs/throughput.md) and the same name with ``.json``, with the machine, the date
and the command. The full run (``--precision both``) takes about 15 minutes on the quiet 2-core machine (an
estimate); the exit status is 1 when an ortspec output differs from alone. ``--quick``: the 8 shortest prompts
(two per kind), ORT GenAI at batch 8 only; a smoke test, its report goes to the temporary folder unless ``--out``
is given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.batch_scaling import outputs as batch_outputs
from bench.engines import SAMPLING, prompt_seed
from bench.machine import machine_info
from bench.peer_ortgenai import OrtGenAIRunner
from bench.peers import make_peer
from bench.workloads import CATEGORIES, Workload, build_workloads, encode_chat, half, python_version_tag
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.engine import DEFAULT_SLOTS
from ortspec.adapters.engine.options import GenerationOptions
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.driver import GenerateResult

DATASET = Path(__file__).resolve().parent / "data" / "throughput-prompts.json"
DATASET_FORMAT = "ortspec-throughput-prompts/1"
DATASET_SEED = 19  # the random.Random seed of every request's number of new tokens
NEW_TOKENS = (64, 128)  # each request's number of new tokens is drawn in this range (inclusive)
MODES = ("greedy", "sampled")
SPECULATION = {"plain": None, "prompt lookup": "prompt-lookup"}  # column name -> Engine's `speculative`
WARMUP_REQUESTS = DEFAULT_SLOTS  # requests of the batched warm-up (4 tokens each), one batch backend's slots


@attrs.frozen
class Request:
    """One dataset request: chat ``messages``, exactly ``max_tokens`` new tokens (EOS ignored) and, when sampled,
    the ``seed`` of its id (``bench.engines.prompt_seed``)."""

    id: str
    messages: tuple[Mapping[str, str], ...] = attrs.field(converter=tuple)
    max_tokens: int
    kind: str

    @property
    def seed(self) -> int:
        return prompt_seed(self.id)

    def options(self, mode: str) -> dict[str, Any]:
        """The generation keywords of this request in ``mode`` (``greedy`` or ``sampled``), as the Engine and an
        ``ortspec batch`` record take them (without ``speculative``)."""
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "ignore_eos": True}
        if mode == "sampled":
            options.update(SAMPLING, seed=self.seed)
        return options


@attrs.frozen
class Plan:
    """What one precision runs: the decodings ``modes``, each on ``prompts[mode]`` requests spread evenly over the
    dataset (``spread``), ORT GenAI's batch sizes (``genai_batches``; its sampled column at the best greedy one
    when ``genai_sampled``), and the decodings ``ortspec batch`` runs (``batch_modes``; with its own defaults).
    ``note`` says what was cut, for the report."""

    precision: str
    prompts: Mapping[str, int] = attrs.field(converter=dict)
    modes: tuple[str, ...]
    genai_batches: tuple[int, ...]
    genai_sampled: bool
    batch_modes: tuple[str, ...]
    note: str = ""


# The full run's plans, cut to fit about 15 minutes on the quiet 2-core machine (an estimate: fp32 about 12.5
# minutes, int4 about 3.5).
PLANS = {
    "fp32": Plan(
        "fp32",
        {"greedy": 64, "sampled": 32},
        MODES,
        (8, 16, 32),
        True,
        ("greedy",),
        "cut to fit the time budget: sampling on every other request (32), `ortspec batch` greedy only",
    ),
    "int4": Plan(
        "int4",
        {"greedy": 64},
        ("greedy",),
        (16,),
        False,
        (),
        "cut to fit the time budget: greedy only (on the same requests as fp32's greedy columns, which the choice "
        "of precision compares), ORT GenAI at batch 16 only, no `ortspec batch` run",
    ),
}


def spread(requests: Sequence[Request], n: int) -> list[Request]:
    """``n`` requests spread evenly over ``requests`` (all of them when ``n`` is larger), in order."""
    count = len(requests)
    return list(requests) if n >= count else [requests[(i * count) // n] for i in range(n)]


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
# The dataset
# --------------------------------------------------------------------------


def _source(workload: Workload) -> str:
    """What a prompt is made from (its code unit, module docstring, target document or text): two prompts with the
    same source would share a prefix, which a prefix cache could reuse."""
    meta = workload.meta
    if workload.category == "summarize":
        return "summarize:" + workload.name.split("-")[1]
    return f"{workload.category}:{meta.get('source') or meta.get('target') or workload.messages[-1]['content']}"


def build_dataset(tokenizer: Tokenizer) -> dict[str, Any]:
    """The dataset file's content: the 32 prompts of ``bench.generate_many`` (8 per kind, at most 1000 prompt
    tokens) then, per kind, 8 more from ``build_workloads(n, 500)`` (shorter ones; n = 16, 24, ... until there are
    8 whose source no earlier prompt has), each with its number of new tokens drawn in ``NEW_TOKENS``."""
    chosen = build_workloads(8, 1000, tokenizer)
    for kind in CATEGORIES:
        taken, n = 0, 16
        while taken < 8:
            sources = {_source(w) for w in chosen}
            fresh = [w for w in build_workloads(n, 500, tokenizer, categories=[kind]) if _source(w) not in sources]
            chosen += fresh[: 8 - taken]
            taken += len(fresh[: 8 - taken])
            n += 8
    rng = random.Random(DATASET_SEED)
    records = [
        {
            "id": f"tp{i:02d}-{w.category}",
            "kind": w.category,
            "source": w.name,
            "messages": w.messages,
            "max_tokens": rng.randint(*NEW_TOKENS),
        }
        for i, w in enumerate(chosen)
    ]
    return {
        "format": DATASET_FORMAT,
        "python": python_version_tag(),
        "rule": "bench.throughput.build_dataset: bench.workloads prompts (text from this Python's stdlib); new "
        f"tokens random.Random({DATASET_SEED}).randint{NEW_TOKENS} per request in order",
        "records": records,
    }


def load_dataset(path: Path = DATASET) -> list[Request]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("format") != DATASET_FORMAT:
        raise ValueError(f"{path}: not an {DATASET_FORMAT} file")
    return [Request(r["id"], r["messages"], r["max_tokens"], r["kind"]) for r in raw["records"]]


def split(requests: Sequence[Request], part: str) -> list[Request]:
    """The dataset's ``part`` (``bench.workloads.SPLITS``; ``bench.workloads.half`` by kind): every request has its
    own source text, so the two halves share none."""
    return half(requests, part, lambda q: q.kind)


def quick_requests(requests: Sequence[Request], tokenizer: Tokenizer) -> list[Request]:
    """The two shortest prompts of each kind (by prompt tokens), in dataset order."""
    length = {r.id: len(encode_chat(r.messages, tokenizer)) for r in requests}
    keep = {
        r.id
        for kind in CATEGORIES
        for r in sorted((q for q in requests if q.kind == kind), key=lambda q: length[q.id])[:2]
    }
    return [r for r in requests if r.id in keep]


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


# --------------------------------------------------------------------------
# Comparison and report
# --------------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(run: ColumnRun, reference: ColumnRun) -> dict[str, Any]:
    """``run``'s outputs against ``reference``'s, request by request."""
    mismatches = []
    for rid, ref in reference.outputs.items():
        position = first_difference(run.outputs.get(rid, []), ref)
        if position is not None:
            mismatches.append({"id": rid, "first_difference": position})
    total = len(reference.outputs)
    return {"identical": total - len(mismatches), "total": total, "mismatches": mismatches}


# --------------------------------------------------------------------------
# One precision
# --------------------------------------------------------------------------


def model_folder(precision: str) -> Path:
    """The default model at ``precision`` (int4: MatMulNBits accuracy level 1, exact), converted on first use."""
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir(precision)
    return folder if is_complete(folder) else convert_smollm2(folder, precision)


def measure(plan: Plan, model_dir: Path, dataset: Sequence[Request], threads: int, tmp: Path) -> dict[str, Any]:
    """Every column of ``plan`` on its requests of ``dataset``; the runs, and each one's comparison with ortspec
    alone (ORT GenAI's greedy ones as information)."""
    by_mode = {mode: spread(dataset, plan.prompts[mode]) for mode in plan.modes}
    runs: list[ColumnRun] = []

    def done(run: ColumnRun) -> ColumnRun:
        print(f"  {plan.precision} {run.mode:7} {run.column:34} {run.seconds:7.1f} s {run.tokens_per_s:7.1f} tok/s",
              file=sys.stderr, flush=True)  # fmt: skip
        runs.append(run)
        return run

    config = BackendConfig(threads=threads)
    engine = Engine.from_dir(model_dir, config, batch_slots=1, drafter=False)  # alone: one request at a time
    batched = Engine.from_dir(model_dir, config, drafter=False)  # DEFAULT_SLOTS, as serve and batch open it
    warm_up(engine, batched, dataset)
    for mode, requests in by_mode.items():
        done(run_alone(engine, requests, mode))
        for speculation in SPECULATION:
            done(run_batched(batched, requests, mode, speculation))
    engine.close()
    batched.close()
    del engine, batched  # their sessions' memory, before the other engines load
    for mode in plan.batch_modes:
        done(run_batch_command(model_dir, by_mode[mode], mode, threads, tmp))
    missing = measure_genai(plan, model_dir, by_mode, threads, done)
    tokenizer = Tokenizer.from_folder(model_dir)
    alone = {r.mode: r for r in runs if r.column == "ortspec alone"}
    return {
        "plan": attrs.asdict(plan),
        "model_dir": str(model_dir).replace(str(Path.home()), "~"),
        "runs": runs,
        "identity": {
            f"{r.mode}|{r.column}": compare(r, alone[r.mode])
            for r in runs
            if r.mode in alone and r is not alone[r.mode] and not (r.mode == "sampled" and r.column.startswith("ORT"))
        },
        "missing": missing,
        "requests": {
            mode: {
                "ids": [q.id for q in requests],
                "prompt_tokens": sum(len(encode_chat(q.messages, tokenizer)) for q in requests),
                "new_tokens": sum(q.max_tokens for q in requests),
            }
            for mode, requests in by_mode.items()
        },
    }


def measure_genai(
    plan: Plan,
    model_dir: Path,
    by_mode: Mapping[str, Sequence[Request]],
    threads: int,
    done: Callable[[ColumnRun], ColumnRun],
) -> dict[str, str]:
    """ORT GenAI's greedy columns at ``plan.genai_batches``, then its sampled column at the best of them; ``{peer:
    why}`` for a peer that cannot run (reported, never faked)."""
    tokenizer = Tokenizer.from_folder(model_dir)
    best: ColumnRun | None = None
    missing = {}
    for mode, peer in (("greedy", "ortgenai"), ("sampled", "ortgenai-sampled")):
        batches = plan.genai_batches if mode == "greedy" else ((int(best.column.rsplit(" ", 1)[1]),) if best else ())
        if mode not in by_mode or (mode == "sampled" and not plan.genai_sampled) or not batches:
            continue
        requests = by_mode[mode]
        runner, why = make_peer(peer, model_dir, threads=threads, sampling=dict(SAMPLING))
        if runner is None:
            missing[peer] = why or "unavailable"
            continue
        assert isinstance(runner, OrtGenAIRunner)
        runner.warmup()
        for batch in batches:
            runner.run_batch([encode_chat(q.messages, tokenizer) for q in requests[:batch]], 2)  # this shape's warm-up
            run = done(run_genai(runner, requests, batch, mode, tokenizer))
            if mode == "greedy" and (best is None or run.tokens_per_s > best.tokens_per_s):
                best = run
        runner.close()
    return missing


# --------------------------------------------------------------------------
# Summary, report, command line
# --------------------------------------------------------------------------


def summarize(measured: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per run: tokens/s, the ratio to the best ORT GenAI batched column of the same decoding, identity
    with ortspec alone."""
    runs: list[ColumnRun] = measured["runs"]
    rows = []
    for run in runs:
        genai = [r for r in runs if r.column.startswith("ORT GenAI") and r.mode == run.mode]
        best = max(genai, key=lambda r: r.tokens_per_s) if genai else None
        identity = measured["identity"].get(f"{run.mode}|{run.column}")
        rows.append(
            {
                "column": run.column,
                "mode": run.mode,
                "seconds": run.seconds,
                "tokens": run.tokens,
                "tokens_per_s": run.tokens_per_s,
                "vs_best_genai": run.tokens_per_s / best.tokens_per_s if best else None,
                "best_genai": best.column if best else None,
                "identity": identity,
                "extra": dict(run.extra),
            }
        )
    return rows


def fastest_precision(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """The precision whose fastest ortspec batched greedy column, with every output equal to alone, is fastest
    (None unless both were measured)."""
    best = {}
    for precision, result in results.items():
        exact = [
            row
            for row in result["summary"]
            if row["column"].startswith("ortspec batched") and row["mode"] == "greedy"
            if row["identity"]["identical"] == row["identity"]["total"]
        ]
        if exact:
            best[precision] = max(exact, key=lambda row: row["tokens_per_s"])
    if len(results) < 2 or not best:
        return None
    choice = max(best, key=lambda p: best[p]["tokens_per_s"])
    return {
        "precision": choice,
        "by": {p: {"column": r["column"], "tokens_per_s": r["tokens_per_s"]} for p, r in best.items()},
    }


TARGETS = (("vs_best_genai", 1.3, "ORT GenAI's best batched greedy"),)


def targets(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """The issue's dataset targets (``TARGETS``), for the fastest ortspec batched greedy column."""
    batched = [r for r in summary if r["column"].startswith("ortspec batched") and r["mode"] == "greedy"]
    if not batched:
        return []
    best = max(batched, key=lambda r: r["tokens_per_s"])
    found = [
        f"{best[key]:.2f}x {name} (target {target}x: {'met' if best[key] >= target else 'missed'})"
        for key, target, name in TARGETS
        if best[key] is not None
    ]
    return (
        ["", f"Targets, fastest batched greedy column ({best['column']}): " + "; ".join(found) + "."] if found else []
    )


def _f(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown(report: Mapping[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        "# Dataset throughput: ortspec batched, `ortspec batch`, ONNX Runtime GenAI batched",
        "",
        f"Generated by `{report['command']}` on {report['date_utc']} (UTC) in {report['elapsed_s']:.0f} s. "
        f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('memory_gib')} GiB, "
        f"{machine.get('os')}, {machine.get('python')}; onnxruntime {machine['versions'].get('onnxruntime')}, "
        f"onnxruntime-genai {machine['versions'].get('onnxruntime-genai')}; other processes used "
        f"{_f(machine.get('background_load_cores'), '.2f')} cores when it started.",
        "",
        f"Dataset: `{report['dataset']['file']}`, {report['dataset']['requests']} chat requests, each with its own "
        f"number of new tokens in {NEW_TOKENS[0]}..{NEW_TOKENS[1]} (EOS ignored); greedy, and sampled at "
        f"{dict(SAMPLING)} with each request's own seed; each precision's section says which requests it ran. "
        f"{report['threads']} intra-op threads for every "
        "engine; the `ortspec batch` column is `ortspec batch INPUT OUTPUT --model DIR "
        + " ".join(report["batch_args"])
        + "` (its defaults otherwise).",
        "",
        "tokens/s = generated tokens ÷ wall seconds of the column's run over the whole dataset. `ortspec batch`'s "
        "wall time includes starting the command and loading the model; ORT GenAI's static batches run every row "
        "to the group's largest number of new tokens and only each request's own tokens are counted. `identical` "
        "= outputs (token ids) equal to the same request decoded alone by `Engine.generate` (plain decoding, same "
        "options and seed); for ORT GenAI (greedy) information only.",
    ]
    for precision, result in report["precisions"].items():
        plan = result["plan"]
        lines += ["", f"## {precision} (`{result['model_dir']}`)", ""]
        ran = "; ".join(
            f"{mode}: {len(r['ids'])} requests, {r['prompt_tokens']} prompt tokens and {r['new_tokens']} new "
            "tokens in all"
            for mode, r in result["requests"].items()
        )
        lines += [f"Requests: {ran}." + (f" Plan: {plan['note']}." if plan["note"] else ""), ""]
        lines += [
            "| decoding | column | wall s | tokens | tok/s | ÷ best ORT GenAI | identical |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in result["summary"]:
            identity = row["identity"]
            lines.append(
                f"| {row['mode']} | {row['column']} | {row['seconds']:.1f} | {row['tokens']} | "
                f"{row['tokens_per_s']:.1f} | {_f(row['vs_best_genai'], '.2f', 'x')} | "
                + (f"{identity['identical']}/{identity['total']}" if identity else "–")
                + " |"
            )
        lines += targets(result["summary"])
        mismatches = [
            f"{key}: {m['id']} at token {m['first_difference']}"
            for key, ident in result["identity"].items()
            if not key.split("|")[1].startswith("ORT GenAI")
            for m in ident["mismatches"]
        ]
        if mismatches:
            lines += ["", "**ortspec outputs differing from alone**: " + "; ".join(mismatches) + "."]
        for peer, why in result["missing"].items():
            lines += ["", f"{peer} is missing: {why}."]
    choice = report["fastest_precision"]
    lines += ["", "## Precision", ""]
    if choice is None:
        lines.append("Both precisions must be measured in one run (`--precision both`) to choose between them.")
    else:
        by = "; ".join(f"{p}: {r['column']}, {r['tokens_per_s']:.1f} tok/s" for p, r in choice["by"].items())
        lines.append(
            f"Fastest batched greedy column with every output equal to alone, per precision: {by}. The faster "
            f"precision is **{choice['precision']}**; the default precision also weighs what each costs in quality "
            "(`python -m bench.quantization precision`, docs/bench/quantization-precision.md)."
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--precision", choices=("fp32", "int4", "both"), default="both", help="default both")
    ap.add_argument("--model", type=Path, help="one model folder instead of the default model (--precision names it)")
    ap.add_argument("--prompts", type=int, help="at most N requests per decoding, spread over the dataset")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (default 2)")
    ap.add_argument("--quick", action="store_true", help="the 8 shortest prompts, ORT GenAI at batch 8 only")
    ap.add_argument("--out", type=Path, help="the report (default docs/throughput.md; --quick: a temporary folder)")
    ap.add_argument("--export-dataset", action="store_true", help=f"rebuild {DATASET.name} and exit")
    return ap.parse_args(argv)


def plans_for(args: argparse.Namespace) -> list[Plan]:
    names = ("fp32", "int4") if args.precision == "both" else (args.precision,)
    plans = [PLANS[name] for name in names]
    if args.quick:
        quick = "quick: a smoke test on the 8 shortest prompts, not a measurement"
        plans = [attrs.evolve(p, prompts=dict.fromkeys(p.modes, 8), genai_batches=(8,), note=quick) for p in plans]
    if args.prompts is not None:
        plans = [attrs.evolve(p, prompts={m: min(n, args.prompts) for m, n in p.prompts.items()}) for p in plans]
    return plans


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.export_dataset:
        content = build_dataset(Tokenizer.from_folder(model_folder("fp32")))
        DATASET.write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {DATASET} ({len(content['records'])} requests)", file=sys.stderr)
        return 0
    started = time.perf_counter()
    dataset = load_dataset()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ortspec-throughput-") as tmp_name:
        tmp = Path(tmp_name)
        for plan in plans_for(args):
            model_dir = args.model if args.model is not None else model_folder(plan.precision)
            tokenizer = Tokenizer.from_folder(model_dir)
            requests = quick_requests(dataset, tokenizer) if args.quick else dataset
            measured = measure(plan, model_dir, requests, args.threads, tmp)
            measured["summary"] = summarize(measured)
            results[plan.precision] = measured
        quick_out = Path(tempfile.gettempdir()) / "ortspec-throughput-quick.md"
        out = args.out or (quick_out if args.quick else Path("docs/throughput.md"))
        report = {
            "command": "python -m bench.throughput" + (" " + " ".join(argv) if argv else ""),
            "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "elapsed_s": time.perf_counter() - started,
            "machine": machine_info(),
            "threads": args.threads,
            "batch_args": list(batch_args(args.threads)),
            "dataset": {
                "file": str(DATASET.relative_to(Path(__file__).resolve().parent.parent)),
                "requests": len(dataset),
            },
            "precisions": results,
            "fastest_precision": fastest_precision(results),
        }
        text = markdown(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=_json) + "\n", encoding="utf-8")
        print(text)
        print(f"wrote {out} and {out.with_suffix('.json').name}", file=sys.stderr)
    exact = all(
        ident["identical"] == ident["total"]
        for result in results.values()
        for key, ident in result["identity"].items()
        if not key.split("|")[1].startswith("ORT GenAI")
    )
    return 0 if exact else 1


def _json(value: Any) -> Any:
    if isinstance(value, ColumnRun):
        return attrs.asdict(value) | {"tokens_per_s": value.tokens_per_s}
    raise TypeError(f"{type(value).__name__} is not JSON")


if __name__ == "__main__":
    raise SystemExit(main())
