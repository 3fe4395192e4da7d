"""What the suite reports: every run's record and metrics, the summaries over them (medians per engine and
category, paired ratios, identity), the sampled column's targets, and the three result files (JSON, markdown,
plot). Sections about sampled engines appear only when sampled engines ran, so older results render as before."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engines import (
    BASELINE,
    NGRAM_PEER,
    REFERENCE,
    SAMPLED_AUTO,
    SAMPLED_ENGINES,
    SAMPLED_NGRAM_PEER,
    SAMPLED_PEER,
    SAMPLED_REFERENCE,
    SAMPLED_SPEC,
    SAMPLED_SPECS,
    SPEC_ENGINES,
    identity_reference,
    is_reference,
)
from ortspec.driver import decode_rate

METRICS = ("e2e_tok_s", "decode_tok_s", "ttft_s", "acceptance", "tokens_per_step", "passes")


# --------------------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------------------


def round_float(x: Any, nd: int = 4) -> Any:
    """``x`` rounded to ``nd`` decimals when it is a float, else ``x``."""
    if isinstance(x, float):
        return round(x, nd)
    return x


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class RunRecord:
    """One run of one engine on one prompt, with the machine's contention around it and the identity check."""

    engine: str
    workload: str
    category: str
    repeat: int
    prompt_tokens: int
    token_ids: list[int]  # EOS removed
    finish_reason: str
    ttft_s: float
    total_s: float
    proposed: int | None = None
    accepted: int | None = None
    passes: int | None = None  # target forward passes (prefill included where the engine reports it)
    decode_passes: int | None = None  # passes after the prefill
    extra: dict = field(default_factory=dict)
    contention: dict = field(default_factory=dict)
    disturbed: bool = False
    identical: bool | None = None
    first_mismatch: int | None = None
    error: str | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def e2e_tok_s(self) -> float | None:
        return self.new_tokens / self.total_s if self.total_s > 0 and self.error is None else None

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(self.new_tokens, self.ttft_s, self.total_s) if self.error is None else None

    @property
    def acceptance(self) -> float | None:
        if self.proposed:
            return (self.accepted or 0) / self.proposed
        return None

    @property
    def tokens_per_step(self) -> float | None:
        if self.decode_passes:
            n = self.new_tokens + (1 if self.finish_reason == "stop" else 0)
            return n / self.decode_passes
        return None

    def compare_with(self, reference: RunRecord) -> None:
        """Set ``identical`` and ``first_mismatch`` against ``reference``'s tokens (when neither failed)."""
        if self.error is None and reference.error is None:
            self.identical = self.token_ids == reference.token_ids
            self.first_mismatch = None if self.identical else first_mismatch(reference.token_ids, self.token_ids)

    def to_dict(self, keep_ids: bool) -> dict:
        d = {
            "engine": self.engine,
            "workload": self.workload,
            "category": self.category,
            "repeat": self.repeat,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": round_float(self.ttft_s, 5),
            "total_s": round_float(self.total_s, 5),
            "e2e_tok_s": round_float(self.e2e_tok_s, 3),
            "decode_tok_s": round_float(self.decode_tok_s, 3),
            "acceptance": round_float(self.acceptance, 4),
            "proposed": self.proposed,
            "accepted": self.accepted,
            "passes": self.passes,
            "decode_passes": self.decode_passes,
            "tokens_per_step": round_float(self.tokens_per_step, 3),
            "identical": self.identical,
            "first_mismatch": self.first_mismatch,
            "contention": self.contention,
            "disturbed": self.disturbed,
            "extra": self.extra,
        }
        if self.error:
            d["error"] = self.error
        if keep_ids:
            d["token_ids"] = list(self.token_ids)
        return d


# --------------------------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else None


def _metric(r: RunRecord, m: str) -> float | None:
    if r.error is not None:
        return None
    v = getattr(r, m)
    return float(v) if v is not None else None


def per_prompt(records: Sequence[RunRecord]) -> dict[tuple[str, str], dict[str, Any]]:
    """(engine, workload) -> median over repeats of every metric, plus identity counts."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.engine, r.workload), []).append(r)
    out = {}
    for key, rs in groups.items():
        d: dict[str, Any] = {m: _median([_metric(r, m) for r in rs]) for m in METRICS}
        d["category"] = rs[0].category
        d["identical"] = sum(1 for r in rs if r.identical)
        d["compared"] = sum(1 for r in rs if r.identical is not None)
        d["disturbed"] = sum(1 for r in rs if r.disturbed)
        d["runs"] = len(rs)
        d["errors"] = sum(1 for r in rs if r.error)
        out[key] = d
    return out


def _category_table(pp: dict, engines: Sequence[str], cats: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category: per engine, medians over prompts and summed counts."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for cat in cats:
        table[cat] = {}
        for e in engines:
            rows = [v for (eng, _), v in pp.items() if eng == e and (cat == "all" or v["category"] == cat)]
            if not rows:
                continue
            entry = {m: _median([v[m] for v in rows]) for m in METRICS}
            entry["prompts"] = len(rows)
            for count in ("identical", "compared", "disturbed", "runs", "errors"):
                entry[count] = sum(v[count] for v in rows)
            table[cat][e] = entry
    return table


def _paired(pp: dict, num: str, den: str, metric: str, cat: str) -> dict[str, Any] | None:
    """Statistics of ``num``'s ``metric`` ÷ ``den``'s, over the prompts of ``cat`` both ran."""
    ratios = []
    for (eng, wl), v in pp.items():
        if eng != num or (cat != "all" and v["category"] != cat):
            continue
        d = pp.get((den, wl))
        if d and v[metric] and d[metric]:
            ratios.append(v[metric] / d[metric])
    if not ratios:
        return None
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "n": len(ratios),
        "geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
    }


def _greedy(e: str) -> bool:
    return e not in SAMPLED_ENGINES


# ratio table -> (which engines, denominator, metric)
RATIOS: dict[str, tuple[Callable[[str], bool], str, str]] = {
    "vs_ortgenai_e2e": (lambda e: e != BASELINE and _greedy(e), BASELINE, "e2e_tok_s"),
    "vs_ortgenai_decode": (lambda e: e != BASELINE and _greedy(e), BASELINE, "decode_tok_s"),
    "spec_vs_ortgenai_ngram_e2e": (lambda e: e in SPEC_ENGINES, NGRAM_PEER, "e2e_tok_s"),
    "spec_vs_ortgenai_ngram_decode": (lambda e: e in SPEC_ENGINES, NGRAM_PEER, "decode_tok_s"),
    "spec_vs_ortspec_greedy_e2e": (lambda e: e in SPEC_ENGINES, REFERENCE, "e2e_tok_s"),
    "spec_vs_ortspec_greedy_decode": (lambda e: e in SPEC_ENGINES, REFERENCE, "decode_tok_s"),
    # the sampled column: every pair ran on the same prompt with the same seed
    "sampled_spec_vs_sampled_plain_e2e": (lambda e: e in SAMPLED_SPECS, SAMPLED_REFERENCE, "e2e_tok_s"),
    "sampled_spec_vs_sampled_plain_decode": (lambda e: e in SAMPLED_SPECS, SAMPLED_REFERENCE, "decode_tok_s"),
    "sampled_spec_vs_ortgenai_ngram_sampled_e2e": (lambda e: e in SAMPLED_SPECS, SAMPLED_NGRAM_PEER, "e2e_tok_s"),
    "sampled_spec_vs_ortgenai_ngram_sampled_decode": (
        lambda e: e in SAMPLED_SPECS,
        SAMPLED_NGRAM_PEER,
        "decode_tok_s",
    ),
    "sampled_vs_ortgenai_sampled_e2e": (lambda e: e == SAMPLED_REFERENCE, SAMPLED_PEER, "e2e_tok_s"),
    "sampled_vs_ortgenai_sampled_decode": (lambda e: e == SAMPLED_REFERENCE, SAMPLED_PEER, "decode_tok_s"),
    "ortgenai_ngram_sampled_vs_ortgenai_sampled_e2e": (lambda e: e == SAMPLED_NGRAM_PEER, SAMPLED_PEER, "e2e_tok_s"),
    "ortgenai_ngram_sampled_vs_ortgenai_sampled_decode": (
        lambda e: e == SAMPLED_NGRAM_PEER,
        SAMPLED_PEER,
        "decode_tok_s",
    ),
}

# The targets for the sampled column: (ratio table, engine, category, at least, what it says).
SAMPLED_TARGETS = (
    ("sampled_spec_vs_sampled_plain_e2e", SAMPLED_SPEC, "code_edit", 1.3, "sampled speculation ÷ plain sampling"),
    ("sampled_spec_vs_sampled_plain_e2e", SAMPLED_SPEC, "open_ended", 0.97, "sampled speculation ÷ plain sampling"),
    (
        "sampled_spec_vs_ortgenai_ngram_sampled_e2e",
        SAMPLED_SPEC,
        "code_edit",
        1.3,
        "sampled speculation ÷ ORT GenAI sampled n-gram speculation",
    ),
)


def summarize(records: Sequence[RunRecord], engines: Sequence[str], categories: Sequence[str]) -> dict[str, Any]:
    """Per category (and "all"): per engine medians over prompts; the ratio tables; the per-prompt medians."""
    pp = per_prompt(records)
    cats = [*categories, "all"]
    ratios = {
        key: {e: {cat: _paired(pp, e, den, metric, cat) for cat in cats} for e in engines if applies(e)}
        for key, (applies, den, metric) in RATIOS.items()
    }
    return {
        "table": _category_table(pp, engines, cats),
        "ratios": ratios,
        "per_prompt": {f"{e}|{w}": {k: round_float(v, 4) for k, v in d.items()} for (e, w), d in sorted(pp.items())},
    }


# The drafter's targets (issue 11): (ratio table, engine, category, at least, what it says).
DRAFTER_TARGETS = (
    ("spec_vs_ortspec_greedy_e2e", "ortspec-shared-kv", "open_ended", 1.3, "shared-KV speculation ÷ ortspec greedy"),
    *(
        ("spec_vs_ortgenai_ngram_e2e", "ortspec-auto", cat, 1.5, "auto ÷ ORT GenAI n-gram speculation")
        for cat in ("code_edit", "summarize", "qa_context", "open_ended", "all")
    ),
    ("vs_ortgenai_e2e", "ortspec-auto", "code_edit", 2.5, "auto ÷ ORT GenAI greedy"),
    # issue 20: the shipped drafter, coupled drafting under sampling, the suffix cache on a repetitive stream
    ("spec_vs_ortspec_greedy_e2e", "ortspec-auto", "open_ended", 1.3, "auto ÷ ortspec greedy"),
    ("sampled_spec_vs_sampled_plain_e2e", SAMPLED_AUTO, "open_ended", 1.2, "sampled auto ÷ plain sampling"),
    (
        "sampled_spec_vs_ortgenai_ngram_sampled_e2e",
        SAMPLED_AUTO,
        "code_edit",
        1.5,
        "sampled auto ÷ ORT GenAI sampled n-gram speculation",
    ),
    ("spec_vs_ortspec_greedy_e2e", "ortspec-auto", "repetitive", 2.0, "auto ÷ ortspec greedy (repetitive stream)"),
)
# The drafter's step as a share of a target decode step, at most (issue 11).
DRAFT_STEP_TARGET = 0.08


def sampled_targets(ratios: dict[str, Any], targets: Sequence[tuple] = SAMPLED_TARGETS) -> list[dict[str, Any]]:
    """The issue's targets (default: the sampled column's, ``SAMPLED_TARGETS``; ``DRAFTER_TARGETS``) beside the
    measured medians of per-prompt ratios: ``met`` is None when the ratio was not measured."""
    out = []
    for key, engine, cat, target, what in targets:
        r = ((ratios.get(key) or {}).get(engine) or {}).get(cat)
        measured = r["median"] if r else None
        out.append(
            {
                "ratio": key,
                "engine": engine,
                "category": cat,
                "what": what,
                "target_at_least": target,
                "measured": measured,
                "prompts": r["n"] if r else 0,
                "met": None if measured is None else measured >= target,
            }
        )
    return out


def identity_counts(records: Sequence[RunRecord], engines: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per engine (the references excepted): runs whose tokens equal its reference's (``identity_reference``:
    ortspec-greedy's for greedy engines, the plain sampled run of the same family for sampled ones), and runs
    compared; sampled engines name their reference."""
    return {
        e: {
            "identical": sum(1 for r in records if r.engine == e and r.identical),
            "compared": sum(1 for r in records if r.engine == e and r.identical is not None),
            **({"reference": identity_reference(e)} if e in SAMPLED_ENGINES else {}),
        }
        for e in engines
        if not is_reference(e)
    }


def mismatches(records: Sequence[RunRecord], decode: Callable[[Sequence[int]], str]) -> list[dict[str, Any]]:
    """Every run whose tokens differ from its reference run's (``identity_reference``) on the same prompt and
    repeat, with the text around the first difference (``decode``: token ids -> text)."""
    reference = {(r.engine, r.workload, r.repeat): r.token_ids for r in records if is_reference(r.engine)}
    out = []
    for r in records:
        if r.identical is not False:
            continue
        ref_engine = identity_reference(r.engine)
        ref = reference.get((ref_engine, r.workload, r.repeat), [])
        i = r.first_mismatch or 0
        out.append(
            {
                **({"reference": ref_engine} if r.engine in SAMPLED_ENGINES else {}),
                "engine": r.engine,
                "workload": r.workload,
                "repeat": r.repeat,
                "first_mismatch": r.first_mismatch,
                "reference_len": len(ref),
                "len": r.new_tokens,
                "reference_text": decode(ref[max(0, i - 8) : i + 8]),
                "text": decode(r.token_ids[max(0, i - 8) : i + 8]),
                "token_ids": r.token_ids,
                "reference_ids": ref,
            }
        )
    return out


# --------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------


def _fmt(x: Any, nd: int = 1, suffix: str = "") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}{suffix}"
    return f"{x}{suffix}"


def _ratio_cell(r: dict | None) -> str:
    if not r:
        return "—"
    return f"{r['median']:.2f}x"


def _header(result: dict[str, Any]) -> Iterator[str]:
    cfg, mi, wl = result["config"], result["machine"], result["workloads"]
    yield f"# ortspec benchmark — {result['label']}"
    yield ""
    yield (
        f"Generated by `{result['command']}` on {result['date_utc']}. Model `{cfg['model_dir']}` "
        f"({cfg['precision']}), {cfg['threads']} intra-op threads for every engine, "
        f"{cfg['n_per_category']} prompts per category, {cfg['max_new_tokens']} new tokens, "
        f"{cfg['repeat']} run(s) per prompt and engine, engines interleaved per prompt."
    )
    yield ""
    versions = ", ".join(f"{k} {v}" for k, v in (mi.get("versions") or {}).items() if v)
    yield (
        f"Machine: {mi.get('cpu')}, cores {mi.get('cores')}, {mi.get('memory_gib')} GiB, {mi.get('os')}, "
        f"{mi.get('python')}. Versions: {versions}."
    )
    yield f"Workloads digest `{wl['digest'][:16]}` ({wl['count']} prompts, text from {wl['python']}'s stdlib)."
    if result["missing"]:
        yield ""
        yield "**Missing engines** (not run, not faked): " + "; ".join(
            f"`{k}`: {v}" for k, v in result["missing"].items()
        )
    yield ""
    yield (
        "Medians over prompts. tok/s e2e = new tokens ÷ total time (prefill included); decode tok/s = "
        "(new − 1) ÷ (total − TTFT); acceptance = accepted ÷ verified draft tokens; tokens/step = tokens "
        "per target pass after the prefill; passes = target forward passes (ortspec: prefill + steps; "
        "ORT GenAI n-gram and draft model: its reported target_forward_passes + standard_fallback_steps; "
        "greedy peers: one per token); identical = runs whose tokens equal ortspec-greedy's (EOS removed); disturbed = "
        f"runs during which other processes used > {cfg['contention_threshold']} cores."
    )
    if any(e in SAMPLED_ENGINES for e in result["engines_run"]):
        options = ", ".join(f"{k} {v}" for k, v in ((result.get("sampling") or {}).get("options") or {}).items())
        yield ""
        yield (
            f"Sampled engines ({options}) get one seed per prompt, the same for every engine "
            f"({(result.get('sampling') or {}).get('seed_rule', 'see the results file')}); their identical column "
            f"counts runs whose tokens equal the plain sampled run of the same family at that seed "
            f"({SAMPLED_SPEC}: {SAMPLED_REFERENCE}'s; {SAMPLED_NGRAM_PEER}: {SAMPLED_PEER}'s). ORT GenAI's RNG is "
            "not ortspec's, so its sampled tokens are not compared with ortspec's."
        )
    yield ""
    yield (
        f"Noise control: before each prompt's engine group the suite waited up to {cfg.get('wait_quiet_s')} s "
        f"for a quiet machine, and re-ran a group with a disturbed run up to {cfg.get('retry_disturbed')} "
        f"time(s) ({result.get('retries_used', 0)} re-runs); {result.get('disturbed_runs', 0)} of "
        f"{len(result.get('runs', []))} kept runs are still flagged disturbed."
    )


TABLE_HEAD = (
    "| engine | tok/s e2e | decode tok/s | TTFT s | acceptance | tokens/step | passes | identical | disturbed |"
)


def _category_tables(result: dict[str, Any]) -> Iterator[str]:
    table = result["summary"]["table"]
    for cat in [*result["config"]["categories"], "all"]:
        rows = table.get(cat, {})
        if not rows:
            continue
        yield ""
        yield f"## {cat}"
        yield ""
        yield TABLE_HEAD
        yield "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        for e in result["engines_run"]:
            v = rows.get(e)
            if v is None:
                continue
            ident = "ref" if is_reference(e) else f"{v['identical']}/{v['compared']}"
            acceptance = v["acceptance"] * 100 if v["acceptance"] is not None else None
            yield (
                f"| {e} | {_fmt(v['e2e_tok_s'])} | {_fmt(v['decode_tok_s'])} | {_fmt(v['ttft_s'], 3)} | "
                f"{_fmt(acceptance, 0, '%')} | "
                f"{_fmt(v['tokens_per_step'], 2)} | {_fmt(v['passes'], 0)} | {ident} | {v['disturbed']}/{v['runs']} |"
            )


RATIO_TITLES = {
    "vs_ortgenai_e2e": "Each engine ÷ ORT GenAI greedy, tok/s end to end",
    "vs_ortgenai_decode": "Each engine ÷ ORT GenAI greedy, decode tok/s",
    "spec_vs_ortgenai_ngram_e2e": "ortspec speculative ÷ ORT GenAI n-gram, tok/s end to end",
    "spec_vs_ortgenai_ngram_decode": "ortspec speculative ÷ ORT GenAI n-gram, decode tok/s",
    "spec_vs_ortspec_greedy_e2e": "ortspec speculative ÷ ortspec greedy, tok/s end to end",
    "spec_vs_ortspec_greedy_decode": "ortspec speculative ÷ ortspec greedy, decode tok/s",
}


def _ratio_tables(result: dict[str, Any]) -> Iterator[str]:
    cats = [*result["config"]["categories"], "all"]
    yield ""
    yield "## Ratios"
    yield ""
    yield "Medians of per-prompt ratios (each pair ran back to back on the same prompt)."
    for key, title in RATIO_TITLES.items():
        tab = result["summary"]["ratios"].get(key, {})
        rows = [(e, tab[e]) for e in result["engines_run"] if e in tab and any(tab[e].values())]
        if not rows:
            continue
        yield ""
        yield f"### {title}"
        yield ""
        yield "| engine | " + " | ".join(cats) + " |"
        yield "| --- |" + " ---: |" * len(cats)
        for e, per in rows:
            yield f"| {e} | " + " | ".join(_ratio_cell(per.get(c)) for c in cats) + " |"


def _ratio(result: dict[str, Any], key: str, engine: str, cat: str) -> dict | None:
    return ((result["summary"]["ratios"].get(key) or {}).get(engine) or {}).get(cat)


def _identity_cell(row: dict[str, Any] | None) -> str:
    return f"{row['identical']}/{row['compared']}" if row else "—"


def _sampled(result: dict[str, Any]) -> Iterator[str]:
    """The sampled column: ortspec's sampled speculation priced against plain sampling and against ORT GenAI's
    sampled n-gram speculation, identities, and the issue's targets."""
    if not any(e in SAMPLED_ENGINES for e in result["engines_run"]):
        return
    sampling = result.get("sampling") or {}
    options = ", ".join(f"{k} {v}" for k, v in (sampling.get("options") or {}).items())
    cats = [*result["config"]["categories"], "all"]
    table = result["summary"]["table"]
    yield ""
    yield "## Sampled"
    yield ""
    yield (
        f"Sampling at {options}, one seed per prompt shared by every engine. Medians of per-prompt ratios "
        f"(e2e = tok/s end to end, dec = decode tok/s). spec = each sampled speculative setting that ran "
        f"(`{SAMPLED_SPEC}`: prompt lookup, cost-aware width; `{SAMPLED_AUTO}`: auto, its drafter coupled), "
        f"plain = `{SAMPLED_REFERENCE}`; ORT n-gram = `{SAMPLED_NGRAM_PEER}`, ORT plain = `{SAMPLED_PEER}`. "
        "identical: spec's tokens equal plain's at the same seed (ortspec's exactness); ORT identical: ORT GenAI's "
        "n-gram tokens equal its own plain sampling's at the same seed (a fact about the peer, no target)."
    )
    yield ""
    yield (
        "| category | spec | spec ÷ plain e2e | spec ÷ plain dec | acceptance | identical | spec ÷ ORT n-gram e2e | "
        "spec ÷ ORT n-gram dec | plain ÷ ORT plain e2e | ORT n-gram ÷ ORT plain e2e | ORT n-gram ÷ ORT plain dec | "
        "ORT identical |"
    )
    yield "| --- | --- |" + " ---: |" * 10
    ran = [e for e in SAMPLED_SPECS if e in result["engines_run"]] or [SAMPLED_SPEC]
    for cat in cats:
        rows = table.get(cat, {})
        for name in ran:
            spec = rows.get(name)
            if spec is None and SAMPLED_NGRAM_PEER not in rows:
                continue
            yield f"| {cat} | {name} | " + " | ".join(_sampled_cells(result, rows, spec, name, cat)) + " |"
    yield from _target_lines(
        sampling.get("targets") or [],
        "Targets (tok/s end to end, medians of per-prompt ratios on the same prompts and seeds):",
    )


def _sampled_cells(result: dict[str, Any], rows: dict[str, Any], spec: dict | None, name: str, cat: str) -> list[str]:
    """One sampled speculative setting's cells on ``cat`` (``spec``: its summary row, if it ran there)."""
    acceptance = spec["acceptance"] * 100 if spec and spec["acceptance"] is not None else None
    return [
        _ratio_cell(_ratio(result, "sampled_spec_vs_sampled_plain_e2e", name, cat)),
        _ratio_cell(_ratio(result, "sampled_spec_vs_sampled_plain_decode", name, cat)),
        _fmt(acceptance, 0, "%"),
        _identity_cell(spec),
        _ratio_cell(_ratio(result, "sampled_spec_vs_ortgenai_ngram_sampled_e2e", name, cat)),
        _ratio_cell(_ratio(result, "sampled_spec_vs_ortgenai_ngram_sampled_decode", name, cat)),
        _ratio_cell(_ratio(result, "sampled_vs_ortgenai_sampled_e2e", SAMPLED_REFERENCE, cat)),
        _ratio_cell(_ratio(result, "ortgenai_ngram_sampled_vs_ortgenai_sampled_e2e", SAMPLED_NGRAM_PEER, cat)),
        _ratio_cell(_ratio(result, "ortgenai_ngram_sampled_vs_ortgenai_sampled_decode", SAMPLED_NGRAM_PEER, cat)),
        _identity_cell(rows.get(SAMPLED_NGRAM_PEER)),
    ]


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


def _target_lines(targets: Sequence[dict[str, Any]], heading: str) -> Iterator[str]:
    """``heading`` and one line per target (``sampled_targets``'s records): measured, target, met or missed."""
    if not targets:
        return
    yield ""
    yield heading
    yield ""
    for t in targets:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "missed")
        measured = "—" if t["measured"] is None else f"{t['measured']:.2f}x"
        yield (
            f"- {t['what']} on {t['category']}: {measured} over {t['prompts']} prompts "
            f"(target >= {t['target_at_least']:.2f}x): **{verdict}**"
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


def _identity(result: dict[str, Any]) -> Iterator[str]:
    if result.get("prompt_checks"):
        yield ""
        yield "## Prompt identity"
        yield ""
        for k, v in result["prompt_checks"].items():
            yield f"- `{k}`: {v['summary']}"
    yield ""
    yield "## Identity failures"
    yield ""
    everything = result.get("mismatches") or []
    mism = [m for m in everything if m["engine"] != SAMPLED_NGRAM_PEER]
    sampled = any(e in SAMPLED_ENGINES for e in result["engines_run"])
    if not mism:
        yield (
            "None: every run equals its reference token for token (ortspec-greedy; for ortspec's sampled "
            f"speculation, {SAMPLED_REFERENCE} at the same seed)."
            if sampled
            else "None: every run equals ortspec-greedy token for token."
        )
    yield from _mismatch_lines(mism)
    peer = [m for m in everything if m["engine"] == SAMPLED_NGRAM_PEER]
    if SAMPLED_NGRAM_PEER in result["engines_run"]:
        yield ""
        yield "## ORT GenAI sampled n-gram vs its plain sampling (a fact, no target)"
        yield ""
        ident = (result.get("identity") or {}).get(SAMPLED_NGRAM_PEER) or {}
        yield (
            f"`{SAMPLED_NGRAM_PEER}` equalled `{SAMPLED_PEER}` at the same seed on {ident.get('identical', 0)} of "
            f"{ident.get('compared', 0)} runs." + (" Differences:" if peer else "")
        )
        if peer:
            yield ""
        yield from _mismatch_lines(peer)


def _mismatch_lines(mism: Sequence[dict[str, Any]]) -> Iterator[str]:
    for m in mism:
        against = f" against `{m['reference']}`" if m.get("reference") else ""
        yield (
            f"- `{m['engine']}` on `{m['workload']}` (repeat {m['repeat']}){against}: first difference at new token "
            f"{m['first_mismatch']} ({m['reference_len']} vs {m['len']} tokens); reference "
            f"{json.dumps(m['reference_text'])} vs {json.dumps(m['text'])}"
        )


SECTIONS = (_header, _category_tables, _ratio_tables, _sampled, _drafter, _physical, _overhead, _identity)


def markdown(result: dict[str, Any]) -> str:
    """The results file's markdown: header, per-category tables, ratios, the sampled column (when sampled
    engines ran), physical limits, driver overhead, prompt identity and identity failures."""
    return "\n".join([line for section in SECTIONS for line in section(result)] + [""])


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    path.write_text(markdown(result), encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------
# Plot and files
# --------------------------------------------------------------------------------------------------------------


def write_plot(path: Path, result: dict[str, Any]) -> str | None:
    """Bars of tokens/s (end to end, decode) by engine and category; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable: {exc}"
    cats = [*result["config"]["categories"], "all"]
    engines = result["engines_run"]
    table = result["summary"]["table"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / max(len(engines), 1)
    cmap = plt.get_cmap("tab10" if len(engines) <= 10 else "tab20")
    colors = 10 if len(engines) <= 10 else 20
    for ax, metric, title in (
        (axes[0], "e2e_tok_s", "tokens/s end to end (prefill included)"),
        (axes[1], "decode_tok_s", "decode tokens/s (after the first token)"),
    ):
        for i, e in enumerate(engines):
            vals = [(table.get(c, {}).get(e) or {}).get(metric) or 0.0 for c in cats]
            xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(cats))]
            ax.bar(xs, vals, width, label=e, color=cmap(i % colors))
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats)
        ax.set_ylabel("tokens/s (median over prompts)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    cfg = result["config"]
    fig.suptitle(
        f"{Path(cfg['model_dir']).name}, {cfg['threads']} threads, {cfg['max_new_tokens']} new tokens, "
        f"{cfg['n_per_category']} prompts/category"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_results(out_dir: Path, label: str, result: dict[str, Any]) -> list[Path]:
    """``results-<label>.json``, ``results-<label>.md`` and ``tokens_per_second-<label>.png`` in ``out_dir``
    (without the plot, and ``result["plot_error"]`` saying why, when it cannot be drawn); returns the paths
    written."""
    json_path = out_dir / f"results-{label}.json"
    md_path = out_dir / f"results-{label}.md"
    png_path = out_dir / f"tokens_per_second-{label}.png"
    plot_error = write_plot(png_path, result)
    if plot_error:
        result["plot_error"] = plot_error
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    write_markdown(md_path, result)
    return [json_path, md_path] + ([] if plot_error else [png_path])
