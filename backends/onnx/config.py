"""``BackendConfig``: how ``OrtBackend.from_folder`` opens a decoder folder, as one frozen value.

Every setting is declared once here, with its default and its check (a validator on the field: a bad value raises
``ValueError`` naming the field when the value is made, before any folder is read). The one check that needs the
folder, ``max_length`` against the model's ``context_length``, is :meth:`BackendConfig.capacity`. Change a
setting with ``attrs.evolve``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ortspec.core.checks import check_int, int_at_least

from .session import check_graph_optimization_level, make_session_options

DEFAULT_PREFILL_CHUNK = 256
DEFAULT_GRAPH_MAX_TOKENS = 17  # the pending token + up to 16 draft tokens (the cost-aware width policy's widest)
PROVIDERS = ("cpu", "cuda")
ARRAY_MODULES = ("auto", "cupy", "torch")
SLIDING_WINDOW_POLICIES = ("config", "graph")
MATMUL_ACCURACY_LEVELS = (0, 1, 2, 3, 4)


def _one_of(choices: tuple[str, ...]):
    """An attrs validator: the field is one of ``choices`` (the error names the field and the choices)."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {choices}, got {value!r}")

    return validate


def _provider(instance: Any, attribute: Any, value: Any) -> None:
    if value not in PROVIDERS:
        raise ValueError(f"provider must be 'cpu' or 'cuda', got {value!r}")


def _graph_optimization_level(instance: Any, attribute: Any, value: Any) -> None:
    check_graph_optimization_level(value)


def _optionalint_at_least(minimum: int):
    def validate(instance: Any, attribute: Any, value: Any) -> None:
        if value is not None:
            check_int(attribute.name, value, minimum)

    return validate


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _entries(value: Mapping[str, str] | tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...]:
    """Session config entries as sorted ``(key, value)`` string pairs (a mapping or pairs in)."""
    pairs = value.items() if isinstance(value, Mapping) else (value or ())
    return tuple(sorted((str(key), str(entry)) for key, entry in pairs))


def _needs_cuda(instance: BackendConfig, attribute: Any, value: bool) -> None:
    if value and instance.provider != "cuda":
        raise ValueError("cuda_graphs=True needs provider='cuda'")


def feature_layers(value: Iterable[int]) -> tuple[int, ...]:
    """``value`` as the layers of fused features (``hidden_features``, a drafter recipe's ``feature_layers``): a
    tuple of distinct decoder layers, each >= 1 (the residual stream entering layer 0 is the embedding), else
    ``ValueError`` naming them."""
    layers = tuple(value)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"feature layers must be distinct decoder layers >= 1, got {list(layers)}")
    return layers


def _accuracy_level(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and value not in MATMUL_ACCURACY_LEVELS:
        raise ValueError(f"matmul_accuracy_level must be 0..4 or None, got {value!r}")


SLOT_LENGTH = 2048  # a batched backend's KV positions per slot when max_length is not given (BackendConfig.capacity)


@attrs.frozen
class BackendConfig:
    """How to open one decoder (every field has the default a plain ``OrtBackend.from_folder(path)`` uses).

    Device: ``provider`` (``"cpu"`` or ``"cuda"``, any case), ``device_id`` (the CUDA device), ``array_module``
    (CUDA buffers: ``"cupy"``, ``"torch"`` or ``"auto"``: CuPy, else torch).
    Capacity: ``max_length`` (KV positions; None: the model's ``context_length``, also the maximum),
    ``prefill_chunk`` (tokens per pass of a long prompt; the logits buffer's first size).
    KV: ``share_buffer`` (None: the folder's ``past_present_share_buffer``; False forces the grow/copy path).
    Session: ``threads`` (intra-op; None: the folder's, else the physical cores), ``graph_optimization_level``
    (one of ``session.GRAPH_OPTIMIZATION_LEVELS``), ``allow_spinning`` (None: onnxruntime's default),
    ``config_entries`` (further session config entries, kept as sorted string pairs; a mapping is accepted).
    The fast CUDA path: ``static_shapes`` (fixed-shape binding; see ``binding.py``), ``cuda_graphs`` (one
    captured CUDA graph per pass width up to ``graph_max_tokens`` tokens; needs ``provider="cuda"`` and implies
    static shapes; see ``cuda_graphs.py``). Load-time rewrites (see ``graph_rewrites.py``): ``sliding_window``
    (``"config"``: apply the window ``genai_config.json`` names where the graph ignores it; ``"graph"``: run the
    graph as written) and ``matmul_accuracy_level`` (0..4: every ``MatMulNBits`` node's ``accuracy_level``; 1 =
    float32 compute, which makes a quantized model's verify passes agree with its one-token decodes; None keeps
    the graph's) and ``hidden_features`` (decoder layers, each >= 1: the residual stream entering each is appended
    to every hidden-state row, so a row is ``[(1 + len(hidden_features)) * H]``: what a drafter with fused features
    reads; empty: the final hidden state alone) and ``tree_rows`` (the graph takes each ``GroupQueryAttention``'s
    ``position_ids`` and ``attention_bias`` inputs, so a pass can verify a token tree: ``tree_rewrite.py``; True:
    required, ``BackendError`` for a graph the rewrite refuses, and on ``OrtBackend`` the dynamic binding only
    (``ValueError`` with static shapes); None (default): ``OrtBatchBackend`` where the graph allows, ``OrtBackend``
    never; False: never) and ``ragged_rows`` (the batch backend's graph
    takes each ``GroupQueryAttention``'s ``query_seqlens`` input, so one session run carries rows of any lengths at
    any positions, right-padded: ``ragged_rewrite.py``; ``OrtBatchBackend`` only; True: required; None (default):
    where the graph and the installed ONNX Runtime allow; False: never, each multi-token row after a past runs
    alone)."""

    provider: str = attrs.field(default="cpu", converter=_lower, validator=_provider)
    device_id: int = attrs.field(default=0, validator=int_at_least(0))
    array_module: str = attrs.field(default="auto", validator=_one_of(ARRAY_MODULES))
    max_length: int | None = attrs.field(default=None, validator=_optionalint_at_least(1))
    prefill_chunk: int = attrs.field(default=DEFAULT_PREFILL_CHUNK, validator=int_at_least(1))
    share_buffer: bool | None = None
    threads: int | None = attrs.field(default=None, validator=_optionalint_at_least(1))
    graph_optimization_level: str = attrs.field(default="all", converter=_lower, validator=_graph_optimization_level)
    allow_spinning: bool | None = None
    config_entries: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_entries)
    static_shapes: bool = False
    cuda_graphs: bool = attrs.field(default=False, validator=_needs_cuda)
    graph_max_tokens: int = attrs.field(default=DEFAULT_GRAPH_MAX_TOKENS, validator=int_at_least(1))
    sliding_window: str = attrs.field(default="config", validator=_one_of(SLIDING_WINDOW_POLICIES))
    matmul_accuracy_level: int | None = attrs.field(default=None, validator=_accuracy_level)
    hidden_features: tuple[int, ...] = attrs.field(default=(), converter=feature_layers)
    tree_rows: bool | None = None
    ragged_rows: bool | None = None

    @property
    def static(self) -> bool:
        """Whether passes take the static-shape binding (``static_shapes``, or implied by ``cuda_graphs``)."""
        return self.static_shapes or self.cuda_graphs

    def session_options(self, genai_session_options: Mapping[str, Any] | None = None) -> Any:
        """The ``onnxruntime.SessionOptions`` these settings give a decoder (``threads``, ``graph_optimization_level``,
        ``allow_spinning``, ``config_entries``), over the folder's own ``genai_session_options``."""
        return make_session_options(
            threads=self.threads,
            graph_optimization_level=self.graph_optimization_level,
            allow_spinning=self.allow_spinning,
            config_entries=dict(self.config_entries),
            genai_session_options=genai_session_options,
        )

    def capacity(self, context_length: int, *, batched: bool = False) -> int:
        """The KV capacity for a model of ``context_length`` positions: ``max_length`` or, when None, all of them
        (for one slot of a batched backend, ``batched``: at most ``SLOT_LENGTH``, since ONNX Runtime's attention
        writes a slot's whole buffer on its first prompt, so every slot costs its capacity in memory:
        ``2 * layers * kv_heads * head_size`` KV values per position); ``ValueError`` when ``max_length`` exceeds the
        model's."""
        if self.max_length is None:
            return min(context_length, SLOT_LENGTH) if batched else context_length
        if not 1 <= self.max_length <= context_length:
            raise ValueError(
                f"max_length must be in [1, {context_length}] (the model's context_length), got {self.max_length}"
            )
        return int(self.max_length)
