"""The GPU benchmark's model folders and machine: the published architectures' shapes (``SHAPES``), a
random-weight folder built (or found) for each shape, precision and provider (``build_folder``; ``build_all`` in
parallel processes), and the facts of the machine the results name (``machine_facts``, ``device_slug``)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
