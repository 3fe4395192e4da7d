"""Writing shared-KV drafter folders: the ONNX graph of a one-layer draft head, its metadata and the target's
tables (the producer side of the contract that ``ortspec.backends.onnx.drafter`` reads; see docs/drafter.md).

A drafter folder holds

* ``drafter.onnx``: the head. Inputs ``inputs_embeds`` ``[B, q, 2H]`` float32 (the target's input embedding of a
  token, then a hidden state of width H), ``position_ids`` ``[B, q]`` int64 (the query's position, for RoPE) and,
  per KV head ``h`` of the one target layer it reads, ``shared_kv.<group>.key.<h>`` and ``.value.<h>``
  ``[B, 1, kv_len, head_size]`` float32 (that head's first ``kv_len`` cached positions, post-RoPE keys). Outputs
  ``logits`` ``[B, q, V']`` (over the draft vocabulary) and ``projected_state`` ``[B, q, H]``.
* ``drafter.json``: the metadata (``speculative.proposal_type = "shared_kv"`` and the fields listed in
  :func:`drafter_metadata`).
* ``input_embedding.f32``: the target's input-embedding table, raw little-endian float32 ``[V, H]``.
* ``draft_to_target.i64``: raw little-endian int64 ``[V']``, the target id of each draft-vocabulary entry (absent
  when the head predicts the whole target vocabulary).

The head computes, for each query row (every row attends to all ``kv_len`` bound positions; the drafter has no
KV of its own, so nothing here is causal)::

    e, h  = split(inputs_embeds)                    [B, q, H] each
    u     = concat(rms(e) * w_e, rms(h) * w_h) @ fc + fc_bias
    q     = rope(qnorm(rms(u) * w_attn @ wq), position_ids)   [B, heads, q, D]
    for each KV head j: o_j = softmax(cap(q_j K_j^T * scale)) V_j  (q_j: its heads // kv_heads query heads;
                                                                   K_j, V_j: the last `window` positions)
    u     = u + join(concat(o_j) @ wo)
    m     = rms(u) * w_mlp
    u     = u + join((act(m @ w_gate) * (m @ w_up)) @ w_down)

where ``qnorm`` (a per-head RMS norm), ``cap`` (a tanh soft cap), the window, ``act`` (silu or tanh-GELU) and
``join`` (an RMS norm of the sublayer's output and a residual multiplier) are what the copied target layer has
(:class:`HeadWeights`; a Llama layer has none of them: ``qnorm``, ``cap`` and ``join`` are the identity).
    projected_state = rms(u) * w_out
    logits          = projected_state @ lm_head                [H, V']

Everything here is numpy + ``onnx``; nothing is imported from torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.backends.onnx.drafter_folder import FeatureFusion

DRAFTER_MODEL = "drafter.onnx"
DRAFTER_METADATA = "drafter.json"
INPUT_EMBEDDING = "input_embedding.f32"
DRAFT_TO_TARGET = "draft_to_target.i64"
FUSED_FEATURES = "fuse.f32"  # a head's fused first-step input: float32 [(1 + L) * H + 1, H], the matrix then the bias
GROUP = "full_attention"
OPSET = 17


def _f32(value: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(value, dtype=np.float32))


@attrs.frozen(eq=False)
class HeadWeights:
    """The head's parameters, float32, in the ``x @ W`` orientation (``[in, out]``).

    Shapes (H hidden, A = heads * head_size, I intermediate, V' draft vocabulary): ``norm_embed``, ``norm_hidden``,
    ``norm_attn``, ``norm_mlp``, ``norm_out`` ``[H]``; ``fc`` ``[2H, H]``; ``fc_bias`` ``[H]``; ``wq`` ``[H, A]``;
    ``wo`` ``[A, H]``; ``w_gate``, ``w_up`` ``[H, I]``; ``w_down`` ``[I, H]``; ``lm_head`` ``[H, V']``; ``cos``,
    ``sin`` ``[positions, head_size / 2]`` (the target's RoPE tables, non-interleaved halves). ``heads`` must be a
    multiple of the target's KV heads; ``eps`` is the RMS norms' epsilon.

    What the copied layer computes besides (``backends/onnx/drafter_support.LayerPlan``): ``scale`` (the scores'
    scale; None: ``1 / sqrt(head_size)``), ``softcap`` (``cap * tanh(s / cap)`` on the scaled scores; 0: none),
    ``window`` (a query reads only the last ``window`` bound positions; 0: all), ``residual_scale`` (the attention's
    and the MLP's outputs times it before the residual add), ``activation`` (``silu`` or ``gelu_tanh``), ``q_norm``
    ``[head_size]`` (the query's per-head RMS norm before RoPE; None: none), ``norm_post_attn`` and
    ``norm_post_mlp`` ``[H]`` (RMS norms of the attention's and the MLP's outputs before the residual add; None:
    none)."""

    heads: int
    head_size: int
    eps: float
    norm_embed: np.ndarray = attrs.field(converter=_f32)
    norm_hidden: np.ndarray = attrs.field(converter=_f32)
    fc: np.ndarray = attrs.field(converter=_f32)
    fc_bias: np.ndarray = attrs.field(converter=_f32)
    norm_attn: np.ndarray = attrs.field(converter=_f32)
    wq: np.ndarray = attrs.field(converter=_f32)
    wo: np.ndarray = attrs.field(converter=_f32)
    norm_mlp: np.ndarray = attrs.field(converter=_f32)
    w_gate: np.ndarray = attrs.field(converter=_f32)
    w_up: np.ndarray = attrs.field(converter=_f32)
    w_down: np.ndarray = attrs.field(converter=_f32)
    norm_out: np.ndarray = attrs.field(converter=_f32)
    lm_head: np.ndarray = attrs.field(converter=_f32)
    cos: np.ndarray = attrs.field(converter=_f32)
    sin: np.ndarray = attrs.field(converter=_f32)
    scale: float | None = None
    softcap: float = 0.0
    window: int = 0
    residual_scale: float = 1.0
    activation: str = attrs.field(default="silu", validator=attrs.validators.in_(("silu", "gelu_tanh")))
    q_norm: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(_f32))
    norm_post_attn: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(_f32))
    norm_post_mlp: np.ndarray | None = attrs.field(default=None, converter=attrs.converters.optional(_f32))

    def __attrs_post_init__(self) -> None:
        hidden = self.norm_out.shape[0]
        attn = self.heads * self.head_size
        inter = self.w_gate.shape[1] if self.w_gate.ndim == 2 else -1
        expected = {
            "norm_embed": (hidden,),
            "norm_hidden": (hidden,),
            "fc": (2 * hidden, hidden),
            "fc_bias": (hidden,),
            "norm_attn": (hidden,),
            "wq": (hidden, attn),
            "wo": (attn, hidden),
            "norm_mlp": (hidden,),
            "w_gate": (hidden, inter),
            "w_up": (hidden, inter),
            "w_down": (inter, hidden),
            "norm_out": (hidden,),
            "q_norm": (self.head_size,),
            "norm_post_attn": (hidden,),
            "norm_post_mlp": (hidden,),
        }
        for name, shape in expected.items():
            if getattr(self, name) is not None and getattr(self, name).shape != shape:
                raise ValueError(f"HeadWeights.{name} has shape {getattr(self, name).shape}, expected {shape}")
        if self.lm_head.ndim != 2 or self.lm_head.shape[0] != hidden:
            raise ValueError(f"HeadWeights.lm_head has shape {self.lm_head.shape}, expected [{hidden}, V']")
        half = self.head_size // 2
        if self.head_size % 2 or self.cos.ndim != 2 or self.cos.shape[1] != half or self.sin.shape != self.cos.shape:
            raise ValueError(
                f"HeadWeights.cos/sin must be [positions, {half}] each, got {self.cos.shape}, {self.sin.shape}"
            )

    @property
    def hidden_size(self) -> int:
        return int(self.norm_out.shape[0])

    @property
    def draft_vocab(self) -> int:
        return int(self.lm_head.shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.w_gate.shape[1])

    @property
    def attention_scale(self) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / float(np.sqrt(self.head_size))

    def arrays(self) -> dict[str, np.ndarray]:
        """Every parameter array by field name (the optional ones the head has)."""
        fields = attrs.fields(HeadWeights)
        return {
            a.name: getattr(self, a.name)
            for a in fields
            if a.name not in _SCALARS and getattr(self, a.name) is not None
        }


_SCALARS = ("heads", "head_size", "eps", "scale", "softcap", "window", "residual_scale", "activation")


def kv_input_names(group: str, kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The per-head KV input names of ``group``: (keys, values), ``shared_kv.<group>.key.<h>`` for h < kv_heads."""
    keys = tuple(f"shared_kv.{group}.key.{h}" for h in range(kv_heads))
    values = tuple(f"shared_kv.{group}.value.{h}" for h in range(kv_heads))
    return keys, values


class _Nodes:
    """The nodes and initializers of a graph being built: ``const`` (an initializer), ``node`` (one output, named
    by a counter) and ``rms`` (an RMS norm times a weight, over the last axis; needs the ``eps`` and ``two``
    constants)."""

    def __init__(self, inits: list[Any]) -> None:
        self.nodes: list[Any] = []
        self.inits = inits
        self._counter = iter(range(1 << 30))

    def const(self, name: str, value: Any, dtype: Any = np.int64) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op: str, inputs: Sequence[str], **attributes: Any) -> str:
        from onnx import helper

        out = f"/{op.lower()}_{next(self._counter)}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attributes))
        return out

    def rms(self, x: str, weight: str) -> str:
        node = self.node
        mean_square = node("ReduceMean", [node("Pow", [x, "two"])], axes=[-1], keepdims=1)
        return node("Mul", [node("Div", [x, node("Sqrt", [node("Add", [mean_square, "eps"])])]), weight])


def _joined(g: _Nodes, weights: HeadWeights, x: str, norm: str) -> str:
    """A sublayer's output ``x`` as it joins the residual stream: RMS-normed by ``norm`` when the head has it, times
    the residual multiplier when it is not 1."""
    if getattr(weights, norm) is not None:
        x = g.rms(x, norm)
    if weights.residual_scale != 1.0:
        x = g.node("Mul", [x, "residual_scale"])
    return x


def _mlp(g: _Nodes, weights: HeadWeights, u: str) -> str:
    """``u`` after the MLP sublayer (its gate's activation: SiLU or tanh-GELU)."""
    node, const = g.node, g.const
    m = g.rms(u, "norm_mlp")
    gate = node("MatMul", [m, "w_gate"])
    if weights.activation == "gelu_tanh":  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        cube = node("Mul", [node("Mul", [gate, gate]), gate])
        inner = node("Add", [gate, node("Mul", [cube, const("gelu_c", np.float32(0.044715), np.float32)])])
        inner = node("Mul", [inner, const("gelu_k", np.float32(np.sqrt(2.0 / np.pi)), np.float32)])
        one, point_five = const("one", np.float32(1.0), np.float32), const("half", np.float32(0.5), np.float32)
        activated = node("Mul", [node("Mul", [gate, point_five]), node("Add", [node("Tanh", [inner]), one])])
    else:
        activated = node("Mul", [gate, node("Sigmoid", [gate])])
    act = node("Mul", [activated, node("MatMul", [m, "w_up"])])
    return node("Add", [u, _joined(g, weights, node("MatMul", [act, "w_down"]), "norm_post_mlp")])


def _attention(g: _Nodes, weights: HeadWeights, query: str, kv_heads: int, group: str) -> str:
    """The attended values ``[B, q, heads * D]`` of the rotated ``query`` ``[B, heads, q, D]`` over each KV head's
    bound positions (the last ``window`` of them for a windowed head), scores scaled and soft-capped."""
    node, const = g.node, g.const
    size, heads = weights.head_size, weights.heads
    per_kv = heads // kv_heads
    key_names, value_names = kv_input_names(group, kv_heads)
    outputs = []
    group_shape = const("group_shape", [0, 1, -1, size])
    heads_shape = const("heads_shape", [0, per_kv, -1, size])

    def windowed(name: str) -> str:  # the last `window` bound positions (all of them when fewer)
        return node("Slice", [name, "window_start", "window_end", "axis_2"]) if weights.window else name

    if weights.window:
        const("axis_2", [2])
        const("window_start", [-weights.window])
        const("window_end", [np.iinfo(np.int64).max])
    if weights.softcap:
        const("softcap", np.float32(weights.softcap), np.float32)
    for j in range(kv_heads):
        q_j = node(
            "Slice",
            [query, const(f"start_{j}", [j * per_kv]), const(f"end_{j}", [(j + 1) * per_kv]), "axis_1"],
        )
        q_j = node("Reshape", [q_j, group_shape])  # [B, 1, per_kv * q, D]: one matmul against head j
        keys_j = node("Transpose", [windowed(key_names[j])], perm=[0, 1, 3, 2])
        scores = node("Mul", [node("MatMul", [q_j, keys_j]), "scale"])
        if weights.softcap:
            scores = node("Mul", [node("Tanh", [node("Div", [scores, "softcap"])]), "softcap"])
        probs = node("Softmax", [scores], axis=-1)
        outputs.append(node("Reshape", [node("MatMul", [probs, windowed(value_names[j])]), heads_shape]))
    attended = node("Concat", outputs, axis=1) if len(outputs) > 1 else outputs[0]  # [B, heads, q, D]
    attended = node("Transpose", [attended], perm=[0, 2, 1, 3])
    return node("Reshape", [attended, const("merge_shape", [0, 0, heads * size])])


def build_head_graph(weights: HeadWeights, kv_heads: int, group: str = GROUP):
    """The head as an ``onnx.ModelProto`` (opset 17, float32; see the module docstring for the computation)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if weights.heads % kv_heads:
        raise ValueError(f"heads ({weights.heads}) must be a multiple of kv_heads ({kv_heads})")
    hidden, size, heads = weights.hidden_size, weights.head_size, weights.heads
    half = size // 2
    g = _Nodes([numpy_helper.from_array(array, name) for name, array in weights.arrays().items()])
    node, const, rms, nodes = g.node, g.const, g.rms, g.nodes

    const("eps", np.float32(weights.eps), np.float32)
    const("two", np.float32(2.0), np.float32)
    const("scale", np.float32(weights.attention_scale), np.float32)
    const("halves", [half, half])
    const("hidden_halves", [hidden, hidden])
    if weights.residual_scale != 1.0:
        const("residual_scale", np.float32(weights.residual_scale), np.float32)

    embeds, hidden_in = "/split_embed", "/split_hidden"
    nodes.append(helper.make_node("Split", ["inputs_embeds", "hidden_halves"], [embeds, hidden_in], axis=-1))

    u = node("Concat", [rms(embeds, "norm_embed"), rms(hidden_in, "norm_hidden")], axis=-1)
    u = node("Add", [node("MatMul", [u, "fc"]), "fc_bias"])

    query = node("MatMul", [rms(u, "norm_attn"), "wq"])  # [B, q, heads * D]
    query = node("Reshape", [query, const("q_shape", [0, 0, heads, size])])
    if weights.q_norm is not None:
        query = rms(query, "q_norm")  # per head, over D
    query = node("Transpose", [query], perm=[0, 2, 1, 3])  # [B, heads, q, D]
    cos = node("Unsqueeze", [node("Gather", ["cos", "position_ids"]), const("axis_1", [1])])  # [B, 1, q, D/2]
    sin = node("Unsqueeze", [node("Gather", ["sin", "position_ids"]), "axis_1"])
    nodes.append(helper.make_node("Split", [query, "halves"], ["/q_first", "/q_second"], axis=-1))
    first = node("Sub", [node("Mul", ["/q_first", cos]), node("Mul", ["/q_second", sin])])
    second = node("Add", [node("Mul", ["/q_second", cos]), node("Mul", ["/q_first", sin])])
    query = node("Concat", [first, second], axis=-1)  # [B, heads, q, D], rotated

    attended = _attention(g, weights, query, kv_heads, group)
    u = node("Add", [u, _joined(g, weights, node("MatMul", [attended, "wo"]), "norm_post_attn")])
    state = rms(_mlp(g, weights, u), "norm_out")
    nodes.append(helper.make_node("Identity", [state], ["projected_state"]))
    nodes.append(helper.make_node("MatMul", ["projected_state", "lm_head"], ["logits"]))

    key_names, value_names = kv_input_names(group, kv_heads)
    inputs = [
        helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ["batch", "query", 2 * hidden]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "query"]),
    ]
    for name in (*key_names, *value_names):
        inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 1, "kv_len", size]))
    outputs_info = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "query", weights.draft_vocab]),
        helper.make_tensor_value_info("projected_state", TensorProto.FLOAT, ["batch", "query", hidden]),
    ]
    graph = helper.make_graph(nodes, "ortspec_shared_kv_head", inputs, outputs_info, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ortspec")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@attrs.frozen
class DrafterSpec:
    """What ``drafter.json`` says besides the head's shape: the one target ``layer`` whose KV the head reads and
    that layer's ``kv_heads``, the most tokens per draft (``num_speculative_tokens``), the ``verifier`` (e.g.
    ``{"name_or_path": ...}``), and ``extra``, recorded under ``ortspec`` (the target's fingerprint, the training
    record)."""

    layer: int
    kv_heads: int
    num_speculative_tokens: int = 4
    verifier: Mapping[str, Any] = attrs.field(factory=dict)
    extra: Mapping[str, Any] = attrs.field(factory=dict)


def drafter_metadata(
    spec: DrafterSpec, *, hidden_size: int, draft_vocab: int, has_draft_map: bool, group: str = GROUP
) -> dict[str, Any]:
    """``drafter.json``'s content. ``speculative`` mirrors the seed's fields (``proposal_type``, ``model``,
    ``num_speculative_tokens``, ``backbone_hidden_size``, ``vocab_size`` (the head's logits width), ``input_embedding``,
    ``logits_output``, ``projected_state_output``, ``shared_kv`` groups with ``target_layers`` and
    ``key_input``/``value_input`` prefixes, ``io``); ortspec adds ``draft_to_target`` (the reduced-vocabulary map)
    and ``io.kv_layout = "per_kv_head"`` (one input per KV head: ``<key_input>.<h>``). ``spec.extra`` goes under
    ``ortspec``."""
    keys, values = kv_input_names(group, spec.kv_heads)
    speculative: dict[str, Any] = {
        "proposal_type": "shared_kv",
        "num_speculative_tokens": int(spec.num_speculative_tokens),
        "model": DRAFTER_MODEL,
        "verifier": dict(spec.verifier),
        "backbone_hidden_size": int(hidden_size),
        "vocab_size": int(draft_vocab),
        "input_embedding": INPUT_EMBEDDING,
        "logits_output": "logits",
        "projected_state_output": "projected_state",
        "shared_kv": [
            {
                "name": group,
                "target_layers": [int(spec.layer)],
                "key_input": keys[0].rsplit(".", 1)[0],
                "value_input": values[0].rsplit(".", 1)[0],
                "target_key_input": f"past_key_values.{int(spec.layer)}.key",
                "target_value_input": f"past_key_values.{int(spec.layer)}.value",
            }
        ],
        "io": {"sequence_source": "inputs_embeds", "kv_ownership": "shared", "kv_layout": "per_kv_head"},
    }
    if has_draft_map:
        speculative["draft_to_target"] = DRAFT_TO_TARGET
    return {"speculative": speculative, "ortspec": dict(spec.extra)}


def write_drafter_folder(
    out_dir: str | os.PathLike[str],
    weights: HeadWeights,
    spec: DrafterSpec,
    *,
    embedding: np.ndarray,
    draft_to_target: np.ndarray | None,
    fusion: FeatureFusion | None = None,
) -> Path:
    """Write a drafter folder (graph, metadata, embedding table, draft map) for ``spec`` into ``out_dir`` (created;
    existing files of these names are replaced). ``embedding``: the target's ``[V, H]`` input-embedding table;
    ``draft_to_target``: int ``[V']`` target ids of the head's logits columns, distinct and in ``[0, V)`` (None:
    ``V' == V``, identity); ``fusion``: the head's fused features (``speculative.fused_features``), if any."""
    import onnx

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = np.ascontiguousarray(embedding, dtype="<f4")
    if table.ndim != 2 or table.shape[1] != weights.hidden_size:
        raise ValueError(f"embedding must be [V, {weights.hidden_size}], got {table.shape}")
    if draft_to_target is None:
        if weights.draft_vocab != table.shape[0]:
            raise ValueError(f"without draft_to_target the head must predict all {table.shape[0]} ids")
    else:
        mapping = np.ascontiguousarray(draft_to_target, dtype="<i8")
        if mapping.shape != (weights.draft_vocab,) or len(np.unique(mapping)) != len(mapping):
            raise ValueError(f"draft_to_target must hold {weights.draft_vocab} distinct ids, got {mapping.shape}")
        if mapping.min() < 0 or mapping.max() >= table.shape[0]:
            raise ValueError(f"draft_to_target ids must be in [0, {table.shape[0]})")
        mapping.tofile(out / DRAFT_TO_TARGET)
    table.tofile(out / INPUT_EMBEDDING)
    onnx.save(build_head_graph(weights, spec.kv_heads), str(out / DRAFTER_MODEL))
    meta = drafter_metadata(
        spec,
        hidden_size=weights.hidden_size,
        draft_vocab=weights.draft_vocab,
        has_draft_map=draft_to_target is not None,
    )
    if fusion is not None:
        rows = (1 + len(fusion.layers)) * weights.hidden_size
        if fusion.weight.shape != (rows, weights.hidden_size) or fusion.bias.shape != (weights.hidden_size,):
            raise ValueError(f"the fuse must be [{rows}, {weights.hidden_size}] and its bias [{weights.hidden_size}]")
        np.concatenate([fusion.weight, fusion.bias[None]]).astype("<f4").tofile(out / FUSED_FEATURES)
        meta["speculative"]["fused_features"] = {
            "layers": [int(x) for x in fusion.layers],
            "eps": float(fusion.eps),
            "file": FUSED_FEATURES,
        }
    (out / DRAFTER_METADATA).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return out


WEIGHT_FORMATS = ("fp32", "int8")


def quantize_weights(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Store the MatMul weights of the drafter graph in ``folder`` as int8 (onnxruntime's dynamic quantization,
    per output channel: ``DynamicQuantizeMatMul`` / ``MatMulInteger``, activations quantized per call). The graph's
    inputs and outputs are unchanged. Why: a draft step reads every weight once, so on the CPU it is bound by memory
    bandwidth, and int8 weights are a quarter of the bytes (what that saves per draft step and costs in acceptance,
    measured: docs/drafter.md, "int8 weights"). Exactness does not depend on the drafter: the target checks every draft
    token. Returns ``{"weights": "int8", "bytes": before, after}``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(folder) / DRAFTER_MODEL
    before = path.stat().st_size
    staged = path.with_name(path.name + ".int8.tmp")
    quantize_dynamic(
        str(path), str(staged), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], per_channel=True
    )
    os.replace(staged, path)
    return {"weights": "int8", "bytes_fp32": before, "bytes": path.stat().st_size}
