"""What the suite measures besides the engines' runs: the machine's state (waiting for a quiet machine, memory
bandwidth), the verify cost curve, the drafter's step and the driver overhead per decode step."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engines import ALL_FILTERS, KMAX, OrtspecEngine, TimingBackend, ortspec_engine, sampled_variant
from bench.machine import CpuContention, background_load, measure_memory_bandwidth
from bench.report import round_float
from bench.suite_config import Log, Prompt, SuiteConfig
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.measurements import measure_pass_costs, probe_ids
from ortspec.backends.base import Backend

OVERHEAD_ENGINES = ("ortspec-greedy", "ortspec-lookup-w8")
# The same two settings sampling with every filter on (bench.engines.ALL_FILTERS), timed beside them.
SAMPLED_OVERHEAD_ENGINES = {
    "ortspec-sampled-all-filters": "ortspec-greedy",
    "ortspec-lookup-w8-sampled-all-filters": "ortspec-lookup-w8",
}
OVERHEAD_TARGET_PCT = 2.0  # the target for the sampled settings: < 2% of a decode step


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
# The drafter's step
# --------------------------------------------------------------------------------------------------------------


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
