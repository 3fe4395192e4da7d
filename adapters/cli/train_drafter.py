"""``ortspec train-drafter``: train the shared-KV draft head for a model folder on this machine
(:func:`ortspec.adapters.tools.train_drafter.train_drafter`) and print the drafter folder."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .engine_args import model_dir
from .options import add_command, nonnegative_int, positive_float, positive_int

EXAMPLES = """\
examples:
  ortspec train-drafter                      # SmolLM2-135M-Instruct, 30 minutes on all cores
  ortspec train-drafter --minutes 60 --threads 2
  ortspec train-drafter --model ./my-model-folder --out ./my-model-folder/drafter

Prints the drafter folder. Engine (and demo, generate, bench) then use it for --speculative auto / shared-kv."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "train-drafter",
        "train the shared-KV draft head for a model on this machine (needs the 'convert' extra for torch)",
        "Train a shared-KV draft head for a model folder (with a hidden_states output) from data made here by the "
        "model itself, and write it where Engine finds it. See docs/drafter.md.",
        EXAMPLES,
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder with a hidden_states output (default: SmolLM2-135M-Instruct, converted on first use)",
    )
    p.add_argument("--out", metavar="DIR", help="drafter folder (default: in the ortspec cache, where Engine finds it)")
    p.add_argument(
        "--minutes", type=positive_float, default=30.0, metavar="M",
        help="the whole budget: data, training, export (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--draft-vocab", type=positive_int, default=8192, metavar="N", help="ids the head predicts (default 8192)"
    )
    p.add_argument(
        "--layer", type=nonnegative_int, default=None, metavar="L",
        help="target layer whose KV the head reads (default: the last)",
    )  # fmt: skip
    p.add_argument(
        "--num-speculative-tokens", type=positive_int, default=4, metavar="N", help="most tokens per draft (default 4)"
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, metavar="N",
        help="threads for onnxruntime and torch (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--weights",
        default="int8",
        choices=("int8", "fp32"),
        help="how the drafter's MatMul weights are stored: int8 (default; a draft step reads a quarter of the bytes) "
        "or fp32",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts, split and initialisation (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from ortspec.adapters.tools.train_drafter import TrainConfig, train_drafter

    config = TrainConfig(
        minutes=args.minutes,
        draft_vocab=args.draft_vocab,
        layer=args.layer,
        threads=args.threads,
        seed=args.seed,
        num_speculative_tokens=args.num_speculative_tokens,
        weights=args.weights,
    )
    folder = train_drafter(model_dir(args), args.out, config, progress=lambda m: print(m, file=sys.stderr))
    print(folder)
    return 0
