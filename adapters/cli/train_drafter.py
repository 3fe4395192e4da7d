"""``ortspec train-drafter``: train the shared-KV draft head for a model folder on this machine by the recipe of
:class:`ortspec.adapters.tools.drafter_recipe.TrainConfig` (its defaults are this command's) and print the drafter
folder."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .engine_args import model_dir
from .options import add_command, nonnegative_int, positive_float, positive_int

EXAMPLES = """\
examples:
  ortspec train-drafter --threads 2          # the shipped drafter's recipe, for SmolLM2-135M-Instruct
  ortspec train-drafter --updates 200 --sequences 256 --seed 1
  ortspec train-drafter --model ./my-model-folder --out ./my-model-folder/drafter

Prints the drafter folder. Engine (and demo, generate, bench) then use it for --speculative auto / shared-kv.
The run is set by counts and a seed: the same command on the same kind of machine makes the same drafter."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from ortspec.adapters.tools.drafter_recipe import default

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
    counts = (
        ("--sequences", "sequences", "prompts the model continues to make the data, held-out ones included"),
        ("--heldout", "heldout", "of them, kept out of training to measure acceptance on"),
        ("--max-new", "max_new", "new tokens per data sequence, at most"),
        ("--updates", "updates", "optimiser updates"),
        ("--train-batch", "train_batch", "sequences per update"),
        ("--eval-every", "eval_every", "updates between measurements of the held-out acceptance"),
        ("--draft-vocab", "draft_vocab", "ids the head predicts"),
        ("--num-speculative-tokens", "num_speculative_tokens", "most tokens per draft"),
    )
    for flag, field, text in counts:
        p.add_argument(
            flag, type=positive_int, default=default(field), metavar="N", help=f"{text} (default %(default)s)"
        )
    p.add_argument("--seed", type=int, default=default("seed"), help="every random choice: prompts, split, batch order")
    p.add_argument(
        "--minutes", type=positive_float, default=None, metavar="M",
        help="optional safety bound on the whole run (default: none; a run it cuts short depends on the clock)",
    )  # fmt: skip
    p.add_argument(
        "--layer", type=nonnegative_int, default=None, metavar="L",
        help="target layer whose KV the head reads (default: the last)",
    )  # fmt: skip
    p.add_argument(
        "--feature-layers", type=positive_int, nargs="+", default=list(default("feature_layers")), metavar="L",
        help="target layers whose residual streams the head's first step reads too, through a trained fuse "
        "(EAGLE-3's fused features; default: none, the final hidden state alone)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=positive_int, default=None, metavar="N",
        help="threads for onnxruntime and torch (default: torch's, all cores; fix it to reproduce a run)",
    )  # fmt: skip
    p.add_argument(
        "--weights",
        default=default("weights"),
        choices=("int8", "fp32"),
        help="how the drafter's MatMul weights are stored: int8 (default; a draft step reads a quarter of the bytes) "
        "or fp32",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from ortspec.adapters.tools.drafter_recipe import TrainConfig
    from ortspec.adapters.tools.train_drafter import train_drafter

    config = TrainConfig(
        sequences=args.sequences,
        heldout=args.heldout,
        max_new=args.max_new,
        updates=args.updates,
        train_batch=args.train_batch,
        eval_every=args.eval_every,
        seed=args.seed,
        minutes=args.minutes,
        draft_vocab=args.draft_vocab,
        layer=args.layer,
        threads=args.threads,
        num_speculative_tokens=args.num_speculative_tokens,
        weights=args.weights,
        feature_layers=tuple(args.feature_layers),
    )
    folder = train_drafter(model_dir(args), args.out, config, progress=lambda m: print(m, file=sys.stderr))
    print(folder)
    return 0
