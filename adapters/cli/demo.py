"""``ortspec demo``: greedy (or plain sampled) decoding, then speculative decoding, on a built-in input-grounded
code-editing prompt; prints both statistics lines, the speedup and whether the outputs are identical (exit status
1 when they are not). Unless sampling options are given, the comparison is repeated sampled with a fixed seed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ortspec.adapters.engine.suffix_cache import SuffixCache
from ortspec.core import MAX_DRAFT, PromptLookup

from .engine_args import engine, generation_kwargs, speculative, stats_line
from .options import add_command, generation_options, model_options

DEMO_PASSAGE = """\
def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] intervals and return them sorted by start.\"\"\"
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
"""
DEMO_PROMPT = (
    "Here is a Python function:\n\n```python\n" + DEMO_PASSAGE + "```\n\n"
    "Add a comment line `# sort by start` above the `ordered = ...` line and output the complete function."
)
DEMO_SAMPLING = dict(temperature=0.7, top_p=0.9, seed=1234)

EXAMPLES = """\
examples:
  ortspec demo
  ortspec demo --max-tokens 256 --threads 2
  ortspec demo --model ./my-model-folder

Runs the built-in code-editing prompt greedily, then speculatively, and prints both statistics lines, the
speedup and whether the outputs are identical (exit status 1 if they are not)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "demo",
        "speculative vs greedy on a built-in input-grounded prompt (the main job)",
        "Greedy decoding, then speculative decoding (--speculative, default auto), on a built-in code-editing prompt.",
        EXAMPLES,
    )
    model_options(p, drafter=True)
    generation_options(p, 160)
    return p


def run(args: argparse.Namespace) -> int:
    eng = engine(args)
    kwargs = generation_kwargs(args)
    kwargs["chat"] = True
    proposer = speculative(args) or PromptLookup(max_draft=MAX_DRAFT)
    print("Prompt (chat-formatted):\n" + DEMO_PROMPT + "\n", flush=True)
    eng.generate(DEMO_PROMPT, **dict(kwargs, max_tokens=8))  # warm-up
    sampling = bool(kwargs.get("temperature"))
    same = _compare(eng, kwargs, proposer, "sampled" if sampling else "greedy")
    if not sampling:  # the same comparison, sampled with a fixed seed
        sampled = {**kwargs, **DEMO_SAMPLING}
        label = "sampled (" + ", ".join(f"{k} {v}" for k, v in DEMO_SAMPLING.items()) + ")"
        same = _compare(eng, sampled, proposer, label) and same
    return 0 if same else 1


def _compare(eng, kwargs: dict, proposer, label: str) -> bool:
    """Plain, then speculative (streamed) on the demo prompt with ``kwargs``; print both and whether they agree. The
    speculative run starts from an empty suffix cache, so it cannot draft the plain run's answer to the same
    prompt (the cache records every finished generation of the Engine)."""
    plain = eng.generate(DEMO_PROMPT, speculative=None, **kwargs)
    eng.suffix_cache = SuffixCache()
    names = {
        "auto": "auto: the suffix lookup or the shared-KV drafter"
        if eng.drafter is not None
        else "auto: the suffix lookup, no drafter",
        "shared-kv": "the shared-KV drafter",
        "draft-model": "the draft model",
        "suffix": "the suffix lookup",
    }
    how = names.get(proposer, "prompt lookup") if isinstance(proposer, str) else "prompt lookup"
    print(f"--- {label}: speculative ({how}) output, streamed ---", flush=True)
    spec = eng.generate_stream(
        DEMO_PROMPT,
        lambda text, *_: (sys.stdout.write(text), sys.stdout.flush()),
        speculative=proposer,
        **{**kwargs, "seed": plain.seed if plain.seed is not None else kwargs.get("seed")},
    )
    print("\n---")
    print(stats_line(plain, "plain      "))
    print(stats_line(spec, "speculative"))
    same = plain.token_ids == spec.token_ids
    print(
        f"speedup {spec.tokens_per_second / plain.tokens_per_second:.2f}x end to end; "
        f"output identical to plain decoding: {'yes' if same else 'NO'}\n",
        flush=True,
    )
    return same
