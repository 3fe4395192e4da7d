"""``ortspec batch``: generate for every record of a JSONL file, resumable. The batch runner is imported only when
the command runs or its ``--defaults`` are parsed, through :func:`_runner` (the one import of it)."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from ortspec.adapters.engine.options import CONTEXT_PROPOSERS

from .options import add_command, lookup_options, model_options, positive_int

EXAMPLES = """\
examples:
  ortspec batch prompts.jsonl results.jsonl --workers 2 --threads 1
  ortspec batch prompts.jsonl results.jsonl --max-batch 32     # 32 records decode together per worker
  ortspec batch prompts.jsonl results.jsonl --defaults '{"temperature": 0.7, "top_p": 0.9}'
  ortspec batch prompts.jsonl results.jsonl --ray              # a local Ray instance; --ray auto joins a cluster

A rerun with the same OUTPUT resumes. Exit status: 0; 1 if records were lost (a worker died); 2 for bad input;
130 if interrupted (rerun to resume)."""


def _runner() -> ModuleType:
    """The batch command's module (``cmd_batch``, ``defaults_json``)."""
    from ortspec.adapters.batch import command

    return command


def _defaults(text: str) -> dict:
    return _runner().defaults_json(text)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "batch",
        "generate for every record of a JSONL file (worker processes here, or Ray), resumable",
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
    )
    r = p.add_argument_group("workers")
    r.add_argument("--workers", type=positive_int, default=1, metavar="N", help="Engines running at once (default 1)")
    r.add_argument(
        "--max-batch",
        type=positive_int,
        default=16,
        metavar="N",
        help="records each worker decodes at once, joining as slots free (default %(default)s); 1: one at a time",
    )
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
    r.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin each embedded worker to its own cores"
    )
    g = p.add_argument_group("generation defaults (a record's own fields win)")
    g.add_argument(
        "--speculative",
        default="prompt-lookup",
        choices=(*CONTEXT_PROPOSERS, "none"),
        help="default proposer (default prompt-lookup; suffix also drafts from the worker Engine's earlier "
        "outputs); none = plain decoding",
    )
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
        type=_defaults,
        default={},
        metavar="JSON",
        help='more default generation fields, as in a record, e.g. \'{"temperature": 0.7, "top_p": 0.9}\'',
    )
    lookup_options(p)
    p.add_argument("--retry-errors", action="store_true", help="drop OUTPUT's error lines and run those records again")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    return _runner().cmd_batch(args)
