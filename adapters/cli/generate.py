"""``ortspec generate``: one prompt (text, a file, or standard input), the answer streamed to stdout, a statistics
line on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ortspec.adapters.engine.options import speculative_value

from .engine_args import engine, generation_kwargs, speculative, stats_line
from .options import add_command, generation_options, model_options

EXAMPLES = """\
examples:
  ortspec generate "Repeat exactly: the cat sat on the mat."
  ortspec generate --file prompt.txt --max-tokens 256 --stop "###"
  git diff | ortspec generate --file - --no-chat --speculative none
  ortspec generate "Summarize: ..." --model ./my-model-folder --threads 4 --max-length 2048
  ortspec generate "Write a poem about the sea." --speculative shared-kv   # the trained drafter alone

The text streams to stdout; a statistics line (tokens, tok/s, target passes, acceptance) goes to stderr.
Exit status: 0, 1 if the generation failed, 2 for bad input, 130 if interrupted."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "generate",
        "generate from a prompt, streaming to the terminal, stats at the end",
        "Generate from a prompt (text, or a file), streaming the answer to stdout.",
        EXAMPLES,
    )
    p.add_argument("prompt", nargs="?", help="prompt text (quote it); or use --file")
    p.add_argument("--file", metavar="PATH", help="read the prompt from a UTF-8 file ('-' for stdin)")
    model_options(p, drafter=True)
    generation_options(p)
    return p


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text; ``ValueError`` for none, both, a missing or unreadable file, or only whitespace."""
    if args.prompt is not None and args.file is not None:
        raise ValueError("give either a prompt or --file, not both")
    if args.file == "-":
        text, source = sys.stdin.read(), "standard input"
    elif args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompt file {path} is not UTF-8 text: {exc}") from exc
        source = f"prompt file {path}"
    elif args.prompt is None:
        raise ValueError("give a prompt (or --file PATH, or --file - for stdin)")
    else:
        text, source = args.prompt, "the prompt"
    if not text.strip():
        raise ValueError(f"{source} is empty: there is nothing to answer")
    return text


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    eng = engine(args)

    def show(text: str, token_id: int, finish_reason: str | None) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = eng.generate_stream(prompt, show, speculative=speculative(args), **generation_kwargs(args))
    sys.stdout.write("\n")
    print(
        stats_line(result, "speculative" if speculative_value(args.speculative) is not None else "greedy"),
        file=sys.stderr,
    )
    return 0
