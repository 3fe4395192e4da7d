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

CONFIG_NAME = "genai_config.json"
TOKENIZER_NAME = "tokenizer.json"


class ModelFolderError(ValueError):
    """A model folder is missing, incomplete, or its ``genai_config.json`` is malformed."""


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
        config_path = folder / CONFIG_NAME

        def fail(message: str) -> ModelFolderError:
            return ModelFolderError(f"{config_path}: {message}")

        def section(parent: Any, key: str, where: str) -> Mapping[str, Any]:
            value = parent.get(key) if isinstance(parent, Mapping) else None
            if not isinstance(value, Mapping):
                raise fail(f"missing or malformed section {where}{key!r} (expected an object)")
            return value

        def optional_int(parent: Mapping[str, Any], key: str, where: str, *, minimum: int | None = 1) -> int | None:
            if key not in parent or parent[key] is None:
                return None
            value = parent[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(f"{where}{key} must be an integer, got {value!r}")
            if minimum is not None and value < minimum:
                raise fail(f"{where}{key} must be >= {minimum}, got {value}")
            return value

        def integer(parent: Mapping[str, Any], key: str, where: str, *, minimum: int | None = 1) -> int:
            value = optional_int(parent, key, where, minimum=minimum)
            if value is None:
                raise fail(f"missing {where}{key}")
            return value

        def optional_name(
            parent: Mapping[str, Any], key: str, where: str, default: str | None, *, pattern: bool = False
        ) -> str | None:
            value = parent.get(key, default)
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise fail(f"{where}{key} must be a non-empty string, got {value!r}")
            if pattern:
                try:
                    layer0, layer1 = value % 0, value % 1
                except (TypeError, ValueError) as exc:
                    raise fail(f"{where}{key} must be a name pattern with one %d, got {value!r}") from exc
                if layer0 == layer1:
                    raise fail(f"{where}{key} must be a name pattern with one %d, got {value!r}")
            return value

        def name(parent: Mapping[str, Any], key: str, where: str, default: str, *, pattern: bool = False) -> str:
            value = optional_name(parent, key, where, default, pattern=pattern)
            assert value is not None  # a default is given
            return value

        if not isinstance(raw, Mapping):
            raise fail("the top level must be a JSON object")
        model = section(raw, "model", "")
        decoder_key = "model.decoder."
        decoder = section(model, "decoder", "model.")
        inputs = section(decoder, "inputs", decoder_key)
        outputs = section(decoder, "outputs", decoder_key)
        search = raw.get("search", {})
        if not isinstance(search, Mapping):
            raise fail("section 'search' must be an object")

        filename = optional_name(decoder, "filename", decoder_key, None)
        if filename is None:
            raise fail(f"missing {decoder_key}filename")
        model_path = folder / filename
        if not model_path.is_file():
            raise ModelFolderError(
                f"model folder {folder} lacks {filename}, the decoder named by {CONFIG_NAME} ({decoder_key}filename)"
            )
        tokenizer_path = folder / TOKENIZER_NAME
        if not tokenizer_path.is_file():
            raise ModelFolderError(f"model folder {folder} lacks {TOKENIZER_NAME}")

        eos = model.get("eos_token_id")
        if isinstance(eos, bool) or eos is None:
            raise fail("missing model.eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else eos
        if (
            not isinstance(eos_ids, list)
            or not eos_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids)
        ):
            raise fail(f"model.eos_token_id must be an id or a non-empty list of ids, got {eos!r}")

        num_heads = integer(decoder, "num_attention_heads", decoder_key)
        num_kv_heads = optional_int(decoder, "num_key_value_heads", decoder_key) or num_heads
        hidden_size = optional_int(decoder, "hidden_size", decoder_key)
        head_size = optional_int(decoder, "head_size", decoder_key)
        if head_size is None:
            if hidden_size is None:
                raise fail(f"missing {decoder_key}head_size (and no {decoder_key}hidden_size to derive it from)")
            head_size = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise fail(
                f"{decoder_key}num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        vocab_size = integer(model, "vocab_size", "model.")
        for token_id in eos_ids:
            if token_id >= vocab_size:
                raise fail(f"model.eos_token_id {token_id} is outside the vocabulary of {vocab_size}")

        session_options = decoder.get("session_options", {})
        if not isinstance(session_options, Mapping):
            raise fail(f"{decoder_key}session_options must be an object")
        if not isinstance(session_options.get("provider_options", []), list):
            raise fail(f"{decoder_key}session_options.provider_options must be a list")
        share_buffer = search.get("past_present_share_buffer", False)
        if not isinstance(share_buffer, bool):
            raise fail(f"search.past_present_share_buffer must be true or false, got {share_buffer!r}")

        context_length = integer(model, "context_length", "model.")
        num_layers = integer(decoder, "num_hidden_layers", decoder_key)
        # Keys the builder writes that this backend does not read are still checked, so that a malformed
        # config is refused whichever reader meets it.
        optional_int(model, "bos_token_id", "model.", minimum=0)
        optional_int(model, "pad_token_id", "model.", minimum=0)
        in_inputs, in_outputs = decoder_key + "inputs.", decoder_key + "outputs."
        input_ids_name = name(inputs, "input_ids", in_inputs, "input_ids")
        attention_mask_name = optional_name(inputs, "attention_mask", in_inputs, None)
        position_ids_name = optional_name(inputs, "position_ids", in_inputs, None)
        past_key_pattern = name(inputs, "past_key_names", in_inputs, "past_key_values.%d.key", pattern=True)
        past_value_pattern = name(inputs, "past_value_names", in_inputs, "past_key_values.%d.value", pattern=True)
        logits_name = name(outputs, "logits", in_outputs, "logits")
        present_key_pattern = name(outputs, "present_key_names", in_outputs, "present.%d.key", pattern=True)
        present_value_pattern = name(outputs, "present_value_names", in_outputs, "present.%d.value", pattern=True)
        hidden_states_name = name(outputs, "hidden_states", in_outputs, "hidden_states")
        optional_int(search, "max_length", "search.")  # checked, not read (see above)

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
        )
