"""The drafter's confidence stop (``ortspec.stop_below`` in a drafter folder): speculative="auto" on open-ended
prompts with the Engine's drafter opened at each threshold, against plain decoding of the same prompts.

    python scripts/confidence_stop.py [--drafter DIR] [--thresholds 0 0.1 0.2 0.3 0.4] [--prompts 10]
                                      [--max-tokens 128] [--temperature 0.7] [--threads 2] [--out FILE]

Each prompt (the benchmark's open-ended chat prompts, bench/workloads.py) runs plain, then with every threshold in
turn, each run from an empty suffix cache (so no run drafts an earlier run's output); with ``--temperature`` the
runs sample (top_p 0.9, seed 1000 + the prompt's number). Reported per threshold: target passes, draft tokens
proposed and accepted (these depend only on the drafter, the prompts and the width policy's pass costs, measured
once when the Engine opens), tokens per pass, and tok/s ÷ plain (the wall clock: compare within one run). Every
speculative output must equal plain decoding's (checked).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.engine.suffix_cache import SuffixCache  # noqa: E402
from ortspec.backends.onnx.drafter import SharedKvProposer  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32").expanduser()


def generate(engine: Engine, chat, options: dict, drafter: SharedKvProposer | None) -> tuple[Any, float]:
    """One generation from an empty suffix cache with ``drafter`` as the Engine's (None: plain decoding);
    (result, seconds)."""
    engine.suffix_cache = SuffixCache()
    speculative = {}
    if drafter is not None:
        engine.drafter, speculative = drafter, {"speculative": "auto"}
    t0 = time.perf_counter()
    result = engine.generate(chat, **options, **speculative)
    return result, time.perf_counter() - t0


def run(args: argparse.Namespace) -> str:
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads), drafter=args.drafter or None)
    assert isinstance(engine.drafter, SharedKvProposer), "no drafter"
    folder = engine.drafter.folder
    drafters = {t: SharedKvProposer.open(engine.backend, folder, stop_below=t) for t in args.thresholds}
    chats = [w.messages for w in build_workloads(args.prompts, tokenizer=None, categories=["open_ended"])]
    engine.generate(chats[0], max_tokens=8)  # warm-up
    load_start = os.getloadavg()
    plain_tokens, plain_seconds = 0, 0.0
    totals = {t: [0, 0, 0, 0, 0.0] for t in args.thresholds}  # tokens, passes, proposed, accepted, seconds
    for i, chat in enumerate(chats):
        options: dict = {"max_tokens": args.max_tokens}
        if args.temperature:
            options.update(temperature=args.temperature, top_p=0.9, seed=1000 + i)
        want, seconds = generate(engine, chat, options, None)
        plain_tokens, plain_seconds = plain_tokens + len(want.token_ids), plain_seconds + seconds
        for threshold in args.thresholds:
            got, seconds = generate(engine, chat, options, drafters[threshold])
            if (got.token_ids, got.text) != (want.token_ids, want.text):
                raise AssertionError(f"prompt {i}, stop_below {threshold}: the output differs from plain decoding")
            t = totals[threshold]
            for k, v in enumerate((len(got.token_ids), got.stats.steps, got.stats.proposed_tokens,
                                   got.stats.accepted_tokens, seconds)):  # fmt: skip
                t[k] += v
        print(f"prompt {i}: {len(want.token_ids)} tokens", flush=True)
    load_end = os.getloadavg()
    plain_rate = plain_tokens / plain_seconds
    sampling = f"T {args.temperature:g}, top_p 0.9, seed 1000 + prompt" if args.temperature else "greedy"
    lines = [
        "# The drafter's confidence stop (scripts/confidence_stop.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime threads {args.threads}",
        f"- load average at the start: {load_start[0]:.2f}; at the end: {load_end[0]:.2f}",
        f"- target: {Path(args.model).name}; drafter: {folder.path}",
        f"- {len(chats)} open-ended chat prompts, {args.max_tokens} new tokens at most, {sampling}; "
        'speculative="auto"; every output equal to plain decoding\'s',
        "",
        "| stop_below | passes | proposed | accepted | acceptance | tokens / pass | tok/s ÷ plain |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| plain | {plain_tokens} | - | - | - | 1.00 | 1.00 ({plain_rate:.1f} tok/s) |",
    ]
    for threshold, (tokens, passes, proposed, accepted, seconds) in totals.items():
        lines.append(
            f"| {threshold:g} | {passes} | {proposed} | {accepted} | {accepted / max(proposed, 1):.0%} | "
            f"{tokens / passes:.2f} | {tokens / seconds / plain_rate:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--drafter", default=None, help="the drafter folder (default: the one the Engine finds)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
