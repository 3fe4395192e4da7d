"""Time OrtBackend: one-token decode, decode_verify / verify_picks for several K, session-option variants, and
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

from ortspec.adapters.tools.convert import default_model_dir
from ortspec.backends.onnx import BackendConfig, OrtBackend, physical_cores


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
    ops = [("decode", lambda: b.decode(toks[p : p + 1], p))]
    for k in ks:
        ops.append((f"verify{k}", lambda k=k: b.decode_verify(toks[p : p + k], p)))
        ops.append((f"argmax{k}", lambda k=k: b.verify_picks(toks[p : p + k], p)))
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
    out["verify_picks_ms"] = {k: med[f"argmax{k}"] for k in ks}
    out["verify_ratio"] = {k: v / out["decode_ms"] for k, v in out["verify_ms"].items()}
    out["decode_ms_min"] = 1000.0 * min(samples["decode"])
    return out


def greedy_ours(b: OrtBackend, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Our plain greedy loop (decode + argmax per token): tokens per second after the first token, and the tokens."""
    b.reset()
    logits = b.decode(prompt, 0)
    out = [int(logits.argmax())]
    t0 = time.perf_counter()
    for _ in range(n):
        logits = b.decode([out[-1]], b.current_len())
        out.append(int(logits.argmax()))
    return n / (time.perf_counter() - t0), out


def genai_model(folder: Path, threads: int):
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(
        json.dumps(
            {"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}
        )
    )
    return og.Model(config)


def greedy_genai(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """onnxruntime-genai greedy: tokens per second after the first token, and the tokens."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    gen.generate_next_token()  # the first token (it finishes the prefill) is not timed
    out = [int(gen.get_next_tokens()[0])]
    t0 = time.perf_counter()
    for _ in range(n):
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return n / (time.perf_counter() - t0), out


def compare_genai(b: OrtBackend, folder: Path, prompt: list[int], n: int, threads: int, rounds: int = 3) -> dict:
    """Alternate our greedy loop and onnxruntime-genai's, ``rounds`` times each; medians of tokens per second."""
    model = genai_model(folder, threads)
    ours, theirs, same = [], [], True
    for _ in range(rounds):
        t_ours, tok_ours = greedy_ours(b, prompt, n)
        t_theirs, tok_theirs = greedy_genai(model, prompt, n)
        ours.append(t_ours)
        theirs.append(t_theirs)
        same = same and tok_ours == tok_theirs
    o, t = statistics.median(ours), statistics.median(theirs)
    return {"ortspec_tok_s": o, "onnxruntime_genai_tok_s": t, "ratio": o / t, "same_tokens": same}


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


def _interleaved(backends, toks, p, runs, warmup):
    dec = {label: [] for label, _ in backends}
    ver = {label: [] for label, _ in backends}
    for r in range(warmup + runs):
        for label, b in backends:
            t0 = time.perf_counter()
            b.decode(toks[p : p + 1], p)
            t1 = time.perf_counter()
            b.rewind(p)
            b.decode_verify(toks[p : p + 4], p)
            t2 = time.perf_counter()
            b.rewind(p)
            if r >= warmup:
                dec[label].append(t1 - t0)
                ver[label].append(t2 - t1)
    return (
        {k: 1000 * statistics.median(v) for k, v in dec.items()},
        {k: 1000 * statistics.median(v) for k, v in ver.items()},
    )


def sweep(
    folder: Path, *, threads: int, max_length: int, runs: int, warmup: int, prompt_len: int, reverse: bool = False
) -> list[dict]:
    """A/B pairs: each variant against the default, the two sessions open together and timed in alternation,
    so load drifts (other processes on a shared machine) hit both alike; reports variant / default."""
    from ortspec.backends.onnx import ModelFolder, make_session_options

    mf = ModelFolder.load(folder)
    rng = np.random.default_rng(2)
    toks = [int(t) for t in rng.integers(3, min(mf.vocab_size, 30000), size=prompt_len + 4)]
    p = prompt_len

    def open_backend(opts):
        so = make_session_options(genai_session_options=mf.session_options, **{"threads": threads, **opts})
        b = OrtBackend.from_folder(mf, BackendConfig(max_length=max_length), session_options=so)
        b.decode(toks[:p], 0)
        return b

    base_label, base_opts = SWEEP[0]
    rows = []
    for label, opts in SWEEP[:0:-1] if reverse else SWEEP[1:]:
        pair = [(base_label, open_backend(base_opts)), (label, open_backend(opts))]
        if reverse:
            pair.reverse()
        dec, ver = _interleaved(pair, toks, p, runs, warmup)
        row = {
            "config": label,
            "decode_ms": dec[label],
            "verify4_ms": ver[label],
            "default_decode_ms": dec[base_label],
            "default_verify4_ms": ver[base_label],
            "decode_vs_default": dec[label] / dec[base_label],
            "verify4_vs_default": ver[label] / ver[base_label],
        }
        rows.append(row)
        print(
            f"  {label:24s} decode {dec[label]:7.2f} ms ({row['decode_vs_default']:4.2f}x default "
            f"{dec[base_label]:6.2f})   verify(4) {ver[label]:7.2f} ms ({row['verify4_vs_default']:4.2f}x default "
            f"{ver[base_label]:6.2f})",
            flush=True,
        )
        del pair
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
    ap.add_argument("--sweep-reverse", action="store_true", help="open the sweep's sessions in reverse order")
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
    b = OrtBackend.from_folder(
        folder, BackendConfig(provider=args.provider, threads=threads, max_length=max_length, **kw)
    )
    print(f"{b!r}, threads={threads}", flush=True)
    r = measure(b, ks=ks, runs=args.runs, warmup=args.warmup, prompt_len=args.prompt_len)
    results["timings"] = r
    print(f"prefill {args.prompt_len} tokens: {r['prefill_ms']:.1f} ms")
    print(f"decode (1 token): {r['decode_ms']:.2f} ms  ({1000 / r['decode_ms']:.1f} tok/s)")
    for k in ks:
        print(
            f"verify K={k:2d}: {r['verify_ms'][k]:7.2f} ms  ratio {r['verify_ratio'][k]:5.2f}x decode   "
            f"verify_picks {r['verify_picks_ms'][k]:7.2f} ms"
        )

    if args.genai or args.sweep:
        rng = np.random.default_rng(1)
        prompt = [int(t) for t in rng.integers(3, min(b.vocab_size, 30000), size=args.prompt_len)]
    if args.genai:
        try:
            g = compare_genai(b, folder, prompt, args.greedy_tokens, threads)
        except Exception as exc:  # noqa: BLE001
            print(f"onnxruntime-genai failed: {exc}")
        else:
            results["greedy"] = g
            print(
                f"greedy {args.greedy_tokens} tokens: ortspec {g['ortspec_tok_s']:.1f} tok/s, onnxruntime-genai "
                f"{g['onnxruntime_genai_tok_s']:.1f} tok/s, ratio {g['ratio']:.2f}, same tokens: {g['same_tokens']}"
            )
    del b
    if args.sweep:
        print("session-option sweep (decode and verify(4) medians):")
        results["sweep"] = sweep(
            folder,
            threads=threads,
            max_length=max_length,
            runs=args.runs,
            warmup=args.warmup,
            prompt_len=args.prompt_len,
            reverse=args.sweep_reverse,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
