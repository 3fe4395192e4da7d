"""The decoder graph's interface, checked against its folder: :func:`inspect_graph` reads an ``InferenceSession``
and a :class:`ModelFolder` and returns a :class:`DecoderGraph`, the names and dtypes of everything a pass binds,
or raises ``BackendError`` naming the model file and what does not match ``genai_config.json``.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from ..base import BackendError
from .folder import ModelFolder

# ONNX Runtime's type strings -> numpy dtypes, for the types this backend feeds or reads
ORT_TYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
}
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # KV and logits
INDEX_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))  # input ids, attention mask, position ids


@attrs.frozen
class LayerKVNames:
    """One layer's KV tensors: graph inputs ``past_key``/``past_value`` and outputs ``present_key``/``present_value``,
    each ``[batch, kv_heads, positions, head_size]``."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str


@attrs.frozen
class DecoderGraph:
    """What one decoder pass binds, by graph name and dtype (all checked against the session).

    Inputs: ``ids_name`` (``[1, tokens]``), ``mask_name`` (``[1, total positions]``, all ones) and
    ``position_name`` (``[1, tokens]``); the graph takes at least one of the last two (None: it takes none by
    that name). ``kv_names`` holds one :class:`LayerKVNames` per layer, all of ``kv_dtype``. Output
    ``logits_name`` is ``[1, tokens, vocab]`` of ``logits_dtype``. ``group_query_attention``: the graph uses
    the ``GroupQueryAttention`` op, which can append to a KV buffer bound as both past and present. Optional output
    ``hidden_name`` (None when the graph has none): the final norm's output, ``[1, tokens, hidden_size]`` of
    ``hidden_dtype`` (``hidden_size`` is 0 without it)."""

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
    hidden_name: str | None = None
    hidden_dtype: np.dtype | None = None
    hidden_size: int = 0


def inspect_graph(session, folder: ModelFolder) -> DecoderGraph:
    """Check that ``session`` declares what ``folder``'s config names, with shapes it states and dtypes this
    backend can feed, and no input it does not know how to feed; return the names and dtypes."""
    where = f"{folder.model_path}"
    inputs = {arg.name: arg for arg in session.get_inputs()}
    outputs = {arg.name: arg for arg in session.get_outputs()}

    def dtype_of(arg, allowed, what):
        dtype = ORT_TYPES.get(arg.type)
        if dtype is None or dtype not in allowed:
            raise BackendError(
                f"{where}: {what} {arg.name!r} has type {arg.type}; supported: " + ", ".join(str(a) for a in allowed)
            )
        return dtype

    def need(table, name, what):
        if name not in table:
            raise BackendError(
                f"{where}: the graph has no {what} named {name!r} (genai_config.json names it); "
                f"it declares {sorted(table)[:8]}{' ...' if len(table) > 8 else ''}"
            )
        return table[name]

    fed: set[str] = set()
    ids = need(inputs, folder.input_ids_name, "input")
    ids_dtype = dtype_of(ids, INDEX_DTYPES, "input")
    fed.add(ids.name)

    wanted_mask = folder.attention_mask_name or "attention_mask"
    mask_name = wanted_mask if wanted_mask in inputs else None
    mask_dtype = dtype_of(inputs[mask_name], INDEX_DTYPES, "input") if mask_name else None
    wanted_position = folder.position_ids_name or "position_ids"
    position_name = wanted_position if wanted_position in inputs else None
    position_dtype = dtype_of(inputs[position_name], INDEX_DTYPES, "input") if position_name else None
    fed.update(name for name in (mask_name, position_name) if name)
    if mask_name is None and position_name is None:
        raise BackendError(
            f"{where}: the graph declares neither {wanted_mask!r} nor {wanted_position!r}, so this backend cannot "
            "tell it the sequence length"
        )

    kv_dtype: np.dtype | None = None
    kv_names = []
    for layer in range(folder.num_layers):
        names = LayerKVNames(
            past_key=folder.past_key_pattern % layer,
            past_value=folder.past_value_pattern % layer,
            present_key=folder.present_key_pattern % layer,
            present_value=folder.present_value_pattern % layer,
        )
        for name, table, what in (
            (names.past_key, inputs, "input"),
            (names.past_value, inputs, "input"),
            (names.present_key, outputs, "output"),
            (names.present_value, outputs, "output"),
        ):
            arg = need(table, name, what)
            dtype = dtype_of(arg, FLOAT_DTYPES, what)
            if kv_dtype is None:
                kv_dtype = dtype
            elif dtype != kv_dtype:
                raise BackendError(f"{where}: {what} {arg.name!r} is {arg.type} but other KV tensors are {kv_dtype}")
            shape = list(arg.shape)
            if len(shape) != 4:
                raise BackendError(
                    f"{where}: {what} {arg.name!r} has rank {len(shape)}, expected 4 "
                    "([batch, kv_heads, length, head_size])"
                )
            for axis, expected, label in (
                (1, folder.num_kv_heads, "num_key_value_heads"),
                (3, folder.head_size, "head_size"),
            ):
                if isinstance(shape[axis], int) and shape[axis] != expected:
                    raise BackendError(
                        f"{where}: {what} {arg.name!r} has dim {axis} = {shape[axis]} but genai_config.json "
                        f"says {label} = {expected}"
                    )
            if table is inputs:
                fed.add(arg.name)
        kv_names.append(names)
    if folder.past_key_pattern % folder.num_layers in inputs:
        raise BackendError(
            f"{where}: the graph has more layers than genai_config.json's num_hidden_layers = {folder.num_layers}"
        )

    logits = need(outputs, folder.logits_name, "output")
    logits_dtype = dtype_of(logits, FLOAT_DTYPES, "output")
    logits_shape = list(logits.shape)
    if len(logits_shape) != 3:
        raise BackendError(
            f"{where}: output {logits.name!r} has rank {len(logits_shape)}, expected 3 ([batch, sequence, vocab])"
        )
    if isinstance(logits_shape[2], int) and logits_shape[2] != folder.vocab_size:
        raise BackendError(
            f"{where}: output {logits.name!r} has vocab dim {logits_shape[2]} but genai_config.json "
            f"says vocab_size = {folder.vocab_size}"
        )

    hidden_name, hidden_dtype, hidden_size = None, None, 0
    hidden = outputs.get(folder.hidden_states_name)
    if hidden is not None:
        hidden_dtype = dtype_of(hidden, FLOAT_DTYPES, "output")
        hidden_shape = list(hidden.shape)
        if len(hidden_shape) != 3 or not isinstance(hidden_shape[2], int) or hidden_shape[2] < 1:
            raise BackendError(
                f"{where}: output {hidden.name!r} has shape {hidden_shape}; expected [batch, sequence, hidden] with "
                "a fixed hidden size"
            )
        hidden_name, hidden_size = hidden.name, int(hidden_shape[2])

    extra = sorted(set(inputs) - fed)
    if extra:
        raise BackendError(f"{where}: the graph declares inputs this backend does not know how to feed: {extra}")

    if kv_dtype is None:
        raise BackendError(f"{where}: the graph has no KV inputs (genai_config.json names no layers)")
    return DecoderGraph(
        ids_name=ids.name,
        ids_dtype=ids_dtype,
        mask_name=mask_name,
        mask_dtype=mask_dtype,
        position_name=position_name,
        position_dtype=position_dtype,
        kv_names=tuple(kv_names),
        kv_dtype=kv_dtype,
        logits_name=logits.name,
        logits_dtype=logits_dtype,
        group_query_attention=uses_group_query_attention(folder.model_path),
        hidden_name=hidden_name,
        hidden_dtype=hidden_dtype,
        hidden_size=hidden_size,
    )


def uses_group_query_attention(model_path: Path) -> bool:
    """True if the ONNX file mentions the ``GroupQueryAttention`` op (a scan of the file's bytes; False if it
    cannot be read)."""
    needle = b"GroupQueryAttention"
    tail = b""
    try:
        with open(model_path, "rb") as model_file:
            while chunk := model_file.read(1 << 22):
                if needle in tail + chunk:
                    return True
                tail = chunk[-len(needle) :]
    except OSError:
        return False
    return False
