"""The suite's run: ``run`` measures everything a ``SuiteConfig`` asks for, in order, and writes the result files;
beside it, loading the engines, checking how the peers receive the prompts, and the interleaved runs (every engine
on each prompt back to back, the group re-run while disturbed)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bench.engines import (
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
    PeerEngine,
    identity_reference,
    is_reference,
    load_peer,
    ortspec_engine,
)
from bench.limits import physical_limits
from bench.machine import CpuContention, git_commit, machine_info
from bench.report import (
    DRAFTER_TARGETS,
    RunRecord,
    first_mismatch,
    identity_counts,
    mismatches,
    sampled_targets,
    summarize,
)
from bench.report_files import write_results
from bench.suite_config import Log, Prompt, SuiteConfig
from bench.suite_measurements import (
    cost_curve_ids,
    drafter_record,
    measure_bandwidth,
    measure_cost_curve,
    measure_overhead,
    quieter,
    wait_quiet,
)
from bench.workloads import Workload, build_workloads, describe_workloads, encode_chat
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import BackendConfig

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
