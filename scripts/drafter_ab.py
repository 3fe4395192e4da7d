"""Two drafter folders side by side: speculative="auto" (or "shared-kv") with each, on the same open-ended
prompts, against plain decoding, each drafter on the target its Engine opens for it (a drafter with fused features
gets a target that carries the residual streams it reads).

    python scripts/drafter_ab.py --a DIR --b DIR [--speculative auto|shared-kv] [--prompts 10]
                                 [--max-tokens 128] [--temperature 0.7] [--threads 2] [--out FILE]

Per prompt (the benchmark's open-ended chat prompts, bench/workloads.py), in turn: plain decoding on A's Engine,
``--speculative`` (``auto``, default; ``shared-kv``: the drafter alone) with A, plain on B's Engine, then with B
(the order alternates from prompt to prompt), each run from an empty suffix cache; with ``--temperature`` the runs
sample (top_p 0.9, seed 1000 + the prompt's number). Reported per drafter: target passes, draft tokens proposed and
accepted, tokens per pass (these do not depend on the clock but for the width policy's pass costs, measured when
each Engine opens), and tok/s ÷ plain decoding on its own Engine and ÷ plain decoding on A's (the wall clock:
compare within one run). Every output must equal plain decoding's (checked).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.engine.suffix_cache import SuffixCache  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32").expanduser()


def timed(engine: Engine, chat, options: dict, speculative: str | None):
    engine.suffix_cache = SuffixCache()
    t0 = time.perf_counter()
    result = engine.generate(chat, **options, **({"speculative": speculative} if speculative else {}))
    return result, time.perf_counter() - t0


def run(args: argparse.Namespace) -> str:
    engines = {
        name: Engine.from_dir(args.model, BackendConfig(threads=args.threads), drafter=path)
        for name, path in (("A", args.a), ("B", args.b))
    }
    chats = [w.messages for w in build_workloads(args.prompts, tokenizer=None, categories=["open_ended"])]
    for engine in engines.values():
        engine.generate(chats[0], max_tokens=8, speculative=args.speculative)  # warm-up
    load_start = os.getloadavg()
    # per drafter: tokens, seconds plain, tokens, seconds, passes, proposed, accepted (auto)
    totals = {name: [0, 0.0, 0, 0.0, 0, 0, 0] for name in engines}
    for i, chat in enumerate(chats):
        options: dict = {"max_tokens": args.max_tokens}
        if args.temperature:
            options.update(temperature=args.temperature, top_p=0.9, seed=1000 + i)
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            engine, t = engines[name], totals[name]
            want, plain_s = timed(engine, chat, options, None)
            got, auto_s = timed(engine, chat, options, args.speculative)
            if (got.token_ids, got.text) != (want.token_ids, want.text):
                raise AssertionError(f"prompt {i}, drafter {name}: the output differs from plain decoding")
            for k, v in enumerate((len(want.token_ids), plain_s, len(got.token_ids), auto_s, got.stats.steps,
                                   got.stats.proposed_tokens, got.stats.accepted_tokens)):  # fmt: skip
                t[k] += v
        print(f"prompt {i}: {len(want.token_ids)} tokens", flush=True)
    load_end = os.getloadavg()
    sampling = f"T {args.temperature:g}, top_p 0.9, seed 1000 + prompt" if args.temperature else "greedy"
    base_rate = totals["A"][0] / totals["A"][1]
    lines = [
        "# Two drafters side by side (scripts/drafter_ab.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime threads {args.threads}",
        f"- load average at the start: {load_start[0]:.2f}; at the end: {load_end[0]:.2f}",
        f"- target: {Path(args.model).name}; A: {args.a}; B: {args.b}",
        f"- {len(chats)} open-ended chat prompts, {args.max_tokens} new tokens at most, {sampling}; "
        f'speculative="{args.speculative}"; every output equal to plain decoding\'s',
        "",
        "| drafter | target's hidden rows | passes | proposed | accepted | acceptance | tokens / pass | tok/s ÷ its "
        "plain | tok/s ÷ A's plain |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (plain_n, plain_s, n, seconds, passes, proposed, accepted) in totals.items():
        features = engines[name].backend_config.hidden_features
        rows = f"+ layers {', '.join(map(str, features))}" if features else "final state"
        lines.append(
            f"| {name} | {rows} | {passes} | {proposed} | {accepted} | {accepted / max(proposed, 1):.0%} | "
            f"{n / passes:.2f} | {(n / seconds) / (plain_n / plain_s):.3f} | {(n / seconds) / base_rate:.3f} |"
        )
    lines.append(f"\nPlain decoding on A's Engine: {base_rate:.1f} tok/s.\n")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--a", required=True, help="a drafter folder")
    parser.add_argument("--b", required=True, help="another drafter folder")
    parser.add_argument("--speculative", choices=("auto", "shared-kv"), default="auto")
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
