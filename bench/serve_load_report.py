"""``bench.serve_load``'s numbers: streamed outcomes -> per-phase summaries, ratios against a baseline
configuration, and the markdown report. Pure functions of their inputs (no server, no clock): the smoke
test feeds them synthetic outcomes.

Units: times in the summaries are milliseconds (``*_ms_*``) or seconds (``*_s``), memory MiB, rates per second of
the phase's wall time. A load row is one (server configuration, concurrency) phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

BASELINE_CONFIG = "batched"  # the server as ``ortspec serve`` runs it: every ratio's denominator by default


@dataclass
class Prompt:
    name: str
    messages: list[dict[str, str]]
    max_tokens: int
    prompt_tokens: int
    reference: str = ""
    reference_finish: str = ""


@dataclass
class Outcome:
    """One streamed request as the client saw it (times: ``time.perf_counter`` seconds)."""

    prompt: str
    text: str = ""
    finish: str | None = None
    start: float = 0.0
    first: float | None = None  # first non-empty content chunk
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error: str | None = None
    retry_after: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return round(x * 1000, 1) if x is not None else None


def summarize_load(outcomes: list[Outcome], wall: float, prompts: dict[str, Prompt]) -> dict[str, Any]:
    """One load phase: counts, rates over ``wall`` seconds, TTFT / inter-chunk / per-token percentiles of the
    requests that completed, and which completed streams differ from their reference (text or finish reason)."""
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.first - o.start for o in ok if o.first is not None]
    gaps = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:], strict=False)]
    tpot = [
        (o.chunk_times[-1] - o.first) / (o.completion_tokens - 1)
        for o in ok
        if o.first is not None and o.completion_tokens > 1
    ]
    mismatches = [
        o.prompt for o in ok if o.text != prompts[o.prompt].reference or o.finish != prompts[o.prompt].reference_finish
    ]
    tokens = sum(o.completion_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_messages": sorted({o.error for o in outcomes if o.error})[:10],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "completion_tokens": tokens,
        "cached_prompt_tokens": sum(o.cached_tokens for o in ok),
        "ttft_ms_p50": _ms(percentile(ttft, 0.5)),
        "ttft_ms_p99": _ms(percentile(ttft, 0.99)),
        "inter_chunk_ms_p50": _ms(percentile(gaps, 0.5)),
        "inter_chunk_ms_p99": _ms(percentile(gaps, 0.99)),
        "time_per_output_token_ms_p50": _ms(percentile(tpot, 0.5)),
        "time_per_output_token_ms_p99": _ms(percentile(tpot, 0.99)),
        "text_equals_reference": f"{len(ok) - len(mismatches)}/{len(ok)}",
        "mismatched_prompts": sorted(set(mismatches)),
    }


def summarize_overload(outcomes: list[Outcome], wall: float, prompts: dict[str, Prompt]) -> dict[str, Any]:
    refused = [o for o in outcomes if o.status == 429]
    clean = [o for o in refused if o.retry_after and o.retry_after.isdigit()]
    served = [o for o in outcomes if o.error is None]
    other = [o for o in outcomes if o.error is not None and o.status != 429]
    # An overload request asks for 32 tokens: its reference is the reference prefix only if that ran to 32 tokens,
    # so check the text is a prefix of the longer reference's text (same prompt, greedy).
    wrong = [o for o in served if not prompts[o.prompt].reference.startswith(o.text)]
    return {
        "requests": len(outcomes),
        "served": len(served),
        "refused_429": len(refused),
        "refused_429_with_retry_after": len(clean),
        "other_errors": len(other),
        "other_error_messages": sorted({o.error for o in other if o.error})[:10],
        "served_text_consistent_with_reference": f"{len(served) - len(wrong)}/{len(served)}",
        "wall_s": round(wall, 2),
    }


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's counters over a phase, from two ``/metrics`` scrapes (sample name -> value summed over labels)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    counters = {
        "passes": delta("ortspec_target_passes_total"),
        "completion_tokens": delta("ortspec_completion_tokens_total"),
        "prompt_tokens": delta("ortspec_prompt_tokens_total"),
        "cached_prompt_tokens": delta("ortspec_cached_prompt_tokens_total"),
        "proposed": delta("ortspec_draft_tokens_proposed_total"),
        "accepted": delta("ortspec_draft_tokens_accepted_total"),
    }
    counters["acceptance"] = counters["accepted"] / counters["proposed"] if counters["proposed"] else 0.0
    return counters


def batch_histogram_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean observation over a phase of every histogram with "batch" in its name (e.g. ``ortspec_batch_rows``:
    sequences per batched pass): delta of ``_sum`` ÷ delta of ``_count``. Empty when the server has none (with
    ``--ray`` they stay in the replicas) or observed nothing in the phase."""
    means = {}
    for name in after:
        if "batch" in name and name.endswith("_sum") and name[: -len("_sum")] + "_count" in after:
            base = name[: -len("_sum")]
            count = after[base + "_count"] - before.get(base + "_count", 0.0)
            if count > 0:
                means[base] = round((after[name] - before.get(name, 0.0)) / count, 2)
    return means


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def ratios(rows: list[dict[str, Any]], baseline: str = BASELINE_CONFIG) -> list[dict[str, Any]]:
    """Each non-baseline row ÷ the baseline row at the same concurrency: generated tokens/s, TTFT p50, peak RSS."""
    base = {r["concurrency"]: r for r in rows if r["config"] == baseline}
    out = []
    for r in rows:
        b = base.get(r["concurrency"])
        if r["config"] != baseline and b is not None:
            out.append(
                {
                    "config": r["config"],
                    "baseline": baseline,
                    "concurrency": r["concurrency"],
                    "tokens_per_s": _ratio(r["tokens_per_s"], b["tokens_per_s"]),
                    "ttft_p50": _ratio(r["ttft_ms_p50"], b["ttft_ms_p50"]),
                    "peak_rss": _ratio(r["peak_rss_mib"], b["peak_rss_mib"]),
                }
            )
    return out


def failures(result: dict[str, Any]) -> list[str]:
    """Every condition a phase failed (the exit status is 1 when this is not empty). The ratios are reported, not
    judged: on a busy shared machine they measure the machine as much as the server."""
    out = []
    reuse, over, target = result["prefix_reuse"], result["overload"], result["settings"]["ttft_target"]
    if target and reuse["median_ratio"] > target:
        out.append(f"second-turn TTFT ratio {reuse['median_ratio']:.3f} > {target} ({reuse['config']})")
    for row in result["load"]:
        where = f"{row['config']} at {row['concurrency']} clients"
        if row["errors"]:
            out.append(f"{row['errors']} errors in the load phase, {where}")
        if row["mismatched_prompts"]:
            out.append(f"text differs from the reference for {row['mismatched_prompts']}, {where}")
    if over["other_errors"]:
        out.append(f"{over['other_errors']} overload errors other than 429")
    if over["refused_429"] != over["refused_429_with_retry_after"]:
        out.append("a 429 without Retry-After")
    if over["served_text_consistent_with_reference"].split("/")[0] != str(over["served"]):
        out.append("overload text differs from the reference")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _cpu_line(cpu: dict[str, Any]) -> str:
    return (
        f"CPU during the phase (average cores): server {cpu['server_cores']}, clients {cpu['client_cores']}, "
        f"other processes (not the benchmark) {cpu['other_cores']}."
    )


def _pair(a: Any, b: Any, unit: str = "") -> str:
    return f"{a} / {b}{unit}"


def _load_table(rows: list[dict[str, Any]], stream_tok_s: float | None) -> list[str]:
    """One row per load phase; ``stream_tok_s``: one plain stream's tokens/s (the references'), the ratio's base."""
    lines = [
        "| server | clients | requests | errors | text == reference | cached prompt tokens | wall | requests/s | "
        "tokens/s | ÷ one plain stream | TTFT p50 / p99 | inter-chunk p50 / p99 | peak RSS / RSS after | "
        "server CPU (cores) | others' cores | rows per pass |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for r in rows:
        per_pass = ", ".join(f"{k.removeprefix('ortspec_')} {v}" for k, v in r["batch_histogram_means"].items()) or "-"
        ratio = f"{r['tokens_per_s'] / stream_tok_s:.2f}x" if stream_tok_s and r["tokens_per_s"] else "-"
        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['text_equals_reference']} | "
            f"{r.get('cached_prompt_tokens', '-')} | {r['wall_s']} s | {r['requests_per_s']} | {r['tokens_per_s']} | "
            f"{ratio} | "
            f"{_pair(r['ttft_ms_p50'], r['ttft_ms_p99'], ' ms')} | "
            f"{_pair(r['inter_chunk_ms_p50'], r['inter_chunk_ms_p99'], ' ms')} | "
            f"{_pair(r['peak_rss_mib'], r['rss_after_mib'], ' MiB')} | {r['server_cpu_s']} s "
            f"({r['cpu']['server_cores']}) | {r['cpu']['other_cores']} | {per_pass} |"
        )
    return lines


def _ratio_table(result: dict[str, Any]) -> list[str]:
    rows = result["ratios"]
    if not rows:
        baseline = result["settings"].get("baseline", BASELINE_CONFIG)
        return [f"No ratios: the run measured no configuration beside {baseline} at the same concurrency.", ""]
    lines = [
        "| server ÷ baseline | clients | tokens/s ratio | TTFT p50 ratio | peak RSS ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['config']} ÷ {r['baseline']} | {r['concurrency']} | {r['tokens_per_s']} | {r['ttft_p50']} | "
        f"{r['peak_rss']} |"
        for r in rows
    ]
    return [*lines, ""]


def _configs_table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| server | command | slots | queue | ready after | RSS when ready |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for s in result["servers"]:
        lines.append(
            f"| {s['config']} | `{' '.join(s['command'])}` | {s['slots']} | {s['max_queue']} | "
            f"{s['ready_s']:.1f} s | {s['ready_rss_mib']} MiB |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    m, s, over, reuse = result["machine"], result["settings"], result["overload"], result["prefix_reuse"]
    base = result["in_process_baseline"]
    prompts = result["prompts"]
    lines = [
        "# `ortspec serve` under load",
        "",
        f"Measured {m['date_utc']} on {m['cpu']} ({m['cores']['usable']} usable cores, {m['memory_gib']} GiB; "
        f"other processes were using {m['background_load_cores']} cores at the start), "
        f"{m['python']}, onnxruntime {m['versions'].get('onnxruntime')}. Written by `{result['command']}`.",
        "",
        f"Model {s['model']}; speculative {s.get('speculative', 'prompt-lookup')} by default, prefix reuse on. The "
        "server configurations, run "
        "one after another on the same prompts and references (slots: requests decoded at once; queue: requests "
        "that may wait beyond them, at least the largest concurrency, so the load phases see no 429):",
        "",
        *_configs_table(result),
        "",
        "Ready after: launch to the first `/health` answer (the Engine loaded and measured). "
        "Clients: the official `openai` AsyncOpenAI client, streaming, no retries, in one process on the same "
        "machine.",
        "",
        f"## Prefix reuse on {reuse['config']} (time to first token, client side)",
        "",
        "| conversation | cold TTFT (turn 1) | second-turn TTFT | ratio | cached tokens (turn 2) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(reuse["conversations"]):
        lines.append(
            f"| {i} ({result['conversation_sources'][i]}, {r['prompt_tokens']} tokens) | "
            f"{r['cold_ttft_s'] * 1000:.0f} ms | {r['second_turn_ttft_s'] * 1000:.0f} ms | {r['ratio']:.3f} | "
            f"{r['second_turn_cached_tokens']} |"
        )
    lines += [
        "",
        f"{_cpu_line(reuse['cpu'])} Median ratio {reuse['median_ratio']:.3f} "
        f"({'target <= ' + str(s['ttft_target']) if s['ttft_target'] else 'no target set'}).",
        "",
        f"## Load: {', '.join(map(str, s['concurrency']))} concurrent streaming clients x {s['requests']} "
        "request(s) each",
        "",
        f"Prompts: {len(prompts)} chats of {min(p['prompt_tokens'] for p in prompts)}-"
        f"{max(p['prompt_tokens'] for p in prompts)} tokens (bench.workloads), max_tokens "
        f"{sorted({p['max_tokens'] for p in prompts})}; each phase takes the next prompts in turn (client c's "
        "request r is the phase's first plus c x requests + r, modulo the count): "
        f"{'every request its own prompt' if s.get('distinct_prompts') else 'prompts repeat across requests'}. "
        "The references, computed in process before any server started with plain greedy "
        f"decoding, one prompt at a time on {base['threads']} threads, double as a baseline on the machine as it "
        f"was: {base['completion_tokens']} tokens in {base['seconds']} s = {base['tokens_per_s']} tokens/s end to "
        f"end (other processes used {base['other_processes_cores']} cores meanwhile).",
        "",
        *_load_table(result["load"], base["tokens_per_s"]),
        "",
        "Inter-chunk: the gap between consecutive streamed content chunks (one chunk per committed token that "
        "releases text; an accepted draft block arrives as several chunks at once). Peak RSS: the server "
        f"process's VmHWM over the {result['peak_rss_scope']}; RSS after: VmRSS when the phase ended. Server CPU: "
        "its user + system seconds in the phase (average cores). Rows per pass: the mean of each batch-size "
        "histogram the server's /metrics exposes, over the phase. The server's RSS and CPU are those of its process "
        "and every process under it (with --ray: the ingress, the local Ray instance and its replicas; peak RSS the "
        "sum of their peaks); with --ray the per-pass histograms stay in the replicas.",
        "",
        f"## Against {s.get('baseline', BASELINE_CONFIG)}",
        "",
        *_ratio_table(result),
        f"## Overload on {over['config']}: {over['requests']} clients at once (slots + queue = {over['capacity']})",
        "",
        f"Served {over['served']}, refused {over['refused_429']} with 429 ({over['refused_429_with_retry_after']} "
        f"with a Retry-After header), other errors {over['other_errors']}; served text consistent with the "
        f"reference {over['served_text_consistent_with_reference']}. {_cpu_line(over['cpu'])}",
        "",
        f"Verdict: {'PASS' if result['passed'] else 'FAIL'} "
        f"({'; '.join(result['failures']) or 'every condition met'}).",
        "",
    ]
    return "\n".join(lines)
