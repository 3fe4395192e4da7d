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

Layout: this module is the plans (``PLANS``), one precision's measurement (``measure``) and the command line;
``bench.throughput_dataset`` holds the dataset (``Request``, building, loading, splitting it),
``bench.throughput_columns`` the columns' runs (``ColumnRun``; ortspec alone and batched, ``ortspec batch``, ORT
GenAI's static batches), ``bench.throughput_report`` the comparison with alone, the summary and the markdown.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.engines import SAMPLING
from bench.machine import machine_info
from bench.peer_ortgenai import OrtGenAIRunner
from bench.peers import make_peer
from bench.throughput_columns import (
    SPECULATION,
    ColumnRun,
    batch_args,
    run_alone,
    run_batch_command,
    run_batched,
    run_genai,
    warm_up,
)
from bench.throughput_dataset import DATASET, Request, build_dataset, load_dataset, quick_requests, spread
from bench.throughput_report import compare, fastest_precision, markdown, summarize
from bench.workloads import encode_chat
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.tokenizer import Tokenizer

MODES = ("greedy", "sampled")


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
