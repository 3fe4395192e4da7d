"""What the suite reports: every run's record and metrics (``RunRecord``), the summaries over them (medians per
engine and category, paired ratios, identity) and the targets they are judged on (the sampled column's, the
drafter's). ``bench.report_files`` writes the three result files (JSON, markdown, plot); the markdown's sections are
``bench.report_tables``' (header, tables, ratios, the sampled column, identity) and ``bench.report_measurements``'
(physical limits, the drafter, driver overhead)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
