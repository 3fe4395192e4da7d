"""The decoder's ONNX graph: its interface checked against its folder, and the load-time rewrites.

The interface, checked against its folder: :func:`inspect_graph` reads an ``InferenceSession``
and a :class:`ModelFolder` and returns a :class:`DecoderGraph`, the names and dtypes of everything a pass binds,
or raises ``ModelFileError`` (a ``ModelFolderError`` and a ``BackendError``) naming the model file, the tensor and
what does not match ``genai_config.json``.

:func:`read_graph_facts` reads what the session's interface does not show (the attention nodes' windows, the
``MatMulNBits`` accuracy levels) from the ONNX file itself (the graph only, not the weights), and
:func:`rewritten_model` returns the graph with some of those attributes changed (the weights stay in their external
data files). :func:`load_rewrites` decides, from a :class:`BackendConfig`, which rewrites ``OrtBackend.from_folder``
applies:

* **Sliding window.** A folder whose ``genai_config.json`` names a sliding window that its graph's attention nodes
  ignore gets the window applied (``sliding_window="config"``, the default) or runs as written (``"graph"``); see
  :func:`window_rewrites`.
* **MatMulNBits accuracy.** ``matmul_accuracy_level`` sets every ``MatMulNBits`` node's accuracy level (1: float32
  compute, which makes a quantized model's verify passes agree with its one-token decodes).
* **Logits of the last positions only** (``keep_logits``, asked by ``OrtBatchBackend``, and by ``OrtBackend`` on the
  CPU with dynamic shapes): a prompt pass needs the logits of its last position, yet the LM head (a product with
  the ``[hidden, vocab]`` matrix) would run over every position. The rewrite adds an int64 input ``KEEP_LOGITS_INPUT``
  (shape ``[1]``: ``L``) and slices the LM head's input to its last ``L`` positions, so ``logits`` is ``[batch, L,
  vocab]``; with ``L`` = the pass width it computes what the file computes. Applied where the logits output is made
  by a ``MatMul`` or ``MatMulNBits`` (the builder's LM head); elsewhere the graph is left as it is
  (``DecoderGraph.keep_name`` None). The hidden-states output (the LM head's input, when the graph has one) is
  sliced the same way: ``[batch, L, hidden]``, the logits' positions.
* **Fused features** (``hidden_features``): the residual streams entering those layers appended to the hidden-states
  output, for a drafter that reads them (``graph_features.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..base import BackendError
from .config import BackendConfig
from .folder import CONFIG_NAME, ModelFileError, ModelFolder, external_data_problem
from .graph_features import append_features
from .ragged_rewrite import QUERY_LENGTHS_INPUT, add_query_lengths
from .tree_rewrite import TREE_BIAS_INPUT, TREE_POSITIONS_INPUT, add_tree_inputs

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


def rewritten_model(
    model_path: Path,
    *,
    windows: Mapping[str, int] | None = None,
    accuracy_level: int | None = None,
    keep_logits: str | None = None,
    features: Sequence[int] = (),
    hidden_name: str | None = None,
    tree: bool | None = False,
    ragged: bool | None = False,
) -> tuple[bytes, GraphFacts]:
    """The ONNX model at ``model_path`` serialized with ``local_window_size`` set to ``windows[past_key]`` on the
    ``GroupQueryAttention`` node reading ``past_key``, (when ``accuracy_level`` is given) every ``MatMulNBits``
    node's ``accuracy_level`` set to it, and (when ``keep_logits`` names the logits output) the logits of the last
    positions only (module docstring), and (with ``features``) the residual streams entering those layers appended
    to the ``hidden_name`` output (``graph_features.py``), and (``tree`` True, or None where the graph allows) the
    tree inputs (``tree_rewrite.add_tree_inputs``), and (``ragged`` True, or None where the graph and the
    installed ONNX Runtime allow) each row's query length (``ragged_rewrite.add_query_lengths``); and the facts
    of the result. External weights stay where they are (open the bytes with the model's folder as the
    external-data folder)."""
    import onnx

    model = _load_proto(model_path)
    windows = dict(windows or {})
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > 3 and node.input[3] in windows:
            _set_int_attribute(onnx, node, "local_window_size", windows[node.input[3]])
        elif node.op_type == "MatMulNBits" and accuracy_level is not None:
            _set_int_attribute(onnx, node, "accuracy_level", accuracy_level)
    kept = _keep_last_logits(onnx, model, keep_logits) if keep_logits is not None else None
    if features:
        append_features(onnx, model, str(hidden_name), features, kept)
    if tree is not False:
        try:
            add_tree_inputs(model)
        except BackendError:
            if tree:
                raise  # asked for; None: the graph runs without tree rows
    if ragged is not False:
        try:
            add_query_lengths(model)
        except BackendError:
            if ragged:
                raise  # asked for; None: multi-token rows after a past run alone
    return model.SerializeToString(), _facts_of(model)


def lm_head(model, logits_name: str):
    """The node that makes ``logits_name`` when it is a ``MatMul`` or ``MatMulNBits`` over the hidden states
    (the builder's LM head), else None."""
    for node in model.graph.node:
        if logits_name in node.output:
            return node if node.op_type in LM_HEAD_OPS else None
    return None


def _keep_last_logits(onnx, model, logits_name: str) -> tuple[str, str, str] | None:
    """Slice the LM head's input to its last ``KEEP_LOGITS_INPUT`` positions (axis 1); when that input is a graph
    output (the hidden states), the output is the sliced tensor too, so it holds the same positions as the
    logits. Returns the slice's ``(starts, ends, axes)`` names; None (and nothing changed) when the logits are not
    made by a plain LM head."""
    head = lm_head(model, logits_name)
    if head is None:
        return None
    helper, graph = onnx.helper, model.graph
    graph.input.append(helper.make_tensor_value_info(KEEP_LOGITS_INPUT, onnx.TensorProto.INT64, [1]))
    prefix = "/ortspec/keep_logits"
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([2**62], np.int64), f"{prefix}/end"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), f"{prefix}/axis"))
    start, every, kept = f"{prefix}/start", head.input[0], f"{prefix}/hidden"
    output = next((o for o in graph.output if o.name == every), None)
    if output is not None:  # the hidden states output: every position's goes by another name, the kept keep it
        every, kept = f"{prefix}/every_hidden", output.name
        for node in graph.node:
            node.input[:] = [every if name == kept else name for name in node.input]
            node.output[:] = [every if name == kept else name for name in node.output]
        dims = output.type.tensor_type.shape.dim
        if len(dims) > 1:
            dims[1].dim_param = KEEP_LOGITS_INPUT
    nodes = [
        helper.make_node("Neg", [KEEP_LOGITS_INPUT], [start], name=f"{prefix}/Neg"),
        helper.make_node("Slice", [every, start, f"{prefix}/end", f"{prefix}/axis"], [kept], name=prefix),
    ]
    head.input[0] = kept
    at = list(graph.node).index(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    return start, f"{prefix}/end", f"{prefix}/axis"


def _set_int_attribute(onnx, node, name: str, value: int) -> None:
    for attribute in node.attribute:
        if attribute.name == name:
            attribute.i = int(value)
            return
    node.attribute.append(onnx.helper.make_attribute(name, int(value)))


def window_rewrites(folder: ModelFolder, facts: GraphFacts, max_length: int, policy: str) -> dict[str, int]:
    """The ``local_window_size`` to set per attention node (by its past-key input) so that the graph applies the
    sliding window ``genai_config.json`` names: for every layer the config's ``sliding_window.layers`` lists
    (every KV layer when it lists none) whose ``GroupQueryAttention`` node attends to everything. Empty when the
    window cannot matter (``max_length`` <= the window) or ``policy`` is ``"graph"``. Raises ``BackendError``
    when the graph sets a different window, or has no such node to set it on."""
    window = folder.sliding_window
    if window is None or policy == "graph" or max_length <= window:
        return {}
    config = folder.path / CONFIG_NAME
    layers = folder.sliding_window_layers or folder.kv_layers
    rewrites: dict[str, int] = {}
    for layer in layers:
        past_key = folder.past_key_pattern % layer
        graph_window = facts.window_of(past_key)
        if graph_window is None:
            raise BackendError(
                f"{config}: model.decoder.sliding_window.window_size = {window} (layer {layer}), but "
                f"{folder.model_path} has no GroupQueryAttention node reading {past_key!r} to apply it to; pass "
                f"sliding_window='graph' to run the graph as written, or max_length <= {window}"
            )
        if graph_window > 0 and graph_window != window:
            raise BackendError(
                f"{config}: model.decoder.sliding_window.window_size = {window}, but {folder.model_path}'s "
                f"GroupQueryAttention on layer {layer} has local_window_size = {graph_window}; pass "
                f"sliding_window='graph' to run the graph as written, or max_length <= {min(window, graph_window)}"
            )
        if graph_window <= 0:
            rewrites[past_key] = window
    if rewrites:
        logger.warning(
            "%s: model.decoder.sliding_window.window_size = %d, but %s's GroupQueryAttention nodes have "
            "local_window_size = -1 (full attention) on %d layer(s); applying the window of %d at load "
            "(sliding_window='graph' runs the graph as written)",
            config,
            window,
            folder.model_path,
            len(rewrites),
            window,
        )
    return rewrites


@attrs.frozen
class LoadedGraph:
    """What ``OrtBackend.from_folder`` read from the model file and changed in it: ``facts`` of the graph the
    session runs, ``rewrites`` (each rewrite that changes what the graph computes, in words; empty for the file
    as written: the LM head over the last positions only is not one, it skips rows nobody reads, and shows as
    ``DecoderGraph.keep_name``) and ``model_bytes`` (the rewritten model to open, None to open the file itself)."""

    facts: GraphFacts
    rewrites: tuple[str, ...] = ()
    model_bytes: bytes | None = attrs.field(default=None, repr=False)


def load_rewrites(
    folder: ModelFolder, config: BackendConfig, *, keep_logits: bool = False, trees: bool = False
) -> LoadedGraph:
    """Read the folder's graph and apply the rewrites ``config`` asks for (``sliding_window``,
    ``matmul_accuracy_level``, ``hidden_features``) that change it, and with ``keep_logits`` the logits of the last
    positions only (where the LM head allows it), and with ``trees`` (a batch backend) the tree inputs as
    ``config.tree_rows`` asks (which, fed consecutive positions and a zero bias, change nothing); ``BackendError``
    as :func:`window_rewrites` and ``tree_rewrite.add_tree_inputs`` (a graph it cannot rewrite, when
    ``tree_rows`` is True)."""
    facts = read_graph_facts(folder.model_path)
    if keep_logits:
        keep_logits = lm_head(_load_proto(folder.model_path), folder.logits_name) is not None
    windows = window_rewrites(folder, facts, config.capacity(folder.context_length), config.sliding_window)
    rewrites = [f"local_window_size={w} on the attention reading {name}" for name, w in windows.items()]
    level = config.matmul_accuracy_level
    levels = {found for (_, found) in facts.matmul_nbits}
    set_level = level is not None and bool(levels) and levels != {level}
    if set_level:
        rewrites.append(f"MatMulNBits accuracy_level {sorted(levels)} -> {level}")
    features = config.hidden_features
    if features:
        rewrites.append(f"{folder.hidden_states_name} + the residual streams entering layers {list(features)}")
    tree = config.tree_rows if trees else False
    ragged = config.ragged_rows if trees else False
    if not (windows or set_level or keep_logits or features or tree is not False or ragged is not False):
        return LoadedGraph(facts)
    model_bytes, facts = rewritten_model(
        folder.model_path,
        windows=windows,
        accuracy_level=level if set_level else None,
        keep_logits=folder.logits_name if keep_logits else None,
        features=features,
        hidden_name=folder.hidden_states_name,
        tree=tree,
        ragged=ragged,
    )
    return LoadedGraph(facts, tuple(rewrites), model_bytes)
