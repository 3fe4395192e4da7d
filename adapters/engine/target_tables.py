"""Reading a builder-written Llama-family decoder's own tables out of its ONNX file: the input-embedding table, the
RoPE tables, the RMS-norm epsilon and one layer's weights, which a shared-KV drafter copies or starts from.

Only the tensors asked for are read (the graph is loaded without its external data; each wanted initializer is
read from its file at its offset). Needs ``onnx``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.backends.onnx import ModelFolder


class TargetTablesError(ValueError):
    """The decoder graph lacks a table a drafter needs (the message names the file and the tensor)."""


@attrs.frozen(eq=False)
class LayerWeights:
    """One decoder layer's weights in the ``x @ W`` orientation: ``wq`` ``[H, heads * D]`` (the query part of the
    fused qkv projection), ``wo`` ``[heads * D, H]``, ``w_gate``/``w_up`` ``[H, I]``, ``w_down`` ``[I, H]``, and the
    two RMS-norm weights ``[H]``."""

    norm_attn: np.ndarray
    wq: np.ndarray
    wo: np.ndarray
    norm_mlp: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


class TargetTables:
    """The tables of ``folder``'s decoder graph. ``embedding()``: ``[V, H]`` float32 (the table its input Gather
    reads, transposed back when the graph shares it with the LM head); ``rope()``: the ``cos``/``sin`` caches
    ``[positions, D / 2]``; ``eps``: its RMS norms' epsilon; ``layer(i)``; ``final_norm()``."""

    def __init__(self, folder: ModelFolder) -> None:
        import onnx

        self.folder = folder
        self.path = folder.model_path
        self._model = onnx.load(str(self.path), load_external_data=False)
        self._inits = {t.name: t for t in self._model.graph.initializer}
        graph_nodes = list(self._model.graph.node)
        self._producers = {out: n for n in graph_nodes for out in n.output}
        eps = [
            a.f for n in graph_nodes if "LayerNormalization" in n.op_type for a in n.attribute if a.name == "epsilon"
        ]
        if not eps:
            raise TargetTablesError(f"{self.path}: no (Skip)SimplifiedLayerNormalization node to read epsilon from")
        self.eps = float(eps[0])
        self._gather = next(
            (n for n in graph_nodes if n.op_type == "Gather" and folder.input_ids_name in n.input[1:]), None
        )

    def tensor(self, name: str) -> np.ndarray:
        """The initializer ``name`` as a numpy array (read from the external data file when stored there)."""
        from onnx import numpy_helper

        init = self._inits.get(name)
        if init is None:
            raise TargetTablesError(f"{self.path}: the graph has no initializer named {name!r}")
        info = {e.key: e.value for e in init.external_data}
        if not info:
            return numpy_helper.to_array(init)
        dtype = np.dtype(_ONNX_DTYPES.get(init.data_type, "?"))
        if dtype == np.dtype("?"):
            raise TargetTablesError(f"{self.path}: initializer {name!r} has an unsupported data type {init.data_type}")
        offset, length = int(info.get("offset", 0)), int(info["length"])
        data = np.fromfile(Path(self.path).parent / info["location"], dtype=np.uint8, count=length, offset=offset)
        return data.view(dtype).reshape(tuple(init.dims))

    def embedding(self) -> np.ndarray:
        if self._gather is None:
            raise TargetTablesError(f"{self.path}: no Gather node reads {self.folder.input_ids_name!r}")
        source = self._gather.input[0]
        if source in self._inits:
            return np.asarray(self.tensor(source), np.float32)
        producer = self._producers.get(source)
        if producer is not None and producer.op_type == "Transpose" and producer.input[0] in self._inits:
            return np.ascontiguousarray(self.tensor(producer.input[0]).T, np.float32)
        raise TargetTablesError(
            f"{self.path}: the input embedding {source!r} is neither an initializer nor a transpose"
        )

    def rope(self) -> tuple[np.ndarray, np.ndarray]:
        return self.tensor("cos_cache").astype(np.float32), self.tensor("sin_cache").astype(np.float32)

    def layer(self, index: int) -> LayerWeights:
        f = self.folder
        prefix = f"model.layers.{index}."
        qkv = self.tensor(prefix + "attn.qkv_proj.MatMul.weight").astype(np.float32)
        width = f.num_attention_heads * f.head_size
        return LayerWeights(
            norm_attn=self.tensor(prefix + "input_layernorm.weight").astype(np.float32),
            wq=np.ascontiguousarray(qkv[:, :width]),
            wo=self.tensor(prefix + "attn.o_proj.MatMul.weight").astype(np.float32),
            norm_mlp=self.tensor(prefix + "post_attention_layernorm.weight").astype(np.float32),
            w_gate=self.tensor(prefix + "mlp.gate_proj.MatMul.weight").astype(np.float32),
            w_up=self.tensor(prefix + "mlp.up_proj.MatMul.weight").astype(np.float32),
            w_down=self.tensor(prefix + "mlp.down_proj.MatMul.weight").astype(np.float32),
        )

    def final_norm(self) -> np.ndarray:
        return self.tensor(f"model.layers.{self.folder.num_layers}.final_norm_layernorm.weight").astype(np.float32)


_ONNX_DTYPES: dict[int, Any] = {1: np.float32, 10: np.float16, 7: np.int64, 6: np.int32}
