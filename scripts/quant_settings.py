"""Which quantized settings make speculative decoding exact, and what they cost: SmolLM2-135M and tiny models.

    python scripts/quant_settings.py                 # about 45 minutes on 2 shared cores (2726 s on 2026-11-30)
    python scripts/quant_settings.py --skip-real     # tiny models only (a minute)

Settings: the builder's fp32, int8 and int4 folders, int8/int4 at each MatMulNBits ``accuracy_level`` (the level a
folder is built with, ``ortspec convert --accuracy-level``, or set at load, ``matmul_accuracy_level``), and int4 at
level 4 with the session option ``mlas.qnbit.force_fp32=1`` (onnxruntime >= 1.23: x64, 4-bit, block size 32
only). For each it measures, with pinned threads and interleaved so that machine noise hits every setting alike:

* **drift**: the largest |logit| difference between verify passes and one-token decodes
  (``Engine.verify_drift``'s protocol, 3 windows of 9 tokens, after contexts of 64, 256 and 512 tokens; 30 to 150
  on the tiny model), and whether speculative
  output (prompt lookup, cost-aware width) equals greedy output on the README's demo prompt and three benchmark
  prompts (``docs/bench/prompts``), 96 new tokens each;
* **speed**: a decode step and verify passes of 1 + K tokens after a 256-token context
  (``measure_pass_costs`` of ``ortspec.adapters.engine.measurements``, K = 4 and 8; its K values interleaved), and a
  256-token prefill; each
  round measures every setting in turn, speeds are ratios to fp32 within a round, medians over rounds; and
  end-to-end tokens/s of greedy and speculative decoding on the same prompts (settings whose decode step is more
  than 4x fp32's are not run end to end).

It writes ``docs/quantization-data.md`` (tables, machine, date) and prints each result as it goes.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # the repository root, for tests.support

from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.cache import cache_root
from ortspec.adapters.engine.measurements import measure_pass_costs, measure_verify_drift, probe_ids
from ortspec.adapters.engine.options import DRIFT_WARNING_THRESHOLD
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.tools.convert import (
    EXACT_ACCURACY_LEVEL,
    default_model_dir,
    export_folder,
    is_complete,
    prepare_smollm2_hf,
)
from ortspec.backends.onnx import BackendConfig, OrtBackend

ROOT = Path(__file__).resolve().parent.parent
FORCE_FP32 = {"mlas.qnbit.force_fp32": "1"}
DRIFT_CONTEXTS = {False: (30, 60, 100, 150), True: (64, 256, 512)}  # tiny, real


Setting = tuple[str, Path, dict, bool]  # label, folder, OrtBackend.from_folder options, run end to end


def setting_list(folders: dict[str, Path], *, all_levels: bool) -> list[Setting]:
    """Every setting measured. ``all_levels``: int8 at levels 2 and 3 and at level 1 set at load too (their decode
    steps take over a second on SmolLM2, so the real-model run measures int8 at levels 4 and 1 only). End to end:
    fp32, the builder defaults, int4 at level 1 (built and at load) and int4 with force_fp32 (levels 2 and 3 run
    the same float32 kernels as level 1 on x64: same drift to the digit)."""
    out: list[Setting] = [("fp32", folders["fp32"], {}, True)]
    for precision in ("int8", "int4"):
        built4, built1 = folders[f"{precision}-4"], folders[f"{precision}-1"]
        out.append((f"{precision} level 4 (builder default)", built4, {}, True))
        out.append((f"{precision} level 1 (built)", built1, {}, precision == "int4"))
        if precision == "int4" or all_levels:
            out.append((f"{precision} level 1 (at load)", built4, {"matmul_accuracy_level": 1}, precision == "int4"))
            for level in (2, 3):
                out.append((f"{precision} level {level} (at load)", built4, {"matmul_accuracy_level": level}, False))
        force = (f"{precision} level 4 + mlas.qnbit.force_fp32", built4, {"config_entries": FORCE_FP32})
        out.append((*force, precision == "int4"))
    return out


def real_folders(say) -> dict[str, Path]:
    """SmolLM2-135M-Instruct fp32 and int8/int4 at levels 4 and 1, converted into the ortspec cache once (the
    dequantized Hugging Face folder is kept under ``quant/`` to export each variant without redoing it)."""
    from ortspec.adapters.tools.convert import convert_smollm2

    folders = {"fp32": convert_smollm2(default_model_dir("fp32"), "fp32", progress=say)}
    hf_dir = cache_root() / "quant" / "hf-SmolLM2-135M-Instruct"
    for precision in ("int8", "int4"):
        for level in (4, 1):
            dest = default_model_dir(precision, level)
            if not is_complete(dest):
                if not (hf_dir / "config.json").is_file():
                    with tempfile.TemporaryDirectory(prefix="ortspec-quant-") as work:
                        prepare_smollm2_hf(hf_dir, Path(work), say)
                t0 = time.perf_counter()
                export_folder(hf_dir, dest, precision, accuracy_level=level)
                say(f"[quant] exported {dest.name} in {time.perf_counter() - t0:.1f}s")
            folders[f"{precision}-{level}"] = dest
    return folders


def tiny_folders(say) -> dict[str, Path]:
    from tests.support.architectures import make_tiny_arch_model

    root = cache_root() / "arch" / "h256"
    folders = {"fp32": make_tiny_arch_model(root / "llama-fp32", "llama", "fp32", hidden=256)}
    for precision in ("int8", "int4"):
        folders[f"{precision}-4"] = make_tiny_arch_model(root / f"llama-{precision}", "llama", precision, hidden=256)
        folders[f"{precision}-1"] = make_tiny_arch_model(
            root / f"llama-{precision}-l1", "llama", precision, hidden=256, accuracy_level=1
        )
    say(f"[quant] tiny folders in {root}")
    return folders


def prompts(engine: Engine, count: int) -> list[list[int]]:
    from ortspec.adapters.cli.demo import DEMO_PROMPT

    texts = [DEMO_PROMPT] + [p.read_text() for p in sorted((ROOT / "docs" / "bench" / "prompts").glob("*.txt"))]
    return [engine.prompt_ids(text, chat=True) for text in texts[:count]]


def measure(settings: list[Setting], args, *, real: bool, say) -> list[dict]:
    threads = args.threads
    engines = []
    end_to_end = {}
    for label, folder, options, e2e_run in settings:
        end_to_end[label] = e2e_run
        backend = OrtBackend.from_folder(
            folder, BackendConfig(threads=threads, max_length=2048 if real else 256, **options)
        )
        tokenizer = Tokenizer.from_folder(folder)
        engine = Engine(backend, tokenizer, eos_token_ids=backend.folder.eos_token_ids, folder=backend.folder)
        engines.append((label, engine, options))
    results = {label: {"label": label, "end_to_end": end_to_end[label]} for label, _, _ in engines}
    context = 256 if real else 120
    kmax = 8
    ids = probe_ids(engines[0][1].backend.vocab_size, context + kmax + 1)
    # drift: Engine.verify_drift's protocol after several contexts (level-4 drift depends on the context)
    for label, engine, _ in engines:
        backend = engine.backend
        drifts = []
        for length in DRIFT_CONTEXTS[real]:
            drift_ids = probe_ids(backend.vocab_size, length + 27)
            drifts.append(measure_verify_drift(backend, drift_ids[:length], drift_ids[length:], windows=3))
        results[label]["drift"] = max(drifts)
        say(f"[quant] {label}: drift {results[label]['drift']:.3g} (contexts {DRIFT_CONTEXTS[real]})")
    # speed: each round measures every setting in turn (rotated per round) with measure_pass_costs
    # (its K values interleaved) and times a prefill; ratios to fp32 are taken within a round, then the median over
    # rounds, so that the machine's load hits fp32 and the setting alike
    rounds: dict[str, list[dict]] = {label: [] for label, _, _ in engines}
    for round_index in range(args.rounds):
        turn = engines[round_index % len(engines) :] + engines[: round_index % len(engines)]
        for label, engine, _ in turn:
            backend = engine.backend
            slow = bool(rounds[label]) and rounds[label][0]["decode_s"] > 0.5
            costs = measure_pass_costs(
                backend, ids[:context], ids[context:], kmax=kmax, repeats=1 if slow else (2 if real else 15)
            )
            t0 = time.perf_counter()
            backend.decode(ids[:context], 0)
            prefill_s = time.perf_counter() - t0
            backend.reset()
            rounds[label].append({"decode_s": costs["decode_step_s"], "curve": costs["curve"], "prefill_s": prefill_s})
        say(f"[quant] speed round {round_index + 1}/{args.rounds} done")
    fp32 = rounds[engines[0][0]]
    for label, _, _ in engines:
        mine = rounds[label]
        results[label].update(
            decode_ms=1000 * statistics.median(r["decode_s"] for r in mine),
            decode_vs_fp32=statistics.median(f["decode_s"] / r["decode_s"] for f, r in zip(fp32, mine, strict=True)),
            verify4=statistics.median(r["curve"][4] for r in mine),
            verify8=statistics.median(r["curve"][8] for r in mine),
            prefill_vs_fp32=statistics.median(f["prefill_s"] / r["prefill_s"] for f, r in zip(fp32, mine, strict=True)),
        )
    # end to end
    if real:
        prompt_ids = prompts(engines[0][1], args.prompts)
        e2e: dict[str, dict[str, list[float]]] = {label: {"greedy": [], "spec": []} for label, _, _ in engines}
        identical: dict[str, list[bool]] = {label: [] for label, _, _ in engines}
        for prompt in prompt_ids:
            for label, engine, _ in engines:
                if results[label]["decode_vs_fp32"] < 0.25 or not results[label]["end_to_end"]:
                    continue
                greedy = engine.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    spec = engine.generate(
                        prompt, max_tokens=args.max_tokens, ignore_eos=True, speculative="prompt-lookup"
                    )
                identical[label].append(spec.token_ids == greedy.token_ids)
                e2e[label]["greedy"].append(len(greedy.token_ids) / greedy.timings.total_s)
                e2e[label]["spec"].append(len(spec.token_ids) / spec.timings.total_s)
            say(f"[quant] end to end: prompt {len(identical[engines[0][0]])}/{len(prompt_ids)} done")
        base = statistics.median(e2e[engines[0][0]]["greedy"])
        for label, _, _ in engines:
            if not identical[label]:
                results[label]["e2e"] = None
                results[label]["e2e_skipped"] = (
                    f"decode step {1 / results[label]['decode_vs_fp32']:.1f}x fp32's"
                    if results[label]["decode_vs_fp32"] < 0.25
                    else "not run: same kernels as a setting above"
                )
                continue
            greedy_rate = statistics.median(e2e[label]["greedy"])
            spec_rate = statistics.median(e2e[label]["spec"])
            results[label]["e2e"] = {
                "identical": f"{sum(identical[label])}/{len(identical[label])}",
                "greedy_tok_s": greedy_rate,
                "spec_tok_s": spec_rate,
                "greedy_vs_fp32": greedy_rate / base,
                "spec_vs_fp32_greedy": spec_rate / base,
            }
    return [results[label] for label, _, _ in engines]


def table(rows: list[dict], real: bool, max_tokens: int = 0) -> list[str]:
    lines = [
        "| setting | drift (logits) | exact | decode step | decode speed vs fp32 | verify(4)/decode | "
        "verify(8)/decode | prefill speed vs fp32 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        exact = "yes" if r["drift"] <= DRIFT_WARNING_THRESHOLD else "no"
        lines.append(
            f"| {r['label']} | {r['drift']:.2g} | {exact} | {r['decode_ms']:.1f} ms | {r['decode_vs_fp32']:.2f}x | "
            f"{r['verify4']:.2f} | {r['verify8']:.2f} | {r['prefill_vs_fp32']:.2f}x |"
        )
    if real:
        lines += [
            "",
            f"End to end (chat prompts, {max_tokens} new tokens, EOS ignored, tokens/s including prefill; "
            "medians over prompts; "
            "speculative = prompt lookup with the cost-aware width):",
            "",
            "| setting | speculative == greedy | greedy tok/s | speculative tok/s | greedy vs fp32 greedy | "
            "speculative vs fp32 greedy |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            e = r.get("e2e")
            if not e:
                lines.append(f"| {r['label']} | {r.get('e2e_skipped', 'not run')} | | | | |")
                continue
            lines.append(
                f"| {r['label']} | {e['identical']} | {e['greedy_tok_s']:.1f} | {e['spec_tok_s']:.1f} | "
                f"{e['greedy_vs_fp32']:.2f}x | {e['spec_vs_fp32_greedy']:.2f}x |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds (default 5)")
    parser.add_argument("--prompts", type=int, default=4, help="end-to-end prompts (default 4)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--skip-real", action="store_true", help="tiny models only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "quantization-data.md")
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    import onnxruntime

    started = time.perf_counter()
    lines = [
        "# Quantized settings: exactness and speed (measured)",
        "",
        "Written by `python scripts/quant_settings.py` (do not edit by hand) on "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.processor() or platform.platform()}, "
        f"{args.threads} intra-op threads; onnxruntime {onnxruntime.__version__}. *drift*: the largest |logit| "
        "difference between verify passes and one-token decodes (3 windows of 9 tokens after each of several "
        f"contexts: {DRIFT_CONTEXTS[True]} tokens on SmolLM2, {DRIFT_CONTEXTS[False]} on the tiny model); *exact*: "
        f"drift <= {DRIFT_WARNING_THRESHOLD:g}. Speeds ({args.rounds} rounds; {args.prompts} prompts end to end): "
        "each round measures every setting in turn; "
        "speed vs fp32 is fp32's time over the setting's in the same round (higher is faster), median over rounds; "
        "verify(K)/decode is a pass over 1 + K tokens divided by a decode step of the same setting "
        "(`measure_pass_costs`), median over rounds. `ortspec convert --precision int4|int8` "
        f"builds level {EXACT_ACCURACY_LEVEL}.",
        "",
    ]
    tiny = measure(setting_list(tiny_folders(say), all_levels=True), args, real=False, say=say)
    lines += ["## Tiny random Llama (hidden 256, 2 layers, vocabulary 384; 120-token context)", ""]
    lines += table(tiny, real=False) + [""]
    if not args.skip_real:
        real = measure(setting_list(real_folders(say), all_levels=False), args, real=True, say=say)
        lines += ["## SmolLM2-135M-Instruct (256-token context)", ""]
        lines += table(real, real=True, max_tokens=args.max_tokens) + [""]
    lines.append(f"Run time: {time.perf_counter() - started:.0f} s.")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
