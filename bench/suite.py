"""The side-by-side benchmark: ortspec (greedy and speculative) against ONNX Runtime GenAI and onnx_genai.

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
``ortgenai``                  ONNX Runtime GenAI greedy
``ortgenai-ngram``            ONNX Runtime GenAI n-gram speculation (ngram_size=3, max_draft_tokens=8)
``onnx_genai``                onnx_genai greedy, a fresh engine per run (no prefix-cache hits)

A peer that cannot be imported or loaded is listed under ``missing`` with the reason; nothing is faked.

Every engine gets the prompt as the token ids of ``bench.workloads.encode_chat`` (ORT GenAI takes the ids;
onnx_genai takes text only, so it gets the decoded ids, and the suite checks that its own tokenizer turns that
text back into exactly the same ids). Identity is token for token against ``ortspec-greedy`` on the same
prompt, after removing a final EOS token from both sides (the peers drop it, ortspec keeps it); new-token
counts exclude that EOS for every engine.

Timing, for every engine: the clock starts with the prompt ids in hand; ``ttft`` is the time to the first new
token (prefill included); ``tok/s e2e`` = new tokens / total time; ``decode tok/s`` = (new - 1) / (total -
ttft). Per engine and category the tables show medians over prompts (each prompt's value being the median over
``--repeat`` runs). Ratios are medians of per-prompt ratios (the engines ran back to back on each prompt, so
the pairs share the machine's state). ``CpuContention`` is recorded around every run; a run during which other
processes used more than ``--contention-threshold`` cores on average is flagged ``disturbed``.

``--quick`` checks that the suite works (not speed): a tiny random-weight model made on the fly, 2 prompts per
category, 16 new tokens, results in ``--out`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_ENGINES = ("ortspec-lookup-w8", "ortspec-lookup-w4", "ortspec-lookup-adaptive", "ortspec-lookup-additive")
ORTSPEC_ENGINES = ("ortspec-greedy", *SPEC_ENGINES)
PEER_ENGINES = ("ortgenai", "ortgenai-ngram", "onnx_genai")
ALL_ENGINES = (*ORTSPEC_ENGINES, *PEER_ENGINES)
REFERENCE = "ortspec-greedy"
BASELINE = "ortgenai"
NGRAM_PEER = "ortgenai-ngram"
KMAX = 16

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"


# --------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else None


def _decode_rate(n: int, ttft: float, total: float) -> float | None:
    span = total - ttft
    if n <= 1 or span <= 0:
        return None
    return (n - 1) / span


def _strip_eos(ids: Sequence[int], eos: frozenset[int]) -> list[int]:
    ids = [int(t) for t in ids]
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    return ids


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _round(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return round(x, nd)
    return x


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------------------------------------------
# Backend timing proxy (driver + core + proposer overhead)
# --------------------------------------------------------------------------------------------------------------


class TimingBackend:
    """Forwards the backend protocol to ``inner`` and adds up the wall time spent inside its calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def decode(self, tokens, past):
        return self._timed(self.inner.decode, tokens, past)

    def decode_verify(self, tokens, base):
        return self._timed(self.inner.decode_verify, tokens, base)

    def rewind(self, length):
        return self._timed(self.inner.rewind, length)

    def reset(self):
        return self._timed(self.inner.reset)

    def current_len(self):
        return self._timed(self.inner.current_len)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_length(self) -> int:
        return self.inner.max_length


# --------------------------------------------------------------------------------------------------------------
# Physical limits: weights per step, verify cost curve
# --------------------------------------------------------------------------------------------------------------


def weight_bytes(model_dir: Path) -> dict[str, Any]:
    """Bytes of weights a decode step streams: the initializers of the decoder graph.

    Initializers consumed only by ``Gather`` (embedding tables) are counted as one row each, since a step reads a
    single row of them. Also reports the files' sizes on disk.
    """
    cfg = json.loads((model_dir / "genai_config.json").read_text(encoding="utf-8"))
    name = cfg.get("model", {}).get("decoder", {}).get("filename", "model.onnx")
    onnx_path = model_dir / name
    files = {
        p.name: p.stat().st_size
        for p in sorted(model_dir.iterdir())
        if p.is_file() and (p.name == name or p.name.startswith(name + ".") or p.suffix == ".data")
    }
    out: dict[str, Any] = {"files": files, "file_bytes": sum(files.values())}
    try:
        import numpy as np
        import onnx
        from onnx import helper

        model = onnx.load(str(onnx_path), load_external_data=False)
        users: dict[str, set[str]] = {}
        for node in model.graph.node:
            for inp in node.input:
                users.setdefault(inp, set()).add(node.op_type)
        total = gather_only = gather_rows = 0
        for t in model.graph.initializer:
            n = int(np.prod(t.dims)) if len(t.dims) else 1
            size = n * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
            total += size
            if users.get(t.name) == {"Gather"} and len(t.dims) == 2 and t.dims[0] > 0:
                gather_only += size
                gather_rows += size // int(t.dims[0])
        out.update(
            {
                "initializer_bytes": total,
                "gather_only_bytes": gather_only,
                "bytes_per_step": total - gather_only + gather_rows,
                "method": "sum of initializer sizes (onnx.load without external data); tables read only by "
                "Gather counted as one row",
            }
        )
    except Exception as exc:  # noqa: BLE001 - onnx missing or unreadable: fall back to file sizes
        out.update({"bytes_per_step": out["file_bytes"], "method": f"file sizes (onnx unavailable: {exc})"})
    return out


def kv_bytes_per_step(model_dir: Path, context: int) -> int:
    """KV bytes read by one decode step at ``context`` positions (float32/float16 from the graph)."""
    cfg = json.loads((model_dir / "genai_config.json").read_text(encoding="utf-8"))
    dec = cfg["model"]["decoder"]
    head = int(dec.get("head_size") or int(dec["hidden_size"]) // int(dec["num_attention_heads"]))
    itemsize = 4
    try:
        import onnx

        model = onnx.load(str(model_dir / dec.get("filename", "model.onnx")), load_external_data=False)
        for vi in model.graph.input:
            if vi.name.startswith("past_key_values"):
                itemsize = 2 if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else 4
                break
    except Exception:  # noqa: BLE001
        pass
    return context * int(dec["num_hidden_layers"]) * 2 * int(dec["num_key_value_heads"]) * head * itemsize


def measure_cost_curve(
    backend, context_ids: Sequence[int], feed_ids: Sequence[int], kmax: int = KMAX, repeats: int = 15
) -> dict[str, Any]:
    """The verify cost curve (see ``ortspec.costs.measure_pass_costs``)."""
    from ortspec.costs import measure_pass_costs

    return measure_pass_costs(backend, context_ids, feed_ids, kmax, repeats)


# --------------------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
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
        return _decode_rate(self.new_tokens, self.ttft_s, self.total_s) if self.error is None else None

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

    def to_dict(self, keep_ids: bool) -> dict:
        d = {
            "engine": self.engine,
            "workload": self.workload,
            "category": self.category,
            "repeat": self.repeat,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": _round(self.ttft_s, 5),
            "total_s": _round(self.total_s, 5),
            "e2e_tok_s": _round(self.e2e_tok_s, 3),
            "decode_tok_s": _round(self.decode_tok_s, 3),
            "acceptance": _round(self.acceptance, 4),
            "proposed": self.proposed,
            "accepted": self.accepted,
            "passes": self.passes,
            "decode_passes": self.decode_passes,
            "tokens_per_step": _round(self.tokens_per_step, 3),
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


class OrtspecEngine:
    """One ortspec setting on a shared ``Engine``."""

    def __init__(
        self, name: str, engine, make_proposer: Callable[[], Any] | None, draft_width: Any, description: dict
    ) -> None:
        self.name = name
        self.engine = engine
        self.make_proposer = make_proposer
        self.draft_width = draft_width
        self.description = description

    def warmup(self, ids: Sequence[int]) -> None:
        self.engine.generate(
            list(ids),
            max_tokens=8,
            speculative=self.make_proposer() if self.make_proposer else None,
            draft_width=self.draft_width,
        )

    def run(self, ids: Sequence[int], max_new: int) -> dict:
        r = self.engine.generate(
            list(ids),
            max_tokens=max_new,
            speculative=self.make_proposer() if self.make_proposer else None,
            draft_width=self.draft_width,
        )
        s = r.stats
        return {
            "token_ids": list(r.token_ids),
            "finish_reason": r.finish_reason.openai,
            "ttft_s": r.timings.first_token_s,
            "total_s": r.timings.total_s,
            "prompt_tokens": r.prompt_tokens,
            "proposed": s.proposed_tokens if self.make_proposer else None,
            "accepted": s.accepted_tokens if self.make_proposer else None,
            "passes": s.steps,
            "decode_passes": s.steps,
            "extra": {
                "verification_steps": s.verification_steps,
                "multi_token_accepts": s.multi_token_accepts,
                "prefill_s": r.timings.prefill_s,
            },
        }

    def describe(self) -> dict:
        return dict(self.description)


class PeerEngine:
    """A ``bench.peers`` runner behind the suite's interface."""

    def __init__(self, name: str, runner) -> None:
        self.name = name
        self.runner = runner

    def warmup(self, ids: Sequence[int]) -> None:
        self.runner.warmup(list(ids), 8)

    def run(self, ids: Sequence[int], max_new: int) -> dict:
        r = self.runner.run(list(ids), max_new)
        extra = dict(r.extra)
        if r.finish_reason == "length" and r.new_tokens < max_new:
            # ORT GenAI 0.18 leaves the EOS token out of get_sequence(), so its runner cannot see it: a run that
            # ended before the budget ended at EOS.
            extra["peer_finish_reason"] = r.finish_reason
            r.finish_reason = "stop"
        proposed = accepted = passes = decode_passes = None
        n_with_eos = r.new_tokens + (1 if r.finish_reason == "stop" else 0)
        spec = extra.get("speculative_stats")
        if spec:
            proposed = spec.get("draft_tokens_evaluated")
            accepted = spec.get("draft_tokens_accepted")
            if "target_forward_passes" in spec and "standard_fallback_steps" in spec:
                decode_passes = int(spec["target_forward_passes"]) + int(spec["standard_fallback_steps"])
                passes = decode_passes
        elif self.name in ("ortgenai", "onnx_genai"):
            # greedy: the prefill pass yields the first token, then one pass per further token (EOS included)
            passes = decode_passes = n_with_eos
        return {
            "token_ids": list(r.token_ids),
            "finish_reason": r.finish_reason,
            "ttft_s": r.ttft_s,
            "total_s": r.total_s,
            "prompt_tokens": r.prompt_tokens,
            "proposed": proposed,
            "accepted": accepted,
            "passes": passes,
            "decode_passes": decode_passes,
            "extra": extra,
        }

    def describe(self) -> dict:
        return self.runner.describe()

    def close(self) -> None:
        self.runner.close()


def build_ortspec_engines(names: Sequence[str], engine, pass_costs: Sequence[float]) -> dict[str, OrtspecEngine]:
    from ortspec.core import PromptLookup
    from ortspec.core.width import AdditiveWidth, CostAwareWidth

    out: dict[str, OrtspecEngine] = {}
    for name in names:
        if name == "ortspec-greedy":
            out[name] = OrtspecEngine(name, engine, None, 8, {"speculative": None})
        elif name in ("ortspec-lookup-w8", "ortspec-lookup-w4"):
            w = 8 if name.endswith("w8") else 4
            out[name] = OrtspecEngine(
                name,
                engine,
                lambda: PromptLookup(ngram=3, max_draft=8),
                w,
                {"proposer": "PromptLookup(ngram=3, max_draft=8)", "draft_width": w},
            )
        elif name == "ortspec-lookup-adaptive":
            policy = CostAwareWidth(pass_costs=tuple(float(c) for c in pass_costs))
            out[name] = OrtspecEngine(
                name,
                engine,
                lambda: PromptLookup(ngram=3, max_draft=KMAX),
                policy,
                {
                    "proposer": f"PromptLookup(ngram=3, max_draft={KMAX})",
                    "draft_width": "CostAwareWidth(pass_costs=measured verify cost curve)",
                    "pass_costs": [round(c, 4) for c in pass_costs],
                },
            )
        elif name == "ortspec-lookup-additive":
            policy = AdditiveWidth(maximum=KMAX)
            out[name] = OrtspecEngine(
                name,
                engine,
                lambda: PromptLookup(ngram=3, max_draft=KMAX),
                policy,
                {
                    "proposer": f"PromptLookup(ngram=3, max_draft={KMAX})",
                    "draft_width": f"AdditiveWidth(current=4, maximum={KMAX}, +2/-1)",
                },
            )
    return out


# --------------------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------------------

METRICS = ("e2e_tok_s", "decode_tok_s", "ttft_s", "acceptance", "tokens_per_step", "passes")


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


def summarize(records: Sequence[RunRecord], engines: Sequence[str], categories: Sequence[str]) -> dict[str, Any]:
    """Per category (and "all"): per engine medians over prompts; the ratio tables."""
    pp = per_prompt(records)
    cats = [*categories, "all"]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for cat in cats:
        table[cat] = {}
        for e in engines:
            rows = [v for (eng, _), v in pp.items() if eng == e and (cat == "all" or v["category"] == cat)]
            if not rows:
                continue
            entry = {m: _median([v[m] for v in rows]) for m in METRICS}
            entry["prompts"] = len(rows)
            entry["identical"] = sum(v["identical"] for v in rows)
            entry["compared"] = sum(v["compared"] for v in rows)
            entry["disturbed"] = sum(v["disturbed"] for v in rows)
            entry["runs"] = sum(v["runs"] for v in rows)
            entry["errors"] = sum(v["errors"] for v in rows)
            table[cat][e] = entry

    def paired(num: str, den: str, metric: str, cat: str) -> dict[str, Any] | None:
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

    ratios: dict[str, Any] = {
        "vs_ortgenai_e2e": {},
        "vs_ortgenai_decode": {},
        "spec_vs_ortgenai_ngram_e2e": {},
        "spec_vs_ortgenai_ngram_decode": {},
        "spec_vs_ortspec_greedy_e2e": {},
        "spec_vs_ortspec_greedy_decode": {},
    }
    for e in engines:
        for cat in cats:
            if e != BASELINE:
                ratios["vs_ortgenai_e2e"].setdefault(e, {})[cat] = paired(e, BASELINE, "e2e_tok_s", cat)
                ratios["vs_ortgenai_decode"].setdefault(e, {})[cat] = paired(e, BASELINE, "decode_tok_s", cat)
            if e in SPEC_ENGINES:
                ratios["spec_vs_ortgenai_ngram_e2e"].setdefault(e, {})[cat] = paired(e, NGRAM_PEER, "e2e_tok_s", cat)
                ratios["spec_vs_ortgenai_ngram_decode"].setdefault(e, {})[cat] = paired(
                    e, NGRAM_PEER, "decode_tok_s", cat
                )
                ratios["spec_vs_ortspec_greedy_e2e"].setdefault(e, {})[cat] = paired(e, REFERENCE, "e2e_tok_s", cat)
                ratios["spec_vs_ortspec_greedy_decode"].setdefault(e, {})[cat] = paired(
                    e, REFERENCE, "decode_tok_s", cat
                )
    return {
        "table": table,
        "ratios": ratios,
        "per_prompt": {f"{e}|{w}": {k: _round(v, 4) for k, v in d.items()} for (e, w), d in sorted(pp.items())},
    }


# --------------------------------------------------------------------------------------------------------------
# Output
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


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    s = result["summary"]
    cats = result["config"]["categories"]
    engines = result["engines_run"]
    lines: list[str] = []
    cfg = result["config"]
    mi = result["machine"]
    lines.append(f"# ortspec benchmark — {result['label']}")
    lines.append("")
    lines.append(
        f"Generated by `{result['command']}` on {result['date_utc']}. Model `{cfg['model_dir']}` "
        f"({cfg['precision']}), {cfg['threads']} intra-op threads for every engine, "
        f"{cfg['n_per_category']} prompts per category, {cfg['max_new_tokens']} new tokens, "
        f"{cfg['repeat']} run(s) per prompt and engine, engines interleaved per prompt."
    )
    lines.append("")
    lines.append(
        f"Machine: {mi.get('cpu')}, cores {mi.get('cores')}, {mi.get('memory_gib')} GiB, {mi.get('os')}, "
        f"{mi.get('python')}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in (mi.get("versions") or {}).items() if v)
        + "."
    )
    lines.append(
        f"Workloads digest `{result['workloads']['digest'][:16]}` ({result['workloads']['count']} prompts, "
        f"text from {result['workloads']['python']}'s stdlib)."
    )
    if result["missing"]:
        lines.append("")
        lines.append(
            "**Missing engines** (not run, not faked): "
            + "; ".join(f"`{k}`: {v}" for k, v in result["missing"].items())
        )
    lines.append("")
    lines.append(
        "Medians over prompts. tok/s e2e = new tokens ÷ total time (prefill included); decode tok/s = "
        "(new − 1) ÷ (total − TTFT); acceptance = accepted ÷ verified draft tokens; tokens/step = tokens "
        "per target pass after the prefill; passes = target forward passes (ortspec: prefill + steps; "
        "ORT GenAI n-gram: its reported target_forward_passes + standard_fallback_steps; greedy peers: "
        "one per token); identical = runs whose tokens equal ortspec-greedy's (EOS removed); disturbed = "
        f"runs during which other processes used > {cfg['contention_threshold']} cores."
    )
    lines.append("")
    lines.append(
        f"Noise control: before each prompt's engine group the suite waited up to {cfg.get('wait_quiet_s')} s "
        f"for a quiet machine, and re-ran a group with a disturbed run up to {cfg.get('retry_disturbed')} "
        f"time(s) ({result.get('retries_used', 0)} re-runs); {result.get('disturbed_runs', 0)} of "
        f"{len(result.get('runs', []))} kept runs are still flagged disturbed."
    )
    for cat in [*cats, "all"]:
        rows = s["table"].get(cat, {})
        if not rows:
            continue
        lines.append("")
        lines.append(f"## {cat}")
        lines.append("")
        lines.append(
            "| engine | tok/s e2e | decode tok/s | TTFT s | acceptance | tokens/step | passes | identical | disturbed |"
        )
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for e in engines:
            v = rows.get(e)
            if v is None:
                continue
            ident = "ref" if e == REFERENCE else f"{v['identical']}/{v['compared']}"
            lines.append(
                f"| {e} | {_fmt(v['e2e_tok_s'])} | {_fmt(v['decode_tok_s'])} | {_fmt(v['ttft_s'], 3)} | "
                f"{_fmt(v['acceptance'] * 100 if v['acceptance'] is not None else None, 0, '%')} | "
                f"{_fmt(v['tokens_per_step'], 2)} | {_fmt(v['passes'], 0)} | {ident} | {v['disturbed']}/{v['runs']} |"
            )

    def ratio_table(title: str, key: str, note: str) -> None:
        tab = s["ratios"].get(key, {})
        rows = [(e, tab[e]) for e in engines if e in tab and any(tab[e].values())]
        if not rows:
            return
        lines.append("")
        lines.append(f"### {title}")
        lines.append("")
        if note:
            lines.append(note)
            lines.append("")
        lines.append("| engine | " + " | ".join([*cats, "all"]) + " |")
        lines.append("| --- |" + " ---: |" * (len(cats) + 1))
        for e, per in rows:
            lines.append(f"| {e} | " + " | ".join(_ratio_cell(per.get(c)) for c in [*cats, "all"]) + " |")

    lines.append("")
    lines.append("## Ratios")
    lines.append("")
    lines.append("Medians of per-prompt ratios (each pair ran back to back on the same prompt).")
    ratio_table("Each engine ÷ ORT GenAI greedy, tok/s end to end", "vs_ortgenai_e2e", "")
    ratio_table("Each engine ÷ ORT GenAI greedy, decode tok/s", "vs_ortgenai_decode", "")
    ratio_table("ortspec speculative ÷ ORT GenAI n-gram, tok/s end to end", "spec_vs_ortgenai_ngram_e2e", "")
    ratio_table("ortspec speculative ÷ ORT GenAI n-gram, decode tok/s", "spec_vs_ortgenai_ngram_decode", "")
    ratio_table("ortspec speculative ÷ ortspec greedy, tok/s end to end", "spec_vs_ortspec_greedy_e2e", "")
    ratio_table("ortspec speculative ÷ ortspec greedy, decode tok/s", "spec_vs_ortspec_greedy_decode", "")

    cc = result.get("cost_curve")
    cc_end = result.get("cost_curve_end")
    phys = result.get("physical", {})
    lines.append("")
    lines.append("## Physical limits")
    if cc:
        lines.append("")
        lines.append(
            f"Verify cost curve on OrtBackend at a {cc['context_tokens']}-token context: one pass over the "
            f"pending token + K draft tokens (`decode_verify` of K + 1 tokens; K = 0 is a 1-token `decode`), "
            f"median of {cc['repeats']} interleaved samples, rewound after each. The curve measured before "
            "the runs is the `pass_costs` of `ortspec-lookup-adaptive`; it is measured again after the runs. "
            "Each is re-measured while other processes disturb it."
        )
        lines.append("")
        lines.append("| K | " + " | ".join(str(k) for k in range(len(cc["curve"]))) + " |")
        lines.append("| --- |" + " ---: |" * len(cc["curve"]))
        for c in (cc, cc_end):
            if not c:
                continue
            others = (c.get("contention") or {}).get("others_cores")
            tag = f"{c.get('when', 'start')}, others {others} cores"
            lines.append(f"| ms ({tag}) | " + " | ".join(f"{t * 1000:.1f}" for t in c["pass_s"]) + " |")
            lines.append(
                f"| ÷ decode ({c.get('when', 'start')}) | " + " | ".join(f"{x:.2f}" for x in c["curve"]) + " |"
            )
    bw = phys.get("bandwidth", {})
    wb = phys.get("weights", {})
    if bw or wb:
        lines.append("")
        lines.append("| quantity | value |")
        lines.append("| --- | ---: |")
        if bw:
            lines.append(f"| copy bandwidth, 1 thread (numpy, read + write) | {bw.get('copy_gb_s')} GB/s |")
            for t, v in (bw.get("per_threads") or {}).items():
                if t == "1":
                    continue
                lines.append(f"| copy bandwidth, {t} Python thread(s) | {v} GB/s |")
            lines.append(
                f"| bandwidth used for the fractions (best copy figure, measured at the start and the end of "
                f"the suite) | {phys.get('bandwidth_gb_s')} GB/s |"
            )
        if wb:
            lines.append(f"| weight bytes per decode step | {wb.get('bytes_per_step', 0) / 1e6:.1f} MB |")
        if phys.get("kv_bytes_per_step") is not None:
            lines.append(
                f"| KV bytes per decode step at {phys.get('kv_context')} tokens | "
                f"{phys['kv_bytes_per_step'] / 1e6:.1f} MB |"
            )
        if phys.get("decode_step_s"):
            lines.append(
                f"| decode step (cost curve K = 0, the quieter measurement: {phys.get('decode_step_from')}) "
                f"| {phys['decode_step_s'] * 1000:.2f} ms |"
            )
            lines.append(f"| weights streamed per second in a decode step | {phys['achieved_gb_s']:.2f} GB/s |")
            lines.append(
                f"| achieved fraction of bandwidth (weights ÷ step ÷ bandwidth) | "
                f"{phys['achieved_fraction'] * 100:.0f}% |"
            )
            if phys.get("achieved_fraction_with_kv") is not None:
                lines.append(f"| achieved fraction, weights + KV | {phys['achieved_fraction_with_kv'] * 100:.0f}% |")
            lines.append(f"| bandwidth-bound ceiling (bandwidth ÷ weight bytes) | {phys['ceiling_tok_s']:.1f} tok/s |")
        if phys.get("greedy_backend_step_s"):
            lines.append(
                f"| backend time per step inside ortspec-greedy generations (overhead runs) → fraction | "
                f"{phys['greedy_backend_step_s'] * 1000:.2f} ms → {phys['greedy_backend_fraction'] * 100:.0f}% |"
            )
        if phys.get("greedy_decode_tok_s"):
            lines.append(
                f"| ortspec-greedy decode tok/s (median, all prompts) → fraction | "
                f"{phys['greedy_decode_tok_s']:.1f} → {phys['greedy_achieved_fraction'] * 100:.0f}% |"
            )
    if phys.get("decode_step_s"):
        lines.append("")
        lines.append(
            "The copy figure counts bytes read + bytes written; a decode step mostly reads, and a read-only "
            "stream can go faster than a copy, so a fraction near (or above) 100% means the step runs at the "
            "memory limit. Weight bytes: initializers of the graph (embedding tables read by Gather only "
            "would count one row)."
        )
    ov = result.get("overhead")
    if ov and ov.get("engines"):
        lines.append("")
        lines.append("## Driver overhead")
        lines.append("")
        lines.append(
            f"Time per decode step outside the backend (driver + core + proposer + detokenizer) = step wall "
            f"time − time inside backend calls, measured through a timing proxy in separate runs on "
            f"{ov['prompts']} prompts; % of a decode step ({_fmt(ov['decode_step_s'] * 1000, 2)} ms, cost "
            "curve K = 0) and of the same runs' backend time per step."
        )
        lines.append("")
        lines.append("| engine | steps | overhead µs/step (median) | % of a decode step | % of backend time/step |")
        lines.append("| --- | ---: | ---: | ---: | ---: |")
        for e, v in ov["engines"].items():
            lines.append(
                f"| {e} | {v['steps']} | {v['overhead_us_per_step']:.0f} | {v['pct_of_decode_step']:.2f}% | "
                f"{_fmt(v['pct_of_backend_step'], 2, '%')} |"
            )
    if result.get("prompt_checks"):
        pc = result["prompt_checks"]
        lines.append("")
        lines.append("## Prompt identity")
        lines.append("")
        for k, v in pc.items():
            lines.append(f"- `{k}`: {v['summary']}")
    mism = result.get("mismatches") or []
    lines.append("")
    lines.append("## Identity failures")
    lines.append("")
    if not mism:
        lines.append("None: every run equals ortspec-greedy token for token.")
    for m in mism:
        lines.append(
            f"- `{m['engine']}` on `{m['workload']}` (repeat {m['repeat']}): first difference at new token "
            f"{m['first_mismatch']} ({m['reference_len']} vs {m['len']} tokens); reference "
            f"{json.dumps(m['reference_text'])} vs {json.dumps(m['text'])}"
        )
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def write_plot(path: Path, result: dict[str, Any]) -> str | None:
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
    cmap = plt.get_cmap("tab10")
    for ax, metric, title in (
        (axes[0], "e2e_tok_s", "tokens/s end to end (prefill included)"),
        (axes[1], "decode_tok_s", "decode tokens/s (after the first token)"),
    ):
        for i, e in enumerate(engines):
            vals = [(table.get(c, {}).get(e) or {}).get(metric) or 0.0 for c in cats]
            xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(cats))]
            ax.bar(xs, vals, width, label=e, color=cmap(i % 10))
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


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="model folder (default: the cached SmolLM2 folder of --precision)")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "int8"),
        help="picks the default cached folder and names the output files (default fp32)",
    )
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine (default 2)")
    ap.add_argument("--categories", default="code_edit,summarize,qa_context,open_ended")
    ap.add_argument("--n-per-category", type=int, default=8)
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
    ap.add_argument("--out", help="output folder (default docs/bench/; --quick: a temporary folder)")
    ap.add_argument("--label", help="names the output files (default: --precision, or 'quick')")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="check the suite works on a tiny random model: 2 prompts/category, 16 tokens",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_per_category = min(args.n_per_category, 2) if "--n-per-category" in (argv or []) else 2
        if "--max-new-tokens" not in (argv or []):
            args.max_new_tokens = 16
        if "--cost-repeat" not in (argv or []):
            args.cost_repeat = 3
        if "--overhead-prompts" not in (argv or []):
            args.overhead_prompts = 1
        if "--max-prompt-tokens" not in (argv or []):
            args.max_prompt_tokens = 400
        if "--wait-quiet" not in (argv or []):
            args.wait_quiet = 0.0
        if "--retry-disturbed" not in (argv or []):
            args.retry_disturbed = 0
    return args


def _resolve_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.quick and not args.model_dir:
        from ortspec.adapters.convert import make_tiny_model

        return Path(make_tiny_model(workdir / "tiny-model", context=1024))
    if args.model_dir:
        return Path(args.model_dir).expanduser().resolve()
    from ortspec.adapters.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir(args.precision)
    if not is_complete(folder):
        print(f"bench.suite: converting the {args.precision} model into {folder} (first use)", file=sys.stderr)
        convert_smollm2(folder, args.precision)
    return folder


def run_suite(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    from bench.machine import CpuContention, background_load, machine_info, measure_memory_bandwidth
    from bench.peers import make_peer
    from bench.workloads import build_workloads, describe_workloads, encode_chat
    from ortspec.adapters.engine import Engine
    from ortspec.adapters.tokenizer import Tokenizer

    label = args.label or ("quick" if args.quick else args.precision)
    out_dir = Path(args.out) if args.out else (None if args.quick else DEFAULT_OUT)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="ortspec-suite-") if args.quick else contextlib.nullcontext(None)
    with tmp_ctx as tmp_name:
        workdir = Path(tmp_name) if tmp_name else Path(tempfile.gettempdir())
        if out_dir is None:
            out_dir = workdir / "out"
            print(f"bench.suite: --quick without --out writes into {out_dir} (removed at exit)", file=sys.stderr)
        out_dir.mkdir(parents=True, exist_ok=True)
        model_dir = _resolve_model(args, workdir)
        quiet = lambda: wait_quiet(args.wait_quiet, args.contention_threshold, background_load)  # noqa: E731
        result = _run(
            args,
            argv,
            label,
            out_dir,
            model_dir,
            workdir,
            tqdm,
            CpuContention,
            quiet,
            machine_info,
            measure_memory_bandwidth,
            make_peer,
            build_workloads,
            describe_workloads,
            encode_chat,
            Tokenizer.from_folder,
            Engine,
        )
        if tmp_name and not args.out:
            print(json.dumps(_headline(result), indent=2))
        return result


def _headline(result: dict[str, Any]) -> dict[str, Any]:
    t = result["summary"]["table"]
    return {cat: {e: _round(v.get("e2e_tok_s"), 1) for e, v in rows.items()} for cat, rows in t.items()}


def _run(
    args,
    argv,
    label,
    out_dir,
    model_dir,
    workdir,
    tqdm,
    CpuContention,
    quiet,
    machine_info,
    measure_memory_bandwidth,
    make_peer,
    build_workloads,
    describe_workloads,
    encode_chat,
    load_tokenizer,
    Engine,
) -> dict[str, Any]:
    t_suite = time.perf_counter()
    categories = [c for c in args.categories.split(",") if c]
    wanted = [e for e in args.engines.split(",") if e]
    unknown = [e for e in wanted if e not in ALL_ENGINES]
    if unknown:
        raise SystemExit(f"bench.suite: unknown engine(s) {unknown}; known: {', '.join(ALL_ENGINES)}")
    if REFERENCE not in wanted:
        wanted.insert(0, REFERENCE)  # identity needs the reference
    progress = not args.no_progress

    def log(msg: str) -> None:
        print(f"[suite {time.perf_counter() - t_suite:7.1f}s] {msg}", file=sys.stderr, flush=True)

    # -- workloads, as token ids ---------------------------------------------------------------------------
    tok = load_tokenizer(model_dir)
    workloads = build_workloads(
        args.n_per_category,
        args.max_prompt_tokens,
        tok,
        max_new_tokens=args.max_new_tokens,
        categories=categories,
    )
    prompts = [(w, encode_chat(w.messages, tok)) for w in workloads]
    wl_info = describe_workloads(workloads, tok)
    log(f"{len(prompts)} prompts, {min(len(i) for _, i in prompts)}-{max(len(i) for _, i in prompts)} tokens")

    # -- machine -------------------------------------------------------------------------------------------
    machine = machine_info()

    def bandwidth() -> dict[str, Any]:
        q = quiet()
        b = measure_memory_bandwidth(
            size_mib=64 if args.quick else 256,
            repeats=3 if args.quick else 9,
            threads=sorted({1, max(1, args.threads)}),
        )
        b["best_gb_s"] = max([b["copy_gb_s"], *[float(v) for v in (b.get("per_threads") or {}).values()]])
        b["quiet_wait"] = q
        return b

    bw_runs = [bandwidth()]
    log(f"bandwidth {bw_runs[0]['best_gb_s']} GB/s")

    # -- ortspec engine and the verify cost curve ----------------------------------------------------------
    engine = Engine.from_dir(model_dir, threads=args.threads, max_length=args.max_length)
    eos = frozenset(int(e) for e in engine.eos_token_ids)
    lens = sorted(len(i) for _, i in prompts)
    mid = min(lens[len(lens) // 2] + args.max_new_tokens // 2, engine.backend.max_length - KMAX - 2)
    pool = [t for _, ids in prompts for t in ids]
    while len(pool) < mid + KMAX + 1:
        pool = pool + pool

    def cost_curve(when: str) -> dict[str, Any]:
        """The curve, re-measured (up to --cost-attempts times) while other processes disturb it."""
        tries = []
        for attempt in range(max(1, args.cost_attempts)):
            q = quiet()
            with CpuContention() as cc:
                c = measure_cost_curve(engine.backend, pool[:mid], pool[mid : mid + KMAX + 1], KMAX, args.cost_repeat)
            c.update(quiet_wait=q, contention=cc.as_dict(), when=when, attempt=attempt + 1)
            c["disturbed"] = bool(cc.others_cores is not None and cc.others_cores > args.contention_threshold)
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

    log(f"verify cost curve at {mid} tokens, K = 0..{KMAX}, {args.cost_repeat} samples each")
    cost = cost_curve("start")

    engines: dict[str, Any] = dict(
        build_ortspec_engines([e for e in wanted if e in ORTSPEC_ENGINES], engine, cost["curve"])
    )
    missing: dict[str, str] = {}
    for name in [e for e in wanted if e in PEER_ENGINES]:
        opts: dict[str, Any] = {"ngram_size": 3, "max_draft_tokens": 8}
        if name == "onnx_genai":
            opts.update(fresh_engine="always", ttft="probe")
            if args.quick:
                opts["cache_root"] = str(workdir / "onnx_genai-cache")
        log(f"loading peer {name}")
        runner, why = make_peer(name, model_dir, threads=args.threads, **opts)
        if runner is None:
            missing[name] = why or "unavailable"
            log(f"peer {name} missing: {why}")
        else:
            engines[name] = PeerEngine(name, runner)
    order = [e for e in wanted if e in engines]

    # -- prompt identity across engines --------------------------------------------------------------------
    prompt_checks: dict[str, Any] = {}
    if "ortgenai" in engines or "ortgenai-ngram" in engines:
        prompt_checks["ortgenai"] = {
            "summary": "given the same token ids (GeneratorParams + append_tokens)",
            "same_ids": len(prompts),
        }
    if "onnx_genai" in engines:
        runner = engines["onnx_genai"].runner
        same, diffs = 0, []
        for w, ids in prompts:
            try:
                got = runner.retokenize(ids)
            except Exception as exc:  # noqa: BLE001
                got = None
                diffs.append({"workload": w.name, "error": str(exc)})
            if got == list(ids):
                same += 1
            elif got is not None:
                diffs.append(
                    {
                        "workload": w.name,
                        "first_mismatch": _first_mismatch(ids, got),
                        "len": len(got),
                        "expected_len": len(ids),
                    }
                )
        prompt_checks["onnx_genai"] = {
            "summary": f"takes text: gets the ids decoded; its tokenizer re-encodes {same}/{len(prompts)} prompts "
            "to exactly the same ids",
            "same_ids": same,
            "differences": diffs,
        }

    # -- warm-up ---------------------------------------------------------------------------------------------
    warm_ids = prompts[0][1]
    for name in order:
        log(f"warm-up {name}")
        engines[name].warmup(warm_ids)

    # -- interleaved runs --------------------------------------------------------------------------------------
    records: list[RunRecord] = []
    reference: dict[tuple[str, int], list[int]] = {}
    retries_used = 0
    total_runs = args.repeat * len(prompts) * len(order)
    bar = tqdm(
        total=total_runs,
        desc=f"bench.suite {label}",
        unit="run",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    for rep in range(args.repeat):
        for p_idx, (w, ids) in enumerate(prompts):
            shift = (p_idx + rep) % len(order)
            # the reference first so identity can be checked as runs arrive; the others rotate
            others = [e for e in order if e != REFERENCE]
            rot = others[shift % len(others) :] + others[: shift % len(others)] if others else []
            group_order = [REFERENCE, *rot] if p_idx % 2 == 0 else [*rot, REFERENCE]
            attempt = 0
            while True:
                q = quiet()
                group: list[RunRecord] = []
                for name in group_order:
                    rec = _one_run(engines[name], name, w, ids, rep, args, eos, CpuContention)
                    group.append(rec)
                    if attempt == 0:
                        bar.update(1)
                    bar.set_postfix_str(f"{name} {w.name[:28]} {rec.e2e_tok_s or 0:.1f} tok/s")
                if any(r.disturbed for r in group) and attempt < args.retry_disturbed:
                    attempt += 1
                    retries_used += 1
                    log(f"{w.name}: disturbed run(s), re-running the group (attempt {attempt + 1})")
                    time.sleep(2.0)
                    continue
                break
            for rec in group:
                rec.extra["attempts"] = attempt + 1
                rec.extra["quiet_wait"] = q
            ref = next(r for r in group if r.engine == REFERENCE)
            reference[(w.name, rep)] = ref.token_ids
            for rec in group:
                if rec.error is None and ref.error is None:
                    rec.identical = rec.token_ids == ref.token_ids
                    rec.first_mismatch = None if rec.identical else _first_mismatch(ref.token_ids, rec.token_ids)
            records.extend(group)
    bar.close()

    # -- the curve again, after the runs: the quieter of the two measurements gives the decode step time -------
    cost_end = cost_curve("end")
    cost_phys = min(
        (cost, cost_end),
        key=lambda c: ((c["contention"]["others_cores"] or 0.0) > args.contention_threshold, c["decode_step_s"]),
    )

    # -- overhead (driver + core + proposer), separate runs through a timing proxy --------------------------
    overhead = _measure_overhead(engine, prompts, categories, args, cost_phys["decode_step_s"], log, Engine)

    bw_runs.append(bandwidth())
    bw = max(bw_runs, key=lambda b: b["best_gb_s"])
    bw_best = bw["best_gb_s"]
    log(f"bandwidth at the end {bw_runs[-1]['best_gb_s']} GB/s; using {bw_best} GB/s")

    # -- aggregate -------------------------------------------------------------------------------------------
    summary = summarize(records, order, categories)
    greedy_all = summary["table"].get("all", {}).get(REFERENCE, {})
    wb = weight_bytes(model_dir)
    kv = kv_bytes_per_step(model_dir, cost["context_tokens"])
    step = cost_phys["decode_step_s"]
    physical: dict[str, Any] = {
        "bandwidth": bw,
        "bandwidth_runs": bw_runs,
        "bandwidth_gb_s": bw_best,
        "weights": wb,
        "kv_bytes_per_step": kv,
        "kv_context": cost["context_tokens"],
        "decode_step_s": step,
        "decode_step_from": cost_phys["when"],
        "achieved_gb_s": wb["bytes_per_step"] / step / 1e9,
        "achieved_fraction": wb["bytes_per_step"] / step / (bw_best * 1e9),
        "achieved_fraction_with_kv": (wb["bytes_per_step"] + kv) / step / (bw_best * 1e9),
        "ceiling_tok_s": bw_best * 1e9 / wb["bytes_per_step"],
    }
    if greedy_all.get("decode_tok_s"):
        physical["greedy_decode_tok_s"] = greedy_all["decode_tok_s"]
        physical["greedy_achieved_fraction"] = wb["bytes_per_step"] * greedy_all["decode_tok_s"] / (bw_best * 1e9)
    g_ov = (overhead.get("engines") or {}).get(REFERENCE) if overhead else None
    if g_ov and g_ov.get("backend_ms_per_step"):
        physical["greedy_backend_step_s"] = g_ov["backend_ms_per_step"] / 1e3
        physical["greedy_backend_fraction"] = wb["bytes_per_step"] / physical["greedy_backend_step_s"] / (bw_best * 1e9)

    mismatches = []
    for r in records:
        if r.identical is False:
            ref = reference.get((r.workload, r.repeat), [])
            i = r.first_mismatch or 0
            mismatches.append(
                {
                    "engine": r.engine,
                    "workload": r.workload,
                    "repeat": r.repeat,
                    "first_mismatch": r.first_mismatch,
                    "reference_len": len(ref),
                    "len": r.new_tokens,
                    "reference_text": engine.tokenizer.decode(ref[max(0, i - 8) : i + 8]),
                    "text": engine.tokenizer.decode(r.token_ids[max(0, i - 8) : i + 8]),
                    "token_ids": r.token_ids,
                    "reference_ids": ref,
                }
            )

    cmd = "python -m bench.suite" + ("" if not argv else " " + " ".join(argv))
    result: dict[str, Any] = {
        "label": label,
        "command": cmd,
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "config": {
            "model_dir": str(model_dir),
            "precision": "tiny-fp32" if args.quick and not args.model_dir else args.precision,
            "threads": args.threads,
            "categories": categories,
            "n_per_category": args.n_per_category,
            "max_new_tokens": args.max_new_tokens,
            "max_prompt_tokens": args.max_prompt_tokens,
            "repeat": args.repeat,
            "cost_repeat": args.cost_repeat,
            "contention_threshold": args.contention_threshold,
            "retry_disturbed": args.retry_disturbed,
            "wait_quiet_s": args.wait_quiet,
            "engines": wanted,
            "quick": bool(args.quick),
            "ortspec_max_length": engine.backend.max_length,
        },
        "machine": machine,
        "workloads": wl_info,
        "engines_run": order,
        "engine_descriptions": {n: engines[n].describe() for n in order},
        "missing": missing,
        "prompt_checks": prompt_checks,
        "cost_curve": cost,
        "cost_curve_end": cost_end,
        "physical": physical,
        "overhead": overhead,
        "summary": {"table": summary["table"], "ratios": summary["ratios"]},
        "per_prompt": summary["per_prompt"],
        "identity": {
            e: {
                "identical": sum(1 for r in records if r.engine == e and r.identical),
                "compared": sum(1 for r in records if r.engine == e and r.identical is not None),
            }
            for e in order
            if e != REFERENCE
        },
        "mismatches": mismatches,
        "disturbed_runs": sum(1 for r in records if r.disturbed),
        "retries_used": retries_used,
        "runs": [r.to_dict(keep_ids=(r.engine == REFERENCE)) for r in records],
        "suite_seconds": round(time.perf_counter() - t_suite, 1),
    }
    for e in order:
        with contextlib.suppress(Exception):
            if hasattr(engines[e], "close"):
                engines[e].close()

    json_path = out_dir / f"results-{label}.json"
    md_path = out_dir / f"results-{label}.md"
    png_path = out_dir / f"tokens_per_second-{label}.png"
    plot_error = write_plot(png_path, result)
    if plot_error:
        result["plot_error"] = plot_error
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    write_markdown(md_path, result)
    log(f"wrote {json_path}, {md_path}" + ("" if plot_error else f", {png_path}"))
    return result


def wait_quiet(max_wait_s: float, threshold: float, background_load) -> dict[str, Any]:
    """Sample the other processes' CPU use (0.5 s windows) until it is below ``threshold`` or ``max_wait_s``
    has passed; returns the waited seconds and the last reading."""
    if max_wait_s <= 0:
        return {"waited_s": 0.0, "load": None}
    t0 = time.perf_counter()
    load = background_load(0.5)
    while load is not None and load > threshold and time.perf_counter() - t0 < max_wait_s:
        load = background_load(0.5)
    return {"waited_s": round(time.perf_counter() - t0, 2), "load": load}


def _one_run(eng, name: str, w, ids, rep: int, args, eos: frozenset[int], CpuContention) -> RunRecord:
    err = None
    with CpuContention() as c:
        try:
            out = eng.run(ids, args.max_new_tokens)
        except Exception as exc:  # noqa: BLE001 - a failing engine is recorded, never faked
            err = f"{type(exc).__name__}: {exc}"
            out = None
    if out is None:
        return RunRecord(
            name,
            w.name,
            w.category,
            rep,
            len(ids),
            [],
            "",
            0.0,
            0.0,
            error=err,
            contention=c.as_dict(),
            disturbed=bool(c.others_cores and c.others_cores > args.contention_threshold),
        )
    toks = _strip_eos(out["token_ids"], eos)
    finish = out["finish_reason"]
    if "stop" in finish.lower() or "eos" in finish.lower():
        finish = "stop"
    elif finish.lower() in ("length", "max_tokens", "finishreason.length"):
        finish = "length"
    if len(toks) < len(out["token_ids"]):
        finish = "stop"
    return RunRecord(
        engine=name,
        workload=w.name,
        category=w.category,
        repeat=rep,
        prompt_tokens=len(ids),
        token_ids=toks,
        finish_reason=finish,
        ttft_s=out["ttft_s"],
        total_s=out["total_s"],
        proposed=out["proposed"],
        accepted=out["accepted"],
        passes=out["passes"],
        decode_passes=out["decode_passes"],
        extra=out["extra"],
        contention=c.as_dict(),
        disturbed=bool(c.others_cores is not None and c.others_cores > args.contention_threshold),
    )


def _measure_overhead(engine, prompts, categories, args, decode_step_s: float, log, Engine) -> dict[str, Any]:
    """Per-step time outside the backend for ortspec-greedy and ortspec-lookup-w8."""
    from ortspec.core import PromptLookup

    if args.overhead_prompts <= 0:
        return {}
    chosen = []
    for cat in categories:
        chosen += [(w, ids) for w, ids in prompts if w.category == cat][: args.overhead_prompts]
    proxy = TimingBackend(engine.backend)
    timed = Engine(proxy, engine.tokenizer, eos_token_ids=engine.eos_token_ids, folder=engine.folder)
    settings = {"ortspec-greedy": (None, 8), "ortspec-lookup-w8": (lambda: PromptLookup(ngram=3, max_draft=8), 8)}
    log(f"overhead runs: {len(chosen)} prompts x {len(settings)} engines")
    out: dict[str, Any] = {"prompts": len(chosen), "decode_step_s": decode_step_s, "engines": {}, "runs": []}
    per: dict[str, list[dict]] = {k: [] for k in settings}
    for w, ids in chosen:
        for name, (mk, width) in settings.items():
            run = timed.start(
                list(ids), max_tokens=args.max_new_tokens, speculative=mk() if mk else None, draft_width=width
            )
            b0, t0 = proxy.seconds, time.perf_counter()
            for _ in run:
                pass
            t1, b1 = time.perf_counter(), proxy.seconds
            steps = run.result().stats.steps
            if steps == 0:
                continue
            wall, backend_s = t1 - t0, b1 - b0
            row = {
                "engine": name,
                "workload": w.name,
                "steps": steps,
                "wall_s": wall,
                "backend_s": backend_s,
                "overhead_s_per_step": (wall - backend_s) / steps,
                "backend_s_per_step": backend_s / steps,
            }
            per[name].append(row)
            out["runs"].append({k: _round(v, 7) for k, v in row.items()})
    for name, rows in per.items():
        if not rows:
            continue
        ov = statistics.median(r["overhead_s_per_step"] for r in rows)
        bk = statistics.median(r["backend_s_per_step"] for r in rows)
        out["engines"][name] = {
            "steps": sum(r["steps"] for r in rows),
            "overhead_us_per_step": ov * 1e6,
            "backend_ms_per_step": bk * 1e3,
            "pct_of_decode_step": 100 * ov / decode_step_s,
            "pct_of_backend_step": 100 * ov / bk if bk > 0 else None,
            "total_overhead_pct_of_wall": 100
            * sum(r["wall_s"] - r["backend_s"] for r in rows)
            / sum(r["wall_s"] for r in rows),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run_suite(args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
