"""The decoder graph rewritten so that one session run carries rows of any lengths at any positions.

**Why.** The builder wires ``GroupQueryAttention`` so that a batch of several rows runs only when every row is one
token or every row starts at position 0: several multi-token rows after a past (draft verifies, later prompt
chunks) are refused ("batch_size must be 1 when sequence_length > 1 and past context is given"), so the batch
backend ran each of them alone. ONNX Runtime 1.32's op takes an optional ``query_seqlens`` (input 16, int32
``[batch]``): the number of valid tokens of each row of a right-padded chunk. With it, row ``b`` of a run of width
``S`` holds ``Q = query_seqlens[b]`` valid tokens after ``P = seqlens_k[b] + 1 - Q`` cached ones (``seqlens_k``
comes from the row's ``attention_mask``: its count of ones minus one); only the ``Q`` valid rows are appended to the
cache, at ``[P, P + Q)``; query row ``s`` is at position ``P + s``; the valid rows' results equal those of the same
call without padding; ``Q = 0`` marks an idle row whose cache stays unchanged; ``P + S`` must fit the cache.

**Contract of** :func:`add_query_lengths` (a ``ModelProto``, changed in place): one graph input is added,
:data:`QUERY_LENGTHS_INPUT` (int32 ``[batch_size]``), and every ``GroupQueryAttention`` node reads it as its
``query_seqlens``. Fed each row's full width (no padding), the graph computes what the file computes. Refused
(``BackendError``, nothing changed): an installed ONNX Runtime whose op has no ``query_seqlens`` input, a graph with
no ``GroupQueryAttention`` node, or one whose nodes already take that input or attend through a window (the windowed
cache's layout is not covered here).
"""

from __future__ import annotations

from ..base import BackendError

QUERY_LENGTHS_INPUT = "ortspec_query_lengths"  # int32 [batch_size]: each row's valid (non-padded) token count
QUERY_SEQLENS_SLOT = 16  # GroupQueryAttention's input, by index (com.microsoft opset 1)


def op_takes_query_lengths() -> bool:
    """Whether the installed ONNX Runtime's ``GroupQueryAttention`` schema declares ``query_seqlens`` at
    :data:`QUERY_SEQLENS_SLOT`."""
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    for schema in capi.get_all_operator_schema():
        if schema.name == "GroupQueryAttention" and schema.domain == "com.microsoft":
            inputs = schema.inputs
            return len(inputs) > QUERY_SEQLENS_SLOT and inputs[QUERY_SEQLENS_SLOT].name == "query_seqlens"
    return False


def _int_attribute(onnx, node, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(onnx.helper.get_attribute_value(attribute))
    return default


def add_query_lengths(model) -> None:
    """Add :data:`QUERY_LENGTHS_INPUT` to ``model`` (an ``onnx.ModelProto``) and feed it to every
    ``GroupQueryAttention`` node as ``query_seqlens``, in place. ``BackendError`` (``model`` unchanged) for what the
    module docstring lists as refused."""
    import onnx

    if not op_takes_query_lengths():
        raise BackendError("ragged rewrite: this onnxruntime's GroupQueryAttention has no query_seqlens input")
    nodes = [node for node in model.graph.node if node.op_type == "GroupQueryAttention"]
    if not nodes:
        raise BackendError("ragged rewrite: the graph has no GroupQueryAttention node")
    for node in nodes:
        if len(node.input) > QUERY_SEQLENS_SLOT and node.input[QUERY_SEQLENS_SLOT]:
            raise BackendError(f"ragged rewrite: {node.name} already takes query_seqlens")
        windowed = _int_attribute(onnx, node, "local_window_size", -1) > 0
        if windowed or _int_attribute(onnx, node, "sliding_window_cache", 0):
            raise BackendError(f"ragged rewrite: {node.name} attends through a window, which it does not cover")
    model.graph.input.append(
        onnx.helper.make_tensor_value_info(QUERY_LENGTHS_INPUT, onnx.TensorProto.INT32, ["batch_size"])
    )
    for node in nodes:
        while len(node.input) <= QUERY_SEQLENS_SLOT:
            node.input.append("")
        node.input[QUERY_SEQLENS_SLOT] = QUERY_LENGTHS_INPUT
