"""Structured outputs measured: the grammar engines' mask cost, its overhead on a decode step, and extraction speed.

    python -m bench.structured_outputs [--folder ~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32] [--repeat 5]
        [--records 12] [--out docs/bench/structured-outputs.md]

The report is printed and written to ``--out``; docs/structured-outputs.md explains the numbers. Three parts:

1. Engines. For llguidance and xgrammar (the latter only when it imports; it is not a dependency of ortspec):
   compile a JSON schema's grammar once, then walk a schema-valid document token by token (its tokenization by the
   model's tokenizer), computing the next-token mask before each token and consuming it, as constrained decoding
   does. The median and mean microseconds per token (mask + advance) and the compile time.
2. Overhead. What ortspec pays per constrained row, as the core pays it (``Constraint.allowed``: llguidance's mask
   unpacked to the vocabulary, EOS set; then the masked row), against the median of a one-token decode step of the
   model (``Engine.backend.decode``), on the same document.
3. Extraction. ``--records`` extraction prompts (a person's record as JSON, by a schema) decoded with constrained
   plain decoding and with constrained speculation (``speculative="auto"``: the grammar's forced tokens, then the
   suffix lookup or the drafter), greedy: outputs compared, schema validity, tokens per second, passes. Each mode
   has its own suffix cache, so a record's speculative run drafts from the earlier records' speculative outputs (a
   dataset in order), never from the plain run's answer to the same record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = Path("docs/bench/structured-outputs.md")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
    "status": "active",
}


def _row(vocab: int, tokens: int, compile_s: float, per_token: list[float]) -> dict[str, float]:
    return {
        "vocab": vocab,
        "tokens": tokens,
        "compile_ms": compile_s * 1e3,
        "median_us": statistics.median(per_token) * 1e6,
        "mean_us": statistics.fmean(per_token) * 1e6,
    }


def measure_llguidance(tokenizer_json: Path, text: str, repeat: int) -> dict[str, float]:
    import llguidance

    tok = llguidance.LLTokenizer(str(tokenizer_json))
    tokens = tok.tokenize_str(text)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    bitmask = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    per_token: list[float] = []
    for _ in range(repeat):
        matcher.reset()
        for t in tokens:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            ok = matcher.consume_token(t)
            per_token.append(time.perf_counter() - start)
            assert ok and not matcher.is_error(), matcher.get_error()
    assert matcher.is_accepting()
    return _row(tok.vocab_size, len(tokens), compile_s, per_token)


def measure_xgrammar(folder: Path, text: str, repeat: int) -> dict[str, float]:
    import transformers
    import xgrammar as xgr

    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokens = hf.encode(text, add_special_tokens=False)
    info = xgr.TokenizerInfo.from_huggingface(hf)
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per_token: list[float] = []
    for _ in range(repeat):
        matcher.reset()
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            ok = matcher.accept_token(t)
            per_token.append(time.perf_counter() - start)
            assert ok
    return _row(info.vocab_size, len(tokens), compile_s, per_token)


def measure_overhead(engine: Any, text: str, repeat: int) -> dict[str, float]:
    """Microseconds per constrained row (mask + masked row + advance) against a one-token decode step."""
    from ortspec.adapters.engine.structured import ResponseFormat
    from ortspec.core.constraint import Constraint, masked

    rf = ResponseFormat.parse({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    grammar = engine.grammar(rf, None)
    tokens = engine.tokenize(text)
    row = np.random.default_rng(0).standard_normal(engine.backend.vocab_size).astype(np.float32)
    per_row: list[float] = []
    for _ in range(repeat):
        constraint = Constraint(grammar.matcher())
        for i in range(len(tokens)):
            start = time.perf_counter()
            masked(row, constraint.allowed(tokens[:i], (), engine.eos_token_ids))
            per_row.append(time.perf_counter() - start)
    backend = engine.backend
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
    backend.reset()
    backend.decode(prompt, 0)
    steps: list[float] = []
    for i in range(8 * repeat):
        start = time.perf_counter()
        backend.decode([prompt[i % len(prompt)]], len(prompt) + i)
        steps.append(time.perf_counter() - start)
    row_us, step_us = statistics.median(per_row) * 1e6, statistics.median(steps) * 1e6
    return {"row_us": row_us, "row_mean_us": statistics.fmean(per_row) * 1e6, "step_us": step_us}


PEOPLE = [
    ("Ada Lovelace", 36, "London", "mathematician"),
    ("Alan Turing", 41, "Manchester", "logician"),
    ("Grace Hopper", 85, "Arlington", "admiral"),
    ("Katherine Johnson", 101, "Newport News", "mathematician"),
    ("Edsger Dijkstra", 72, "Nuenen", "programmer"),
    ("Barbara Liskov", 84, "Cambridge", "professor"),
    ("Claude Shannon", 84, "Medford", "engineer"),
    ("Hedy Lamarr", 85, "Casselberry", "inventor"),
    ("John von Neumann", 53, "Washington", "physicist"),
    ("Frances Allen", 88, "Schenectady", "researcher"),
    ("Dennis Ritchie", 70, "Berkeley Heights", "programmer"),
    ("Margaret Hamilton", 88, "Boston", "engineer"),
]
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}


def measure_extraction(engine: Any, records: int) -> dict[str, float]:
    """Constrained plain vs constrained speculative decoding over extraction prompts (greedy)."""
    from ortspec.adapters.engine.suffix_cache import SuffixCache

    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
    prompts = [
        f"{name} was a {job} from {city} who lived to {age}. Extract name, age, city and occupation as JSON."
        for name, age, city, job in (PEOPLE * (records // len(PEOPLE) + 1))[:records]
    ]
    engine.generate(prompts[0], chat=True, max_tokens=8, speculative="auto")  # measures the verify costs once
    totals = {"plain": [0, 0.0, 0], "speculative": [0, 0.0, 0]}
    # Each mode has its own suffix cache: the speculative run of record i drafts from its own outputs of records
    # 0 .. i - 1 (a dataset's records, in order), never from the plain run's answer to the same record.
    caches = {"plain": SuffixCache(), "speculative": SuffixCache()}
    same = valid = 0
    for prompt in prompts:
        results = {}
        for label, spec in (("plain", None), ("speculative", "auto")):
            engine.suffix_cache = caches[label]
            r = engine.generate(prompt, chat=True, max_tokens=120, response_format=rf, speculative=spec)
            totals[label][0] += len(r.token_ids)
            totals[label][1] += r.timings.total_s
            totals[label][2] += r.stats.steps
            results[label] = r
        same += results["plain"].token_ids == results["speculative"].token_ids
        try:
            value = json.loads(results["plain"].text)
            valid += set(value) == set(RECORD["properties"]) and 0 <= value["age"] <= 150
        except (ValueError, TypeError):
            pass
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["speculative"][0] / totals["speculative"][1]
    return {
        "records": records,
        "identical": same,
        "valid": valid,
        "plain_tok_s": plain_tps,
        "spec_tok_s": spec_tps,
        "speedup": spec_tps / plain_tps,
        "plain_passes": totals["plain"][2],
        "spec_passes": totals["speculative"][2],
        "tokens": totals["plain"][0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path.home() / ".cache/ortspec/models/SmolLM2-135M-Instruct-fp32")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--records", type=int, default=12)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the report (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    lines = [
        "# Structured outputs: the grammar engines' mask cost, its overhead on a decode step, JSON extraction",
        "",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `python -m bench.structured_outputs` "
        f"on {platform.processor() or platform.machine()} ({os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.2f} at the start), model `{args.folder.name}`, {args.repeat} walks of the document, "
        f"{args.records} extraction records.",
        "",
    ]
    rows = {"llguidance": measure_llguidance(args.folder / "tokenizer.json", text, args.repeat)}
    try:
        rows["xgrammar"] = measure_xgrammar(args.folder, text, args.repeat)
    except ImportError as exc:
        lines += [f"xgrammar not measured: {exc}", ""]
    lines += [
        "| engine | vocab | tokens | compile ms | median us/token | mean us/token |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        cells = [name, str(r["vocab"]), str(r["tokens"])] + [
            f"{r[k]:.1f}" for k in ("compile_ms", "median_us", "mean_us")
        ]
        lines.append("| " + " | ".join(cells) + " |")

    from ortspec.adapters.engine import Engine

    engine = Engine.from_dir(args.folder)
    o = measure_overhead(engine, text, args.repeat)
    lines += [
        "",
        f"overhead: {o['row_us']:.0f} us per constrained row (median; mean {o['row_mean_us']:.0f}) against a "
        f"{o['step_us'] / 1e3:.1f} ms decode step (median): {100 * o['row_us'] / o['step_us']:.2f}%",
    ]
    x = measure_extraction(engine, args.records)
    lines += [
        "",
        f"extraction: {x['records']} records, {x['tokens']} tokens; identical {x['identical']}/{x['records']}, "
        f"schema-valid {x['valid']}/{x['records']}; plain {x['plain_tok_s']:.1f} tok/s ({x['plain_passes']} passes), "
        f"speculative {x['spec_tok_s']:.1f} tok/s ({x['spec_passes']} passes): {x['speedup']:.2f}x",
        "",
    ]
    report = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
