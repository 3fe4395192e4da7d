"""The ``ortspec`` command: the parser assembled from one module per command (``demo``, ``generate``, ``bench``,
``convert``, ``train-drafter``, ``serve``, ``batch``), and :func:`main`, which runs one and maps its errors to
an exit status.

Each command module has ``add_parser(subparsers)`` (its options; the shared groups come from
:mod:`ortspec.adapters.cli.options`) and ``run(args) -> exit status``. Every command works on an ONNX Runtime GenAI
model folder (``--model``); without one it uses SmolLM2-135M-Instruct, converted on first use into the user cache
(see ``ortspec convert``).

The command installs nothing process-wide when imported; what a command needs, it sets up when it runs.
"""

from __future__ import annotations

import argparse
import sys

from . import batch, bench, convert, demo, generate, serve, train_drafter
from .options import speak_flags

COMMANDS = (demo, generate, bench, convert, train_drafter, serve, batch)


def build_parser() -> argparse.ArgumentParser:
    """The ``ortspec`` parser. Every subcommand parser is its namespace's ``command_parser`` (``main`` reports an
    unknown argument with that subcommand's usage) and its ``func`` is the command module's ``run``."""
    parser = argparse.ArgumentParser(prog="ortspec", description="Exact, fast speculative decoding for ONNX Runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = command.add_parser(sub)
        p.set_defaults(func=command.run, command_parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ortspec`` command. Exit status: 0; 1 when a generation failed once started (or a demo's outputs
    differ); 2 for bad input (arguments, prompt, model folder); 130 when interrupted (Ctrl-C)."""
    from ortspec.adapters.tools.convert import ConversionError
    from ortspec.backends.base import BackendError
    from ortspec.backends.onnx import route_onnxruntime_logging
    from ortspec.driver import GenerationError

    route_onnxruntime_logging()  # onnxruntime's own log lines go to Python logging (ortspec.onnxruntime)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nortspec: interrupted", file=sys.stderr)
        return 130
    except GenerationError as exc:
        sys.stdout.write("\n")
        print(f"ortspec: {speak_flags(str(exc))}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, ConversionError, BackendError) as exc:
        print(f"ortspec: {speak_flags(str(exc))}", file=sys.stderr)
        return 2
