"""How many requests at once: ortspec's batched throughput by its number of slots, against ONNX Runtime GenAI's
static batches of the same sizes, side by side, on one split of the throughput dataset.

    python -m bench.slots [--split tuning|evaluation] [--sizes 8,16,32] [--genai-sizes 1,2,4,8,16,32]
                          [--speculative none,auto] [--repeats 3] [--threads 2] [--batch-command]
                          [--out docs/bench/slots-<split>.md]

The requests are ``bench.throughput``'s (chat prompts, each with its own number of new tokens, EOS ignored, greedy),
the ``--split`` half of them (``bench.throughput_dataset.split``: constants are chosen on ``tuning`` and reported on
``evaluation``). For each size N: one Engine with ``batch_slots=N`` runs every request through its one scheduler
(``Engine.generate_requests``), once per ``--speculative`` name (default ``none``: plain decoding; a name ending in
``-tree``, such as ``auto-tree``, is that speculation with the Engine's ``tree_branches`` at the suite's tree settings'
(``bench.engines.TREE_BRANCHES``); the
Engine opens the shipped drafter only when one is named); for each of ``--genai-sizes`` (default: the same
sizes) ORT GenAI runs consecutive groups of that many requests as static batches
(``bench.throughput_columns.run_genai``).
With ``--batch-command``, the ``ortspec batch`` command (its defaults, the whole job as a subprocess: start and
model load included) runs the same requests too. Every
configuration runs ``--repeats`` times, interleaved (the order of the sizes rotates each round), after a warm-up of
each shape; the report gives each one's median tokens/s, its spread (min-max), and its ratio to ORT GenAI's best
median. Every ortspec output must be the same in every configuration (a request's output does not depend on what
else is in its batch); ORT GenAI's are compared with them as information. Exit status 1 when an ortspec output
differs. ``--from-log LOG``: the report of a run cut short (killed), from the lines it printed: its rates, without
its outputs (the identity is then not checked, and the report says so).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.engines import TREE_BRANCHES
from bench.machine import git_commit, machine_info
from bench.peer_ortgenai import OrtGenAIRunner
from bench.peers import make_peer
from bench.throughput import model_folder
from bench.throughput_columns import ColumnRun, batch_args, generate_batched, run_batch_command, run_genai
from bench.throughput_dataset import Request, load_dataset, split
from bench.workloads import SPLITS, encode_chat
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.options import GenerationOptions
from ortspec.adapters.engine.tokenizer import Tokenizer


def run_ortspec(engine: Engine, requests: Sequence[Request], size: int, speculative: str | None = None) -> ColumnRun:
    """Every request through ``engine``'s scheduler at once, greedy, with ``speculative`` (None: plain decoding; a
    name ending in ``-tree``: that speculation drafting trees, ``TREE_BRANCHES``)."""
    name = speculative.removesuffix("-tree") if speculative else None
    batch = [(list(q.messages), GenerationOptions(**q.options("greedy"), speculative=name)) for q in requests]
    engine.tree_branches = TREE_BRANCHES if name != speculative else 1
    t0 = time.perf_counter()
    try:
        results = generate_batched(engine, batch)
    finally:
        engine.tree_branches = 1
    seconds = time.perf_counter() - t0
    outputs = {q.id: list(r.token_ids) for q, r in zip(requests, results, strict=True)}
    column = f"ortspec {size} slots" + (f", {speculative}" if speculative else "")
    return ColumnRun(column, "greedy", seconds, sum(len(v) for v in outputs.values()), outputs)


def _rounds(sizes: Sequence[int], repeats: int) -> list[list[int]]:
    """The order of the sizes in each round: rotated by one each round, so no size always runs first or last."""
    return [[sizes[(r + i) % len(sizes)] for i in range(len(sizes))] for r in range(repeats)]


def measure(args: argparse.Namespace, requests: Sequence[Request], tmp: Path) -> dict[str, Any]:
    model_dir = args.model_dir or model_folder("fp32")
    tokenizer = Tokenizer.from_folder(model_dir)
    config = BackendConfig(threads=args.threads)
    drafter = None if any(args.speculative) else False  # the shipped drafter where a configuration may draft
    engines = {n: Engine.from_dir(model_dir, config, batch_slots=n, drafter=drafter) for n in args.sizes}
    runner, why = make_peer("ortgenai", model_dir, threads=args.threads)
    if runner is not None:
        assert isinstance(runner, OrtGenAIRunner)
        runner.warmup()
    ids = [encode_chat(q.messages, tokenizer) for q in requests]
    for n, engine in engines.items():  # every shape once, untimed
        head = [(list(q.messages), GenerationOptions(max_tokens=4, speculative=None)) for q in requests[:n]]
        generate_batched(engine, head)
    for n in args.genai_sizes if runner is not None else ():
        runner.run_batch(ids[:n], 2)
    runs: list[ColumnRun] = []

    def done(run: ColumnRun) -> None:
        print(f"  {run.column:28} {run.seconds:7.1f} s {run.tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True)
        runs.append(run)

    for ours, theirs in zip(_rounds(args.sizes, args.repeats), _rounds(args.genai_sizes, args.repeats), strict=True):
        for n in ours:
            for speculative in args.speculative:
                done(run_ortspec(engines[n], requests, n, speculative))
        for n in theirs if runner is not None else ():
            done(run_genai(runner, requests, n, "greedy", tokenizer))
        if args.batch_command:
            done(run_batch_command(model_dir, requests, "greedy", args.threads, tmp))
    for engine in engines.values():
        engine.close()
    if runner is not None:
        runner.close()
    return {
        "model_dir": str(model_dir).replace(str(Path.home()), "~"),
        "runs": runs,
        "missing": {} if runner is not None else {"ortgenai": why or "unavailable"},
        "prompt_tokens": sum(len(i) for i in ids),
        "new_tokens": sum(q.max_tokens for q in requests),
    }


def runs_from_log(text: str) -> list[ColumnRun]:
    """The runs a cut-short invocation printed (``measure``'s lines: column, seconds, tokens/s), without outputs."""
    runs = []
    for line in text.splitlines():
        match = re.match(r"^  (.+?)\s+([0-9.]+) s\s+([0-9.]+) tok/s$", line)
        if match:
            column, seconds, rate = match.group(1).strip(), float(match.group(2)), float(match.group(3))
            runs.append(ColumnRun(column, "greedy", seconds, round(seconds * rate), {}))
    return runs


def summarize(runs: Sequence[ColumnRun]) -> list[dict[str, Any]]:
    """One row per configuration: median, min and max tokens/s over its runs, and the median's ratio to ORT GenAI's
    best median."""
    columns: dict[str, list[float]] = {}
    for run in runs:
        columns.setdefault(run.column, []).append(run.tokens_per_s)
    medians = {c: statistics.median(v) for c, v in columns.items()}
    genai = [m for c, m in medians.items() if c.startswith("ORT GenAI")]
    best = max(genai) if genai else None
    return [
        {
            "column": c,
            "runs": len(v),
            "median": medians[c],
            "min": min(v),
            "max": max(v),
            "vs_best_genai": medians[c] / best if best else None,
        }
        for c, v in columns.items()
    ]


def identity(runs: Sequence[ColumnRun]) -> dict[str, Any]:
    """Whether every ortspec run gave every request the same tokens; how many of ORT GenAI's outputs equal them
    (``checked`` False for runs without outputs: a report from a log)."""
    ours = [r for r in runs if not r.column.startswith("ORT GenAI")]
    if any(not r.outputs for r in runs):
        return {"checked": False, "ortspec_identical": True, "differing": [], "genai_equal": 0, "genai_total": 0}
    reference = ours[0].outputs if ours else {}
    differing = sorted({f"{r.column}: {k}" for r in ours for k, v in r.outputs.items() if v != reference.get(k)})
    genai = [r for r in runs if r.column.startswith("ORT GenAI")]
    agree = sum(v == reference.get(k) for r in genai for k, v in r.outputs.items())
    return {
        "checked": True,
        "ortspec_identical": not differing,
        "differing": differing[:20],
        "genai_equal": agree,
        "genai_total": sum(len(r.outputs) for r in genai),
    }


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# Requests at once: ortspec's slots against ORT GenAI's batches ({report['split']} split)",
        "",
        f"Generated by `{report['command']}` on {report['date_utc']} (UTC), commit {report['commit']}, in "
        f"{report['elapsed_s'] / 60:.1f} minutes. Machine: {m.get('cpu')}, cores {m.get('cores')}, "
        f"{m.get('memory_gib')} GiB, background load {m.get('background_load_cores')} cores at the start; "
        f"onnxruntime {m['versions'].get('onnxruntime')}, onnxruntime-genai {m['versions'].get('onnxruntime-genai')}. "
        "Shared and noisy: read the ratios (medians of runs interleaved in this one invocation) more than the rates.",
        "",
        f"Load: {report['requests']} requests of the {report['split']} split of `bench/data/throughput-prompts.json`"
        f" ({report['prompt_tokens']} prompt tokens, {report['new_tokens']} new tokens, EOS ignored), greedy, plain "
        "decoding unless a configuration names its speculation (`ortspec batch`: its default), "
        f"{report['threads']} intra-op threads, SmolLM2-135M-Instruct fp32. tokens/s = new tokens ÷ wall "
        "seconds of the run (ORT GenAI: its batches' own seconds, prompt ids in hand to the last token; "
        f"`ortspec batch`: the command from start to exit, model load included; its arguments: "
        f"`{' '.join(report['batch_args'])}`).",
        "",
        "| configuration | runs | median tok/s | min–max | ÷ ORT GenAI's best |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in report["summary"]:
        ratio = f"{row['vs_best_genai']:.2f}x" if row["vs_best_genai"] else "–"
        lines.append(
            f"| {row['column']} | {row['runs']} | {row['median']:.1f} | {row['min']:.1f}–{row['max']:.1f} | {ratio} |"
        )
    lines += _job_lines(report["runs"])
    ident = report["identity"]
    same = "yes" if ident["ortspec_identical"] else "NO"
    if not ident.get("checked", True):
        lines += ["", f"**Not checked**: {report.get('cut_short', 'this report has no outputs')}."]
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Every ortspec configuration gave every request the same tokens: **{same}**"
        + ("" if ident["ortspec_identical"] else f" ({', '.join(ident['differing'])})")
        + f". ORT GenAI's outputs equal them for {ident['genai_equal']} of {ident['genai_total']} (information: its "
        "kernels differ).",
    ]
    for peer, why in report["missing"].items():
        lines.append(f"\n{peer} did not run: {why}")
    return "\n".join(lines) + "\n"


def _job_lines(runs: Sequence[ColumnRun]) -> list[str]:
    """Where ``ortspec batch``'s seconds went (medians over its runs): process start (the command's seconds less the
    job's own), model load and warm-up, and the rest (the records); nothing when no run reported its times."""
    timed = [r for r in runs if r.column == "ortspec batch" and "job_s" in r.extra and "load_s" in r.extra]
    if not timed:
        return []
    start = statistics.median(r.seconds - r.extra["job_s"] for r in timed)
    load = statistics.median(r.extra["load_s"] for r in timed)
    rest = statistics.median(r.extra["job_s"] - r.extra["load_s"] for r in timed)
    return [
        "",
        f"`ortspec batch`, medians of its {len(timed)} runs: process start {start:.1f} s, model load and warm-up "
        f"{load:.1f} s, the records {rest:.1f} s.",
    ]


def _from_log(args: argparse.Namespace, requests: Sequence[Request]) -> dict[str, Any]:
    """``measure``'s answer rebuilt from a cut-short run's log (``runs_from_log``)."""
    tokenizer = Tokenizer.from_folder(model_folder("fp32"))
    runs = runs_from_log(args.from_log.read_text(encoding="utf-8"))
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.column] = counts.get(run.column, 0) + 1
    return {
        "model_dir": str(model_folder("fp32")).replace(str(Path.home()), "~"),
        "runs": runs,
        "elapsed_s": sum(run.seconds for run in runs),  # the runs' own seconds (the warm-up and loads not logged)
        "missing": {},
        "prompt_tokens": sum(len(encode_chat(q.messages, tokenizer)) for q in requests),
        "new_tokens": sum(q.max_tokens for q in requests),
        "cut_short": "the run was killed before its last runs and its report; this report is rebuilt from the "
        f"lines it printed ({len(runs)} runs: "
        + ", ".join(f"{c} x{n}" for c, n in counts.items())
        + "), which carry rates but not outputs, so whether every ortspec output was the same was not checked "
        "here (the batching property and tests/test_ort_batch.py check it)",
    }


QUICK = "check that it works (not speed): a tiny random model, the 4 shortest requests x 8 tokens, 2 and 4 slots, once"


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive ints, got {text!r}")
    return sizes


def _speculative(text: str) -> list[str | None]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one speculation, got {text!r}")
    return [None if name == "none" else name for name in names]


def main(argv: Sequence[str] | None = None, *, measure_fn: Callable[..., dict[str, Any]] = measure) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=SPLITS, default="tuning", help="the dataset's half (default tuning)")
    ap.add_argument("--sizes", type=_sizes, default=[8, 16, 32], help="slots / batch sizes (default 8,16,32)")
    ap.add_argument(
        "--genai-sizes",
        type=_sizes,
        help="ORT GenAI's batch sizes (default: --sizes); a size of at least the "
        "number of requests is one batch of them all",
    )
    ap.add_argument(
        "--speculative",
        type=_speculative,
        default=[None],
        help="ortspec's speculations at each size, comma-separated; none = plain decoding (default none)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration, interleaved (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (default 2)")
    ap.add_argument("--batch-command", action="store_true", help="also run `ortspec batch` with its defaults")
    ap.add_argument("--out", type=Path, help="the report (default docs/bench/slots-<split>.md)")
    ap.add_argument("--from-log", type=Path, help="the report of a run cut short, from the lines it printed")
    ap.add_argument("--quick", action="store_true", help=QUICK)
    args = ap.parse_args(argv)
    args.genai_sizes = args.genai_sizes or args.sizes
    started = time.perf_counter()
    requests = split(load_dataset(), args.split)
    with tempfile.TemporaryDirectory(prefix="ortspec-slots-") as tmp:
        args.model_dir = None
        if args.quick:
            from tests.support.models import make_tiny_model

            args.model_dir = Path(make_tiny_model(Path(tmp) / "tiny-model", context=4096))
            args.sizes, args.genai_sizes, args.repeats = [2, 4], [2, 4], 1
            args.out = args.out or Path(tmp) / f"slots-{args.split}.md"
            shortest = sorted(requests, key=lambda q: sum(len(m["content"]) for m in q.messages))[:4]
            requests = [attrs.evolve(q, max_tokens=min(q.max_tokens, 8)) for q in shortest]
        if args.from_log is not None:
            measured = _from_log(args, requests)
        else:
            measured = measure_fn(args, requests, Path(tmp))
        return _write(args, argv, requests, measured, started)


def _write(
    args: argparse.Namespace,
    argv: Sequence[str],
    requests: Sequence[Request],
    measured: dict[str, Any],
    started: float,
) -> int:
    """Writes the report (markdown and json) of ``measured``; the exit status."""
    report = {
        "command": "python -m bench.slots" + (" " + " ".join(argv) if argv else ""),
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(short=True) or "unknown",
        "elapsed_s": measured.pop("elapsed_s", time.perf_counter() - started),
        "machine": machine_info(),
        "split": args.split,
        "requests": len(requests),
        "threads": args.threads,
        "batch_args": list(batch_args(args.threads)),
        "summary": summarize(measured["runs"]),
        "identity": identity(measured["runs"]),
        **measured,
    }
    out = args.out or Path(f"docs/bench/slots-{args.split}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(report), encoding="utf-8")
    data = {k: v for k, v in report.items() if k != "runs"}
    data["runs"] = [
        {"column": r.column, "seconds": r.seconds, "tokens": r.tokens, "tokens_per_s": r.tokens_per_s, **r.extra}
        for r in measured["runs"]
    ]
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(markdown(report))
    print(f"wrote {out} and {out.with_suffix('.json').name}", file=sys.stderr)
    return 0 if report["identity"]["ortspec_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
