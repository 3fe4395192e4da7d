"""The load-time rewrites of the decoder's ONNX graph: :func:`rewritten_model` returns the graph with some of its
attributes and inputs changed (the weights stay in their external data files), and :func:`load_rewrites` decides,
from a :class:`BackendConfig`, which rewrites ``OrtBackend.from_folder`` and ``OrtBatchBackend.from_folder`` apply
(the graph's facts are ``model_graph.py``'s):

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
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from ..base import BackendError
from .config import BackendConfig
from .folder import CONFIG_NAME, ModelFolder
from .graph_features import append_features
from .model_graph import KEEP_LOGITS_INPUT, LM_HEAD_OPS, GraphFacts, _facts_of, _load_proto, read_graph_facts
from .ragged_rewrite import add_query_lengths
from .tree_rewrite import add_tree_inputs

logger = logging.getLogger(__name__)


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
    folder: ModelFolder,
    config: BackendConfig,
    *,
    keep_logits: bool = False,
    trees: bool = False,
    ragged: bool = False,
) -> LoadedGraph:
    """Read the folder's graph and apply the rewrites ``config`` asks for (``sliding_window``,
    ``matmul_accuracy_level``, ``hidden_features``) that change it, and with ``keep_logits`` the logits of the last
    positions only (where the LM head allows it), with ``trees`` the tree inputs as ``config.tree_rows`` asks
    (which, fed consecutive positions and a zero bias, change nothing), and with ``ragged`` (a batch backend) the
    query lengths as ``config.ragged_rows`` asks; ``BackendError`` as :func:`window_rewrites` and
    ``tree_rewrite.add_tree_inputs`` (a graph it cannot rewrite, when ``tree_rows`` is True)."""
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
    query_lengths = config.ragged_rows if ragged else False
    if not (windows or set_level or keep_logits or features or tree is not False or query_lengths is not False):
        return LoadedGraph(facts)
    model_bytes, facts = rewritten_model(
        folder.model_path,
        windows=windows,
        accuracy_level=level if set_level else None,
        keep_logits=folder.logits_name if keep_logits else None,
        features=features,
        hidden_name=folder.hidden_states_name,
        tree=tree,
        ragged=query_lengths,
    )
    return LoadedGraph(facts, tuple(rewrites), model_bytes)
