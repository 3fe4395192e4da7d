"""Time OrtBackend: one-token decode, decode_verify / verify_argmax for several K, session-option variants, and
onnxruntime-genai greedy on the same folder.

    python scripts/bench_backend.py [--model DIR] [--provider cpu|cuda] [--threads N] [--ks 1,2,4,8,16]
                                    [--runs 20] [--sweep] [--genai] [--json OUT]

Every timing is the median of ``--runs`` rounds after ``--warmup`` rounds; a round times each operation once,
interleaved, at a fixed position after a prompt of ``--prompt-len`` tokens; each timed call is followed by a rewind
to that position (not timed), so the cache length is the same for every sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ortspec.adapters.convert import default_model_dir
from ortspec.backends.onnx import OrtBackend, physical_cores


def measure(b: OrtBackend, *, ks, runs: int, warmup: int, prompt_len: int, seed: int = 0) -> dict:
    """Medians over ``runs`` rounds; each round times every operation once, interleaved, so that slow drifts in
    machine load (other processes) hit decode and every verify(K) alike and the ratios stay meaningful."""
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(3, min(b.vocab_size, 30000), size=prompt_len + max(ks) + 1)]
    b.reset()
    t0 = time.perf_counter()
    b.decode(toks[:prompt_len], 0)
    prefill_ms = 1000 * (time.perf_counter() - t0)
    p = prompt_len
    ops = [("decode", lambda: b.decode(toks[p:p + 1], p))]
    for k in ks:
        ops.append((f"verify{k}", lambda k=k: b.decode_verify(toks[p:p + k], p)))
        ops.append((f"argmax{k}", lambda k=k: b.verify_argmax(toks[p:p + k], p)))
    samples: dict[str, list[float]] = {name: [] for name, _ in ops}
    for r in range(warmup + runs):
        for name, fn in ops:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            b.rewind(p)
            if r >= warmup:
                samples[name].append(dt)
    med = {name: 1000.0 * statistics.median(v) for name, v in samples.items()}
    out = {"prefill_ms": prefill_ms, "prompt_len": prompt_len, "decode_ms": med["decode"]}
    out["verify_ms"] = {k: med[f"verify{k}"] for k in ks}
    out["verify_argmax_ms"] = {k: med[f"argmax{k}"] for k in ks}
    out["verify_ratio"] = {k: v / out["decode_ms"] for k, v in out["verify_ms"].items()}
    out["decode_ms_min"] = 1000.0 * min(samples["decode"])
    return out


def greedy_tok_s(b: OrtBackend, prompt: list[int], n: int) -> float:
    """Our plain greedy loop (decode + argmax per token), tokens per second after the prefill."""
    b.reset()
    logits = b.decode(prompt, 0)
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(logits.argmax())
        logits = b.decode([t], b.current_len())
    return n / (time.perf_counter() - t0)


def genai_tok_s(folder: Path, prompt: list[int], n: int, threads: int) -> float:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    gen.generate_next_token()  # first token (finishes the prefill) is not timed
    t0 = time.perf_counter()
    for _ in range(n):
        gen.generate_next_token()
    return n / (time.perf_counter() - t0)


SWEEP = [  # (label, make_session_options arguments)
    ("default (opt=all, spinning on)", {}),
    ("allow_spinning=0", {"allow_spinning": False}),
    ("opt=extended", {"graph_optimization_level": "extended"}),
    ("opt=basic", {"graph_optimization_level": "basic"}),
    ("opt=disable", {"graph_optimization_level": "disable"}),
    ("enable_mem_pattern=0", {"enable_mem_pattern": False}),
    ("enable_cpu_mem_arena=0", {"enable_cpu_mem_arena": False}),
    ("inter_op=2", {"inter_op_threads": 2}),
    ("threads=1", {"threads": 1}),
]


def sweep(folder: Path, *, threads: int, max_length: int, runs: int, warmup: int, prompt_len: int) -> list[dict]:
    """Every variant's session is open at once and the rounds visit them in turn, so load drifts hit all alike."""
    from ortspec.adapters.model_dir import ModelFolder
    from ortspec.backends.onnx import make_session_options

    mf = ModelFolder.load(folder)
    rng = np.random.default_rng(2)
    toks = [int(t) for t in rng.integers(3, min(mf.vocab_size, 30000), size=prompt_len + 4)]
    p = prompt_len
    backends = []
    for label, opts in SWEEP:
        so = make_session_options(genai_session_options=mf.session_options, **{"threads": threads, **opts})
        b = OrtBackend.from_folder(mf, session_options=so, max_length=max_length)
        b.decode(toks[:p], 0)
        backends.append((label, b))
    dec: dict[str, list[float]] = {label: [] for label, _ in backends}
    ver: dict[str, list[float]] = {label: [] for label, _ in backends}
    for r in range(warmup + runs):
        for label, b in backends:
            t0 = time.perf_counter()
            b.decode(toks[p:p + 1], p)
            t1 = time.perf_counter()
            b.rewind(p)
            b.decode_verify(toks[p:p + 4], p)
            t2 = time.perf_counter()
            b.rewind(p)
            if r >= warmup:
                dec[label].append(t1 - t0)
                ver[label].append(t2 - t1)
    rows = []
    for label, _ in backends:
        d, v = 1000 * statistics.median(dec[label]), 1000 * statistics.median(ver[label])
        rows.append({"config": label, "decode_ms": d, "verify4_ms": v})
        print(f"  {label:34s} decode {d:7.2f} ms   verify(4) {v:7.2f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the cached SmolLM2 fp32)")
    ap.add_argument("--provider", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--array-module", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true", help="try session-option variants (CPU)")
    ap.add_argument("--genai", action="store_true", help="compare greedy tok/s with onnxruntime-genai (CPU)")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    folder = Path(args.model) if args.model else default_model_dir("fp32")
    threads = args.threads if args.threads is not None else physical_cores()
    ks = tuple(int(k) for k in args.ks.split(","))
    max_length = min(args.max_length, json.loads((folder / "genai_config.json").read_text())["model"]["context_length"])
    results: dict = {"model": str(folder), "provider": args.provider, "threads": threads}

    kw = {"array_module": args.array_module} if args.provider == "cuda" else {}
    b = OrtBackend.from_folder(folder, provider=args.provider, threads=threads, max_length=max_length, **kw)
    print(f"{b!r}, threads={threads}", flush=True)
    r = measure(b, ks=ks, runs=args.runs, warmup=args.warmup, prompt_len=args.prompt_len)
    results["timings"] = r
    print(f"prefill {args.prompt_len} tokens: {r['prefill_ms']:.1f} ms")
    print(f"decode (1 token): {r['decode_ms']:.2f} ms  ({1000 / r['decode_ms']:.1f} tok/s)")
    for k in ks:
        print(f"verify K={k:2d}: {r['verify_ms'][k]:7.2f} ms  ratio {r['verify_ratio'][k]:5.2f}x decode   "
              f"verify_argmax {r['verify_argmax_ms'][k]:7.2f} ms")

    if args.genai or args.sweep:
        rng = np.random.default_rng(1)
        prompt = [int(t) for t in rng.integers(3, min(b.vocab_size, 30000), size=args.prompt_len)]
    if args.genai:
        ours = greedy_tok_s(b, prompt, args.greedy_tokens)
        try:
            theirs = genai_tok_s(folder, prompt, args.greedy_tokens, threads)
        except Exception as exc:  # noqa: BLE001
            print(f"onnxruntime-genai failed: {exc}")
            theirs = float("nan")
        results["greedy_tok_s"] = {"ortspec": ours, "onnxruntime_genai": theirs, "ratio": ours / theirs}
        print(f"greedy {args.greedy_tokens} tokens: ortspec {ours:.1f} tok/s, onnxruntime-genai {theirs:.1f} tok/s, "
              f"ratio {ours / theirs:.2f}")
    del b
    if args.sweep:
        print("session-option sweep (decode and verify(4) medians):")
        results["sweep"] = sweep(folder, threads=threads, max_length=max_length, runs=args.runs,
                                 warmup=args.warmup, prompt_len=args.prompt_len)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
