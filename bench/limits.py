"""Physical limits of a decode step: the bytes it streams (weights, KV cache) and how close the measured step
comes to the machine's memory bandwidth. Model facts come from ``ModelFolder.load``; the byte counts from the
decoder graph."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ortspec.backends.onnx import ModelFolder


def weight_bytes(folder: ModelFolder) -> dict[str, Any]:
    """Bytes of weights a decode step streams: the initializers of the decoder graph.

    Initializers consumed only by ``Gather`` (embedding tables) are counted as one row each, since a step reads a
    single row of them. Also reports the files' sizes on disk.
    """
    name = folder.model_path.name
    files = {
        p.name: p.stat().st_size
        for p in sorted(folder.path.iterdir())
        if p.is_file() and (p.name == name or p.name.startswith(name + ".") or p.suffix == ".data")
    }
    out: dict[str, Any] = {"files": files, "file_bytes": sum(files.values())}
    try:
        import numpy as np
        import onnx
        from onnx import helper

        model = onnx.load(str(folder.model_path), load_external_data=False)
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


def kv_bytes_per_step(folder: ModelFolder, context: int) -> int:
    """KV bytes read by one decode step at ``context`` positions (float32/float16 from the graph's KV inputs)."""
    itemsize = 4
    try:
        import onnx

        model = onnx.load(str(folder.model_path), load_external_data=False)
        for vi in model.graph.input:
            if vi.name.startswith("past_key_values"):
                itemsize = 2 if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else 4
                break
    except Exception:  # noqa: BLE001
        pass
    return context * folder.num_layers * 2 * folder.num_kv_heads * folder.head_size * itemsize


def physical_limits(
    model_dir: Path,
    bandwidth_runs: Sequence[dict[str, Any]],
    cost: dict[str, Any],
    quieter_cost: dict[str, Any],
    greedy_decode_tok_s: float | None,
    greedy_backend_ms_per_step: float | None,
) -> dict[str, Any]:
    """Bandwidth (the best of ``bandwidth_runs``), bytes per decode step, and the fraction of the bandwidth
    that the decode step of ``quieter_cost`` (the quieter verify cost curve), the ortspec-greedy runs and the
    backend time inside them achieve; the KV bytes at ``cost``'s context."""
    folder = ModelFolder.load(model_dir)
    bw = max(bandwidth_runs, key=lambda b: b["best_gb_s"])
    per_s = bw["best_gb_s"] * 1e9
    wb = weight_bytes(folder)
    kv = kv_bytes_per_step(folder, cost["context_tokens"])
    step = quieter_cost["decode_step_s"]
    physical: dict[str, Any] = {
        "bandwidth": bw,
        "bandwidth_runs": list(bandwidth_runs),
        "bandwidth_gb_s": bw["best_gb_s"],
        "weights": wb,
        "kv_bytes_per_step": kv,
        "kv_context": cost["context_tokens"],
        "decode_step_s": step,
        "decode_step_from": quieter_cost["when"],
        "achieved_gb_s": wb["bytes_per_step"] / step / 1e9,
        "achieved_fraction": wb["bytes_per_step"] / step / per_s,
        "achieved_fraction_with_kv": (wb["bytes_per_step"] + kv) / step / per_s,
        "ceiling_tok_s": per_s / wb["bytes_per_step"],
    }
    if greedy_decode_tok_s:
        physical["greedy_decode_tok_s"] = greedy_decode_tok_s
        physical["greedy_achieved_fraction"] = wb["bytes_per_step"] * greedy_decode_tok_s / per_s
    if greedy_backend_ms_per_step:
        physical["greedy_backend_step_s"] = greedy_backend_ms_per_step / 1e3
        physical["greedy_backend_fraction"] = wb["bytes_per_step"] / physical["greedy_backend_step_s"] / per_s
    return physical
