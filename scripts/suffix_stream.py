"""Suffix drafting on the real model: a repetitive stream of requests, and copy-heavy prompts.

The stream is ``bench.repetitive``'s (what an agent or a batch job sends one Engine: requests of three task shapes
whose answers share text that is NOT in each prompt), ``--rounds`` rounds of the three shapes. Each mode runs the
whole stream on one Engine, in order, after a warm-up: plain decoding, prompt lookup, suffix (the Engine's suffix
cache starts empty and learns from the stream as it goes). Then ``--copy`` prompts of the bench suite's copy-heavy
category (``code_edit``: the answer copies the prompt), prompt lookup against suffix, each request on its own (the
cache emptied before each): what decides whether ``speculative="auto"`` should draft by suffix. Prints a markdown
table (tokens/s end to end, target passes, acceptance, speed-up over plain) and whether every output is identical to
plain; ``--streams FILE`` writes the stream's prompts and plain outputs (token ids), the token streams
``scripts/suffix_vs_arctic.py`` replays.

    python scripts/suffix_stream.py [--model DIR] [--rounds 6] [--new-tokens 96] [--copy 4] [--streams FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.repetitive import repetitive_stream  # noqa: E402
from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.engine.suffix_cache import SuffixCache  # noqa: E402


def run_mode(engine: Engine, prompts: list, speculative: str | None, new_tokens: int, fresh_cache: bool) -> dict:
    """Every prompt in order on ``engine``; the totals and the outputs."""
    engine.suffix_cache = SuffixCache()
    outputs, seconds, tokens, steps, proposed, accepted = [], 0.0, 0, 0, 0, 0
    for prompt in prompts:
        if fresh_cache:
            engine.suffix_cache = SuffixCache()
        t0 = time.perf_counter()
        result = engine.generate(prompt, chat=True, max_tokens=new_tokens, speculative=speculative)
        seconds += time.perf_counter() - t0
        outputs.append(result.token_ids)
        tokens += len(result.token_ids)
        steps += result.stats.steps
        proposed += result.stats.proposed_tokens
        accepted += result.stats.accepted_tokens
    return dict(outputs=outputs, seconds=seconds, tokens=tokens, steps=steps, proposed=proposed, accepted=accepted)


def table(title: str, prompts: list, engine: Engine, modes: dict, new_tokens: int, fresh: bool) -> list[str]:
    runs = {name: run_mode(engine, prompts, spec, new_tokens, fresh) for name, spec in modes.items()}
    plain = runs["plain"]
    lines = [
        f"{title}: {len(prompts)} requests, up to {new_tokens} new tokens each",
        "",
        "| mode | tokens | seconds | tok/s | target passes | acceptance | speed-up | identical to plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        rate = run["tokens"] / run["seconds"]
        acc = f"{run['accepted']}/{run['proposed']}" if run["proposed"] else "-"
        same = sum(a == b for a, b in zip(run["outputs"], plain["outputs"], strict=True))
        lines.append(
            f"| {name} | {run['tokens']} | {run['seconds']:.1f} | {rate:.1f} | {run['steps']} | {acc} | "
            f"{plain['seconds'] / run['seconds']:.2f}x | {same}/{len(prompts)} |"
        )
    return lines, runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--copy", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads), drafter=False)
    engine.generate("Hello", max_tokens=4, speculative="prompt-lookup")  # warm-up and the verify cost curve
    modes = {"plain": None, "prompt lookup": "prompt-lookup", "suffix": "suffix"}
    prompts = repetitive_stream(3 * args.rounds)
    lines, runs = table("Repetitive stream", prompts, engine, modes, args.new_tokens, fresh=False)
    print("\n".join(lines), flush=True)
    if args.streams is not None:
        ids = [engine.prompt_ids(p, chat=True) for p in prompts]
        args.streams.write_text(json.dumps({"prompts": ids, "outputs": [list(o) for o in runs["plain"]["outputs"]]}))
    if args.copy:
        copy = [w.messages for w in build_workloads(args.copy, 1000, engine.tokenizer, categories=["code_edit"])]
        copy = copy[: args.copy]
        lines, _ = table("\nCopy-heavy (code_edit), the cache emptied before each request", copy, engine, modes,
                         args.new_tokens * 2, fresh=True)  # fmt: skip
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
