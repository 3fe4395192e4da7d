"""The GPU benchmark: everything it needs is made on the machine it runs on.

    python -m bench.gpu --provider cuda                       # SmolLM2-135M and Qwen2.5-0.5B shapes, fp16 + int4
    python -m bench.gpu --shape tiny --provider cpu --out DIR  # the CI smoke run: seconds

For each model shape (:data:`SHAPES`: the published architectures' dimensions) and precision it builds a model
folder with random weights (``tests.support.models.make_random_model``: the onnxruntime-genai builder, run here,
so no weights travel), then for each backend mode (:data:`MODES`: ``eager`` = the default binding; ``static`` =
static shapes, stream-ordered on CUDA; ``graphs`` = static shapes + one CUDA graph per pass width) measures with
``OrtBackend`` on the chosen provider:

* **greedy** tokens per second through the real driver (``ortspec.generate``, no proposer): decode phase (after the
  first token) and end to end, median of ``--repeats`` runs of ``--new-tokens`` after a ``--prompt-tokens`` prompt;
* the **verify(K)/decode cost curve**, K = 0..16 (``measure_pass_costs`` in ``ortspec.adapters.engine.measurements``;
  on CUDA with device picks, the pass the driver makes there);
* **time per pass** split into host work, session run, explicit syncs and read-back (``OrtBackend.timer``, a
  ``PhaseTimer``), for greedy steps (width 1) and 9-token verify passes, and the driver's own time per step;
* **speculative == greedy** on the device: drafts from the greedy output with every 4th drafted token wrong (so
  passes accept part of a draft), and prompt lookup; plus the verify drift (``measure_verify_drift``);
* **speculation priced** with the acceptance recorded on the CPU real-model runs: ``bench.replay.price`` replays
  ``bench/data/replay-fp32.json`` (SmolLM2-135M's greedy outputs on the suite's prompts) through the driver with
  this mode's measured pass times and the replay's own host time per pass, per category: expected speculative
  tokens per second, and its ratio to greedy.

Beside it, **ONNX Runtime GenAI**'s own greedy on the same folder where its package runs (``onnxruntime-genai`` on
the CPU; ``onnxruntime-genai-cuda`` on CUDA, with its CUDA graphs off and on). Results go to ``--out`` (default
``docs/gpu``) as ``gpu-bench-<provider>-<device>-<date>.json`` and ``.md``, with the machine, date and provider.
``--build-only`` builds the folders (in parallel with ``--build-jobs``) and stops. Random weights make the numbers
those of the shapes, not of the models' text: no output of these folders is meaningful, only their speed.

Layout: this module is the command line (``parse_args``, ``main``: build, measure, write); ``bench.gpu_models``
holds the shapes and the folders built from them, and the machine's facts; ``bench.gpu_measure`` the measurements
of one mode (``measure_mode``) and ORT GenAI's greedy (``measure_genai``); ``bench.gpu_report`` the targets and the
markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu_measure import MODES, measure_genai, measure_mode
from bench.gpu_models import SHAPES, build_all, device_slug, folder_name, machine_facts
from bench.gpu_report import render_markdown, targets

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REPLAY_INPUTS = REPO / "bench" / "data" / "replay-fp32.json"
DEFAULT_SHAPES = {"cuda": ("smollm2-135m", "qwen2.5-0.5b"), "cpu": ("tiny",)}
DEFAULT_PRECISIONS = {"cuda": ("fp16", "int4"), "cpu": ("fp32",)}
DEFAULT_MODES = {"cuda": ("eager", "static", "graphs"), "cpu": ("eager", "static")}


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="model shape(s); default per provider")
    ap.add_argument("--precision", action="append", help="fp32, fp16, int4 (default: fp16+int4 on CUDA, fp32 on CPU)")
    ap.add_argument("--modes", default=None, help="comma-separated: eager,static,graphs (default per provider)")
    ap.add_argument("--models-dir", default=None, help="where the folders are built (default: <out>/../.gpu-models)")
    ap.add_argument("--out", default=str(REPO / "docs" / "gpu"), help="folder for the JSON and markdown results")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-repeats", type=int, default=10)
    ap.add_argument("--max-length", type=int, default=None, help="KV capacity (default: prompt + new tokens + 64)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads on the CPU provider")
    ap.add_argument("--replay-inputs", default=str(DEFAULT_REPLAY_INPUTS))
    ap.add_argument("--replay-limit", type=int, default=None, help="at most this many prompts per category")
    ap.add_argument("--no-genai", action="store_true", help="skip ONNX Runtime GenAI")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--build-jobs", type=int, default=1)
    ap.add_argument("--label", default=None, help="file name label (default: provider-device-date)")
    args = ap.parse_args(argv)
    args.shape = args.shape or list(DEFAULT_SHAPES[args.provider])
    args.precision = args.precision or list(DEFAULT_PRECISIONS[args.provider])
    args.modes = args.modes.split(",") if args.modes else list(DEFAULT_MODES[args.provider])
    for mode in args.modes:
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if args.max_length is None:
        args.max_length = args.prompt_tokens + args.new_tokens + 64
    if args.models_dir is None:
        args.models_dir = str(Path(args.out).resolve().parent / ".gpu-models")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)

    def log(message: str) -> None:
        print(f"[bench.gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)

    models_dir = Path(cfg.models_dir)
    targets_list = [(shape, precision, cfg.provider) for shape in cfg.shape for precision in cfg.precision]
    t_start = time.perf_counter()
    builds = build_all(models_dir, targets_list, cfg.build_jobs, log)
    if cfg.build_only:
        return 0 if all("error" not in b for b in builds.values()) else 1

    from bench.replay import load_inputs

    inputs = None
    replay_source = None
    if cfg.replay_inputs and Path(cfg.replay_inputs).is_file():
        inputs = load_inputs(cfg.replay_inputs)
        replay_source = f"{inputs['model']}, {inputs.get('source')} of {str(inputs.get('source_date_utc'))[:10]}"
    facts = machine_facts(cfg.provider)
    report: dict[str, Any] = {
        "command": "python -m bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": facts,
        "config": {
            "provider": cfg.provider,
            "shapes": {s: SHAPES[s] for s in cfg.shape},
            "precisions": cfg.precision,
            "modes": cfg.modes,
            "prompt_tokens": cfg.prompt_tokens,
            "new_tokens": cfg.new_tokens,
            "repeats": cfg.repeats,
            "cost_repeats": cfg.cost_repeats,
            "max_length": cfg.max_length,
            "models_dir": str(models_dir),
            "replay_inputs": os.path.relpath(cfg.replay_inputs, REPO) if inputs else None,
            "replay_limit": cfg.replay_limit,
        },
        "replay_source": replay_source,
        "models": {},
    }
    for shape, precision, provider in targets_list:
        name = folder_name(shape, precision, provider)
        built = builds[name]
        model: dict[str, Any] = {"shape": shape, "precision": precision, **built, "modes": {}}
        report["models"][name] = model
        if "error" in built:
            log(f"{name}: not built: {built['error']}")
            continue
        for mode in cfg.modes:
            if mode == "graphs" and provider != "cuda":
                model["modes"][mode] = {"error": "CUDA graphs need the CUDA provider"}
                continue
            log(f"{name} {mode}")
            try:
                model["modes"][mode] = measure_mode(built["path"], provider, mode, cfg, inputs)
            except Exception as exc:  # noqa: BLE001 - one mode failing must not lose the others
                model["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"{name} {mode}: {json.dumps(_headline(model['modes'][mode]))}")
        if not cfg.no_genai:
            variants = (False, True) if provider == "cuda" else (False,)
            model["ortgenai"] = {}
            for graphs in variants:
                key = "cuda graphs on" if graphs else ("cuda graphs off" if provider == "cuda" else "cpu")
                model["ortgenai"][key] = measure_genai(built["path"], provider, cfg, graphs)
                log(f"{name} ORT GenAI {key}: {json.dumps(_headline(model['ortgenai'][key]))}")
    report["targets"] = targets(report)
    report["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = cfg.label or f"{cfg.provider}-{device_slug(facts)}-{facts['date_utc'][:10]}"
    json_path = out_dir / f"gpu-bench-{label}.json"
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md_path = out_dir / f"gpu-bench-{label}.md"
    md_path.write_text(render_markdown(report) + "\n")
    log(f"wrote {json_path} and {md_path} in {report['bench_seconds']} s")
    return 0


def _headline(result: dict) -> dict:
    if "error" in result or "skipped" in result:
        return {k: v for k, v in result.items() if k in ("error", "skipped")}
    if "greedy" in result:
        return {
            "greedy_decode_tok_s": round(result["greedy"]["decode_tok_s"], 1),
            "verify8/decode": round(result["verify8_over_decode"], 3),
            "identical": result["identity"]["oracle_drafts_identical"],
        }
    return {"decode_tok_s": round(result.get("decode_tok_s", 0.0), 1)}


if __name__ == "__main__":
    sys.exit(main())
