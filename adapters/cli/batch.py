"""``ortspec batch``: generate for every record of a JSONL file, resumable. The command's arguments become a
``BatchJob`` (:func:`job_of`), which ``run_batch`` runs. The batch runner (``ortspec.adapters.batch``) is imported
only when the command runs or its ``--defaults`` are checked."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine_args import backend_config, draft_model, drafter, speculative
from .options import (
    add_command,
    default_proposer_option,
    lookup_options,
    model_options,
    positive_int,
    prefill_budget_option,
)

if TYPE_CHECKING:
    from ortspec.adapters.batch import BatchJob

EXAMPLES = """\
examples:
  ortspec batch prompts.jsonl results.jsonl                    # one Engine in this process, slots sized from the work
  ortspec batch prompts.jsonl results.jsonl --max-batch 8      # 8 records decode together per worker
  ortspec batch prompts.jsonl results.jsonl --workers 2 --threads 1   # two worker processes
  ortspec batch prompts.jsonl results.jsonl --defaults '{"temperature": 0.7, "top_p": 0.9}'
  ortspec batch prompts.jsonl results.jsonl --ray              # a local Ray instance; --ray auto joins a cluster

A rerun with the same OUTPUT resumes. Exit status: 0; 1 if records were lost (a worker process died); 2 for bad input;
130 if interrupted (rerun to resume)."""


def defaults_json(text: str) -> dict[str, Any]:
    """``--defaults``: a JSON object of generation fields (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of generation fields")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "batch",
        "generate for every record of a JSONL file (here, or on Ray), resumable",
        "Generate for every record of INPUT (one JSON object per line: id, prompt or messages, and optional "
        "generation fields) into OUTPUT (one JSON line per record, in completion order). A rerun with the same "
        "OUTPUT skips the records already there. See docs/batch.md.",
        EXAMPLES,
    )
    p.add_argument("input", metavar="INPUT", help="JSONL records: id, prompt or messages, generation fields")
    p.add_argument("output", metavar="OUTPUT", nargs="?", help="JSONL results, appended (a rerun resumes)")
    model_options(
        p,
        threads_help="intra-op threads per worker (default: the cores shared out); workers x threads <= cores",
        load_rewrites=False,
        drafter=True,
    )
    r = p.add_argument_group("workers")
    r.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="Engines running at once (default 1: in this process; N > 1: worker processes, or Ray actors)",
    )
    r.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="records each worker decodes at once, joining as slots free (default: sized from the work, each "
        "worker's share of the records, up to a cap chosen by measurement: docs/batch.md)",
    )
    prefill_budget_option(r)
    r.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data: no ADDRESS starts a local Ray instance (put --ray after INPUT OUTPUT then); "
        "'auto' or ray://HOST:PORT joins a cluster (needs the ray extra: pip install 'ortspec[ray]')",
    )
    r.add_argument(
        "--ship-model",
        action="store_true",
        help="with --ray: send the model folder through Ray's object store to nodes that lack it",
    )
    r.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin each worker process to its own cores")
    g = p.add_argument_group("generation defaults (a record's own fields win)")
    default_proposer_option(g)
    g.add_argument(
        "--max-tokens", type=positive_int, default=128, metavar="N", help="most new tokens (default %(default)s)"
    )
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="format text prompts with the chat template (default on)",
    )
    g.add_argument(
        "--defaults",
        type=defaults_json,
        default={},
        metavar="JSON",
        help='more default generation fields, as in a record, e.g. \'{"temperature": 0.7, "top_p": 0.9}\'',
    )
    lookup_options(p)
    p.add_argument("--retry-errors", action="store_true", help="drop OUTPUT's error lines and run those records again")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _missing_output(args: argparse.Namespace) -> str:
    """Why OUTPUT is missing, in the words the user needs."""
    if args.ray is not None and (Path(args.ray).suffix in (".jsonl", ".json") or Path(args.ray).is_file()):
        return f"--ray took {args.ray!r} as the cluster address: put --ray after INPUT OUTPUT, or give one"
    return "give OUTPUT, the JSONL file for the results"


def job_of(args: argparse.Namespace) -> BatchJob:
    """The job the arguments ask for; ``ValueError`` naming a bad one. ``--speculative`` is the name itself (the
    Engine resolves it, as every surface does), or prompt lookup with its own settings (``engine_args.speculative``)."""
    from ortspec.adapters.batch import BatchJob
    from ortspec.adapters.batch.records import RECORD_KEYS, option_fields, record_options

    if set(args.defaults) & set(RECORD_KEYS):
        raise ValueError("--defaults takes generation fields only (not id, prompt or messages)")
    record_defaults = record_options(args.defaults, option_fields())
    options = {
        "max_tokens": args.max_tokens,
        "chat": args.chat,
        "draft_width": args.draft_width,
        "speculative": speculative(args),
        **record_defaults,
    }
    return BatchJob(
        args.input,
        args.output,
        model=args.model,
        options=options,
        workers=args.workers,
        threads=args.threads,
        max_batch=args.max_batch,
        prefill_budget=args.prefill_budget,
        ray=args.ray,
        backend=backend_config(args, threads=None),
        retry_errors=args.retry_errors,
        pin=args.pin,
        ship_model=args.ship_model,
        drafter=drafter(args),
        draft_model=draft_model(args),
        tree_branches=args.tree_branches,
    )


def run(args: argparse.Namespace) -> int:
    """``ortspec batch``: exit status 0 (every record written), 1 (some lost: rerun), 2 (the run could not start
    or go on), 130 (interrupted)."""
    from ortspec.adapters.batch import BatchError, run_batch

    if args.output is None:
        print(f"ortspec batch: {_missing_output(args)}", file=sys.stderr)
        return 2
    try:
        job = job_of(args)
    except ValueError as exc:
        print(f"ortspec batch: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_batch(job, progress=args.progress)
    except BatchError as exc:
        print(f"ortspec batch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nortspec batch: interrupted; rerun the same command to resume ({args.output})", file=sys.stderr)
        return 130
    print(f"ortspec batch: {summary.line()}", file=sys.stderr)
    return 0 if not summary.lost else 1
