"""The decoder graph rewritten to verify a tree of draft tokens in one pass.

**Why a rewrite.** The builder's graph takes ``input_ids``, ``attention_mask`` and the KV buffers; its
``GroupQueryAttention`` nodes compute ``seqlens_k = ReduceSum(attention_mask) - 1`` and ``total_sequence_length =
Shape(attention_mask)[1]``, rotate Q and K inside the op (``do_rotary=1``, ``cos_cache``/``sin_cache``
initializers) at the implicit positions ``past + index``, and mask causally. A tree pass needs each node to attend
to the context and to its ancestors only, at rotary position ``past + depth``. The op has two optional inputs for
that, which the builder leaves empty: ``position_ids`` (input 9, int64 ``[batch, sequence]``) and
``attention_bias`` (input 10, ``T`` ``[batch or 1, heads or 1, sequence, total_sequence_length]``, added to
``QK'`` before the softmax, on top of the causal mask). ONNX Runtime 1.32 honours both on the CPU once there is a
past (``tests/test_tree_attention_ort.py``; ``docs/tree-attention.md``).

**Contract of** :func:`add_tree_inputs` (a ``ModelProto``, changed in place, e.g. after
``graph_rewrites.rewritten_model``'s rewrites): two graph inputs are added, :data:`TREE_POSITIONS_INPUT` (int64
``[batch_size, sequence_length]``) and :data:`TREE_BIAS_INPUT` (the attention nodes' ``T``, ``[batch_size or 1, 1,
sequence_length, total_sequence_length]``), and every ``GroupQueryAttention`` node reads them as its
``position_ids`` and ``attention_bias``. Fed ``positions = past + arange(n)`` and a zero bias, the rewritten graph
computes what the file computes. Refused (``BackendError``, nothing changed): a graph with no
``GroupQueryAttention`` node, or one whose nodes already take either input, rotate outside the op
(``do_rotary=0``: the depths would go to the graph's own position input, not covered here), attend through a
window (``local_window_size > 0`` counts cache rows, not depths) or index a window-sized cache
(``sliding_window_cache``).

**Contract of a tree pass** (the caller's side, :func:`tree_feeds`): the nodes in topological order (each parent
before its children), ``input_ids`` their tokens, ``attention_mask`` as for a chain of ``n`` tokens at ``past``
(ones ``[1, past + n]``, or the static binding's ``[1, max_length]`` with ``past + n`` leading ones: the bias's
last dimension is that width), positions ``past + depth`` and the bias 0 on the context and on each node's
ancestors and itself, ``-inf`` elsewhere. ``past >= 1`` is required: with no past the op takes only the first
position and ignores the rest (the "first prompt" case). Then logits row ``i`` is the distribution after node ``i``'s
root-to-node path, and KV row ``past + i`` holds node ``i``'s key and value rotated at ``past + depth(i)``: to keep
an accepted path ``a_0, a_1, ...`` copy row ``past + a_k`` to ``past + k`` in every layer (nothing to copy for a
path laid out first, depth-first), then shorten the length as after a rejected chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortspec.core.tree import DraftTree, tree_mask

from ..base import BackendError

TREE_POSITIONS_INPUT = "ortspec_tree_position_ids"  # int64 [batch_size, sequence_length]: past + depth
TREE_BIAS_INPUT = "ortspec_tree_attention_bias"  # T [batch_size or 1, 1, sequence_length, total_sequence_length]
POSITION_IDS_SLOT = 9  # GroupQueryAttention's inputs, by index (com.microsoft opset 1)
ATTENTION_BIAS_SLOT = 10
COS_CACHE_SLOT = 7
BIAS_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.float32), 10: np.dtype(np.float16)}  # TensorProto FLOAT, FLOAT16


def _attribute(onnx, node, name: str, default: int) -> int:
    for attribute in node.attribute:
        if attribute.name == name:
            return int(onnx.helper.get_attribute_value(attribute))
    return default


def _bias_type(model, nodes) -> int:
    """The TensorProto type of the attention nodes' ``T`` (their ``cos_cache``'s: every node's must agree)."""
    declared = {t.name: t.data_type for t in model.graph.initializer}
    declared.update({v.name: v.type.tensor_type.elem_type for v in model.graph.input})
    declared.update({v.name: v.type.tensor_type.elem_type for v in model.graph.value_info})
    types = {declared.get(node.input[COS_CACHE_SLOT], -1) for node in nodes}
    found = types.pop() if len(types) == 1 else -1
    if found not in BIAS_DTYPES:
        raise BackendError(
            "tree rewrite: cannot tell the attention nodes' float type from their cos_cache inputs "
            f"(TensorProto types {sorted(types | {found})})"
        )
    return int(found)


def add_tree_inputs(model) -> np.dtype:
    """Add :data:`TREE_POSITIONS_INPUT` and :data:`TREE_BIAS_INPUT` to ``model`` (an ``onnx.ModelProto``) and feed
    them to every ``GroupQueryAttention`` node (module docstring), in place; returns the bias's numpy dtype.
    ``BackendError`` (``model`` unchanged) for a graph the module docstring lists as refused."""
    import onnx

    graph = model.graph
    nodes = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    if not nodes:
        raise BackendError("tree rewrite: the graph has no GroupQueryAttention node")
    for node in nodes:
        taken = [i for i in (POSITION_IDS_SLOT, ATTENTION_BIAS_SLOT) if len(node.input) > i and node.input[i]]
        if taken:
            raise BackendError(f"tree rewrite: {node.name} already takes inputs {taken} (position_ids/attention_bias)")
        if not _attribute(onnx, node, "do_rotary", 0) or len(node.input) <= COS_CACHE_SLOT:
            raise BackendError(
                f"tree rewrite: {node.name} does not rotate inside the op (do_rotary=0); the depths would go to the "
                "graph's own position input, which this rewrite does not cover"
            )
        if _attribute(onnx, node, "local_window_size", -1) > 0 or _attribute(onnx, node, "sliding_window_cache", 0):
            raise BackendError(
                f"tree rewrite: {node.name} attends through a window, which counts cache rows, not tree depths"
            )
    bias_type = _bias_type(model, nodes)
    helper, batch, sequence = onnx.helper, "batch_size", "sequence_length"  # the builder's names for the ids' dims
    graph.input.append(helper.make_tensor_value_info(TREE_POSITIONS_INPUT, onnx.TensorProto.INT64, [batch, sequence]))
    graph.input.append(
        helper.make_tensor_value_info(TREE_BIAS_INPUT, bias_type, ["tree_bias_batch", 1, sequence, "tree_total"])
    )
    for node in nodes:
        while len(node.input) <= ATTENTION_BIAS_SLOT:
            node.input.append("")
        node.input[POSITION_IDS_SLOT] = TREE_POSITIONS_INPUT
        node.input[ATTENTION_BIAS_SLOT] = TREE_BIAS_INPUT
    return BIAS_DTYPES[bias_type]


def tree_depths(parents: Sequence[int]) -> np.ndarray:
    """Each node's depth (a root's is 0) for ``parents[i]`` in ``[-1, i)`` (-1: a root); ``ValueError`` otherwise."""
    return np.asarray(DraftTree((0,) * len(parents), parents).depths, np.int64)


def tree_feeds(
    parents: Sequence[int], past: int, total: int | None = None, dtype: np.dtype | type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, bias)`` for a tree pass of ``len(parents)`` nodes after ``past`` positions (``parents[i]``: -1
    for a root, else an earlier node): int64 ``[1, n]`` (``past + depth``) and ``dtype`` ``[1, 1, n, total]``
    (``total``: the attention mask's width, ``past + n`` by default): 0 on the context and on each node's ancestors
    and itself (``core.tree.tree_mask``, without its pending row), ``-inf`` elsewhere. A batch backend's tree row
    ``(pending, *nodes)`` is the tree whose one root is the pending token: ``(-1, *(p + 1 for p in nodes'))``."""
    n = len(parents)
    total = past + n if total is None else total
    if past < 1 or total < past + n:
        raise ValueError(f"a tree pass needs past >= 1 and total >= past + n, got past={past}, total={total}, n={n}")
    depths = tree_depths(parents)
    visible = tree_mask(parents)[1:, 1:]
    bias = np.full((1, 1, n, total), -np.inf, dtype)
    bias[..., :past] = 0
    bias[0, 0, :, past : past + n] = np.where(visible, 0, -np.inf)
    return (past + depths)[None, :], bias
