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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ortspec.core.proposers import DraftContext

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REPLAY_INPUTS = REPO / "bench" / "data" / "replay-fp32.json"

# The published architectures' dimensions (Hugging Face config.json of HuggingFaceTB/SmolLM2-135M-Instruct and
# Qwen/Qwen2.5-0.5B); "tiny" is for tests. context = max_position_embeddings.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=512,
        rope_theta=10000.0,
        tie_embeddings=False,
        context=2048,
        rms_norm_eps=1e-5,
    ),
    "smollm2-135m": dict(
        architecture="llama",
        hidden=576,
        layers=30,
        heads=9,
        kv_heads=3,
        intermediate=1536,
        vocab=49152,
        rope_theta=100000.0,
        tie_embeddings=True,
        context=8192,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-0.5b": dict(
        architecture="qwen2",
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab=151936,
        rope_theta=1000000.0,
        tie_embeddings=True,
        context=32768,
        rms_norm_eps=1e-6,
    ),
}
DEFAULT_SHAPES = {"cuda": ("smollm2-135m", "qwen2.5-0.5b"), "cpu": ("tiny",)}
DEFAULT_PRECISIONS = {"cuda": ("fp16", "int4"), "cpu": ("fp32",)}
MODES: dict[str, dict[str, bool]] = {
    "eager": {},
    "static": {"static_shapes": True},
    "graphs": {"cuda_graphs": True},
}
DEFAULT_MODES = {"cuda": ("eager", "static", "graphs"), "cpu": ("eager", "static")}
# The targets on the H200 (greedy only for the Qwen2.5-0.5B-shaped int4 model on CUDA).
TARGET_GREEDY = ("qwen2.5-0.5b", "int4", "cuda", 762.0)
TARGET_VERIFY8 = 1.2  # verify(8)/decode at most
TARGET_SPEC = {"code_edit": 1.5, "open_ended": 0.97}  # priced speculative / our greedy, at least
PRICED = "lookup n3 w16 cost-aware"  # the setting the targets are judged on (the suite's headline setting)
KMAX = 16


# ----------------------------------------------------------------------------------------------------------------
# model folders


def folder_name(shape: str, precision: str, provider: str) -> str:
    return f"{shape}-{precision}-{provider}"


def build_folder(models_dir: Path, shape: str, precision: str, provider: str, threads: int | None = None) -> dict:
    """Build (or find) one random-weight folder; returns ``path`` and ``build_s`` (None when it already existed)."""
    from ortspec.adapters.tools.convert import is_complete
    from tests.support.models import make_random_model

    if threads:
        try:
            import torch

            torch.set_num_threads(threads)
        except ImportError:
            pass
    path = models_dir / folder_name(shape, precision, provider)
    if is_complete(path):
        return {"path": str(path), "build_s": None}
    t0 = time.perf_counter()
    make_random_model(path, precision=precision, execution_provider=provider, **SHAPES[shape])
    return {"path": str(path), "build_s": round(time.perf_counter() - t0, 2)}


def build_all(models_dir: Path, targets: Sequence[tuple[str, str, str]], jobs: int, log) -> dict[str, dict]:
    """Build every (shape, precision, provider) folder, ``jobs`` at a time in separate processes (one in this
    process when ``jobs`` is 1); returns the results by folder name. Errors are reported, not raised."""
    models_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    if jobs <= 1 or len(targets) <= 1:
        for shape, precision, provider in targets:
            name = folder_name(shape, precision, provider)
            try:
                out[name] = build_folder(models_dir, shape, precision, provider)
            except Exception as exc:  # noqa: BLE001 - reported in the results
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"build {name}: {out[name]}")
        return out
    import concurrent.futures
    import multiprocessing

    threads = max(1, (os.cpu_count() or jobs) // jobs)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {
            pool.submit(build_folder, models_dir, shape, precision, provider, threads): folder_name(
                shape, precision, provider
            )
            for shape, precision, provider in targets
        }
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                out[name] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported in the results
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"build {name}: {out[name]}")
    return out


# ----------------------------------------------------------------------------------------------------------------
# machine


def _run_text(cmd: Sequence[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def machine_facts(provider: str) -> dict[str, Any]:
    """Date, CPU, GPU (nvidia-smi), Python and the versions that matter, and onnxruntime's providers."""
    import onnxruntime as ort

    from bench.machine import machine_info

    info = machine_info()
    gpu = _run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    versions = dict(info.get("versions", {}))
    for module in ("cupy", "torch", "onnxruntime_genai", "transformers"):
        try:
            versions[module] = getattr(__import__(module), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - absent or broken: say which
            versions[module] = f"not importable ({type(exc).__name__})"
    versions["onnxruntime"] = ort.__version__
    return {
        "date_utc": info["date_utc"],
        "provider": provider,
        "gpu": gpu,
        "device": (gpu.split(",")[0].strip() if gpu else None) if provider == "cuda" else info["cpu"],
        "cpu": info["cpu"],
        "cores": info["cores"],
        "memory_gib": info["memory_gib"],
        "python": info["python"],
        "os": info["os"],
        "onnxruntime_providers": ort.get_available_providers(),
        "versions": versions,
    }


def device_slug(facts: dict[str, Any]) -> str:
    name = str(facts.get("device") or facts.get("provider") or "unknown")
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "unknown"


# ----------------------------------------------------------------------------------------------------------------
# measurements


class OracleDrafts:
    """Drafts the known greedy continuation, with every ``wrong_every``-th drafted position wrong, so passes accept
    part of their draft (a random-weight model gives prompt lookup little to find)."""

    def __init__(self, prompt: Sequence[int], greedy: Sequence[int], vocab: int, wrong_every: int = 4) -> None:
        self.sequence = [*prompt, *greedy]
        self.vocab, self.wrong_every = vocab, wrong_every

    def propose(self, context: DraftContext) -> tuple[int, ...]:
        tokens = context.tokens
        n = len(tokens)
        if list(tokens[-8:]) != self.sequence[max(0, n - 8) : n]:
            return ()
        draft = self.sequence[n : n + context.width]
        return tuple((t + 1) % self.vocab if (n + i) % self.wrong_every == 0 else t for i, t in enumerate(draft))


def _prompt_ids(vocab: int, count: int, seed: int = 1234) -> list[int]:
    """A fixed prompt of ``count`` ids (no special ids 0-2), with a repeated stretch for prompt lookup to find."""
    rng = np.random.default_rng(seed)
    body = [int(t) for t in rng.integers(3, min(vocab, 32000), size=max(1, count - count // 4))]
    return (body + body[: count // 4])[:count]


def _timer_summary(timer, width: int) -> dict[str, float]:
    per = timer.per_pass(width)
    return {phase: round(seconds * 1e6, 1) for phase, seconds in per.items()} | {"passes": timer.passes.get(width, 0)}


def measure_mode(folder: str, provider: str, mode: str, cfg: argparse.Namespace, inputs: dict | None) -> dict:
    """Every measurement of one backend mode on one folder (see the module docstring)."""
    from bench.replay import PRICED_SETTINGS, price
    from ortspec import Options, PromptLookup, generate
    from ortspec.adapters.engine.measurements import measure_pass_costs, measure_verify_drift, probe_ids
    from ortspec.backends.onnx import BackendConfig, OrtBackend
    from ortspec.backends.onnx.cuda_graphs import PhaseTimer

    out: dict[str, Any] = {"mode": mode}
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(MODES[mode])
    if provider == "cpu":
        kwargs["threads"] = cfg.threads
    backend = OrtBackend.from_folder(folder, BackendConfig(provider=provider, max_length=cfg.max_length, **kwargs))
    out["open_s"] = round(time.perf_counter() - t0, 3)
    out["backend"] = repr(backend)
    out["array_module"] = getattr(backend.array_module, "name", None)
    if backend.graphs is not None:
        t0 = time.perf_counter()
        out["graphs"] = backend.capture_graphs()
        out["capture_s"] = round(time.perf_counter() - t0, 3)
    vocab = backend.vocab_size
    prompt = _prompt_ids(vocab, cfg.prompt_tokens)
    options = Options(max_tokens=cfg.new_tokens)
    generate(backend, prompt, Options(max_tokens=8))  # warm-up: first use of each shape

    runs = [generate(backend, prompt, options) for _ in range(cfg.repeats)]
    greedy = runs[0].token_ids
    decode = [r.decode_tokens_per_second for r in runs]
    out["greedy"] = {
        "decode_tok_s": statistics.median(decode),
        "decode_tok_s_runs": decode,
        "e2e_tok_s": statistics.median(r.tokens_per_second for r in runs),
        "prefill_ms": 1e3 * statistics.median(r.timings.first_token_s for r in runs),
        "new_tokens": len(greedy),
        "prompt_tokens": len(prompt),
        "same_tokens_every_run": all(r.token_ids == greedy for r in runs),
    }

    # time per pass: greedy steps through the driver, then 9-token verify passes
    timer = PhaseTimer()
    backend.timer = timer
    timed = generate(backend, prompt, options)
    steps = timed.stats.steps - 1
    step_s = (timed.timings.total_s - timed.timings.first_token_s) / max(steps - 1, 1)
    width1 = _timer_summary(timer, 1)
    out["step_us"] = {
        "greedy_pass": width1,
        "greedy_step_wall": round(step_s * 1e6, 1),
        "driver_per_step": round(step_s * 1e6 - width1["total"], 1),
    }
    timer.reset()
    feed = probe_ids(vocab, 9)
    backend.reset()
    backend.decode(prompt, 0)
    base = backend.current_len()
    for i in range(max(cfg.cost_repeats, 5) + 1):
        if i == 1:
            timer.reset()  # the first pass of this width was a warm-up
        if backend.picks_on_device:
            backend.verify_picks(feed, base)
        else:
            backend.decode_verify(feed, base)
        backend.rewind(base)
    out["step_us"]["verify9_pass"] = _timer_summary(timer, 9)
    backend.timer = None

    # cost curve
    ids = probe_ids(vocab, cfg.prompt_tokens + KMAX + 1)
    costs = measure_pass_costs(
        backend,
        ids[: cfg.prompt_tokens],
        ids[cfg.prompt_tokens :],
        KMAX,
        cfg.cost_repeats,
        picks=bool(backend.picks_on_device),
    )
    costs.pop("samples_s", None)
    out["costs"] = costs
    out["verify8_over_decode"] = costs["curve"][8]

    # speculative == greedy on this device
    drift = measure_verify_drift(backend, prompt[:64], probe_ids(vocab, 24))
    oracle = generate(backend, prompt, options, OracleDrafts(prompt, greedy, vocab), draft_width=8)
    lookup = generate(backend, prompt, options, PromptLookup(ngram=3, max_draft=8), draft_width=8)
    identity: dict[str, Any] = {
        "verify_drift_logits": drift,
        "oracle_drafts_identical": oracle.token_ids == greedy,
        "oracle_drafts_acceptance": f"{oracle.stats.accepted_tokens}/{oracle.stats.proposed_tokens}",
        "prompt_lookup_identical": lookup.token_ids == greedy,
        "prompt_lookup_acceptance": f"{lookup.stats.accepted_tokens}/{lookup.stats.proposed_tokens}",
    }
    if drift > 0:
        margin = 2 * drift
        guarded = generate(
            backend,
            prompt,
            Options(max_tokens=cfg.new_tokens, tie_margin=margin),
            OracleDrafts(prompt, greedy, vocab),
            draft_width=8,
        )
        identity["tie_margin"] = margin
        identity["oracle_drafts_identical_with_tie_margin"] = guarded.token_ids == greedy
    out["identity"] = identity

    # speculation priced with the CPU runs' acceptance
    if inputs is not None:
        t0 = time.perf_counter()
        priced = price(inputs, costs["curve"], PRICED_SETTINGS, limit=cfg.replay_limit, pass_s=costs["pass_s"])
        for entry in priced.values():
            entry["greedy"]["over_measured_greedy"] = entry["greedy"]["expected_tok_s"] / out["greedy"]["decode_tok_s"]
        out["priced"] = priced
        out["price_s"] = round(time.perf_counter() - t0, 2)
    del backend
    return out


def measure_genai(folder: str, provider: str, cfg: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    """ONNX Runtime GenAI's own greedy on ``folder`` (its CUDA graphs on or off on CUDA): decode tokens per second
    after the first token, median of ``--repeats`` runs of exactly ``--new-tokens`` (min_length = max_length)."""
    try:
        if provider == "cuda":
            import onnxruntime

            from ortspec.backends.onnx.session import preload_cuda_libraries

            preload_cuda_libraries(onnxruntime)  # the CUDA libraries of the nvidia-* packages, for GenAI too
        import onnxruntime_genai as og
    except Exception as exc:  # noqa: BLE001 - ImportError, or its native library failing to load
        return {"skipped": f"onnxruntime_genai is not importable: {type(exc).__name__}: {exc}"}
    try:
        config = og.Config(folder)
        config.clear_providers()
        if provider == "cuda":
            config.append_provider("cuda")
            config.set_provider_option("cuda", "enable_cuda_graph", "1" if graphs else "0")
        else:
            overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": cfg.threads or 1}}}}
            config.overlay(json.dumps(overlay))
        model = og.Model(config)
    except Exception as exc:  # noqa: BLE001 - e.g. the CPU package asked for CUDA
        return {"skipped": f"ORT GenAI could not load the folder on {provider}: {type(exc).__name__}: {exc}"}
    prompt = _prompt_ids(model_vocab(folder), cfg.prompt_tokens)
    total = len(prompt) + cfg.new_tokens
    rates, e2e = [], []
    for i in range(cfg.repeats + 1):  # the first run warms up
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))
        generator.generate_next_token()
        t_first = time.perf_counter()
        steps = 1
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
        t_end = time.perf_counter()
        del generator
        if i:
            rates.append((steps - 1) / (t_end - t_first))
            e2e.append(steps / (t_end - t0))
    return {
        "cuda_graphs": graphs if provider == "cuda" else None,
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_runs": rates,
        "e2e_tok_s": statistics.median(e2e),
        "new_tokens": cfg.new_tokens,
        "version": getattr(og, "__version__", "?"),
    }


def model_vocab(folder: str) -> int:
    from ortspec.backends.onnx import ModelFolder

    return ModelFolder.load(folder).vocab_size


# ----------------------------------------------------------------------------------------------------------------
# report


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def targets(report: dict) -> list[dict[str, Any]]:
    """The issue's targets, judged on what this run measured (a target whose model or mode did not run is
    "not measured")."""
    provider = report["machine"]["provider"]
    rows: list[dict[str, Any]] = []
    shape, precision, target_provider, goal = TARGET_GREEDY
    for name, model in report["models"].items():
        for mode, result in model.get("modes", {}).items():
            if "greedy" not in result:
                continue
            label = f"{name} {mode}"
            if (model["shape"], model["precision"], provider) == (shape, precision, target_provider):
                rate = result["greedy"]["decode_tok_s"]
                rows.append(
                    {"target": f"greedy >= {goal:g} tok/s", "where": label, "measured": rate, "met": rate >= goal}
                )
            ratio = result.get("verify8_over_decode")
            if ratio is not None:
                rows.append(
                    {
                        "target": f"verify(8)/decode <= {TARGET_VERIFY8}",
                        "where": label,
                        "measured": ratio,
                        "met": ratio <= TARGET_VERIFY8,
                    }
                )
            for category, goal_ratio in TARGET_SPEC.items():
                item = result.get("priced", {}).get(category, {}).get(PRICED)
                if item is not None:
                    value = item["speedup_with_host"]
                    rows.append(
                        {
                            "target": f"priced speculative / greedy on {category} >= {goal_ratio}",
                            "where": label,
                            "measured": value,
                            "met": value >= goal_ratio,
                        }
                    )
            ident = result.get("identity", {})
            if ident:
                same = bool(ident.get("oracle_drafts_identical")) and bool(ident.get("prompt_lookup_identical"))
                rows.append({"target": "speculative == greedy", "where": label, "measured": same, "met": same})
    return rows


def render_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# GPU benchmark: {m['device']} ({m['provider']}), {m['date_utc'][:10]}",
        "",
        f"`{report['command']}`",
        "",
        f"- machine: {m.get('gpu') or '-'}; CPU {m['cpu']}, {m['cores']}, {m['memory_gib']} GiB; {m['python']}; "
        f"{m['os']}",
        f"- onnxruntime {m['versions'].get('onnxruntime')} ({', '.join(m['onnxruntime_providers'])}); "
        f"CuPy {m['versions'].get('cupy')}; torch {m['versions'].get('torch')}; "
        f"onnxruntime-genai {m['versions'].get('onnxruntime_genai')}",
        f"- random-weight folders of the published shapes (built here, {report['config']['models_dir']}); prompt "
        f"{report['config']['prompt_tokens']} tokens, {report['config']['new_tokens']} new tokens, median of "
        f"{report['config']['repeats']} runs; KV capacity {report['config']['max_length']}",
        f"- speculation priced with the acceptance of `{report['config']['replay_inputs']}` "
        f"({report.get('replay_source', '-')}), setting `{PRICED}`",
        "",
        "Modes: `eager` = the default binding; `static` = static shapes (on CUDA also stream-ordered: no host sync "
        "but the read-back); `graphs` = static shapes + one CUDA graph per pass width.",
        "",
    ]
    for name, model in report["models"].items():
        lines += [f"## {name}", ""]
        if "error" in model:
            lines += [f"not measured: {model['error']}", ""]
            continue
        lines += [f"build: {_fmt(model.get('build_s'))} s (None: already built)", ""]
        lines += [
            "| mode | greedy decode tok/s | e2e tok/s | prefill ms | verify(8)/decode | greedy pass µs (host / run / "
            "sync / readback) | driver µs/step | spec == greedy | drift |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
        ]
        for mode, r in model["modes"].items():
            if "error" in r:
                lines.append(f"| {mode} | error: {r['error'][:200]} | | | | | | | |")
                continue
            g, s, ident = r["greedy"], r["step_us"], r["identity"]
            p = s["greedy_pass"]
            same = "yes" if ident["oracle_drafts_identical"] and ident["prompt_lookup_identical"] else "NO"
            lines.append(
                f"| {mode} | {_fmt(g['decode_tok_s'], 1)} | {_fmt(g['e2e_tok_s'], 1)} | {_fmt(g['prefill_ms'], 1)} | "
                f"{_fmt(r['verify8_over_decode'])} | {p['host']:.0f} / {p['run']:.0f} / {p['sync']:.0f} / "
                f"{p['readback']:.0f} | {_fmt(s['driver_per_step'], 0)} | {same} "
                f"({ident['oracle_drafts_acceptance']}) | {ident['verify_drift_logits']:.2g} |"
            )
        lines.append("")
        lines += ["verify(K)/decode, K = 0..16:", ""]
        for mode, r in model["modes"].items():
            if "costs" in r:
                curve = ", ".join(f"{c:.2f}" for c in r["costs"]["curve"])
                lines.append(f"- {mode} (decode step {r['costs']['decode_step_s'] * 1e6:.0f} µs): {curve}")
            if r.get("graphs"):
                gr = r["graphs"]
                lines.append(
                    f"  - CUDA graphs: {'on' if gr.get('enabled') else 'off'}"
                    f"{'' if gr.get('enabled') else ' (' + str(gr.get('disabled_reason'))[:300] + ')'}; "
                    f"captured widths {gr.get('captured_widths')}; capture {r.get('capture_s')} s"
                )
        lines.append("")
        priced_modes = [(mode, r) for mode, r in model["modes"].items() if r.get("priced")]
        if priced_modes:
            categories = list(priced_modes[0][1]["priced"])
            lines += [
                f"Speculation priced (`{PRICED}`): expected decode tok/s from this mode's pass times K = 0..16 and the "
                "host time per pass the replay measured here (driver, core, prompt lookup); in brackets ÷ greedy "
                "priced the same way. Last column: priced greedy ÷ measured greedy (how well the pricing "
                "reproduces the measured loop).",
                "",
                "| mode | " + " | ".join(categories) + " | priced greedy ÷ measured |",
                "| --- |" + " ---: |" * (len(categories) + 1),
            ]
            for mode, r in priced_modes:
                cells = []
                for entry in r["priced"].values():
                    item = entry[PRICED]
                    cells.append(f"{item['expected_tok_s']:.0f} ({item['speedup_with_host']:.2f}x)")
                checks = [entry["greedy"]["over_measured_greedy"] for entry in r["priced"].values()]
                lines.append(f"| {mode} | " + " | ".join(cells) + f" | {statistics.median(checks):.2f} |")
            lines.append("")
        genai = model.get("ortgenai", {})
        if genai:
            lines += ["ONNX Runtime GenAI greedy on the same folder:", ""]
            for key, r in genai.items():
                if "skipped" in r:
                    lines.append(f"- {key}: not run ({r['skipped'][:300]})")
                else:
                    lines.append(f"- {key}: {r['decode_tok_s']:.1f} decode tok/s, {r['e2e_tok_s']:.1f} e2e tok/s")
            lines.append("")
    rows = targets(report)
    if rows:
        lines += [
            "## Targets (as measured in this run)",
            "",
            "| target | where | measured | met |",
            "| --- | --- | ---: | --- |",
        ]
        for row in rows:
            value = row["measured"]
            shown = ("yes" if value else "no") if isinstance(value, bool) else _fmt(value)
            lines.append(f"| {row['target']} | {row['where']} | {shown} | {'met' if row['met'] else 'missed'} |")
        lines.append("")
    return "\n".join(lines)


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
