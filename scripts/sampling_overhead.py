"""What sampling costs per decode step on the host, without a model: ``StepContext.pick`` per row and
``core.step`` per step on SmolLM2-sized logits rows (49,152 ids; K + 1 = 9 rows), greedy against sampling, and
the ratio to a decode step's time.

    python scripts/sampling_overhead.py [--decode-ms 27] [--vocab 49152] [--k 8] [--repeat 15] [--out FILE]

Settings timed: greedy; the benchmark's sampled column (temperature 0.7, top_p 0.9); and every filter on
(temperature 0.7, top_k 50, top_p 0.9, min_p 0.05, repetition_penalty 1.1), the issue's overhead setting, whose
target is under 2% of a decode step. ``--decode-ms`` is the decode step to compare with (default 27 ms: the fp32
SmolLM2-135M decode step on the 2-core benchmark machine; the suite's cost curve measures it, K = 0).

Rows are synthetic and deterministic (``--seed``): float32, the bulk drawn from N(0, 3.5^2) and a head of 5 ids
lifted 15-20 logits above its mean, as SmolLM2-135M-Instruct's rows look (measured on a chat prompt: standard
deviation about 3.6, top about 20 above the mean, 98-99% of the ids within 40 T = 28 logits of the top at T 0.7, so
the sampler's e**-40 cut keeps nearly the whole vocabulary; top_p 0.9 then keeps 1-3 ids). Here the cut keeps
75-100% of the ids and top_p 1-3.
``core.step`` is timed with a draft that equals the picks (found first), so all K + 1 rows are picked: the most
work a step can do. The context is ``--prompt-tokens`` + ``--generated`` random ids (the repetition penalty's set).
Times are medians over ``--repeat`` rounds, in CPU time of this process (``time.process_time``: what the work
costs, which other processes on a shared machine do not inflate; numpy runs these operations on one thread) and in
wall time (printed beside, with the load average). The ratios use the CPU time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.core import DecodeState, Options, step
from ortspec.core.sampling import StepContext

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "sampled: temperature 0.7, top_p 0.9 (the suite's column)": {"temperature": 0.7, "top_p": 0.9},
    "sampled: all filters (T 0.7, top_k 50, top_p 0.9, min_p 0.05, rep 1.1)": {
        "temperature": 0.7,
        "top_k": 50,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    },
}
TARGET_PCT = 2.0


def make_rows(vocab: int, n: int, seed: int) -> np.ndarray:
    """``n`` synthetic logits rows (see the module docstring)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0.0, 3.5, size=(n, vocab)).astype(np.float32)
    head = np.array([20.0, 18.0, 17.0, 16.0, 15.0], dtype=np.float32)
    for row in rows:
        row[rng.choice(vocab, size=head.size, replace=False)] += head
    return rows


def _median_time(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of one call of ``fn``."""
    fn()  # warm-up
    cpu, wall = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(cpu), statistics.median(wall)


def time_setting(
    options: Options, rows: np.ndarray, prompt: Sequence[int], generated: Sequence[int], repeat: int
) -> dict[str, float]:
    """CPU seconds per ``StepContext.pick`` row, per plain ``core.step`` (one row) and per ``core.step`` over all
    K + 1 rows with every draft token accepted; and the full step's wall seconds."""
    k = rows.shape[0] - 1
    context = StepContext(options.sampling, prompt, generated)
    # the picks a fully accepted step makes: row i sees the first i of them as its draft
    picks: list[int] = []
    for i in range(k + 1):
        picks.append(context.pick(rows[i], i, picks[:i], margin=False, top_n=0).token)
    draft = picks[:k]

    def pick_rows() -> None:
        for i in range(k + 1):
            context.pick(rows[i], i, draft[:i], margin=False, top_n=0)

    state = attrs.evolve(DecodeState.start(prompt, options), generated_tokens=tuple(generated))
    _, commits, _, _ = step(state, rows[0], rows[1:], draft)
    assert [c.token_id for c in commits] == picks, "the draft should be accepted in full"
    per_rows, _ = _median_time(pick_rows, repeat)
    plain, _ = _median_time(lambda: step(state, rows[0], None, ()), repeat)
    full, full_wall = _median_time(lambda: step(state, rows[0], rows[1:], draft), repeat)
    return {"pick_s_per_row": per_rows / (k + 1), "plain_step_s": plain, "full_step_s": full, "wall_s": full_wall}


def primitives(row: np.ndarray, repeat: int) -> list[tuple[str, float]]:
    """CPU seconds of the stages of a sampled pick (``core/sampling.py``'s own functions, in its order) on one row,
    at temperature 0.7 with top_k 50 and top_p 0.9."""
    from ortspec.core import sampling as sp

    t = 0.7
    z = np.asarray(row, dtype=np.float32)
    best = int(np.argmax(z))
    zmax = z[best]
    window = np.flatnonzero((z - zmax) / np.float32(t) >= -sp.UNLIKELY)
    p = np.exp((z[window] - zmax) / np.float32(t))
    mass = p.astype(np.float64)
    blocks = sp._block_cumsum(mass)
    ops: list[tuple[str, Callable[[], object]]] = [
        ("argmax over the row (greedy's pick; every pick makes it)", lambda: np.argmax(z)),
        ("float32 copy of the row (processors)", lambda: np.array(z, copy=True)),
        (f"the e**-40 window ({window.size} ids survive)", lambda: np.flatnonzero((z - zmax) / np.float32(t) >= -40)),
        ("float32 exp over the window", lambda: np.exp((z[window] - zmax) / np.float32(t))),
        ("top_k 50 (threshold search, sort of the candidates)", lambda: sp._top_k(z, zmax, t, 50)),
        ("top_p 0.9 over the window (mass-bounded candidate sort)", lambda: sp._top_p(z[window], p, 0.9)),
        ("block sums of the window's mass (float64)", lambda: sp._block_cumsum(mass)),
        ("inverse-CDF draw in the blocks", lambda: sp._inverse_cdf(mass, blocks, 0.5 * float(blocks[-1]))),
    ]
    return [(name, _median_time(fn, repeat)[0]) for name, fn in ops]


def report(args: argparse.Namespace) -> str:
    rows = make_rows(args.vocab, args.k + 1, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompt = [int(t) for t in rng.integers(0, args.vocab, args.prompt_tokens)]
    generated = [int(t) for t in rng.integers(0, args.vocab, args.generated)]
    decode_s = args.decode_ms / 1000
    lines = [
        "Sampling overhead on the host: StepContext.pick per row, core.step per step (scripts/sampling_overhead.py)",
        "",
        f"vocab {args.vocab}, K + 1 = {args.k + 1} rows (all picked in the full step), context {args.prompt_tokens} "
        f"prompt + {args.generated} generated ids, synthetic rows (seed {args.seed}), medians of {args.repeat} rounds",
        f"decode step compared with: {args.decode_ms:g} ms; target for the all-filters setting: < {TARGET_PCT:g}% "
        "of a decode step",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f", Python {platform.python_version()}, numpy {np.__version__}",
        "",
        f"{'setting':72s} {'pick µs/row':>12s} {'plain step µs':>14s} {'full step µs':>13s} "
        f"{'full ÷ decode':>14s} {'÷ greedy':>9s} {'full step wall µs':>18s}",
    ]
    greedy_full = None
    verdicts = []
    for name, sampling in SETTINGS.items():
        options = Options(max_tokens=1 << 20, seed=args.seed if sampling else None, **sampling)
        t = time_setting(options, rows, prompt, generated, args.repeat)
        greedy_full = greedy_full or t["full_step_s"]
        pct = 100 * t["full_step_s"] / decode_s
        lines.append(
            f"{name:72s} {t['pick_s_per_row'] * 1e6:12.0f} {t['plain_step_s'] * 1e6:14.0f} "
            f"{t['full_step_s'] * 1e6:13.0f} {pct:13.2f}% {t['full_step_s'] / greedy_full:8.1f}x "
            f"{t['wall_s'] * 1e6:18.0f}"
        )
        if name.startswith("sampled: all filters"):
            plain_pct = 100 * t["plain_step_s"] / decode_s
            verdicts.append(
                f"all filters: a full step (K + 1 = {args.k + 1} rows) costs {pct:.2f}% of a {args.decode_ms:g} ms "
                f"decode step, a plain step {plain_pct:.2f}%: target < {TARGET_PCT:g}% "
                + ("met" if pct < TARGET_PCT else "missed")
                + (" (plain step met)" if plain_pct < TARGET_PCT <= pct else "")
            )
    lines += ["", *verdicts, "", "Where a sampled pick's time goes (the sampler's stages on row 0, CPU µs):"]
    lines += [f"  {name:60s} {t * 1e6:8.0f}" for name, t in primitives(rows[0], args.repeat)]
    lines += [
        "",
        "CPU time unless marked wall. pick µs/row: StepContext.pick on one row (mean over the K + 1 rows); plain "
        "step: core.step with no draft (one row); full step: core.step over K + 1 rows with the whole draft "
        "accepted; ÷ decode: full step ÷ the decode step; ÷ greedy: full step ÷ greedy's full step; full step "
        "wall: the same in wall time (inflated by other processes on a loaded machine).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--decode-ms", type=float, default=27.0, help="decode step to compare with (default 27 ms)")
    ap.add_argument("--vocab", type=int, default=49152, help="row length (default 49152, SmolLM2's vocabulary)")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per verify step (default 8: 9 rows)")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--generated", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=15, help="rounds per measurement (default 15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    text = report(args)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
