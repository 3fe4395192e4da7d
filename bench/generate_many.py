"""Throughput of ``Engine.generate_many`` (continuous batching) against the same prompts one at a time.

    python -m bench.generate_many [--model DIR] [--n 8] [--new-tokens 64] [--threads 2] [--speculative none]
                                  [--out docs/generate-many.md]

The dataset is the batch-scaling one (``bench.workloads``: ``--n`` chat prompts per category, four categories, up to
``--max-prompt-tokens`` prompt tokens), greedy, plain decoding (or ``--speculative``: ``prompt-lookup``, or ``auto``
and ``shared-kv`` with the drafter found for the model, both ways), ``--new-tokens`` new tokens each (EOS ignored, so
every record does the same work either way). One Engine (``--threads`` intra-op threads) runs every prompt for 4
tokens both ways (the warm-up), then the prompts one after another with ``generate``, then all of them with
``generate_many``; every output is compared with the one-at-a-time
output, and the ratio of the two wall times is the figure to read (both in one run, on the same machine). The report
is written to ``--out`` with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

from bench.workloads import build_workloads
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.engine import DEFAULT_SLOTS as BATCH_SLOTS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: SmolLM2-135M-Instruct fp32)")
    ap.add_argument("--n", type=int, default=8, help="prompts per category (default 8: 32 prompts)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1000, help="longest prompt (default 1000 tokens)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument(
        "--speculative", default="none", choices=("none", "prompt-lookup", "auto", "shared-kv"), help="both ways"
    )
    ap.add_argument("--out", type=Path, default=Path("docs/generate-many.md"), help="the report")
    args = ap.parse_args()
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads))
    workloads = build_workloads(args.n, args.max_prompt_tokens, engine.tokenizer)
    prompts = [w.messages for w in workloads]
    speculative = None if args.speculative == "none" else args.speculative
    options = dict(max_tokens=args.new_tokens, ignore_eos=True, speculative=speculative)
    # Warm-up, the same for both: every prompt once, 4 tokens (opens the batch session; onnxruntime's first run of
    # each shape allocates, and a batch pass sees many shapes: every batch size as sequences finish).
    engine.generate_many(prompts, max_tokens=4, ignore_eos=True)
    for p in prompts:
        engine.generate(p, max_tokens=4, ignore_eos=True)
    t0 = time.perf_counter()
    alone = [engine.generate(p, **options) for p in prompts]
    t_alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    many = engine.generate_many(prompts, **options)
    t_many = time.perf_counter() - t0
    same = sum(a.token_ids == m.token_ids for a, m in zip(alone, many, strict=True))
    tokens = sum(len(r.token_ids) for r in many)
    prompt_tokens = sum(r.prompt_tokens for r in many)
    report = "\n".join(
        [
            "# `Engine.generate_many` against one prompt at a time",
            "",
            f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `python -m bench.generate_many` on "
            f"{platform.processor() or platform.machine()} ({platform.machine()}, a 2-core machine shared with other "
            f"work), {args.threads} intra-op threads, `{Path(args.model).name}`; {len(prompts)} chat prompts "
            f"({prompt_tokens} prompt tokens in all) x {args.new_tokens} new tokens, greedy, "
            f"{'plain decoding' if speculative is None else f'speculative={speculative!r}'} (both ways), EOS "
            f"ignored; generate_many runs up to {BATCH_SLOTS} sequences per pass, folding in at most "
            f"{engine.prefill_budget or 'unbounded'} prompt tokens per pass (the Engine's `prefill_budget`).",
            "",
            "| run | wall s | new tokens/s | ratio |",
            "| --- | --: | --: | --: |",
            f"| `generate`, one prompt at a time | {t_alone:.1f} | {tokens / t_alone:.1f} | 1.00 |",
            f"| `generate_many` | {t_many:.1f} | {tokens / t_many:.1f} | {t_alone / t_many:.2f} |",
            "",
            f"Outputs identical to one at a time: {same}/{len(prompts)}.",
            "",
            "With `--speculative auto` or `shared-kv`, generate_many drafts with the Engine's shared-KV drafter too: "
            "one drafter session for every slot, each sequence reading its own slot's KV and hidden state, its "
            "widths priced by the pass it joins ([drafter.md](drafter.md), In batches).",
            "",
        ]
    )
    args.out.write_text(report, encoding="utf-8")
    print(report)
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
