"""The side-by-side benchmark: ortspec (greedy, speculative, sampled) against ONNX Runtime GenAI and onnx_genai.

``python -m bench.suite`` regenerates everything: it runs every engine on the same model folder, the same
prompts (as the same token ids) and the same thread count, interleaved prompt by prompt, and writes

* ``docs/bench/results-<precision>.json``: everything (machine, versions, workloads digest, every run),
* ``docs/bench/results-<precision>.md``: tables per category, ratios, the verify cost curve, memory
  bandwidth and the achieved fraction of it, the driver overhead,
* ``docs/bench/tokens_per_second-<precision>.png``: tokens/s by engine and category.

Engines (``--engines``, comma separated):

``ortspec-greedy``            ``Engine.generate(ids, speculative=None)``
``ortspec-lookup-w8``         ``PromptLookup(ngram=3, max_draft=8)``, ``draft_width=8``
``ortspec-lookup-w4``         the same proposer, ``draft_width=4``
``ortspec-lookup-adaptive``   ``PromptLookup(ngram=3, max_draft=16)``, ``CostAwareWidth(pass_costs=curve)``
                              where ``curve`` is the verify cost curve measured in this run (K = 0..16)
``ortspec-lookup-additive``   ``PromptLookup(ngram=3, max_draft=16)``, ``AdditiveWidth()`` (+2 / -1, 1..16)
``ortspec-suffix``            ``speculative="suffix"``, ``draft_width="auto"``: the suffix lookup (the context and
                              this setting's own suffix cache of its earlier outputs in this run)
``ortspec-shared-kv``         ``speculative="shared-kv"``, ``draft_width="auto"``: the Engine's drafter alone
``ortspec-auto``              ``speculative="auto"``, ``draft_width="auto"``: per draft, the suffix lookup or the
                              drafter (what ``ortspec demo`` / ``generate`` use by default)
``ortspec-sampled``           ``ortspec-greedy`` sampling: temperature 0.7, top_p 0.9, the prompt's seed
``ortspec-lookup-adaptive-sampled``  ``ortspec-lookup-adaptive`` sampling the same way, at the same seed
``ortspec-auto-sampled``      ``ortspec-auto`` sampling the same way, at the same seed
``ortgenai``                  ONNX Runtime GenAI greedy
``ortgenai-ngram``            ONNX Runtime GenAI n-gram speculation (``--ngram SIZE,DRAFT``, default 3,8)
``ortgenai-draft-model``      ONNX Runtime GenAI draft-model speculation: the ``--draft-model`` folder drafts
                              (``model.draft`` in an overlay of the model folder; ``--genai-draft-tokens K``,
                              default 4; ``bench.genai_draft_model``); missing without ``--draft-model``
``onnx_genai``                onnx_genai greedy, a fresh engine per run (no prefix-cache hits)
``ortgenai-sampled``          ONNX Runtime GenAI sampling (do_sample, temperature 0.7, top_p 0.9, top_k = the
                              vocabulary, i.e. no cut; random_seed = the prompt's seed)
``ortgenai-ngram-sampled``    the same with its n-gram speculation (the same ``--ngram``)
``llamacpp``                  llama.cpp greedy on the model's own Q4_1 GGUF (``bench.llamacpp``; optional: needs
                              ``llama-cpp-python``)

A peer that cannot be imported or loaded is listed under ``missing`` with the reason; nothing is faked.

Prompts (``--split``): each category's evaluation half by default (``bench.workloads.half``), so constants
chosen on the tuning half are reported on prompts they were not chosen on; ``--n-per-category`` counts the
prompts in the half.

Categories (``--categories``): the four of independent prompts (``bench.workloads.CATEGORIES``), and
``repetitive``, the repetitive stream (``bench.repetitive``): requests of three task shapes whose answers share
text that is not in the prompts, measured in order. Every ortspec setting keeps its own suffix cache across the
whole run (``OrtspecEngine.suffix_cache``: it learns from that setting's outputs only; warm-ups record nothing; a
prompt measured again starts from the cache its first run saw), so request ``i`` of the stream may draft from the
outputs of the requests before it, never from its own.

Layout: this module is the run (``SuiteConfig``, the order of the measurements, ``main``); ``bench.engines``
holds the engines under test, ``bench.report`` the summaries and the result files, ``bench.limits`` the
physical limits of a decode step.

Every engine gets the prompt as the token ids of ``bench.workloads.encode_chat`` (the chat rendered and encoded
by ortspec's ``Tokenizer``; ORT GenAI takes the ids; onnx_genai takes text only, so it gets the decoded ids, and
the suite checks that its own tokenizer turns that text back into exactly the same ids). Identity is token for
token against ``ortspec-greedy`` on the same prompt, after removing a final EOS token from both sides (the peers
drop it, ortspec keeps it); new-token counts exclude that EOS for every engine.

Sampled column: every sampled engine gets the prompt's seed (``bench.engines.prompt_seed``, from the workload's
name; all seeds are recorded under ``sampling`` in the results). Identity of a sampled setting is checked against
the plain sampled run of its own family on the same prompt and seed: ``ortspec-lookup-adaptive-sampled`` against
``ortspec-sampled`` (ortspec's exactness claim), ``ortgenai-ngram-sampled`` against ``ortgenai-sampled`` (reported
as a fact about ORT GenAI). ORT GenAI's RNG is not ortspec's, so its sampled tokens differ from ortspec's at the
same seed: that is expected and never checked. The report's sampled section prices sampled speculation against
plain sampling and against ORT GenAI's sampled n-gram speculation, with the issue's targets.

Timing, for every engine: the clock starts with the prompt ids in hand; ``ttft`` is the time to the first new
token (prefill included); ``tok/s e2e`` = new tokens / total time; ``decode tok/s`` = (new - 1) / (total -
ttft) (``ortspec.driver.decode_rate``). Per engine and category the tables show medians over prompts (each
prompt's value being the median over ``--repeat`` runs). Ratios are medians of per-prompt ratios (the engines
ran back to back on each prompt, so the pairs share the machine's state). ``CpuContention`` is recorded around
every run; a run during which other processes used more than ``--contention-threshold`` cores on average is
flagged ``disturbed``.

``--quick`` checks that the suite works (not speed): a tiny random-weight model made on the fly, with a random
shared-KV drafter beside it (so the drafter settings run; their drafts are mostly wrong), 2 prompts per category,
16 new tokens, results in ``--out`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from bench.engines import (
    ALL_ENGINES,
    ALL_FILTERS,
    DEFAULT_GENAI_DRAFT_TOKENS,
    DEFAULT_NGRAM,
    DRAFT_MODEL_ENGINES,
    DRAFTER_ENGINES,
    KMAX,
    ORTSPEC_ENGINES,
    PEER_ENGINES,
    REFERENCE,
    SAMPLED_ENGINES,
    SAMPLED_ORTSPEC_ENGINES,
    SAMPLED_PEER_ENGINES,
    SAMPLING,
    SEED_RULE,
    BenchEngine,
    EngineRun,
    OrtspecEngine,
    PeerEngine,
    TimingBackend,
    identity_reference,
    is_reference,
    load_peer,
    ortspec_engine,
    prompt_seed,
    sampled_variant,
)
from bench.limits import physical_limits
from bench.machine import CpuContention, background_load, git_commit, machine_info, measure_memory_bandwidth
from bench.report import (
    DRAFTER_TARGETS,
    RunRecord,
    first_mismatch,
    identity_counts,
    mismatches,
    round_float,
    sampled_targets,
    summarize,
    write_results,
)
from bench.workloads import SPLITS, SUITE_CATEGORIES, Workload, build_workloads, describe_workloads, encode_chat
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.measurements import measure_pass_costs, probe_ids
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.base import Backend
from ortspec.backends.onnx import BackendConfig

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"
OVERHEAD_ENGINES = ("ortspec-greedy", "ortspec-lookup-w8")
# The same two settings sampling with every filter on (bench.engines.ALL_FILTERS), timed beside them.
SAMPLED_OVERHEAD_ENGINES = {
    "ortspec-sampled-all-filters": "ortspec-greedy",
    "ortspec-lookup-w8-sampled-all-filters": "ortspec-lookup-w8",
}
OVERHEAD_TARGET_PCT = 2.0  # the target for the sampled settings: < 2% of a decode step

# --quick: what it changes unless the option is given explicitly
QUICK_DEFAULTS = {
    "max_new_tokens": 16,
    "cost_repeat": 3,
    "overhead_prompts": 1,
    "max_prompt_tokens": 400,
    "wait_quiet": 0.0,
    "retry_disturbed": 0,
}


# --------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Machine state
# --------------------------------------------------------------------------------------------------------------


def wait_quiet(cfg: SuiteConfig) -> dict[str, Any]:
    """Sample the other processes' CPU use (0.5 s windows) until it is below the contention threshold or
    ``wait_quiet_s`` has passed; returns the waited seconds and the last reading."""
    if cfg.wait_quiet_s <= 0:
        return {"waited_s": 0.0, "load": None}
    t0 = time.perf_counter()
    load = background_load(0.5)
    while load is not None and load > cfg.contention_threshold and time.perf_counter() - t0 < cfg.wait_quiet_s:
        load = background_load(0.5)
    return {"waited_s": round(time.perf_counter() - t0, 2), "load": load}


def measure_bandwidth(cfg: SuiteConfig) -> dict[str, Any]:
    """Copy bandwidth with 1 and ``threads`` threads, after waiting for a quiet machine; ``best_gb_s`` is the
    best figure."""
    quiet = wait_quiet(cfg)
    b = measure_memory_bandwidth(
        size_mib=64 if cfg.quick else 256,
        repeats=3 if cfg.quick else 9,
        threads=sorted({1, max(1, cfg.threads)}),
    )
    b["best_gb_s"] = max([b["copy_gb_s"], *[float(v) for v in (b.get("per_threads") or {}).values()]])
    b["quiet_wait"] = quiet
    return b


# --------------------------------------------------------------------------------------------------------------
# The verify cost curve
# --------------------------------------------------------------------------------------------------------------


def cost_curve_ids(cfg: SuiteConfig, backend: Backend, prompts: Sequence[Prompt]) -> tuple[list[int], list[int]]:
    """Context and feed ids (``ortspec.adapters.engine.measurements.probe_ids``) for the verify cost curve. The
    context is as long as
    a typical decode step's in the runs (the median prompt plus half the new tokens), within the KV capacity."""
    lens = sorted(len(p.ids) for p in prompts)
    context = min(lens[len(lens) // 2] + cfg.max_new_tokens // 2, backend.max_length - KMAX - 2)
    ids = probe_ids(backend.vocab_size, context + KMAX + 1)
    return ids[:context], ids[context:]


def measure_cost_curve(
    cfg: SuiteConfig, backend: Backend, probe: tuple[list[int], list[int]], when: str, log: Log
) -> dict[str, Any]:
    """``measure_pass_costs`` for K = 0..KMAX, re-measured (up to ``cost_attempts`` times) while other processes
    disturb it; the least disturbed try, with the others under ``discarded_tries``."""
    tries = []
    for attempt in range(max(1, cfg.cost_attempts)):
        quiet = wait_quiet(cfg)
        with CpuContention() as cc:
            c = measure_pass_costs(backend, probe[0], probe[1], KMAX, cfg.cost_repeat)
        c.update(quiet_wait=quiet, contention=cc.as_dict(), when=when, attempt=attempt + 1)
        c["disturbed"] = cfg.disturbed(cc.others_cores)
        tries.append(c)
        log(
            f"cost curve ({when}, try {attempt + 1}): decode {c['decode_step_s'] * 1000:.1f} ms, others "
            f"{cc.others_cores} cores; " + " ".join(f"{x:.2f}" for x in c["curve"])
        )
        if not c["disturbed"]:
            break
    best = min(tries, key=lambda c: c["contention"]["others_cores"] or 0.0)
    best["discarded_tries"] = [
        {"decode_step_s": t["decode_step_s"], "contention": t["contention"], "curve": t["curve"]}
        for t in tries
        if t is not best
    ]
    return best


def quieter(cfg: SuiteConfig, *curves: dict[str, Any]) -> dict[str, Any]:
    """The undisturbed curve with the fastest decode step (any curve when all were disturbed)."""
    return min(curves, key=lambda c: (cfg.disturbed(c["contention"]["others_cores"] or 0.0), c["decode_step_s"]))


# --------------------------------------------------------------------------------------------------------------
# Engines and prompts
# --------------------------------------------------------------------------------------------------------------


def load_engines(
    cfg: SuiteConfig, engine: Engine, pass_costs: Sequence[float], log: Log, with_draft_model: Engine | None = None
) -> tuple[dict[str, BenchEngine], dict[str, str]]:
    """The requested engines in the requested order, and the missing peers with the reason. The settings of
    ``DRAFT_MODEL_ENGINES`` run on ``with_draft_model`` (an Engine with the suite's draft model), the others on
    ``engine``."""
    missing: dict[str, str] = {}
    loaded: dict[str, BenchEngine] = {}
    for n in [e for e in cfg.engines if e in (*ORTSPEC_ENGINES, *SAMPLED_ORTSPEC_ENGINES)]:
        if n in DRAFTER_ENGINES and engine.drafter is None:
            missing[n] = "no shared-KV drafter for this model (run `ortspec train-drafter`)"
            log(f"{n} missing: {missing[n]}")
            continue
        if n in DRAFT_MODEL_ENGINES and with_draft_model is None:
            missing[n] = "no draft model (run the suite with --draft-model DIR)"
            log(f"{n} missing: {missing[n]}")
            continue
        on = with_draft_model if n in DRAFT_MODEL_ENGINES and with_draft_model is not None else engine
        loaded[n] = ortspec_engine(n, on, pass_costs)
    for name in [e for e in cfg.engines if e in (*PEER_ENGINES, *SAMPLED_PEER_ENGINES)]:
        log(f"loading peer {name}")
        cache = cfg.workdir / "onnx_genai-cache" if cfg.quick else None
        peer, why = load_peer(
            name,
            cfg.model_dir,
            cfg.threads,
            cache_root=cache,
            ngram=cfg.ngram,
            draft_model=cfg.draft_model,
            draft_tokens=cfg.genai_draft_tokens,
        )
        if peer is None:
            missing[name] = why
            log(f"peer {name} missing: {why}")
        else:
            loaded[name] = peer
    return {n: loaded[n] for n in cfg.engines if n in loaded}, missing


def check_prompts(engines: dict[str, BenchEngine], prompts: Sequence[Prompt]) -> dict[str, Any]:
    """How each peer receives the prompts: ORT GenAI takes the ids; onnx_genai takes text, so its tokenizer must
    turn that text back into exactly the same ids."""
    checks: dict[str, Any] = {}
    if any(name.startswith("ortgenai") for name in engines):
        checks["ortgenai"] = {
            "summary": "given the same token ids (GeneratorParams + append_tokens)",
            "same_ids": len(prompts),
        }
    onnx_genai = engines.get("onnx_genai")
    if isinstance(onnx_genai, PeerEngine):
        checks["onnx_genai"] = _retokenized(onnx_genai, prompts)
    return checks


def _retokenized(peer: PeerEngine, prompts: Sequence[Prompt]) -> dict[str, Any]:
    """How many prompts onnx_genai's tokenizer turns back into the same ids, and where the others differ."""
    same, diffs = 0, []
    for p in prompts:
        try:
            got = peer.runner.retokenize(p.ids)
        except Exception as exc:  # noqa: BLE001
            diffs.append({"workload": p.workload.name, "error": str(exc)})
            continue
        if got == list(p.ids):
            same += 1
        else:
            diffs.append(
                {
                    "workload": p.workload.name,
                    "first_mismatch": first_mismatch(p.ids, got),
                    "len": len(got),
                    "expected_len": len(p.ids),
                }
            )
    return {
        "summary": f"takes text: gets the ids decoded; its tokenizer re-encodes {same}/{len(prompts)} prompts "
        "to exactly the same ids",
        "same_ids": same,
        "differences": diffs,
    }


# --------------------------------------------------------------------------------------------------------------
# The interleaved runs
# --------------------------------------------------------------------------------------------------------------


def group_order(names: Sequence[str], index: int, repeat: int) -> list[str]:
    """The engines' order on prompt ``index``: the reference first on even prompts and last on odd ones (so
    identity can be checked as runs arrive), the others rotated by prompt and repeat."""
    others = [e for e in names if e != REFERENCE]
    shift = (index + repeat) % len(names)
    rot = others[shift % len(others) :] + others[: shift % len(others)] if others else []
    return [REFERENCE, *rot] if index % 2 == 0 else [*rot, REFERENCE]


def run_one(cfg: SuiteConfig, engine: BenchEngine, prompt: Prompt, repeat: int) -> RunRecord:
    """One run of ``engine`` on ``prompt``, with the machine's contention around it; a failure is recorded."""
    out: EngineRun | None = None
    error = None
    with CpuContention() as c:
        try:
            out = engine.run(prompt.ids, cfg.max_new_tokens, seed=prompt.seed if engine.sampled else None)
        except Exception as exc:  # noqa: BLE001 - a failing engine is recorded, never faked
            error = f"{type(exc).__name__}: {exc}"
    w = prompt.workload
    where = {
        "engine": engine.name,
        "workload": w.name,
        "category": w.category,
        "repeat": repeat,
        "prompt_tokens": len(prompt.ids),
        "contention": c.as_dict(),
        "disturbed": cfg.disturbed(c.others_cores),
    }
    if out is None:
        return RunRecord(**where, token_ids=[], finish_reason="", ttft_s=0.0, total_s=0.0, error=error)
    return RunRecord(
        **where,
        token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        ttft_s=out.ttft_s,
        total_s=out.total_s,
        proposed=out.proposed,
        accepted=out.accepted,
        passes=out.passes,
        decode_passes=out.decode_passes,
        extra=dict(out.extra),
    )


def run_group(
    cfg: SuiteConfig, engines: Sequence[BenchEngine], prompt: Prompt, repeat: int, bar: tqdm, log: Log
) -> list[RunRecord]:
    """Every engine once on ``prompt``, in the given order, after waiting for a quiet machine; the whole group
    again (up to ``retry_disturbed`` times) while any run was disturbed. ``extra["attempts"]`` counts the tries."""
    attempt = 0
    while True:
        quiet = wait_quiet(cfg)
        group = []
        for engine in engines:
            rec = run_one(cfg, engine, prompt, repeat)
            group.append(rec)
            if attempt == 0:
                bar.update(1)
            bar.set_postfix_str(f"{engine.name} {prompt.workload.name[:28]} {rec.e2e_tok_s or 0:.1f} tok/s")
        if not any(r.disturbed for r in group) or attempt >= cfg.retry_disturbed:
            break
        attempt += 1
        log(f"{prompt.workload.name}: disturbed run(s), re-running the group (attempt {attempt + 1})")
        time.sleep(2.0)
    by_engine = {r.engine: r for r in group}
    for rec in group:
        rec.extra["attempts"] = attempt + 1
        rec.extra["quiet_wait"] = quiet
        reference = by_engine.get(identity_reference(rec.engine))
        if reference is not None:
            rec.compare_with(reference)
    return group


def run_prompts(
    cfg: SuiteConfig, engines: dict[str, BenchEngine], prompts: Sequence[Prompt], log: Log
) -> list[RunRecord]:
    """``repeat`` rounds over the prompts, every engine on each prompt back to back (see ``group_order``)."""
    records: list[RunRecord] = []
    total = cfg.repeat * len(prompts) * len(engines)
    desc = f"bench.suite {cfg.label}"
    with tqdm(total=total, desc=desc, unit="run", file=sys.stderr, disable=not cfg.progress, dynamic_ncols=True) as bar:
        for repeat in range(cfg.repeat):
            for index, prompt in enumerate(prompts):
                order = [engines[n] for n in group_order(list(engines), index, repeat)]
                records.extend(run_group(cfg, order, prompt, repeat, bar, log))
    return records


# --------------------------------------------------------------------------------------------------------------
# Driver overhead
# --------------------------------------------------------------------------------------------------------------


def _overhead_row(setting: OrtspecEngine, proxy: TimingBackend, prompt: Prompt, max_new: int) -> dict[str, Any] | None:
    """One generation of ``setting`` through ``proxy``: its wall time and the time inside backend calls."""
    run = setting.start(prompt.ids, max_new, prompt.seed if setting.sampled else None, setting.cache_for(prompt.ids))
    b0, t0 = proxy.seconds, time.perf_counter()
    for _ in run:
        pass
    t1, b1 = time.perf_counter(), proxy.seconds
    steps = run.result().stats.steps
    if steps == 0:
        return None
    wall, backend_s = t1 - t0, b1 - b0
    return {
        "engine": setting.name,
        "workload": prompt.workload.name,
        "steps": steps,
        "wall_s": wall,
        "backend_s": backend_s,
        "overhead_s_per_step": (wall - backend_s) / steps,
        "backend_s_per_step": backend_s / steps,
    }


def _overhead_summary(rows: Sequence[dict[str, Any]], decode_step_s: float, sampled: bool) -> dict[str, Any]:
    ov = statistics.median(r["overhead_s_per_step"] for r in rows)
    bk = statistics.median(r["backend_s_per_step"] for r in rows)
    target = {"target_pct_of_decode_step": OVERHEAD_TARGET_PCT} if sampled else {}
    return {
        "steps": sum(r["steps"] for r in rows),
        "overhead_us_per_step": ov * 1e6,
        "backend_ms_per_step": bk * 1e3,
        "pct_of_decode_step": 100 * ov / decode_step_s,
        "pct_of_backend_step": 100 * ov / bk if bk > 0 else None,
        "total_overhead_pct_of_wall": 100
        * sum(r["wall_s"] - r["backend_s"] for r in rows)
        / sum(r["wall_s"] for r in rows),
        **target,
    }


def measure_overhead(
    cfg: SuiteConfig, engine: Engine, prompts: Sequence[Prompt], decode_step_s: float, log: Log
) -> dict[str, Any]:
    """Per-step time outside the backend (driver + core + proposer + detokenizer) for ``OVERHEAD_ENGINES`` and
    the same settings sampling with every filter on (``SAMPLED_OVERHEAD_ENGINES``, at each prompt's seed), in
    separate runs on ``overhead_prompts`` prompts per category through a ``TimingBackend``."""
    if cfg.overhead_prompts <= 0:
        return {}
    chosen = [
        p for cat in cfg.categories for p in [q for q in prompts if q.workload.category == cat][: cfg.overhead_prompts]
    ]
    proxy = TimingBackend(engine.backend)
    timed = Engine(proxy, engine.tokenizer, eos_token_ids=engine.eos_token_ids, folder=engine.folder)
    settings = [ortspec_engine(name, timed) for name in OVERHEAD_ENGINES]
    settings += [
        sampled_variant(ortspec_engine(greedy, timed), name, ALL_FILTERS)
        for name, greedy in SAMPLED_OVERHEAD_ENGINES.items()
    ]
    log(f"overhead runs: {len(chosen)} prompts x {len(settings)} engines")
    rows = [row for p in chosen for s in settings if (row := _overhead_row(s, proxy, p, cfg.max_new_tokens))]
    per = {s.name: [r for r in rows if r["engine"] == s.name] for s in settings}
    sampled = {s.name for s in settings if s.sampled}
    return {
        "prompts": len(chosen),
        "decode_step_s": decode_step_s,
        "sampling": dict(ALL_FILTERS),
        "engines": {name: _overhead_summary(rs, decode_step_s, name in sampled) for name, rs in per.items() if rs},
        "runs": [{k: round_float(v, 7) for k, v in row.items()} for row in rows],
    }


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def load_prompts(cfg: SuiteConfig, tokenizer: Tokenizer, log: Log) -> tuple[list[Workload], list[Prompt]]:
    workloads = build_workloads(
        cfg.n_per_category,
        cfg.max_prompt_tokens,
        tokenizer,
        max_new_tokens=cfg.max_new_tokens,
        categories=cfg.categories,
        split=cfg.split,
    )
    prompts = [Prompt(w, tuple(encode_chat(w.messages, tokenizer))) for w in workloads]
    lens = [len(p.ids) for p in prompts]
    log(f"{len(prompts)} prompts, {min(lens)}-{max(lens)} tokens")
    return workloads, prompts


def run(cfg: SuiteConfig) -> dict[str, Any]:
    """Measure everything ``cfg`` asks for, in order (machine, cost curve, interleaved runs, cost curve again,
    driver overhead, bandwidth again), and write the result files; returns the results."""
    log = Log()
    tokenizer = Tokenizer.from_folder(cfg.model_dir)
    workloads, prompts = load_prompts(cfg, tokenizer, log)
    machine = machine_info()
    bandwidth = [measure_bandwidth(cfg)]
    log(f"bandwidth {bandwidth[0]['best_gb_s']} GB/s")
    config = BackendConfig(threads=cfg.threads, max_length=cfg.max_length)
    engine = Engine.from_dir(cfg.model_dir, config)
    with_draft_model = None
    if cfg.draft_model is not None and any(n in DRAFT_MODEL_ENGINES for n in cfg.engines):
        with_draft_model = Engine.from_dir(cfg.model_dir, config, draft_model=cfg.draft_model)
    probe = cost_curve_ids(cfg, engine.backend, prompts)
    log(f"verify cost curve at {len(probe[0])} tokens, K = 0..{KMAX}, {cfg.cost_repeat} samples each")
    cost = measure_cost_curve(cfg, engine.backend, probe, "start", log)
    engines, missing = load_engines(cfg, engine, cost["curve"], log, with_draft_model)
    drafter = drafter_record(cfg, engine, probe, log) if any(n in DRAFTER_ENGINES for n in engines) else {}
    prompt_checks = check_prompts(engines, prompts)
    for name, e in engines.items():
        log(f"warm-up {name}")
        e.warmup(prompts[0].ids)
    records = run_prompts(cfg, engines, prompts, log)
    cost_end = measure_cost_curve(cfg, engine.backend, probe, "end", log)
    step_curve = quieter(cfg, cost, cost_end)
    overhead = measure_overhead(cfg, engine, prompts, step_curve["decode_step_s"], log)
    bandwidth.append(measure_bandwidth(cfg))
    log(f"bandwidth at the end {bandwidth[-1]['best_gb_s']} GB/s; using {max(b['best_gb_s'] for b in bandwidth)} GB/s")
    order = list(engines)
    summary = summarize(records, order, cfg.categories)
    greedy_overhead = (overhead.get("engines") or {}).get(REFERENCE) or {}
    result: dict[str, Any] = {
        "label": cfg.label,
        "command": cfg.command,
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "config": cfg.record(engine.backend.max_length),
        "machine": machine,
        "workloads": describe_workloads(workloads, tokenizer),
        "engines_run": order,
        "engine_descriptions": {n: e.describe() for n, e in engines.items()},
        "missing": missing,
        "prompt_checks": prompt_checks,
        "cost_curve": cost,
        "cost_curve_end": cost_end,
        "physical": physical_limits(
            cfg.model_dir,
            bandwidth,
            cost,
            step_curve,
            summary["table"].get("all", {}).get(REFERENCE, {}).get("decode_tok_s"),
            greedy_overhead.get("backend_ms_per_step"),
        ),
        "overhead": overhead,
        "sampling": sampling_record(order, prompts, summary),
        "drafter": drafter and {**drafter, "targets": sampled_targets(summary["ratios"], DRAFTER_TARGETS)},
        "summary": {"table": summary["table"], "ratios": summary["ratios"]},
        "per_prompt": summary["per_prompt"],
        "identity": identity_counts(records, order),
        "mismatches": mismatches(records, tokenizer.decode),
        "disturbed_runs": sum(1 for r in records if r.disturbed),
        # re-run groups: every group holds one reference run
        "retries_used": sum(r.extra["attempts"] - 1 for r in records if r.engine == REFERENCE),
        "runs": [r.to_dict(keep_ids=is_reference(r.engine)) for r in records],
        "suite_seconds": log.seconds(),
    }
    for e in engines.values():
        with contextlib.suppress(Exception):
            e.close()
    log("wrote " + ", ".join(str(p) for p in write_results(cfg.out_dir, cfg.label, result)))
    return result


def drafter_record(cfg: SuiteConfig, engine: Engine, probe: Sequence[Sequence[int]], log: Log) -> dict[str, Any]:
    """The ``drafter`` section: the Engine's drafter folder, its training record (``drafter.json``), and its step
    measured here against a decode step (``measure_draft_cost``, not the cached value) after the cost curve's
    probe context."""
    from ortspec.adapters.engine.measurements import measure_draft_cost

    folder = getattr(getattr(engine.drafter, "folder", None), "path", None)
    training: dict[str, Any] = {}
    if folder is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads((Path(folder) / "drafter.json").read_text(encoding="utf-8"))["ortspec"]["training"]
            keys = ("timing", "updates", "data", "heldout_before_training", "heldout_after_training")
            training = {k: record[k] for k in keys if k in record}
    context = list(probe[0])
    log(f"drafter step at a {len(context)}-token context")
    cost = measure_draft_cost(
        engine.backend, engine.drafter, context, width=4, repeats=cfg.cost_repeat, slot=engine.lone_slot
    )
    log(f"drafter step {cost['step_s'] * 1000:.2f} ms = {cost['cost'] * 100:.1f}% of a decode step")
    return {"folder": str(folder), "training": training, "cost": cost}


def sampling_record(engines: Sequence[str], prompts: Sequence[Prompt], summary: dict[str, Any]) -> dict[str, Any]:
    """The ``sampling`` section of the results: the sampled engines' options, the seed of every prompt, which
    engine each sampled engine's identity is checked against, and the issue's targets against the measured
    ratios (empty when no sampled engine ran)."""
    sampled = [e for e in engines if e in SAMPLED_ENGINES]
    if not sampled:
        return {}
    return {
        "engines": sampled,
        "options": dict(SAMPLING),
        "seed_rule": SEED_RULE,
        "seeds": {p.workload.name: p.seed for p in prompts},
        "identity_reference": {e: identity_reference(e) for e in sampled},
        "targets": sampled_targets(summary["ratios"]),
    }


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def _ngram_setting(text: str) -> tuple[int, int]:
    """``SIZE,DRAFT`` as two positive ints; ``argparse.ArgumentTypeError`` naming the problem otherwise."""
    try:
        size, draft = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SIZE,DRAFT (two integers), got {text!r}") from None
    if size < 1 or draft < 1:
        raise argparse.ArgumentTypeError(f"ngram size and draft length must be >= 1, got {text!r}")
    return size, draft


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="model folder (default: the cached SmolLM2 folder of --precision)")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8"),
        help="picks the default cached folder and names the output files (default fp32; int8 is built at the "
        "builder's default MatMulNBits accuracy level 4, as in the committed results)",
    )
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine (default 2)")
    ap.add_argument("--categories", default=",".join(SUITE_CATEGORIES))
    ap.add_argument(
        "--split",
        choices=(*SPLITS, "all"),
        default="evaluation",
        help="the prompts' half: tuning (to choose constants on), evaluation (to report; the default), or all",
    )
    ap.add_argument("--n-per-category", type=int, default=8, help="prompts per category (in the chosen half)")
    ap.add_argument(
        "--ngram",
        type=_ngram_setting,
        default=DEFAULT_NGRAM,
        help="the ORT GenAI n-gram peers' setting SIZE,DRAFT (ngram_size, max_draft_tokens; default "
        f"{DEFAULT_NGRAM[0]},{DEFAULT_NGRAM[1]}; python -m bench.ngram_grid chooses one on the tuning split)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma-separated engine names")
    ap.add_argument("--repeat", type=int, default=1, help="runs per prompt and engine (default 1)")
    ap.add_argument("--cost-repeat", type=int, default=15, help="samples per verify cost point (default 15)")
    ap.add_argument(
        "--cost-attempts",
        type=int,
        default=3,
        help="re-measure the cost curve up to this many times while it is disturbed (default 3)",
    )
    ap.add_argument(
        "--overhead-prompts",
        type=int,
        default=2,
        help="prompts per category for the driver-overhead runs (0 = skip; default 2)",
    )
    ap.add_argument(
        "--contention-threshold",
        type=float,
        default=0.3,
        help="a run is flagged disturbed when other processes used more cores than this on average",
    )
    ap.add_argument(
        "--retry-disturbed",
        type=int,
        default=1,
        help="re-run a prompt's whole engine group up to N times while any of its runs is disturbed",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=30.0,
        help="before each prompt's engine group (and the cost curve), wait up to this many seconds for "
        "other processes to use fewer than --contention-threshold cores (default 30; 0 = never)",
    )
    ap.add_argument("--max-length", type=int, default=None, help="ortspec KV capacity (default: the model's)")
    ap.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="a model folder of the same vocabulary: the draft-model settings (ortspec-draft-model, "
        "ortspec-auto-draft-model) run on a second Engine that drafts with it",
    )
    ap.add_argument(
        "--genai-draft-tokens",
        type=int,
        choices=range(1, 17),
        default=DEFAULT_GENAI_DRAFT_TOKENS,
        metavar="K",
        help="ortgenai-draft-model's draft length (ORT GenAI's max_draft_tokens, 1..16; default "
        f"{DEFAULT_GENAI_DRAFT_TOKENS}, GenAI's own)",
    )
    ap.add_argument("--out", help="output folder (default docs/bench/; --quick: a temporary folder)")
    ap.add_argument("--label", help="names the output files (default: --precision, or 'quick')")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="check the suite works on a tiny random model: 2 prompts/category, 16 tokens",
    )
    ap.add_argument("--no-progress", action="store_true")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    given = list(argv or [])
    if args.quick:
        args.n_per_category = min(args.n_per_category, 2) if "--n-per-category" in given else 2
        for key, value in QUICK_DEFAULTS.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    return args


def _resolve_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.quick and not args.model_dir:
        from tests.support.drafters import make_random_drafter
        from tests.support.models import make_tiny_model

        model = Path(make_tiny_model(workdir / "tiny-model", context=1024))
        # a random shared-KV drafter beside it (Engine.from_dir finds <model>/drafter), so the drafter settings run
        make_random_drafter(model, model / "drafter", seed=0)
        if not args.draft_model:  # and the model drafts for itself (the same vocabulary), so the draft model's run
            args.draft_model = str(model)
        return model
    if args.model_dir:
        return Path(args.model_dir).expanduser().resolve()
    from ortspec.adapters.tools.convert import BUILDER_ACCURACY_LEVEL, convert_smollm2, default_model_dir, is_complete

    # int8 as ONNX Runtime GenAI users run it: the builder's default MatMulNBits level (4), as in the committed
    # results (ortspec convert builds level 1, the exact one; see docs/bench/quantization-settings.md)
    level = BUILDER_ACCURACY_LEVEL if args.precision == "int8" else None
    folder = default_model_dir(args.precision, level)
    if not is_complete(folder):
        print(f"bench.suite: converting the {args.precision} model into {folder} (first use)", file=sys.stderr)
        convert_smollm2(folder, args.precision, accuracy_level=level)
    return folder


@contextlib.contextmanager
def _workspace(args: argparse.Namespace) -> Iterator[tuple[Path, Path]]:
    """(scratch folder, output folder): with --quick a temporary folder, removed at exit, which also holds the
    output unless --out says otherwise."""
    with tempfile.TemporaryDirectory(prefix="ortspec-suite-") if args.quick else contextlib.nullcontext() as tmp:
        workdir = Path(tmp) if tmp else Path(tempfile.gettempdir())
        out_dir = Path(args.out) if args.out else (workdir / "out" if args.quick else DEFAULT_OUT)
        if args.quick and not args.out:
            print(f"bench.suite: --quick without --out writes into {out_dir} (removed at exit)", file=sys.stderr)
        out_dir.mkdir(parents=True, exist_ok=True)
        yield workdir, out_dir


def run_suite(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    with _workspace(args) as (workdir, out_dir):
        model_dir = _resolve_model(args, workdir)
        cfg = SuiteConfig.from_args(args, argv, model_dir=model_dir, workdir=workdir, out_dir=out_dir)
        result = run(cfg)
        if args.quick and not args.out:
            print(json.dumps(_headline(result), indent=2))
        return result


def _headline(result: dict[str, Any]) -> dict[str, Any]:
    t = result["summary"]["table"]
    return {cat: {e: round_float(v.get("e2e_tok_s"), 1) for e, v in rows.items()} for cat, rows in t.items()}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run_suite(args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
