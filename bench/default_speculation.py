"""Which ``speculative`` should every surface default to? Plain decoding, the suffix lookup and ``auto``, for a lone
request and for many at once, side by side in one run.

    python -m bench.default_speculation [--model DIR] [--rounds 2] [--lone 8] [--many 32] [--new-tokens 64]
        [--out docs/bench/default-speculation.md]

One Engine (``--threads`` intra-op threads, its default slots, the drafter found for the model). Prompts: chat
records of ``bench/data/throughput-prompts.json`` (a mix of workloads; EOS ignored, ``--new-tokens`` each). Lone:
the first ``--lone`` records one at a time with ``generate``; many: the first ``--many`` with one ``generate_many``.
Each round runs every setting in turn (the order rotates per round), after one warm-up per setting; the figure is
the total wall time of each setting, the least of the rounds, and its tokens per second; every output is compared
with plain decoding's. Each run starts from an empty suffix cache (the same prompts run again in every round: no
run may draft an earlier run's answers). The setting with the most tokens per second in both cases is the one to
default to.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.suffix_cache import SuffixCache

PROMPTS = Path(__file__).resolve().parent / "data" / "throughput-prompts.json"
SETTINGS = {"none": None, "suffix": "suffix", "auto": "auto"}
DEFAULT_OUT = Path("docs/bench/default-speculation.md")


def _timed(run: Any) -> tuple[float, list[tuple[int, ...]]]:
    t0 = time.perf_counter()
    results = run()
    return time.perf_counter() - t0, [r.token_ids for r in results]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lone", type=int, default=8)
    ap.add_argument("--many", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    records = json.loads(PROMPTS.read_text())["records"]
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads))
    engine.warm()
    options = dict(max_tokens=args.new_tokens, ignore_eos=True)
    cases = {
        "lone": lambda s: [engine.generate(r["messages"], speculative=s, **options) for r in records[: args.lone]],
        "many": lambda s: engine.generate_many([r["messages"] for r in records[: args.many]], speculative=s, **options),
    }
    best: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    names = list(SETTINGS)
    for name in names:  # warm-up: each setting's shapes, and its suffix cache's first outputs
        engine.generate(records[0]["messages"], max_tokens=4, speculative=SETTINGS[name])
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for case, run in cases.items():
                engine.suffix_cache = SuffixCache()  # no run drafts another run's outputs of the same prompts
                seconds, tokens = _timed(lambda run=run, name=name: run(SETTINGS[name]))
                best[case, name] = min(best.get((case, name), seconds), seconds)
                outputs[case, name] = tokens
    machine = machine_info()
    lines = [
        "# The default `speculative`: plain, the suffix lookup and `auto`, alone and many at once",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC by `python -m bench.default_speculation` on "
        f"{machine.get('cpu', 'this machine')}, {args.threads} intra-op threads, `{Path(args.model).name}` "
        f"({engine.batch.slots} slots, drafter: {'yes' if engine.drafter is not None else 'no'}); "
        f"{args.new_tokens} new tokens per request (EOS ignored), {args.rounds} rounds, the least wall time of the "
        f"rounds. Lone: {args.lone} requests one at a time; many: {args.many} requests in one `generate_many`.",
        "",
        "| case | setting | wall s | tok/s | ÷ plain | identical to plain |",
        "| --- | --- | --: | --: | --: | --: |",
    ]
    for case in cases:
        count = args.lone if case == "lone" else args.many
        for name in names:
            seconds = best[case, name]
            same = sum(a == b for a, b in zip(outputs[case, name], outputs[case, "none"], strict=True))
            lines.append(
                f"| {case} | {name} | {seconds:.2f} | {count * args.new_tokens / seconds:.1f} | "
                f"{best[case, 'none'] / seconds:.2f}x | {same}/{count} |"
            )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
