"""One request at a time: the batched Engine (what ``ortspec serve`` runs) against today's one-sequence Engine.

Issue 19's target: a request alone is within 5% of today's latency. For each of ``--prompts`` chat prompts of the
batch-scaling dataset, greedy and prompt lookup (the server's default speculation), ``--new-tokens`` new tokens
(EOS ignored), the same request runs on ``Engine.from_dir(folder)`` (``OrtBackend``: today's worker) and through
the batched path of ``Engine.from_dir(folder, batch_slots=16)`` (``generate_requests``: one sequence on the
Engine's shared passes, a ``BatchScheduler`` like the batched server's, running a lone request), interleaved per
prompt, each once after a warm-up. Prints and writes (``--out``, default docs/single-request.md) the wall times, the
ratio batched ÷ today (sum over prompts) and whether every output is identical.

    python scripts/single_request.py [--model DIR] [--prompts 8] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine_info  # noqa: E402
from bench.workloads import build_workloads  # noqa: E402
from ortspec import BackendConfig, Engine, GenerationOptions  # noqa: E402
from ortspec.adapters.engine.many import batch_request, generate_requests  # noqa: E402

MODES = {"greedy": {}, "prompt lookup": {"speculative": "prompt-lookup"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/single-request.md"))
    args = ap.parse_args()
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    config = BackendConfig(threads=args.threads)
    today = Engine.from_dir(args.model, config, drafter=False)
    batched = Engine.from_dir(args.model, config, batch_slots=16)
    per_category = max(1, (args.prompts + 3) // 4)
    prompts = [w.messages for w in build_workloads(per_category, 1000, today.tokenizer)][: args.prompts]
    rows, identical = [], 0
    for mode, extra in MODES.items():
        options = dict(max_tokens=args.new_tokens, ignore_eos=True, **extra)
        for engine in (today, batched):  # warm-up: sessions, shapes, the verify and batch decode costs
            engine.generate(prompts[0], max_tokens=4, **extra)
        generate_requests(batched, [batch_request(batched, prompts[0], GenerationOptions(max_tokens=4, **extra))])
        t_today = t_batched = 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            alone = today.generate(prompt, **options)
            t1 = time.perf_counter()
            (lone,) = generate_requests(batched, [batch_request(batched, prompt, GenerationOptions(**options))])
            t2 = time.perf_counter()
            t_today, t_batched = t_today + t1 - t0, t_batched + t2 - t1
            identical += alone.token_ids == lone.token_ids
        rows.append((mode, t_today, t_batched))
        print(f"{mode}: today {t_today:.2f} s, batched {t_batched:.2f} s, ratio {t_batched / t_today:.3f}", flush=True)
    machine = machine_info()
    lines = [
        "# One request at a time: the batched Engine against today's one-sequence Engine",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `python scripts/single_request.py` "
        f"on {machine.get('cpu', 'this machine')} ({machine.get('cores')} cores, shared with other "
        f"work), {args.threads} intra-op threads, `{Path(args.model).name}`; {len(prompts)} chat prompts x "
        f"{args.new_tokens} new tokens (EOS ignored), each run once on each path, interleaved per prompt.",
        "",
        "| decoding | today (`OrtBackend`) s | batched path s | batched ÷ today |",
        "| --- | --: | --: | --: |",
        *(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.3f} |" for m, a, b in rows),
        "",
        f"Outputs identical: {identical}/{len(prompts) * len(MODES)}.",
        "",
    ]
    args.out.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0 if identical == len(prompts) * len(MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
