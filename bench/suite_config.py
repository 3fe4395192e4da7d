"""The settings of one ``bench.suite`` run (``SuiteConfig``, read from the command line), the prompts as every
engine gets them (``Prompt``) and the run's progress lines (``Log``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.engines import ALL_ENGINES, DEFAULT_GENAI_DRAFT_TOKENS, REFERENCE, identity_reference, prompt_seed
from bench.workloads import Workload


@attrs.frozen(kw_only=True)
class SuiteConfig:
    """One suite run's settings, fixed before anything is measured (``from_args`` reads the command line)."""

    model_dir: Path
    out_dir: Path
    workdir: Path  # scratch space (a temporary folder with --quick)
    label: str  # names the output files
    precision: str  # as recorded: "tiny-fp32" for --quick's own model
    command: str
    engines: tuple[str, ...]  # the reference first when it was not asked for
    categories: tuple[str, ...]
    split: str | None  # the prompts' half (bench.workloads.SPLITS), or None for every prompt
    ngram: tuple[int, int]  # the n-gram peers' (ngram_size, max_draft_tokens)
    threads: int
    n_per_category: int
    max_new_tokens: int
    max_prompt_tokens: int
    repeat: int
    cost_repeat: int
    cost_attempts: int
    overhead_prompts: int
    contention_threshold: float
    retry_disturbed: int
    wait_quiet_s: float
    max_length: int | None
    quick: bool
    progress: bool
    draft_model: Path | None = None  # a draft model folder: the DRAFT_MODEL_ENGINES settings run on an Engine with it
    genai_draft_tokens: int = DEFAULT_GENAI_DRAFT_TOKENS  # ortgenai-draft-model's max_draft_tokens

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, argv: Sequence[str] | None, *, model_dir: Path, workdir: Path, out_dir: Path
    ) -> SuiteConfig:
        wanted = [e for e in args.engines.split(",") if e]
        unknown = [e for e in wanted if e not in ALL_ENGINES]
        if unknown:
            raise SystemExit(f"bench.suite: unknown engine(s) {unknown}; known: {', '.join(ALL_ENGINES)}")
        if REFERENCE not in wanted:
            wanted.insert(0, REFERENCE)  # identity needs the reference
        for name in list(wanted):  # and a sampled setting needs its family's plain sampled run
            ref = identity_reference(name)
            if ref not in wanted:
                wanted.insert(wanted.index(name), ref)
        return cls(
            model_dir=model_dir,
            out_dir=out_dir,
            workdir=workdir,
            label=args.label or ("quick" if args.quick else args.precision),
            precision="tiny-fp32" if args.quick and not args.model_dir else args.precision,
            command="python -m bench.suite" + ("" if not argv else " " + " ".join(argv)),
            engines=tuple(wanted),
            categories=tuple(c for c in args.categories.split(",") if c),
            split=None if args.split == "all" else args.split,
            ngram=args.ngram,
            threads=args.threads,
            n_per_category=args.n_per_category,
            max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            repeat=args.repeat,
            cost_repeat=args.cost_repeat,
            cost_attempts=args.cost_attempts,
            overhead_prompts=args.overhead_prompts,
            contention_threshold=args.contention_threshold,
            retry_disturbed=args.retry_disturbed,
            wait_quiet_s=args.wait_quiet,
            max_length=args.max_length,
            quick=bool(args.quick),
            progress=not args.no_progress,
            draft_model=Path(args.draft_model) if args.draft_model else None,
            genai_draft_tokens=args.genai_draft_tokens,
        )

    def disturbed(self, others_cores: float | None) -> bool:
        """Whether other processes used more than ``contention_threshold`` cores on average."""
        return others_cores is not None and others_cores > self.contention_threshold

    def record(self, ortspec_max_length: int) -> dict[str, Any]:
        """The ``config`` section of the results."""
        return {
            "model_dir": str(self.model_dir),
            "precision": self.precision,
            "threads": self.threads,
            "categories": list(self.categories),
            "split": self.split or "all",
            "ngram": {"ngram_size": self.ngram[0], "max_draft_tokens": self.ngram[1]},
            "genai_draft_tokens": self.genai_draft_tokens,
            "n_per_category": self.n_per_category,
            "max_new_tokens": self.max_new_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "repeat": self.repeat,
            "cost_repeat": self.cost_repeat,
            "contention_threshold": self.contention_threshold,
            "retry_disturbed": self.retry_disturbed,
            "wait_quiet_s": self.wait_quiet_s,
            "engines": list(self.engines),
            "quick": self.quick,
            "ortspec_max_length": ortspec_max_length,
        }


@attrs.frozen
class Prompt:
    """A workload and its token ids, as every engine gets them."""

    workload: Workload
    ids: tuple[int, ...]

    @property
    def seed(self) -> int:
        """The seed every sampled engine gets on this prompt (``bench.engines.prompt_seed``)."""
        return prompt_seed(self.workload.name)


class Log:
    """Progress lines on stderr, stamped with the seconds since the suite started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[suite {time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def seconds(self) -> float:
        return round(time.perf_counter() - self.t0, 1)
