"""The decoder's ONNX graph: its interface checked against its folder, and the load-time rewrites.

The interface, checked against its folder: :func:`inspect_graph` reads an ``InferenceSession``
and a :class:`ModelFolder` and returns a :class:`DecoderGraph`, the names and dtypes of everything a pass binds,
or raises ``ModelFileError`` (a ``ModelFolderError`` and a ``BackendError``) naming the model file, the tensor and
what does not match ``genai_config.json``.

:func:`read_graph_facts` reads what the session's interface does not show (the attention nodes' windows, the
``MatMulNBits`` accuracy levels) from the ONNX file itself (the graph only, not the weights). The load-time rewrites
of the graph are ``graph_rewrites.py``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .folder import ModelFileError, ModelFolder, external_data_problem
from .ragged_rewrite import QUERY_LENGTHS_INPUT
from .tree_rewrite import TREE_BIAS_INPUT, TREE_POSITIONS_INPUT

logger = logging.getLogger(__name__)

# ONNX Runtime's type strings -> numpy dtypes, for the types this backend feeds or reads
ORT_TYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
}
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # KV and logits
INDEX_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))  # input ids, attention mask, position ids
KEEP_LOGITS_INPUT = "ortspec_logits_to_keep"  # added by the keep_logits rewrite: int64 [1], positions kept
LM_HEAD_OPS = ("MatMul", "MatMulNBits")


@attrs.frozen
class LayerKVNames:
    """One layer's KV tensors: graph inputs ``past_key``/``past_value`` and outputs ``present_key``/``present_value``,
    each ``[batch, kv_heads, positions, head_size]``."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    layer: int = 0


@attrs.frozen
class StateNames:
    """One layer's recurrent state (e.g. LFM2's ``conv``): graph input ``past`` and output ``present``, both
    ``[batch, *shape]`` of ``dtype``. A pass reads the state after the positions before it and writes the state
    after its last token, so, unlike the KV cache, it cannot be rewound by changing a length."""

    layer: int
    kind: str
    past: str
    present: str
    shape: tuple[int, ...]
    dtype: np.dtype


@attrs.frozen
class AttentionNode:
    """A ``GroupQueryAttention`` node: the layer whose KV it reads (by its past-key input), its
    ``local_window_size`` (-1 or 0: full attention) and whether it indexes a window-sized cache
    (``sliding_window_cache``)."""

    name: str
    past_key: str
    local_window_size: int
    sliding_window_cache: bool


@attrs.frozen
class GraphFacts:
    """What :func:`read_graph_facts` reads from an ONNX file: its ``GroupQueryAttention`` nodes and the
    ``accuracy_level`` of each ``MatMulNBits`` node (counted per ``(bits, accuracy_level)``)."""

    attention: tuple[AttentionNode, ...]
    matmul_nbits: Mapping[tuple[int, int], int] = attrs.field(factory=dict)

    @property
    def group_query_attention(self) -> bool:
        return bool(self.attention)

    def window_of(self, past_key: str) -> int | None:
        """The ``local_window_size`` of the attention node reading ``past_key`` (None: no such node)."""
        for node in self.attention:
            if node.past_key == past_key:
                return node.local_window_size
        return None


@attrs.frozen
class DecoderGraph:
    """What one decoder pass binds, by graph name and dtype (all checked against the session).

    Inputs: ``ids_name`` (``[1, tokens]``), ``mask_name`` (``[1, total positions]``, all ones) and
    ``position_name`` (``[1, tokens]``); the graph takes at least one of the last two (None: it takes none by
    that name). ``kv_names`` holds one :class:`LayerKVNames` per layer with a KV cache (every layer, except in
    hybrid models), all of ``kv_dtype``; ``states`` one :class:`StateNames` per recurrent state. Output
    ``logits_name`` is ``[1, tokens, vocab]`` of ``logits_dtype``. ``group_query_attention``: the graph uses
    the ``GroupQueryAttention`` op, which can append to a KV buffer bound as both past and present. Optional output
    ``hidden_name`` (None when the graph has none): the final norm's output, ``[1, tokens, hidden_size]`` of
    ``hidden_dtype`` (``hidden_size`` is 0 without it). ``tree_positions_name`` and ``tree_bias_name`` (None unless
    the tree rewrite added them, ``tree_rewrite.py``): every attention node's position ids (int64 ``[batch,
    tokens]``) and additive bias (``tree_bias_dtype``, ``[1, 1, tokens, total positions]``).
    ``query_lengths_name`` (None unless the ragged rewrite added it, ``ragged_rewrite.py``): each row's count of real
    tokens, int32 ``[batch]``."""

    ids_name: str
    ids_dtype: np.dtype
    mask_name: str | None
    mask_dtype: np.dtype | None
    position_name: str | None
    position_dtype: np.dtype | None
    kv_names: tuple[LayerKVNames, ...]
    kv_dtype: np.dtype
    logits_name: str
    logits_dtype: np.dtype
    group_query_attention: bool
    states: tuple[StateNames, ...] = ()
    hidden_name: str | None = None
    hidden_dtype: np.dtype | None = None
    hidden_size: int = 0
    keep_name: str | None = None
    tree_positions_name: str | None = None
    tree_bias_name: str | None = None
    tree_bias_dtype: np.dtype | None = None
    query_lengths_name: str | None = None


class _Interface:
    """A session's declared inputs and outputs, read against one folder: lookups that raise ``ModelFileError``
    naming the model file, and ``fed``, the inputs a pass will bind."""

    def __init__(self, session, folder: ModelFolder) -> None:
        self.folder = folder
        self.where = f"{folder.model_path}"
        self.inputs = {arg.name: arg for arg in session.get_inputs()}
        self.outputs = {arg.name: arg for arg in session.get_outputs()}
        self.fed: set[str] = set()

    def fail(self, message: str) -> ModelFileError:
        return ModelFileError(f"{self.where}: {message}")

    def dtype_of(self, arg, allowed, what: str) -> np.dtype:
        dtype = ORT_TYPES.get(arg.type)
        if dtype is None or dtype not in allowed:
            raise self.fail(
                f"{what} {arg.name!r} has type {arg.type}; supported: " + ", ".join(str(a) for a in allowed)
            )
        return dtype

    def need(self, table: Mapping[str, Any], name: str, what: str) -> Any:
        if name not in table:
            declared = sorted(n for n in table if n != KEEP_LOGITS_INPUT)  # the file's names, not a rewrite's
            raise self.fail(
                f"the graph has no {what} named {name!r} (genai_config.json names it); "
                f"it declares {declared[:8]}{' ...' if len(declared) > 8 else ''}"
            )
        return table[name]

    def optional_index_input(self, name: str) -> tuple[str | None, np.dtype | None]:
        """``(name, dtype)`` of an index input the graph may take (``(None, None)`` when it does not)."""
        if name not in self.inputs:
            return None, None
        self.fed.add(name)
        return name, self.dtype_of(self.inputs[name], INDEX_DTYPES, "input")

    def kv(self) -> tuple[tuple[LayerKVNames, ...], np.dtype | None]:
        """Each KV layer's tensors, checked: one float dtype, rank 4, the config's heads and head size."""
        folder, inputs, outputs = self.folder, self.inputs, self.outputs
        kv_dtype: np.dtype | None = None
        kv_names = []
        for layer in folder.kv_layers:
            names = LayerKVNames(
                past_key=folder.past_key_pattern % layer,
                past_value=folder.past_value_pattern % layer,
                present_key=folder.present_key_pattern % layer,
                present_value=folder.present_value_pattern % layer,
                layer=layer,
            )
            for name, table, what in (
                (names.past_key, inputs, "input"),
                (names.past_value, inputs, "input"),
                (names.present_key, outputs, "output"),
                (names.present_value, outputs, "output"),
            ):
                arg = self.need(table, name, what)
                dtype = self.dtype_of(arg, FLOAT_DTYPES, what)
                if kv_dtype is None:
                    kv_dtype = dtype
                elif dtype != kv_dtype:
                    raise self.fail(f"{what} {arg.name!r} is {arg.type} but other KV tensors are {kv_dtype}")
                self._check_kv_shape(arg, what)
                if table is inputs:
                    self.fed.add(arg.name)
            kv_names.append(names)
        if (extra_layer := folder.past_key_pattern % folder.num_layers) in inputs:
            raise self.fail(
                f"the graph has more layers than genai_config.json's num_hidden_layers = {folder.num_layers} "
                f"(it declares input {extra_layer!r})"
            )
        return tuple(kv_names), kv_dtype

    def _check_kv_shape(self, arg, what: str) -> None:
        shape = list(arg.shape)
        if len(shape) != 4:
            raise self.fail(
                f"{what} {arg.name!r} has rank {len(shape)}, expected 4 ([batch, kv_heads, length, head_size])"
            )
        for axis, expected, label in (
            (1, self.folder.num_kv_heads, "num_key_value_heads"),
            (3, self.folder.head_size, "head_size"),
        ):
            if isinstance(shape[axis], int) and shape[axis] != expected:
                raise self.fail(
                    f"{what} {arg.name!r} has dim {axis} = {shape[axis]} but genai_config.json "
                    f"says {label} = {expected}"
                )

    def states(self) -> tuple[StateNames, ...]:
        """The recurrent states the folder's ``state_patterns`` name and the graph takes, checked."""
        folder, inputs = self.folder, self.inputs
        states = []
        for kind, past_pattern, present_pattern in folder.state_patterns:
            for layer in range(folder.num_layers):
                past_name, present_name = past_pattern % layer, present_pattern % layer
                if past_name not in inputs:
                    continue
                past = inputs[past_name]
                present = self.need(self.outputs, present_name, "output")
                dtype = self.dtype_of(past, FLOAT_DTYPES, "input")
                if self.dtype_of(present, FLOAT_DTYPES, "output") != dtype:
                    raise self.fail(f"state {past_name!r} is {past.type} but {present_name!r} is {present.type}")
                shape = list(past.shape)[1:]
                fixed = shape and all(isinstance(d, int) and d > 0 for d in shape)
                if not fixed or list(present.shape)[1:] != shape:
                    raise self.fail(
                        f"state {past_name!r} has shape {list(past.shape)} and {present_name!r} "
                        f"{list(present.shape)}; this backend needs [batch, fixed sizes...] for both"
                    )
                self.fed.add(past_name)
                states.append(StateNames(layer, kind, past_name, present_name, tuple(int(d) for d in shape), dtype))
        return tuple(states)

    def logits(self) -> tuple[str, np.dtype]:
        folder = self.folder
        logits = self.need(self.outputs, folder.logits_name, "output")
        logits_dtype = self.dtype_of(logits, FLOAT_DTYPES, "output")
        logits_shape = list(logits.shape)
        if len(logits_shape) != 3:
            raise self.fail(
                f"output {logits.name!r} has rank {len(logits_shape)}, expected 3 ([batch, sequence, vocab])"
            )
        if isinstance(logits_shape[2], int) and logits_shape[2] != folder.vocab_size:
            raise self.fail(
                f"output {logits.name!r} has vocab dim {logits_shape[2]} but genai_config.json "
                f"says vocab_size = {folder.vocab_size}"
            )
        return logits.name, logits_dtype

    def hidden(self) -> tuple[str | None, np.dtype | None, int]:
        """``(name, dtype, size)`` of the hidden-states output (``(None, None, 0)`` when the graph has none)."""
        hidden = self.outputs.get(self.folder.hidden_states_name)
        if hidden is None:
            return None, None, 0
        hidden_dtype = self.dtype_of(hidden, FLOAT_DTYPES, "output")
        hidden_shape = list(hidden.shape)
        if len(hidden_shape) != 3 or not isinstance(hidden_shape[2], int) or hidden_shape[2] < 1:
            raise self.fail(
                f"output {hidden.name!r} has shape {hidden_shape}; expected [batch, sequence, hidden] with "
                "a fixed hidden size"
            )
        return hidden.name, hidden_dtype, int(hidden_shape[2])

    def check_all_fed(self) -> None:
        extra = sorted(set(self.inputs) - self.fed)
        if not extra:
            return
        hint = ""
        if any(name.startswith("past") for name in extra) and not self.folder.state_patterns:
            hint = (
                " (per-layer state inputs that genai_config.json does not name as past_<kind>_names, or layers "
                "its layer_types does not mark as attention)"
            )
        raise self.fail(f"the graph declares inputs this backend does not know how to feed: {extra}{hint}")


def inspect_graph(session, folder: ModelFolder, facts: GraphFacts | None = None) -> DecoderGraph:
    """Check that ``session`` declares what ``folder``'s config names, with shapes it states and dtypes this
    backend can feed, and no input it does not know how to feed; return the names and dtypes. ``facts``: the
    session's graph as :func:`read_graph_facts` reads it (default: read from ``folder.model_path``)."""
    interface = _Interface(session, folder)
    ids = interface.need(interface.inputs, folder.input_ids_name, "input")
    ids_dtype = interface.dtype_of(ids, INDEX_DTYPES, "input")
    interface.fed.add(ids.name)
    wanted_mask = folder.attention_mask_name or "attention_mask"
    wanted_position = folder.position_ids_name or "position_ids"
    mask_name, mask_dtype = interface.optional_index_input(wanted_mask)
    position_name, position_dtype = interface.optional_index_input(wanted_position)
    if mask_name is None and position_name is None:
        raise interface.fail(
            f"the graph declares neither {wanted_mask!r} nor {wanted_position!r}, so this backend cannot "
            "tell it the sequence length"
        )
    kv_names, kv_dtype = interface.kv()
    states = interface.states()
    logits_name, logits_dtype = interface.logits()
    hidden_name, hidden_dtype, hidden_size = interface.hidden()
    keep_name = KEEP_LOGITS_INPUT if KEEP_LOGITS_INPUT in interface.inputs else None
    if keep_name is not None:
        interface.fed.add(keep_name)
    tree = TREE_POSITIONS_INPUT in interface.inputs and TREE_BIAS_INPUT in interface.inputs
    tree_bias_dtype = None
    if tree:
        interface.fed.update((TREE_POSITIONS_INPUT, TREE_BIAS_INPUT))
        tree_bias_dtype = interface.dtype_of(interface.inputs[TREE_BIAS_INPUT], FLOAT_DTYPES, "input")
    query_lengths = QUERY_LENGTHS_INPUT if QUERY_LENGTHS_INPUT in interface.inputs else None
    if query_lengths is not None:
        interface.fed.add(query_lengths)
    interface.check_all_fed()
    if kv_dtype is None:
        raise interface.fail("the graph has no KV inputs (genai_config.json names no layers)")
    return DecoderGraph(
        ids_name=ids.name,
        ids_dtype=ids_dtype,
        mask_name=mask_name,
        mask_dtype=mask_dtype,
        position_name=position_name,
        position_dtype=position_dtype,
        kv_names=kv_names,
        kv_dtype=kv_dtype,
        logits_name=logits_name,
        logits_dtype=logits_dtype,
        group_query_attention=(
            facts if facts is not None else read_graph_facts(folder.model_path)
        ).group_query_attention,
        states=tuple(states),
        hidden_name=hidden_name,
        hidden_dtype=hidden_dtype,
        hidden_size=hidden_size,
        keep_name=keep_name,
        tree_positions_name=TREE_POSITIONS_INPUT if tree else None,
        tree_bias_name=TREE_BIAS_INPUT if tree else None,
        tree_bias_dtype=tree_bias_dtype,
        query_lengths_name=query_lengths,
    )


def _load_proto(model_path: Path):
    """The ONNX model at ``model_path`` without its external weights (the graph and small initializers)."""
    import onnx

    try:
        return onnx.load(os.fspath(model_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for an unreadable file
        problem = external_data_problem(model_path) or f"{model_path}: could not read the ONNX graph"
        raise ModelFileError(f"{problem} [onnx: {exc}]") from exc


def _attribute(node, name: str, default: Any) -> Any:
    import onnx

    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _facts_of(model) -> GraphFacts:
    attention = []
    levels: dict[tuple[int, int], int] = {}
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            past_key = node.input[3] if len(node.input) > 3 else ""
            attention.append(
                AttentionNode(
                    name=node.name,
                    past_key=past_key,
                    local_window_size=int(_attribute(node, "local_window_size", -1)),
                    sliding_window_cache=bool(_attribute(node, "sliding_window_cache", 0)),
                )
            )
        elif node.op_type == "MatMulNBits":
            key = (int(_attribute(node, "bits", 4)), int(_attribute(node, "accuracy_level", 0)))
            levels[key] = levels.get(key, 0) + 1
    return GraphFacts(attention=tuple(attention), matmul_nbits=levels)


def read_graph_facts(model_path: Path) -> GraphFacts:
    """The attention nodes and ``MatMulNBits`` accuracy levels of the ONNX file at ``model_path``."""
    return _facts_of(_load_proto(model_path))
