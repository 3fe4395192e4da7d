"""Reading an ONNX Runtime GenAI model folder (``genai_config.json`` + ``model.onnx`` + ``tokenizer.json``).

:meth:`ModelFolder.load` validates what the ONNX Runtime backend needs from the config and returns a frozen
value; every problem is reported as a :class:`ModelFolderError` that names the folder, the file and the
offending key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..base import BackendError

CONFIG_NAME = "genai_config.json"
# ``model.decoder.layer_types`` entries whose layers hold a KV cache (other layers hold a recurrent state or none)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
TOKENIZER_NAME = "tokenizer.json"


class ModelFolderError(ValueError):
    """A model folder cannot be used: it is missing or incomplete, a file in it is malformed, or its parts do not
    belong together. The message names the folder or file and the key or tensor at fault."""


class ModelFileError(ModelFolderError, BackendError):
    """The folder's model file cannot be used: it is not a loadable ONNX model, its external data is missing or
    truncated, or its graph does not match ``genai_config.json``. A ``ModelFolderError`` (the fix is in the
    folder), and a ``BackendError`` (a caller that catches the backend's errors catches it too)."""


def _as_tuple_of_ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class ModelFolder:
    """What the ONNX Runtime backend needs to know about one decoder folder written by the onnxruntime-genai builder.

    ``model_path`` (the decoder's ``.onnx`` file) and ``tokenizer_path`` exist when the value is made by
    :meth:`load`. ``eos_token_ids`` holds at least one id in ``[0, vocab_size)``; ``num_attention_heads`` is a
    multiple of ``num_kv_heads``. The graph names come from ``model.decoder.inputs`` / ``outputs``; the KV names
    are ``%d`` patterns filled with the layer index. ``hidden_states_name`` is the optional output holding the
    final norm's output (``model.decoder.outputs.hidden_states``, default ``hidden_states``; the graph need not
    declare it). ``session_options`` is ``model.decoder.session_options`` without its ``provider_options``.

    Hybrid models: ``layer_types`` (``model.decoder.layer_types``, None when absent) says which layers hold a
    KV cache (:attr:`kv_layers`: the attention types, every layer when absent); ``state_patterns`` holds one
    ``(kind, past pattern, present pattern)`` per recurrent state the config names (``past_<kind>_names`` /
    ``present_<kind>_names``, e.g. LFM2's ``conv``). ``sliding_window`` is
    ``model.decoder.sliding_window.window_size`` (None when absent) and ``sliding_window_layers`` its ``layers``
    (empty: the config does not say which layers).
    """

    path: Path
    model_path: Path
    tokenizer_path: Path
    vocab_size: int
    context_length: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    eos_token_ids: tuple[int, ...] = attrs.field(converter=_as_tuple_of_ints)
    input_ids_name: str
    attention_mask_name: str | None
    position_ids_name: str | None
    past_key_pattern: str
    past_value_pattern: str
    logits_name: str
    present_key_pattern: str
    present_value_pattern: str
    hidden_states_name: str
    past_present_share_buffer: bool
    session_options: Mapping[str, Any] = attrs.field(converter=dict)
    layer_types: tuple[str, ...] | None = None
    state_patterns: tuple[tuple[str, str, str], ...] = ()
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache: those whose ``layer_types`` entry is an attention type (every layer when
        the config has no ``layer_types``)."""
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ATTENTION_LAYER_TYPES)

    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelFolder:
        """Read and validate ``path/genai_config.json``; check that the model and tokenizer files exist."""
        folder = Path(path).expanduser()
        if not folder.exists():
            raise ModelFolderError(f"model folder {folder} does not exist")
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {folder} is not a directory")
        cfg_path = folder / CONFIG_NAME
        if not cfg_path.is_file():
            raise ModelFolderError(f"model folder {folder} has no {CONFIG_NAME} (is it an onnxruntime-genai folder?)")
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFolderError(f"{cfg_path} is not valid JSON: {exc}") from exc
        return cls.from_config(folder, raw)

    @classmethod
    def from_config(cls, folder: Path, raw: Any) -> ModelFolder:
        """Validate ``raw`` (the parsed ``genai_config.json`` of ``folder``) and check that the decoder and
        tokenizer files exist; ``ModelFolderError`` names the file and the key at fault."""
        r = _ConfigReader(folder / CONFIG_NAME)
        if not isinstance(raw, Mapping):
            raise r.fail("the top level must be a JSON object")
        model = r.section(raw, "model", "")
        decoder_key = "model.decoder."
        decoder = r.section(model, "decoder", "model.")
        inputs = r.section(decoder, "inputs", decoder_key)
        outputs = r.section(decoder, "outputs", decoder_key)
        search = raw.get("search", {})
        if not isinstance(search, Mapping):
            raise r.fail("section 'search' must be an object")

        filename = r.optional_name(decoder, "filename", decoder_key, None)
        if filename is None:
            raise r.fail(f"missing {decoder_key}filename")
        model_path = folder / filename
        if not model_path.is_file():
            raise ModelFolderError(
                f"model folder {folder} lacks {filename}, the decoder named by {CONFIG_NAME} ({decoder_key}filename)"
            )
        tokenizer_path = folder / TOKENIZER_NAME
        if not tokenizer_path.is_file():
            raise ModelFolderError(f"model folder {folder} lacks {TOKENIZER_NAME}")

        eos_ids = r.eos_ids(model)
        num_heads, num_kv_heads, head_size = r.heads(decoder, decoder_key)
        vocab_size = r.integer(model, "vocab_size", "model.")
        for token_id in eos_ids:
            if token_id >= vocab_size:
                raise r.fail(f"model.eos_token_id {token_id} is outside the vocabulary of {vocab_size}")

        session_options = decoder.get("session_options", {})
        if not isinstance(session_options, Mapping):
            raise r.fail(f"{decoder_key}session_options must be an object")
        if not isinstance(session_options.get("provider_options", []), list):
            raise r.fail(f"{decoder_key}session_options.provider_options must be a list")
        share_buffer = search.get("past_present_share_buffer", False)
        if not isinstance(share_buffer, bool):
            raise r.fail(f"search.past_present_share_buffer must be true or false, got {share_buffer!r}")

        context_length = r.integer(model, "context_length", "model.")
        num_layers = r.integer(decoder, "num_hidden_layers", decoder_key)
        # Keys the builder writes that this backend does not read are still checked, so that a malformed
        # config is refused whichever reader meets it.
        r.optional_int(model, "bos_token_id", "model.", minimum=0)
        r.optional_int(model, "pad_token_id", "model.", minimum=0)
        in_inputs, in_outputs = decoder_key + "inputs.", decoder_key + "outputs."
        input_ids_name = r.name(inputs, "input_ids", in_inputs, "input_ids")
        attention_mask_name = r.optional_name(inputs, "attention_mask", in_inputs, None)
        position_ids_name = r.optional_name(inputs, "position_ids", in_inputs, None)
        past_key_pattern = r.name(inputs, "past_key_names", in_inputs, "past_key_values.%d.key", pattern=True)
        past_value_pattern = r.name(inputs, "past_value_names", in_inputs, "past_key_values.%d.value", pattern=True)
        logits_name = r.name(outputs, "logits", in_outputs, "logits")
        present_key_pattern = r.name(outputs, "present_key_names", in_outputs, "present.%d.key", pattern=True)
        present_value_pattern = r.name(outputs, "present_value_names", in_outputs, "present.%d.value", pattern=True)
        hidden_states_name = r.name(outputs, "hidden_states", in_outputs, "hidden_states")
        r.optional_int(search, "max_length", "search.")  # checked, not read (see above)
        layer_types = r.layer_types(decoder, decoder_key, num_layers)
        state_patterns = r.state_patterns(inputs, outputs, in_inputs, in_outputs)
        sliding_window, sliding_layers = r.sliding_window(decoder, decoder_key, num_layers)
        return cls(
            path=folder,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            vocab_size=vocab_size,
            context_length=context_length,
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            eos_token_ids=eos_ids,
            input_ids_name=input_ids_name,
            attention_mask_name=attention_mask_name,
            position_ids_name=position_ids_name,
            past_key_pattern=past_key_pattern,
            past_value_pattern=past_value_pattern,
            logits_name=logits_name,
            present_key_pattern=present_key_pattern,
            present_value_pattern=present_value_pattern,
            hidden_states_name=hidden_states_name,
            past_present_share_buffer=share_buffer,
            session_options={key: value for key, value in session_options.items() if key != "provider_options"},
            layer_types=layer_types,
            state_patterns=state_patterns,
            sliding_window=sliding_window,
            sliding_window_layers=sliding_layers,
        )


class _ConfigReader:
    """Reads the fields of one ``genai_config.json`` with checks that raise ``ModelFolderError`` naming the file and
    the key (``where`` is the dotted path of the section a key is in)."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path

    def fail(self, message: str) -> ModelFolderError:
        return ModelFolderError(f"{self.config_path}: {message}")

    def section(self, parent: Any, key: str, where: str) -> Mapping[str, Any]:
        value = parent.get(key) if isinstance(parent, Mapping) else None
        if not isinstance(value, Mapping):
            raise self.fail(f"missing or malformed section {where}{key!r} (expected an object)")
        return value

    def optional_int(self, parent: Mapping[str, Any], key: str, where: str, *, minimum: int | None = 1) -> int | None:
        if key not in parent or parent[key] is None:
            return None
        value = parent[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{where}{key} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(f"{where}{key} must be >= {minimum}, got {value}")
        return value

    def integer(self, parent: Mapping[str, Any], key: str, where: str, *, minimum: int | None = 1) -> int:
        value = self.optional_int(parent, key, where, minimum=minimum)
        if value is None:
            raise self.fail(f"missing {where}{key}")
        return value

    def optional_name(
        self, parent: Mapping[str, Any], key: str, where: str, default: str | None, *, pattern: bool = False
    ) -> str | None:
        value = parent.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(f"{where}{key} must be a non-empty string, got {value!r}")
        if pattern:
            try:
                layer0, layer1 = value % 0, value % 1
            except (TypeError, ValueError) as exc:
                raise self.fail(f"{where}{key} must be a name pattern with one %d, got {value!r}") from exc
            if layer0 == layer1:
                raise self.fail(f"{where}{key} must be a name pattern with one %d, got {value!r}")
        return value

    def name(self, parent: Mapping[str, Any], key: str, where: str, default: str, *, pattern: bool = False) -> str:
        value = self.optional_name(parent, key, where, default, pattern=pattern)
        assert value is not None  # a default is given
        return value

    def eos_ids(self, model: Mapping[str, Any]) -> list[int]:
        eos = model.get("eos_token_id")
        if isinstance(eos, bool) or eos is None:
            raise self.fail("missing model.eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else eos
        if (
            not isinstance(eos_ids, list)
            or not eos_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids)
        ):
            raise self.fail(f"model.eos_token_id must be an id or a non-empty list of ids, got {eos!r}")
        return eos_ids

    def heads(self, decoder: Mapping[str, Any], decoder_key: str) -> tuple[int, int, int]:
        """``(num_attention_heads, num_key_value_heads, head_size)``."""
        num_heads = self.integer(decoder, "num_attention_heads", decoder_key)
        num_kv_heads = self.optional_int(decoder, "num_key_value_heads", decoder_key) or num_heads
        hidden_size = self.optional_int(decoder, "hidden_size", decoder_key)
        head_size = self.optional_int(decoder, "head_size", decoder_key)
        if head_size is None:
            if hidden_size is None:
                raise self.fail(f"missing {decoder_key}head_size (and no {decoder_key}hidden_size to derive it from)")
            head_size = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise self.fail(
                f"{decoder_key}num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        return num_heads, num_kv_heads, head_size

    def layer_types(self, decoder: Mapping[str, Any], decoder_key: str, num_layers: int) -> tuple[str, ...] | None:
        layer_types = decoder.get("layer_types")
        if layer_types is None:
            return None
        if not isinstance(layer_types, list) or not all(isinstance(t, str) and t for t in layer_types):
            raise self.fail(f"{decoder_key}layer_types must be a list of strings, got {layer_types!r}")
        if len(layer_types) != num_layers:
            raise self.fail(
                f"{decoder_key}layer_types has {len(layer_types)} entries but num_hidden_layers = {num_layers}"
            )
        return tuple(layer_types)

    def state_patterns(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], in_inputs: str, in_outputs: str
    ) -> tuple[tuple[str, str, str], ...]:
        """Recurrent states: every ``past_<kind>_names`` input besides key/value, paired with
        ``present_<kind>_names``, as ``(kind, past pattern, present pattern)``."""
        state_patterns = []
        for key in inputs:
            if not (key.startswith("past_") and key.endswith("_names")) or key in (
                "past_key_names",
                "past_value_names",
            ):
                continue
            kind = key[len("past_") : -len("_names")]
            past = self.name(inputs, key, in_inputs, "", pattern=True)
            if f"present_{kind}_names" not in outputs:
                raise self.fail(f"{in_inputs}{key} names a state with no {in_outputs}present_{kind}_names")
            present = self.name(outputs, f"present_{kind}_names", in_outputs, "", pattern=True)
            state_patterns.append((kind, past, present))
        return tuple(state_patterns)

    def sliding_window(
        self, decoder: Mapping[str, Any], decoder_key: str, num_layers: int
    ) -> tuple[int | None, tuple[int, ...]]:
        """``(window_size, layers)`` of ``sliding_window`` (``(None, ())`` without one)."""
        if decoder.get("sliding_window") is None:
            return None, ()
        window_section = self.section(decoder, "sliding_window", decoder_key)
        window_key = decoder_key + "sliding_window."
        window = self.optional_int(window_section, "window_size", window_key)
        listed = window_section.get("layers", [])
        if not isinstance(listed, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in listed
        ):
            raise self.fail(f"{window_key}layers must be a list of layer indices below {num_layers}, got {listed!r}")
        return window, tuple(listed)


# ----------------------------------------------------------------------------------------------------------------
# Why onnxruntime could not load a model file: a minimal reading of the ONNX protobuf (ModelProto.graph ->
# GraphProto.initializer -> TensorProto.external_data), enough to name a missing or truncated external data file.

_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_NAME, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 8, 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


class _Malformed(ValueError):
    pass


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise _Malformed(f"a varint runs past byte {at}")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _fields(buf: bytes, start: int, end: int) -> list[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of one message; a length-delimited value is its ``(start, end)``."""
    out: list[tuple[int, int, Any]] = []
    at = start
    while at < end:
        key, at = _varint(buf, at)
        number, wire = key >> 3, key & 7
        value: Any = None
        if wire == 0:
            value, at = _varint(buf, at)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            length, at = _varint(buf, at)
            value, at = (at, at + length), at + length
        else:
            raise _Malformed(f"wire type {wire} at byte {at}")
        if at > end or number == 0:
            raise _Malformed(f"a field runs past its message at byte {at}")
        out.append((number, wire, value))
    return out


def _text(buf: bytes, span: tuple[int, int]) -> str:
    return buf[span[0] : span[1]].decode("utf-8", "replace")


def _external_data(buf: bytes, tensor: list[tuple[int, int, Any]]) -> tuple[str, str, int] | None:
    """``(tensor name, file, end offset)`` of an initializer stored in an external file, else None."""
    if not any(n == _TENSOR_DATA_LOCATION and v == _EXTERNAL for n, _, v in tensor):
        return None
    name = next((_text(buf, v) for n, w, v in tensor if n == _TENSOR_NAME and w == 2), "?")
    entry: dict[str, str] = {}
    for number, wire, span in tensor:
        if number == _TENSOR_EXTERNAL_DATA and wire == 2:
            pair = {n: _text(buf, v) for n, w, v in _fields(buf, *span) if w == 2}
            entry[pair.get(1, "")] = pair.get(2, "")
    location = entry.get("location")
    if not location:
        return None
    return name, location, int(entry.get("offset") or 0) + int(entry.get("length") or 0)


def external_data_problem(model_path: Path) -> str | None:
    """Why ``model_path`` cannot be loaded, when the reason is in the folder: the file does not parse as an ONNX
    model, or an external data file its initializers name is missing, or shorter than the bytes they need. None
    when none of these (the problem is elsewhere)."""
    try:
        buf = model_path.read_bytes()
    except OSError as exc:
        return f"{model_path} cannot be read: {exc}"
    needs: dict[str, tuple[int, str]] = {}  # file -> (bytes needed, a tensor stored there)
    try:
        graphs = [v for n, w, v in _fields(buf, 0, len(buf)) if n == _MODEL_GRAPH and w == 2]
        if not graphs:
            return f"{model_path} is not an ONNX model (it has no graph)"
        for graph in graphs:
            for number, wire, span in _fields(buf, *graph):
                if number != _GRAPH_INITIALIZER or wire != 2:
                    continue
                found = _external_data(buf, _fields(buf, *span))
                if found is not None and found[2] > needs.get(found[1], (-1, ""))[0]:
                    needs[found[1]] = (found[2], found[0])
    except ValueError:  # _Malformed, or an offset that is not a number
        return f"{model_path} is not an ONNX model (it does not parse as one: is it truncated, or another file?)"
    for location, (end, tensor) in sorted(needs.items()):
        data = model_path.parent / location
        if not data.is_file():
            return (
                f"{model_path.parent} lacks {location}, the external data file of {model_path.name} "
                f"(it holds the weights, e.g. {tensor})"
            )
        size = data.stat().st_size
        if size < end:
            return (
                f"{data} is truncated: {size} bytes, but {model_path.name} needs {end} "
                f"(the weights of {tensor} end there); copy or download it again"
            )
    return None
