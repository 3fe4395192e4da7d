"""``ortspec batch``: the command's arguments as a ``BatchJob``, run by ``run_batch``. Its options are declared
with the other commands' in the command line's parser; ``cmd_batch`` reads them, ``defaults_json`` is the type of
``--defaults``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ortspec.adapters.cli.engine_args import backend_config, drafter, speculative

from .job import BatchError, BatchJob
from .records import RECORD_KEYS, option_fields, record_options
from .run import run_batch


def defaults_json(text: str) -> dict[str, Any]:
    """``--defaults``: a JSON object of generation fields (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of generation fields")
    return value


def _missing_output(args: argparse.Namespace) -> str:
    """Why OUTPUT is missing, in the words the user needs."""
    if args.ray is not None and (Path(args.ray).suffix in (".jsonl", ".json") or Path(args.ray).is_file()):
        return f"--ray took {args.ray!r} as the cluster address: put --ray after INPUT OUTPUT, or give one"
    return "give OUTPUT, the JSONL file for the results"


def _job(args: argparse.Namespace) -> BatchJob:
    """The job the arguments ask for; ``ValueError`` naming a bad one."""
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
    )


def cmd_batch(args: argparse.Namespace) -> int:
    """``ortspec batch``: exit status 0 (every record written), 1 (some lost: rerun), 2 (the run could not start
    or go on), 130 (interrupted)."""
    if args.output is None:
        print(f"ortspec batch: {_missing_output(args)}", file=sys.stderr)
        return 2
    try:
        job = _job(args)
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
