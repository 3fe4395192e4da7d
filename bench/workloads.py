"""Deterministic benchmark prompts built from text present on every machine.

The source text is the Python standard library itself (``.py`` files and their
docstrings, located through ``sysconfig.get_paths()["stdlib"]``). Files are
visited in sorted order and every choice is a fixed arithmetic rule, so the same
Python version (same stdlib) always yields the same prompts; the version is
recorded in every workload's ``meta`` and in :func:`describe_workloads`.

Four categories:

``code_edit``
    A 40-120 line function or class from a stdlib file, to be reproduced with a
    small change; the answer mostly copies the prompt.
``summarize``
    Extractive work on a long module docstring: quote sentences, repeat the first
    paragraph, then summarize.
``qa_context``
    Retrieval QA over several docstrings given as numbered documents, single- or
    multi-turn, asking for the relevant document to be quoted.
``open_ended``
    Short creative / explanatory prompts where nothing can be copied.

When a tokenizer (``ortspec.adapters.engine.tokenizer.Tokenizer``, the product's) is
given, each prompt, rendered with its chat template, is kept within
``max_prompt_tokens`` by choosing sources that fit or by cutting source text at
line / sentence boundaries; without one a characters/4 estimate is used.

``python -m bench.workloads [--model-dir DIR] [--n 8]`` prints a JSON summary.

Layout: this module is the public face (``build_workloads``, ``half``, ``workloads_digest``,
``describe_workloads``, the command line; ``Workload``, ``encode_chat`` and ``python_version_tag`` are imported
here from where they live); ``bench.workloads_builders`` holds ``Workload`` and the builder of each category,
``bench.workloads_text`` the scan of the standard library, the prompt-token budget and the text cutting they share.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from bench.workloads_builders import _BUILDERS, Workload
from bench.workloads_text import _Budget, encode_chat, python_version_tag, stdlib_dir
from ortspec.adapters.engine.tokenizer import Tokenizer

# The categories of independent prompts (each prompt measured on its own; ``bench.throughput``'s dataset).
CATEGORIES = ("code_edit", "summarize", "qa_context", "open_ended")
# The repetitive stream (``bench.repetitive``): its prompts are measured in order on one Engine, each drafting from
# the outputs of the ones before it (``bench.engines.OrtspecEngine`` keeps a suffix cache per setting).
STREAM_CATEGORIES = ("repetitive",)
SUITE_CATEGORIES = (*CATEGORIES, *STREAM_CATEGORIES)

DEFAULT_MAX_TOKENS = 256

# Every workload's two disjoint halves: constants chosen by measurement are chosen on ``tuning`` and reported on
# ``evaluation`` (``half``).
SPLITS = ("tuning", "evaluation")
T = TypeVar("T")


def build_workloads(
    n_per_category: int = 8,
    max_prompt_tokens: int = 1500,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    *,
    max_new_tokens: int | dict[str, int] = DEFAULT_MAX_TOKENS,
    categories: Iterable[str] = CATEGORIES,
    split: str | None = None,
) -> list[Workload]:
    """Build ``n_per_category`` prompts for each category, in category order: with ``split`` (one of ``SPLITS``),
    that half of ``2 * n_per_category`` prompts per category (``half``), so the tuning and evaluation prompts of a
    category share no source text.

    ``tokenizer`` is an ortspec ``Tokenizer`` (or a model folder, read with
    ``Tokenizer.from_folder``): every prompt, rendered with its chat template, is
    kept within ``max_prompt_tokens``. Without a tokenizer a characters/4 estimate
    is used. ``max_new_tokens`` may be an int or a per-category dict.
    """
    if n_per_category < 1:
        raise ValueError("n_per_category must be >= 1")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = Tokenizer.from_folder(tokenizer)
    budget = _Budget(tokenizer, max_prompt_tokens)
    pyver = python_version_tag()
    result: list[Workload] = []
    for cat in categories:
        if cat not in _BUILDERS:
            raise ValueError(f"unknown category {cat!r}; expected one of {SUITE_CATEGORIES}")
        mnt = max_new_tokens.get(cat, DEFAULT_MAX_TOKENS) if isinstance(max_new_tokens, dict) else max_new_tokens
        built = _BUILDERS[cat](n_per_category * (2 if split else 1), budget, int(mnt), pyver)
        result.extend(half(built, split, lambda w: w.category) if split else built)
    return result


def half(items: Iterable[T], part: str, kind: Callable[[T], str]) -> list[T]:
    """``items``' half ``part`` (one of ``SPLITS``), in order: within each ``kind``, the items at even positions are
    the tuning half and those at odd positions the evaluation half. Raises ``ValueError`` for another ``part``."""
    if part not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {part!r}")
    position: dict[str, int] = {}
    chosen = []
    for item in items:
        at = position[kind(item)] = position.get(kind(item), -1) + 1
        if (at % 2 == 0) == (part == "tuning"):
            chosen.append(item)
    return chosen


def workloads_digest(workloads: Sequence[Workload]) -> str:
    """SHA-256 over the prompts: equal digests mean identical workloads."""
    h = hashlib.sha256()
    for w in workloads:
        h.update(
            json.dumps([w.category, w.name, w.messages, w.max_new_tokens], sort_keys=True, ensure_ascii=False).encode(
                "utf-8"
            )
        )
    return h.hexdigest()


def describe_workloads(workloads: Sequence[Workload], tokenizer: Tokenizer | None = None) -> dict:
    """Summary for a results file: Python version (source of the text), counts, digest, and with a tokenizer
    every prompt's token count."""
    info: dict[str, Any] = {
        "python": python_version_tag(),
        "python_full": sys.version,
        "stdlib": str(stdlib_dir()),
        "digest": workloads_digest(workloads),
        "count": len(workloads),
        "per_category": dict(collections.Counter(w.category for w in workloads)),
    }
    if tokenizer is not None:
        info["prompt_tokens"] = {w.name: len(encode_chat(w.messages, tokenizer)) for w in workloads}
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the benchmark workloads as JSON.")
    ap.add_argument("--model-dir", help="model folder (tokenizer.json + chat template)")
    ap.add_argument("--n", type=int, default=8, help="prompts per category")
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--full", action="store_true", help="include the prompt texts")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_folder(args.model_dir) if args.model_dir else None
    wls = build_workloads(args.n, args.max_prompt_tokens, tok)
    summary = describe_workloads(wls, tok)
    if args.full:
        summary["workloads"] = [w.to_dict() for w in wls]
    else:
        summary["names"] = [w.name for w in wls]
    json.dump(summary, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
