"""``ortspec bench``: greedy vs speculative decoding on the same prompts, back to back (one speculative run per tie
margin): median speed, acceptance, tokens per pass, identity to greedy, and the verify cost curve."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from ortspec.core import MAX_DRAFT, PromptLookup
from ortspec.core.width import acceptance_rate
from ortspec.driver import GenerateResult

from .demo import DEMO_PROMPT
from .engine_args import engine, generation_kwargs, speculative
from .options import add_command, generation_options, model_options, positive_int

EXAMPLES = """\
examples:
  ortspec bench
  ortspec bench --prompt "Repeat: a b c d" --repeat 5 --tie-margin 0
  ortspec bench --file p1.txt --file p2.txt --tie-margin 0,0.05,0.2 --no-verify-cost

Each prompt runs greedily and then speculatively with each tie margin, back to back; medians are reported, with
whether every speculative output was identical to the greedy one."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "bench",
        "greedy vs speculative on the same prompts: tok/s, acceptance, identity",
        "Greedy vs speculative decoding on the same prompts: speed, acceptance, identity, verify cost.",
        EXAMPLES,
    )
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; default: the demo prompt)")
    p.add_argument("--file", action="append", metavar="PATH", help="a UTF-8 prompt file (repeatable)")
    p.add_argument(
        "--repeat", type=positive_int, default=3, metavar="N", help="runs per prompt (default 3); medians are reported"
    )
    p.add_argument(
        "--verify-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time verify(K) ÷ decode for K = 1, 4, 8 (default on)",
    )
    p.add_argument(
        "--cost-repeat", type=positive_int, default=20, metavar="N",
        help="samples per verify-cost point (default 20)",
    )  # fmt: skip
    model_options(p, drafter=True)
    generation_options(p, margins_list=True)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    eng = engine(args)
    if args.file:
        prompts = [Path(f).read_text(encoding="utf-8") for f in args.file]
    elif args.prompt:
        prompts = list(args.prompt)
    else:
        prompts = [DEMO_PROMPT]
    margins = args.tie_margin
    kwargs = generation_kwargs(args)
    kwargs.pop("tie_margin")
    eng.generate(prompts[0], **dict(kwargs, max_tokens=4, speculative=None))  # warm-up
    proposer = speculative(args) or PromptLookup(max_draft=MAX_DRAFT)
    greedy: list[GenerateResult] = []
    spec: dict[float, list[GenerateResult]] = {m: [] for m in margins}
    runs = [(p, r) for p in prompts for r in range(args.repeat)]
    # Each prompt runs greedy then every speculative setting back to back, so machine noise hits all alike.
    for prompt, _ in tqdm(runs, desc="greedy vs speculative", unit="prompt", file=sys.stderr):
        greedy.append(eng.generate(prompt, speculative=None, **kwargs))
        for m in margins:
            spec[m].append(eng.generate(prompt, speculative=proposer, tie_margin=m, **kwargs))
    g_tps = statistics.median(r.tokens_per_second for r in greedy)
    print(
        f"prompts: {len(prompts)} x {args.repeat} runs, max_tokens {args.max_tokens}, "
        f"threads {getattr(eng.backend, 'threads', '?')}, proposer {proposer}"
    )
    print(
        f"greedy                  {g_tps:8.1f} tok/s (median, end to end); verify-vs-decode drift "
        f"{eng.measurements.verify_drift():.3g} logits"
    )
    for m in margins:
        _print_speculative(m, spec[m], greedy, g_tps)
    if args.verify_cost:
        _print_verify_cost(eng, eng.prompt_ids(prompts[0], chat=args.chat), args)
    return 0


def _print_speculative(margin: float, rows: list[GenerateResult], greedy: list[GenerateResult], g_tps: float) -> None:
    """One line for the speculative runs at tie margin ``margin``, against the greedy runs (same order)."""
    s_tps = statistics.median(r.tokens_per_second for r in rows)
    proposed = sum(r.stats.proposed_tokens for r in rows)
    accepted = sum(r.stats.accepted_tokens for r in rows)
    per_pass = sum(len(r.token_ids) for r in rows) / max(1, sum(r.stats.steps for r in rows))
    identical = sum(g.token_ids == r.token_ids for g, r in zip(greedy, rows, strict=True))
    print(
        f"speculative tie={margin:<6g} {s_tps:8.1f} tok/s (median)  speedup {s_tps / g_tps:.2f}x  "
        f"acceptance {accepted}/{proposed} = {acceptance_rate(accepted, proposed):.0%}  tokens/pass {per_pass:.2f}  "
        f"identical to greedy {identical}/{len(rows)}"
    )


def _print_verify_cost(eng, ids: list[int], args: argparse.Namespace) -> None:
    """Median wall time of one verify pass of the pending token + K drafts ÷ one decode step, after ``ids``."""
    from ortspec.adapters.engine.measurements import measure_pass_costs

    backend = eng.backend
    ids = ids[: max(10, backend.max_length - 20)]
    feed = [ids[i % len(ids)] for i in range(9)]
    costs = measure_pass_costs(backend, ids, feed, kmax=8, repeats=args.cost_repeat)
    print(
        f"decode step  {costs['decode_step_s'] * 1000:.2f} ms (median of {args.cost_repeat}, "
        f"{costs['context_tokens']}-token context)"
    )
    for k in (1, 4, 8):
        print(f"verify K={k:<2d} {costs['pass_s'][k] * 1000:.2f} ms = {costs['curve'][k]:.2f}x a decode step")
