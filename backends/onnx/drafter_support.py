"""Which targets a shared-KV drafter can serve, and what the target's layer L computes (the layer whose KV the head
reads and, in ``ortspec train-drafter``'s recipe, whose weights it copies).

:func:`drafter_support` is the one rule, with its reason in words: the Engine asks it when a drafter folder is
opened for a target (``SharedKvProposer``: what the head *reads*), ``ortspec train-drafter`` before it collects any
data (what the head also *copies*). :func:`layer_plan` reads layer L out of the builder-written decoder graph (its
nodes, without the weights) into a :class:`LayerPlan`: the attention's scale, soft cap and window, the QK norm, the
residual multiplier, the norms around the attention and the MLP, the activation, the RoPE tables, and the
initializers holding each weight. A layer that computes anything the head's graph does not reproduce is refused,
naming the node; nothing is approximated.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import attrs

from .drafter_folder import DrafterError
from .folder import ModelFolder


class DrafterSupportError(DrafterError):
    """A shared-KV drafter cannot serve this target (the message says why)."""


@attrs.frozen
class LayerPlan:
    """What target layer ``layer`` computes, as the head reproduces it. ``scale``: the attention's score scale;
    ``softcap``: ``cap * tanh(score / cap)`` on the scaled scores (0: none); ``window``: a query attends to the
    ``window`` positions before its own (0: every position); ``residual_scale``: the attention's and the MLP's
    outputs are multiplied by it before they join the residual stream; ``sandwich``: the attention's output and the
    MLP's output are RMS-normed before they join it (``norm_post_attn``, ``norm_post_mlp``); ``activation``:
    ``"silu"`` or ``"gelu_tanh"``; ``q_norm``: the per-head RMS norm of the query before RoPE (None: none);
    ``cos``/``sin``: the RoPE tables the layer reads. ``weights`` maps each head parameter (``norm_attn``, ``wqkv``,
    ``wo``, ``norm_mlp``, ``w_gate``, ``w_up``, ``w_down`` and the optional ``q_norm``, ``norm_post_attn``,
    ``norm_post_mlp``) to its initializer."""

    layer: int
    scale: float
    softcap: float = 0.0
    window: int = 0
    residual_scale: float = 1.0
    sandwich: bool = False
    activation: str = "silu"
    cos: str = "cos_cache"
    sin: str = "sin_cache"
    weights: dict[str, str] = attrs.field(factory=dict)


# (the part of a node's name after "/model/layers.<L>/", its op type) -> its role in the layer
_ROLES: dict[tuple[str, str], str] = {
    ("input_layernorm", "SkipSimplifiedLayerNormalization"): "norm_attn",
    ("attn/qkv_proj", "MatMul"): "wqkv",
    ("attn/qkv_proj", "Split"): "split",
    ("attn/q_norm", "Reshape"): "reshape",
    ("attn/q_norm", "SimplifiedLayerNormalization"): "q_norm",
    ("attn/k_norm", "Reshape"): "reshape",
    ("attn/k_norm", "SimplifiedLayerNormalization"): "k_norm",
    ("attn/GroupQueryAttention", "GroupQueryAttention"): "attention",
    ("attn/o_proj", "MatMul"): "wo",
    ("residual_mul", "Mul"): "residual_mul",
    ("post_attention_layernorm", "SkipSimplifiedLayerNormalization"): "norm_mlp",
    ("post_attention_layernorm", "SimplifiedLayerNormalization"): "norm_post_attn",
    ("pre_feedforward_layernorm", "SkipSimplifiedLayerNormalization"): "norm_mlp",
    ("post_feedforward_layernorm", "SimplifiedLayerNormalization"): "norm_post_mlp",
    ("mlp/gate_proj", "MatMul"): "w_gate",
    ("mlp/up_proj", "MatMul"): "w_up",
    ("mlp/down_proj", "MatMul"): "w_down",
    ("mlp/act_fn", "Sigmoid"): "silu",
    ("mlp/act_fn", "Mul"): "silu",
    ("mlp/act_fn", "Gelu"): "gelu",
    ("mlp/Mul", "Mul"): "gate_mul",
}
_REQUIRED = ("norm_attn", "wqkv", "attention", "wo", "norm_mlp", "w_gate", "w_up", "w_down")


def drafter_support(target: ModelFolder, layer: int | None = None, *, training: bool = True) -> str | None:
    """Why a shared-KV drafter reading target layer ``layer`` (None: the last) cannot serve ``target``, or None
    when it can. Always: the target must output hidden states, and layer ``layer`` must exist and keep a KV cache of
    every position (not a recurrent state, not a window-sized cache). With ``training`` (``ortspec
    train-drafter``), also: the data step runs the target alone (no recurrent state anywhere), and the layer must
    compute only what the head reproduces (:func:`layer_plan`)."""
    try:
        if training:
            layer_plan(target, layer)
        else:
            _check_reading(target, _layer_of(target, layer))
    except DrafterSupportError as exc:
        return str(exc)
    return None


def _layer_of(target: ModelFolder, layer: int | None) -> int:
    return target.num_layers - 1 if layer is None else int(layer)


def _arch(target: ModelFolder) -> str:
    return str(_graph(target.path / "genai_config.json").get("type") or target.path.name)


def _check_reading(target: ModelFolder, layer: int) -> dict[str, Any]:
    """The attention node of ``layer`` (attributes and inputs), once what a head reads there is checked."""
    name = f"{_arch(target)}: layer {layer}"
    if target.hidden_states_name not in _graph(target.model_path)["outputs"]:
        raise DrafterSupportError(
            f"{_arch(target)}: {target.model_path} has no 'hidden_states' output, which a shared-KV drafter reads; "
            "rebuild the folder with `ortspec convert` or the builder's extra option include_hidden_states=true"
        )
    if not 0 <= layer < target.num_layers:
        raise DrafterSupportError(f"{name} does not exist: the target has {target.num_layers} layers")
    if layer not in target.kv_layers:
        kind = target.layer_types[layer] if target.layer_types else "non-attention"
        raise DrafterSupportError(
            f"{name} is a {kind!r} layer: it carries a recurrent state, not a KV cache; the shared-KV head reads "
            "layer L's KV (layers with a KV cache: " + ", ".join(str(i) for i in target.kv_layers) + ")"
        )
    attention = _graph(target.model_path)["attention"].get(target.past_key_pattern % layer)
    if attention is None:
        raise DrafterSupportError(f"{name}: no GroupQueryAttention node reads {target.past_key_pattern % layer!r}")
    if attention["attributes"].get("sliding_window_cache", 0):
        raise DrafterSupportError(
            f"{name} keeps a window-sized cache (sliding_window_cache), not every position from 0; the head reads "
            "the first kv_len positions of layer L's cache"
        )
    return attention


def layer_plan(target: ModelFolder, layer: int | None = None) -> LayerPlan:
    """What layer ``layer`` (None: the last) of ``target`` computes, for a head that copies it;
    ``DrafterSupportError`` saying why when the head cannot reproduce it (see :func:`drafter_support`)."""
    layer = _layer_of(target, layer)
    attention = _check_reading(target, layer)
    arch, name = _arch(target), f"{_arch(target)}: layer {layer}"
    if len(target.kv_layers) < target.num_layers:
        others = [i for i in range(target.num_layers) if i not in target.kv_layers]
        raise DrafterSupportError(
            f"{arch}: layers {others} carry a recurrent state, not a KV cache; train-drafter's data step runs the "
            "target with KV caches alone"
        )
    if layer < 1:
        raise DrafterSupportError(f"{name}: the head copies a layer >= 1 (it needs the residual stream entering it)")
    attributes = attention["attributes"]
    if not attributes.get("do_rotary", 0) or attributes.get("rotary_interleaved", 0):
        raise DrafterSupportError(
            f"{name} does not rotate its queries inside the attention with non-interleaved halves (do_rotary="
            f"{attributes.get('do_rotary', 0)}, rotary_interleaved={attributes.get('rotary_interleaved', 0)}); "
            "the head's RoPE does"
        )
    graph = _graph(target.model_path)
    cos, sin = attention["inputs"][7], attention["inputs"][8]
    width = graph["dims"].get(cos, (0, 0))[-1]
    if 2 * width != target.head_size:
        raise DrafterSupportError(
            f"{name} rotates {2 * width} of its {target.head_size} head dimensions (partial rotary); the head rotates "
            "all of them"
        )
    weights, roles = _roles(target, layer, graph, name)
    gelu = roles.get("gelu")
    if gelu is not None and gelu.get("approximate") != "tanh":
        raise DrafterSupportError(f"{name}: its GELU is exact (approximate='none'); the head's is the tanh form")
    if ("norm_post_attn" in weights) != ("norm_post_mlp" in weights):
        raise DrafterSupportError(f"{name}: a norm after the attention or after the MLP, but not both")
    scale = float(attributes.get("scale", 0.0)) or 1.0 / math.sqrt(target.head_size)
    window = int(attributes.get("local_window_size", -1))
    if (
        window <= 0
        and target.sliding_window
        and (not target.sliding_window_layers or layer in target.sliding_window_layers)
    ):
        window = int(target.sliding_window)  # applied at load (graph_rewrites.window_rewrites)
    return LayerPlan(
        layer=layer,
        scale=scale,
        softcap=float(attributes.get("softcap", 0.0)),
        window=max(window - 1, 0),  # GroupQueryAttention's window counts the query's own position
        residual_scale=roles.get("residual_mul", {}).get("value", 1.0),
        sandwich="norm_post_attn" in weights,
        activation="gelu_tanh" if gelu is not None else "silu",
        cos=cos,
        sin=sin,
        weights=weights,
    )


def _roles(target: ModelFolder, layer: int, graph: dict[str, Any], name: str) -> tuple[dict[str, str], dict]:
    """Each node of ``layer`` by its role: the initializers of the weights, and the roles' extra facts (the
    residual multiplier's value, the GELU's form); ``DrafterSupportError`` naming a node the head does not
    reproduce, or a weight the layer lacks."""
    prefix = f"/model/layers.{layer}/"
    weights: dict[str, str] = {}
    facts: dict[str, dict[str, Any]] = {}
    residual: set[float] = set()
    for node in graph["nodes"]:
        if not node["name"].startswith(prefix):
            continue
        parts = node["name"][len(prefix) :].split("/")
        key = "/".join(parts[:2]) if parts[0] in ("attn", "mlp") else parts[0]
        role = _ROLES.get((key, node["op"]))
        if role is None:
            hint = " (quantized weights: train on the float32 folder)" if "MatMul" in node["op"] else ""
            raise DrafterSupportError(
                f"{name} computes {node['name']} ({node['op']}), which the shared-KV head does not reproduce{hint}"
            )
        if role in ("norm_attn", "norm_mlp", "q_norm", "norm_post_attn", "norm_post_mlp"):
            weights[role] = node["inputs"][2] if "Skip" in node["op"] else node["inputs"][1]
        elif role in ("wqkv", "wo", "w_gate", "w_up", "w_down"):
            weights[role] = node["inputs"][1]
        elif role == "residual_mul":
            value = next((graph["scalars"][i] for i in node["inputs"] if i in graph["scalars"]), None)
            if value is None:
                raise DrafterSupportError(f"{name}: {node['name']} multiplies by no constant scalar")
            residual.add(value)
        elif role == "gelu":
            facts["gelu"] = node["attributes"]
    if len(residual) > 1:
        raise DrafterSupportError(f"{name}: its residual multipliers differ ({sorted(residual)})")
    if residual:
        facts["residual_mul"] = {"value": residual.pop()}
    missing = [role for role in _REQUIRED if role not in weights and role != "attention"]
    if missing:
        raise DrafterSupportError(f"{name}: no {', '.join(missing)} where the head expects them")
    return weights, facts


def _graph(path: Path) -> dict[str, Any]:
    """The facts of the decoder graph (or ``genai_config.json``) at ``path`` this module reads, cached per file and
    modification time."""
    stat = path.stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read(path: str, _mtime: int, _size: int) -> dict[str, Any]:
    if path.endswith(".json"):
        import json

        return json.loads(Path(path).read_text(encoding="utf-8")).get("model", {})
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path, load_external_data=False)

    def attributes(node) -> dict[str, Any]:
        values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name != "value"}
        return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}

    scalars: dict[str, float] = {}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
            array = numpy_helper.to_array(node.attribute[0].t)
            if array.size == 1 and array.dtype.kind == "f":
                scalars[node.output[0]] = float(array.reshape(()))
    for init in model.graph.initializer:
        if not init.external_data and len(init.dims) == 0 and init.data_type in (1, 10):
            scalars[init.name] = float(numpy_helper.to_array(init))
    nodes = [
        {"name": n.name, "op": n.op_type, "inputs": list(n.input), "attributes": attributes(n)}
        for n in model.graph.node
        if n.op_type != "Constant"
    ]
    return {
        "nodes": nodes,
        "attention": {n["inputs"][3]: n for n in nodes if n["op"] == "GroupQueryAttention" and len(n["inputs"]) > 3},
        "dims": {t.name: tuple(t.dims) for t in model.graph.initializer},
        "scalars": scalars,
        "outputs": {o.name for o in model.graph.output},
    }
