"""The suffix rule's resync after an edit (``DraftRule.resync_back``, core/suffix.py): speculative="auto" with the
rule as shipped against the same rule with the resync off, on the benchmark's chat prompts.

    python scripts/suffix_resync.py [--categories code_edit open_ended] [--prompts 10] [--repeat 2]
                                    [--max-tokens 128] [--threads 2] [--out FILE]

Per prompt and repeat, each setting runs once, in an order that rotates with the prompt and the repeat, each run
from an empty suffix cache (so a run drafts from its own context only, never an earlier run's output). Reported per
category and setting: target passes (the prompt pass included), tokens per pass, the time of every run added up,
and the median over prompts of (the resync-off run's time ÷ this setting's), each prompt's time being the median
over its repeats: a ratio above 1 is faster than the resync off. Every output must equal the first run's (checked:
the rule chooses drafts only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import build_workloads, encode_chat  # noqa: E402
from ortspec import BackendConfig, Engine  # noqa: E402
from ortspec.adapters.engine.suffix_cache import SuffixCache  # noqa: E402
from ortspec.core import DraftRule  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32").expanduser()
SETTINGS = {"resync off": DraftRule(resync_back=0), "resync (default rule)": DraftRule()}


def run_category(engine: Engine, category: str, args: argparse.Namespace) -> list[str]:
    """The category's table rows (markdown), after running every prompt, repeat and setting."""
    workloads = build_workloads(args.prompts, tokenizer=engine.tokenizer, categories=[category])
    names = list(SETTINGS)
    seconds: dict[str, list[list[float]]] = {name: [[] for _ in workloads] for name in names}
    passes = dict.fromkeys(names, 0)
    tokens = dict.fromkeys(names, 0)
    for i, workload in enumerate(workloads):
        ids = encode_chat(workload.messages, engine.tokenizer)
        want: tuple[int, ...] | None = None
        for repeat in range(args.repeat):
            shift = (i + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                engine.suffix_cache, engine.suffix_rule = SuffixCache(), SETTINGS[name]
                t0 = time.perf_counter()
                result = engine.start(ids, max_tokens=args.max_tokens, speculative="auto", draft_width="auto").run()
                seconds[name][i].append(time.perf_counter() - t0)
                got = tuple(result.token_ids)
                if want is None:
                    want = got
                elif got != want:
                    raise AssertionError(f"{workload.name}, {name}: the output differs from the first run's")
                passes[name] += result.stats.steps
                tokens[name] += len(got)
        print(f"{workload.name}: {len(want or ())} tokens", flush=True)
    base = [statistics.median(s) for s in seconds[names[0]]]
    rows = []
    for name in names:
        mine = [statistics.median(s) for s in seconds[name]]
        ratio = statistics.median(b / m for b, m in zip(base, mine, strict=True))
        total = sum(sum(s) for s in seconds[name])
        rows.append(
            f"| {category} | {name} | {passes[name]} | {tokens[name] / passes[name]:.2f} | {total:.1f} | {ratio:.3f} |"
        )
    return rows


def run(args: argparse.Namespace) -> str:
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads))
    engine.generate([{"role": "user", "content": "Hello"}], max_tokens=8)  # warm-up, and the measured pass costs
    load_start = os.getloadavg()
    rows = [row for category in args.categories for row in run_category(engine, category, args)]
    load_end = os.getloadavg()
    drafter = getattr(getattr(engine.drafter, "folder", None), "path", None)
    lines = [
        "# The suffix rule's resync after an edit (scripts/suffix_resync.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime threads {args.threads}",
        f"- load average at the start: {load_start[0]:.2f}; at the end: {load_end[0]:.2f}",
        f"- target: {Path(args.model).name}; drafter: {drafter}",
        f"- {args.prompts} prompts per category, {args.repeat} run(s) per prompt and setting, {args.max_tokens} new "
        'tokens at most, greedy, speculative="auto", draft_width="auto"; every output equal to the first run\'s',
        "",
        "| category | setting | target passes | tokens / pass | seconds, all runs | speed ÷ resync off (median) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *rows,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--categories", nargs="+", default=["code_edit", "open_ended"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
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
