"""Concurrent ``stream`` calls on one Engine: shared passes against the same calls one after another.

``--streams`` threads each ``stream`` one chat prompt of the batch-scaling dataset (``--new-tokens`` new tokens, EOS
ignored) at once on ``Engine.from_dir(folder, batch_slots=--streams)`` (its calls share passes: ``shared.py``); the
same calls run one after another on ``Engine.from_dir(folder)`` (today's one-sequence Engine). Greedy and prompt
lookup, each after a warm-up. Writes a markdown table to ``--out`` (default docs/bench/concurrent-streams.md) and
prints it: wall seconds, new tokens/s, the ratio, the shared passes' rows per pass, how many cores other processes
used meanwhile, and whether every stream's text is the text of the same call alone. Exit status 1 when a stream's
text differs.

    python -m bench.concurrent_streams [--model DIR] [--streams 8] [--new-tokens 32] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import threading
import time
from pathlib import Path

from bench.machine import CpuContention, machine_info
from bench.workloads import build_workloads
from ortspec import BackendConfig, Engine

DEFAULT_OUT = Path("docs/bench/concurrent-streams.md")
MODES = {"greedy": {"speculative": None}, "prompt lookup": {"speculative": "prompt-lookup"}}


def at_once(engine: Engine, prompts: list, options: dict) -> tuple[float, list[str]]:
    """Every prompt streamed from its own thread, all started together; (wall seconds, each stream's text)."""
    texts = [""] * len(prompts)
    start = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        start.wait()
        texts[i] = "".join(engine.stream(prompts[i], **options))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, texts


def one_after_another(engine: Engine, prompts: list, options: dict) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    texts = ["".join(engine.stream(prompt, **options)) for prompt in prompts]
    return time.perf_counter() - t0, texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-prompt-tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the report (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    config = BackendConfig(threads=args.threads)
    today = Engine.from_dir(args.model, config, drafter=False)
    shared = Engine.from_dir(args.model, config, batch_slots=args.streams)
    per_category = max(1, (args.streams + 3) // 4)
    workloads = build_workloads(per_category, args.max_prompt_tokens, today.tokenizer)
    prompts = [w.messages for w in workloads][: args.streams]
    rows, identical = [], 0
    with shared:
        for mode, extra in MODES.items():
            options = dict(max_tokens=args.new_tokens, ignore_eos=True, **extra)
            for engine in (today, shared):  # warm-up: sessions, shapes, the verify and batch decode costs
                engine.generate(prompts[0], max_tokens=4, **extra)
            scheduler = shared.scheduler
            passes, rows_before = scheduler.passes, sum(n * k for n, k in scheduler.rows_per_pass.items())
            with CpuContention() as load:
                t_shared, got = at_once(shared, prompts, options)
                rows_run = sum(n * k for n, k in scheduler.rows_per_pass.items()) - rows_before
                passes = scheduler.passes - passes
                t_today, want = one_after_another(today, prompts, options)
            identical += sum(a == b for a, b in zip(got, want, strict=True))
            tokens = len(prompts) * args.new_tokens
            per_pass = rows_run / max(1, passes)
            rows.append((mode, t_today, tokens / t_today, t_shared, tokens / t_shared, per_pass, load.others_cores))
            print(f"{mode}: one after another {t_today:.2f} s, shared {t_shared:.2f} s", flush=True)
    machine = machine_info()
    cores = machine.get("cores")
    lines = [
        "# Concurrent `stream` calls on one Engine: shared passes against one after another",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by "
        f"`python -m bench.concurrent_streams` on {machine.get('cpu', 'this machine')} "
        f"({cores.get('usable', cores) if isinstance(cores, dict) else cores} cores, shared with other work), "
        f"{args.threads} intra-op threads, `{Path(args.model).name}`; {len(prompts)} chat prompts (at most "
        f"{args.max_prompt_tokens} tokens) x {args.new_tokens} new tokens, EOS ignored.",
        "",
        "| decoding | one after another s | tok/s | shared passes s | tok/s | ratio | rows per pass | other load |",
        "| --- | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for mode, a, a_rate, b, b_rate, per_pass, others in rows:
        load = f"{others:.1f} cores" if others is not None else "?"
        ratio = b_rate / a_rate
        lines.append(
            f"| {mode} | {a:.2f} | {a_rate:.1f} | {b:.2f} | {b_rate:.1f} | {ratio:.2f} | {per_pass:.1f} | {load} |"
        )
    lines += ["", f"Streams identical to the same call alone: {identical}/{len(prompts) * len(MODES)}.", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0 if identical == len(prompts) * len(MODES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
