"""What int4 (MatMulNBits accuracy level 1) costs in quality against fp32, on the throughput dataset's text.

Issue 19 asks to choose, by the numbers, the precision that ``ortspec demo``, ``serve`` and ``batch`` use by
default. ``python -m bench.throughput`` measures the speed side (docs/throughput.json); this script measures the
other side on the same 64 chat prompts (bench/data/throughput-prompts.json), both default folders, the same text:

* **perplexity**: each prompt's first ``--tokens`` tokens (chat-formatted) in one verify pass; the mean negative
  log-likelihood of every token after the first, as exp(mean NLL), per precision, and int4 ÷ fp32;
* **top-1 agreement**: at how many of those positions int4's most likely next token is fp32's;
* **greedy continuations**: ``--new-tokens`` new tokens (EOS ignored) from the first ``--generate`` prompts on each
  precision: how many are identical and, where they differ, the mean position of the first difference.

Then it states the choice: the precision with the best measured batched throughput (docs/throughput.json's
``fastest_precision``) unless its perplexity is more than ``--max-ppl-ratio`` (default 1.03) times fp32's. Writes
``--out`` (default docs/precision.md) and the same numbers as JSON beside it.

    python scripts/precision_quality.py [--prompts 64] [--tokens 512] [--generate 16] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete  # noqa: E402

PRECISIONS = ("fp32", "int4")
DATASET = Path("bench/data/throughput-prompts.json")
THROUGHPUT = Path("docs/throughput.json")


def folder(precision: str) -> Path:
    """The default model's folder at ``precision`` (converted now if it is not yet)."""
    path = default_model_dir(precision)
    if not is_complete(path):
        convert_smollm2(path, precision, progress=lambda m: print(m, file=sys.stderr))
    return path


def token_log_probs(engine: Engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For ``ids`` folded in from position 0 in one pass: the log-probability of each of ``ids[1:]`` given the
    tokens before it, and the most likely next token at each of those positions (both ``[len(ids) - 1]``)."""
    engine.backend.reset()
    logits = engine.backend.decode_verify(ids, 0)[:-1].astype(np.float64)
    engine.backend.reset()
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1))
    targets = np.asarray(ids[1:])
    return shifted[np.arange(len(targets)), targets] - log_z, logits.argmax(axis=1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (None when identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--generate", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-ppl-ratio", type=float, default=1.03)
    ap.add_argument("--out", type=Path, default=Path("docs/precision.md"))
    args = ap.parse_args()
    records = json.loads(DATASET.read_text(encoding="utf-8"))["records"][: args.prompts]
    config = BackendConfig(threads=args.threads)
    engines = {p: Engine.from_dir(folder(p), config, drafter=False) for p in PRECISIONS}
    nll = {p: [] for p in PRECISIONS}
    agree = positions = 0
    for record in records:
        ids = engines["fp32"].prompt_ids(record["messages"])[: args.tokens]
        lp = {p: token_log_probs(e, ids) for p, e in engines.items()}
        for p in PRECISIONS:
            nll[p].extend((-lp[p][0]).tolist())
        agree += int((lp["fp32"][1] == lp["int4"][1]).sum())
        positions += len(ids) - 1
    ppl = {p: math.exp(float(np.mean(nll[p]))) for p in PRECISIONS}
    identical, firsts = 0, []
    for record in records[: args.generate]:
        outs = {
            p: e.generate(record["messages"], max_tokens=args.new_tokens, ignore_eos=True).token_ids
            for p, e in engines.items()
        }
        at = first_difference(list(outs["fp32"]), list(outs["int4"]))
        identical += at is None
        if at is not None:
            firsts.append(at)
    speed = json.loads(THROUGHPUT.read_text(encoding="utf-8"))["fastest_precision"]
    fastest = speed["precision"]
    ratio = ppl["int4"] / ppl["fp32"]
    choice = fastest if fastest == "fp32" or ratio <= args.max_ppl_ratio else "fp32"
    result = {
        "command": "python scripts/precision_quality.py",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "prompts": len(records),
        "tokens_per_prompt": args.tokens,
        "scored_positions": positions,
        "perplexity": ppl,
        "perplexity_ratio_int4": ratio,
        "top1_agreement": agree / positions,
        "greedy": {
            "prompts": args.generate,
            "new_tokens": args.new_tokens,
            "identical": identical,
            "mean_first_difference": float(np.mean(firsts)) if firsts else None,
        },
        "throughput": speed["by"],
        "max_ppl_ratio": args.max_ppl_ratio,
        "choice": choice,
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    args.out.write_text(report(result), encoding="utf-8")
    print(report(result))
    return 0


def report(r: dict) -> str:
    """The markdown page for the measured ``r``."""
    tp = r["throughput"]
    g = r["greedy"]
    first = f"{g['mean_first_difference']:.1f}" if g["mean_first_difference"] is not None else "-"
    return "\n".join(
        [
            "# The default precision: int4 (MatMulNBits accuracy level 1) or fp32",
            "",
            f"Measured {r['date_utc']} by `{r['command']}` on {r['machine'].get('cpu')} "
            f"({r['machine'].get('cores', {}).get('usable')} usable cores). Quality on the throughput dataset's "
            f"{r['prompts']} chat prompts "
            f"(first {r['tokens_per_prompt']} tokens each, {r['scored_positions']} scored positions); speed from "
            "docs/throughput.json (`python -m bench.throughput`, the same prompts).",
            "",
            "| | fp32 | int4 level 1 | int4 ÷ fp32 |",
            "| --- | --: | --: | --: |",
            f"| perplexity | {r['perplexity']['fp32']:.3f} | {r['perplexity']['int4']:.3f} | "
            f"{r['perplexity_ratio_int4']:.4f} |",
            f"| ortspec batched, plain: tok/s | {tp['fp32']['tokens_per_s']:.1f} | {tp['int4']['tokens_per_s']:.1f} | "
            f"{tp['int4']['tokens_per_s'] / tp['fp32']['tokens_per_s']:.2f} |",
            "",
            f"int4's most likely next token is fp32's at {100 * r['top1_agreement']:.1f}% of the positions. Greedy "
            f"continuations ({g['new_tokens']} tokens, EOS ignored): {g['identical']}/{g['prompts']} identical; where "
            f"they differ, the first difference is at token {first} on average.",
            "",
            f"**Choice: {r['choice']}** (the faster precision by batched throughput, unless its perplexity is more "
            f"than {r['max_ppl_ratio']}x fp32's).",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
