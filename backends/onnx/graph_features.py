"""Fused features: the residual streams of chosen decoder layers appended to the hidden-states output.

EAGLE-3's draft head reads a fusion of low, middle and high target layers instead of the top layer alone. A
shared-KV drafter with ``features`` in its folder (``drafter_folder.FeatureFusion``) reads, at position ``p - 1``,
the final hidden state and the residual stream entering each of its ``layers``; this rewrite makes the target's
graph give them in the one output the backends already carry per position: ``hidden_states`` becomes ``[batch,
sequence, (1 + L) * H]``, the final hidden state first, then the residual streams in ``layers`` order (each sliced to
the kept positions when the logits are, ``model_graph``'s ``keep_logits`` rewrite). Nothing the graph computed
before changes; ``BackendConfig.hidden_features`` asks for it.

**Where a residual stream is** (the builder's graphs): the fourth output of the
``SkipSimplifiedLayerNormalization`` named ``/model/layers.<l>/input_layernorm/SkipLayerNorm``, the sum of layer
``l - 1``'s output and its residual, which enters layer ``l``; so a feature layer is ``>= 1``. The rule lives here
alone (``residual_output_name``); ``ortspec train-drafter``'s data reads it too.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..base import BackendError

FEATURES_PREFIX = "/ortspec/features"


def residual_output_name(model, layer: int) -> str:
    """The graph's name for the residual stream entering decoder layer ``layer`` (``layer >= 1``; module
    docstring). ``ValueError`` when the graph has no such output."""
    wanted = f"/model/layers.{layer}/input_layernorm/SkipLayerNorm"
    for node in model.graph.node:
        if node.name == wanted and len(node.output) > 3 and node.output[3]:
            return node.output[3]
    raise ValueError(f"the graph has no node {wanted!r} with a residual output (layer {layer} must be >= 1)")


def append_features(
    onnx, model, hidden_name: str, layers: Sequence[int], kept: tuple[str, str, str] | None = None
) -> None:
    """Make the graph output ``hidden_name`` (``[batch, sequence, H]``) the concatenation of itself and the residual
    streams entering ``layers``, in place. ``kept``: the ``(starts, ends, axes)`` of the slice that keeps the
    hidden states' positions (``model_graph``'s ``keep_logits`` rewrite), applied to each residual stream too.
    ``BackendError`` naming the layer when the graph has no hidden-states output or no such residual stream."""
    graph, helper = model.graph, onnx.helper
    output = next((o for o in graph.output if o.name == hidden_name), None)
    if output is None:
        raise BackendError(f"hidden_features needs the {hidden_name!r} output, which the graph does not have")
    try:
        residuals = [residual_output_name(model, layer) for layer in layers]
    except ValueError as exc:
        raise BackendError(f"hidden_features {list(layers)}: {exc}") from exc
    final = f"{FEATURES_PREFIX}/final_hidden"
    for node in graph.node:  # the hidden states keep flowing to their readers (the LM head) by another name
        node.input[:] = [final if name == hidden_name else name for name in node.input]
        node.output[:] = [final if name == hidden_name else name for name in node.output]
    parts, nodes = [final], []
    for layer, residual in zip(layers, residuals, strict=True):
        if kept is None:
            parts.append(residual)
            continue
        sliced = f"{FEATURES_PREFIX}/residual.{layer}"
        nodes.append(helper.make_node("Slice", [residual, *kept], [sliced], name=f"{FEATURES_PREFIX}/Slice.{layer}"))
        parts.append(sliced)
    nodes.append(helper.make_node("Concat", parts, [hidden_name], name=f"{FEATURES_PREFIX}/Concat", axis=-1))
    graph.node.extend(nodes)
    dims = output.type.tensor_type.shape.dim
    if len(dims) == 3 and dims[2].HasField("dim_value"):
        dims[2].dim_value = (1 + len(layers)) * dims[2].dim_value
