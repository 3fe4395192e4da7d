"""Per-token mask cost of llguidance and xgrammar at a model's vocabulary, for a JSON schema.

Results: docs/structured-outputs.md.

    python scripts/grammar_mask_cost.py [--folder ~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32] [--repeat 5]

For each engine: compile the schema's grammar once, then walk a schema-valid document token by token (its
tokenization by the model's tokenizer), computing the next-token mask before each token and consuming it, as
constrained decoding does. Reports the median and mean microseconds per token (mask + advance) and the compile time.
xgrammar is measured only when it imports (it is not a dependency of ortspec).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path.home() / ".cache/ortspec/models/SmolLM2-135M-Instruct-fp32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    rows = {"llguidance": measure_llguidance(args.folder / "tokenizer.json", text, args.repeat)}
    try:
        rows["xgrammar"] = measure_xgrammar(args.folder, text, args.repeat)
    except ImportError as exc:
        print(f"xgrammar not measured: {exc}")
    print("| engine | vocab | tokens | compile ms | median us/token | mean us/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        cells = [name, str(r["vocab"]), str(r["tokens"])] + [
            f"{r[k]:.1f}" for k in ("compile_ms", "median_us", "mean_us")
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
