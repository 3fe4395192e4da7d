"""The suite's markdown sections about what it measured beside the runs (``bench.suite_measurements``): physical
limits (the verify cost curve, memory bandwidth, the decode step and the achieved fraction of bandwidth), the
shared-KV drafter (its training, its step's cost, its targets) and the driver overhead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench.report import DRAFT_STEP_TARGET
from bench.report_tables import _fmt, _target_lines


def _cost_curve(result: dict[str, Any]) -> Iterator[str]:
    cc, cc_end = result.get("cost_curve"), result.get("cost_curve_end")
    if not cc:
        return
    yield ""
    yield (
        f"Verify cost curve on OrtBackend at a {cc['context_tokens']}-token context: one pass over the "
        f"pending token + K draft tokens (`decode_verify` of K + 1 tokens; K = 0 is a 1-token `decode`), "
        f"median of {cc['repeats']} interleaved samples, rewound after each. The curve measured before "
        "the runs is the `pass_costs` of `ortspec-lookup-adaptive`; it is measured again after the runs. "
        "Each is re-measured while other processes disturb it."
    )
    yield ""
    yield "| K | " + " | ".join(str(k) for k in range(len(cc["curve"]))) + " |"
    yield "| --- |" + " ---: |" * len(cc["curve"])
    for c in (cc, cc_end):
        if not c:
            continue
        others = (c.get("contention") or {}).get("others_cores")
        when = c.get("when", "start")
        yield f"| ms ({when}, others {others} cores) | " + " | ".join(f"{t * 1000:.1f}" for t in c["pass_s"]) + " |"
        yield f"| ÷ decode ({when}) | " + " | ".join(f"{x:.2f}" for x in c["curve"]) + " |"


def _bandwidth_rows(phys: dict[str, Any]) -> Iterator[str]:
    bw = phys.get("bandwidth", {})
    if not bw:
        return
    yield f"| copy bandwidth, 1 thread (numpy, read + write) | {bw.get('copy_gb_s')} GB/s |"
    for t, v in (bw.get("per_threads") or {}).items():
        if t != "1":
            yield f"| copy bandwidth, {t} Python thread(s) | {v} GB/s |"
    yield (
        f"| bandwidth used for the fractions (best copy figure, measured at the start and the end of "
        f"the suite) | {phys.get('bandwidth_gb_s')} GB/s |"
    )


def _step_rows(phys: dict[str, Any]) -> Iterator[str]:
    if phys.get("decode_step_s"):
        yield (
            f"| decode step (cost curve K = 0, the quieter measurement: {phys.get('decode_step_from')}) "
            f"| {phys['decode_step_s'] * 1000:.2f} ms |"
        )
        yield f"| weights streamed per second in a decode step | {phys['achieved_gb_s']:.2f} GB/s |"
        yield (
            f"| achieved fraction of bandwidth (weights ÷ step ÷ bandwidth) | {phys['achieved_fraction'] * 100:.0f}% |"
        )
        if phys.get("achieved_fraction_with_kv") is not None:
            yield f"| achieved fraction, weights + KV | {phys['achieved_fraction_with_kv'] * 100:.0f}% |"
        yield f"| bandwidth-bound ceiling (bandwidth ÷ weight bytes) | {phys['ceiling_tok_s']:.1f} tok/s |"
    if phys.get("greedy_backend_step_s"):
        yield (
            f"| backend time per step inside ortspec-greedy generations (overhead runs) → fraction | "
            f"{phys['greedy_backend_step_s'] * 1000:.2f} ms → {phys['greedy_backend_fraction'] * 100:.0f}% |"
        )
    if phys.get("greedy_decode_tok_s"):
        yield (
            f"| ortspec-greedy decode tok/s (median, all prompts) → fraction | "
            f"{phys['greedy_decode_tok_s']:.1f} → {phys['greedy_achieved_fraction'] * 100:.0f}% |"
        )


def _drafter(result: dict[str, Any]) -> Iterator[str]:
    d = result.get("drafter")
    if not d:
        return
    yield ""
    yield "## The shared-KV drafter"
    yield ""
    yield f"Drafter folder `{d['folder']}`."
    training = d.get("training") or {}
    after = training.get("heldout_after_training") or {}
    if training:
        yield (
            f"Trained by `ortspec train-drafter` ({training.get('updates', '?')} updates) in "
            f"{training.get('timing', {}).get('total_seconds', 0) / 60:.1f} min: "
            f"{training.get('data', {}).get('positions', '?')} positions of target data; held-out first-token "
            f"accuracy {after.get('top1', float('nan')):.3f}, mean tokens accepted per draft of width 1..4: "
            + ", ".join(f"{x:.2f}" for x in after.get("accepted_by_width", []))
            + " (see docs/drafter.md)."
        )
    cost = d.get("cost") or {}
    if cost:
        verdict = "met" if cost["cost"] <= DRAFT_STEP_TARGET else "missed"
        yield ""
        yield (
            f"Draft step (measured here, `ortspec.adapters.engine.measurements.measure_draft_cost`, "
            f"width {cost['width']}, "
            f"{cost['context_tokens']}-token context, median of {cost['repeats']}): "
            f"{cost['step_s'] * 1000:.2f} ms per draft token vs a {cost['decode_step_s'] * 1000:.2f} ms decode step = "
            f"**{cost['cost'] * 100:.1f}%** of a decode step (target <= {DRAFT_STEP_TARGET * 100:.0f}%: **{verdict}**)."
        )
    yield from _target_lines(
        d.get("targets") or [], "Targets (tok/s end to end, medians of per-prompt ratios on the same prompts):"
    )


def _physical(result: dict[str, Any]) -> Iterator[str]:
    phys = result.get("physical", {})
    yield ""
    yield "## Physical limits"
    yield from _cost_curve(result)
    wb = phys.get("weights", {})
    if phys.get("bandwidth") or wb:
        yield ""
        yield "| quantity | value |"
        yield "| --- | ---: |"
        yield from _bandwidth_rows(phys)
        if wb:
            yield f"| weight bytes per decode step | {wb.get('bytes_per_step', 0) / 1e6:.1f} MB |"
        if phys.get("kv_bytes_per_step") is not None:
            yield (
                f"| KV bytes per decode step at {phys.get('kv_context')} tokens | "
                f"{phys['kv_bytes_per_step'] / 1e6:.1f} MB |"
            )
        yield from _step_rows(phys)
    if phys.get("decode_step_s"):
        yield ""
        yield (
            "The copy figure counts bytes read + bytes written; a decode step mostly reads, and a read-only "
            "stream can go faster than a copy, so a fraction near (or above) 100% means the step runs at the "
            "memory limit. Weight bytes: initializers of the graph (embedding tables read by Gather only "
            "would count one row)."
        )


def _overhead(result: dict[str, Any]) -> Iterator[str]:
    ov = result.get("overhead")
    if not ov or not ov.get("engines"):
        return
    yield ""
    yield "## Driver overhead"
    yield ""
    yield (
        f"Time per decode step outside the backend (driver + core + proposer + detokenizer) = step wall "
        f"time − time inside backend calls, measured through a timing proxy in separate runs on "
        f"{ov['prompts']} prompts; % of a decode step ({_fmt(ov['decode_step_s'] * 1000, 2)} ms, cost "
        "curve K = 0) and of the same runs' backend time per step."
    )
    goals = [v["target_pct_of_decode_step"] for v in ov["engines"].values() if "target_pct_of_decode_step" in v]
    targets = bool(goals)
    if targets:
        filters = ", ".join(f"{k} {v}" for k, v in (ov.get("sampling") or {}).items())
        yield ""
        yield (
            f"The `-sampled-all-filters` rows are the settings above them sampling with every filter on ({filters}) "
            f"at each prompt's seed; the issue's target for them: under {max(goals):g}% of a decode step."
        )
    yield ""
    head = "| engine | steps | overhead µs/step (median) | % of a decode step | % of backend time/step |"
    yield head + (" target |" if targets else "")
    yield "| --- | ---: | ---: | ---: | ---: |" + (" --- |" if targets else "")
    for e, v in ov["engines"].items():
        line = (
            f"| {e} | {v['steps']} | {v['overhead_us_per_step']:.0f} | {v['pct_of_decode_step']:.2f}% | "
            f"{_fmt(v['pct_of_backend_step'], 2, '%')} |"
        )
        if targets:
            goal = v.get("target_pct_of_decode_step")
            met = goal is not None and v["pct_of_decode_step"] < goal
            line += " — |" if goal is None else f" < {goal:g}%: **{'met' if met else 'missed'}** |"
        yield line
