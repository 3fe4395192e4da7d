"""Read an ONNX Runtime GenAI model folder (``genai_config.json`` + ``model.onnx`` + ``tokenizer.json``).

:meth:`ModelFolder.load` validates what a backend needs from the config and returns a frozen value; every
problem is reported as a :class:`ModelFolderError` that names the folder, the file and the offending key.
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
    """What a backend needs to know about one decoder folder written by the onnxruntime-genai builder."""

    path: Path
    model_path: Path  # the decoder's .onnx file
    tokenizer_path: Path
    model_type: str
    vocab_size: int
    context_length: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int | None
    eos_token_ids: tuple[int, ...] = attrs.field(converter=_as_tuple_of_ints)
    bos_token_id: int | None
    pad_token_id: int | None
    # graph input / output names; the KV names are ``%d`` patterns filled with the layer index
    input_ids_name: str
    attention_mask_name: str | None
    position_ids_name: str | None
    past_key_pattern: str
    past_value_pattern: str
    logits_name: str
    present_key_pattern: str
    present_value_pattern: str
    past_present_share_buffer: bool
    search_max_length: int | None
    session_options: Mapping[str, Any] = attrs.field(converter=lambda d: dict(d))
    provider_options: tuple[Any, ...] = attrs.field(converter=tuple)

    # ----------------------------------------------------------------------------------------------------------
    def past_key_name(self, layer: int) -> str:
        return self.past_key_pattern % layer

    def past_value_name(self, layer: int) -> str:
        return self.past_value_pattern % layer

    def present_key_name(self, layer: int) -> str:
        return self.present_key_pattern % layer

    def present_value_name(self, layer: int) -> str:
        return self.present_value_pattern % layer

    @property
    def eos_token_id(self) -> int:
        """The first end-of-sequence id (the config may list several)."""
        return self.eos_token_ids[0]

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
        cfg_path = folder / CONFIG_NAME

        def fail(msg: str) -> ModelFolderError:
            return ModelFolderError(f"{cfg_path}: {msg}")

        def section(parent: Any, key: str, where: str) -> Mapping[str, Any]:
            value = parent.get(key) if isinstance(parent, Mapping) else None
            if not isinstance(value, Mapping):
                raise fail(f"missing or malformed section {where}{key!r} (expected an object)")
            return value

        def integer(
            parent: Mapping[str, Any], key: str, where: str, *, required: bool = True, minimum: int | None = 1
        ) -> int | None:
            if key not in parent or parent[key] is None:
                if required:
                    raise fail(f"missing {where}{key}")
                return None
            value = parent[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail(f"{where}{key} must be an integer, got {value!r}")
            if minimum is not None and value < minimum:
                raise fail(f"{where}{key} must be >= {minimum}, got {value}")
            return value

        def name(
            parent: Mapping[str, Any], key: str, where: str, default: str | None, *, pattern: bool = False
        ) -> str | None:
            value = parent.get(key, default)
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise fail(f"{where}{key} must be a non-empty string, got {value!r}")
            if pattern:
                try:
                    a, b = value % 0, value % 1
                except (TypeError, ValueError) as exc:
                    raise fail(f"{where}{key} must be a name pattern with one %d, got {value!r}") from exc
                if a == b:
                    raise fail(f"{where}{key} must be a name pattern with one %d, got {value!r}")
            return value

        if not isinstance(raw, Mapping):
            raise fail("the top level must be a JSON object")
        model = section(raw, "model", "")
        decoder = section(model, "decoder", "model.")
        w = "model.decoder."
        inputs = section(decoder, "inputs", w)
        outputs = section(decoder, "outputs", w)
        search = raw.get("search", {})
        if not isinstance(search, Mapping):
            raise fail("section 'search' must be an object")

        filename = name(decoder, "filename", w, None)
        if filename is None:
            raise fail(f"missing {w}filename")
        model_path = folder / filename
        if not model_path.is_file():
            raise ModelFolderError(
                f"model folder {folder} lacks {filename}, the decoder named by {CONFIG_NAME} ({w}filename)"
            )
        tokenizer_path = folder / TOKENIZER_NAME
        if not tokenizer_path.is_file():
            raise ModelFolderError(f"model folder {folder} lacks {TOKENIZER_NAME}")

        eos = model.get("eos_token_id")
        if isinstance(eos, bool) or eos is None:
            raise fail("missing model.eos_token_id")
        eos_list = [eos] if isinstance(eos, int) else eos
        if (
            not isinstance(eos_list, list)
            or not eos_list
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list)
        ):
            raise fail(f"model.eos_token_id must be an id or a non-empty list of ids, got {eos!r}")

        num_heads = integer(decoder, "num_attention_heads", w)
        num_kv = integer(decoder, "num_key_value_heads", w, required=False) or num_heads
        hidden = integer(decoder, "hidden_size", w, required=False)
        head_size = integer(decoder, "head_size", w, required=False)
        if head_size is None:
            if hidden is None:
                raise fail(f"missing {w}head_size (and no {w}hidden_size to derive it from)")
            head_size = hidden // num_heads
        if num_heads % num_kv:
            raise fail(f"{w}num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
        vocab = integer(model, "vocab_size", "model.")
        for e in eos_list:
            if e >= vocab:
                raise fail(f"model.eos_token_id {e} is outside the vocabulary of {vocab}")

        session = decoder.get("session_options", {})
        if not isinstance(session, Mapping):
            raise fail(f"{w}session_options must be an object")
        provider_options = session.get("provider_options", [])
        if not isinstance(provider_options, list):
            raise fail(f"{w}session_options.provider_options must be a list")
        share = search.get("past_present_share_buffer", False)
        if not isinstance(share, bool):
            raise fail(f"search.past_present_share_buffer must be true or false, got {share!r}")

        return cls(
            path=folder,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            model_type=str(model.get("type", "")),
            vocab_size=vocab,
            context_length=integer(model, "context_length", "model."),
            num_layers=integer(decoder, "num_hidden_layers", w),
            num_attention_heads=num_heads,
            num_kv_heads=num_kv,
            head_size=head_size,
            hidden_size=hidden,
            eos_token_ids=eos_list,
            bos_token_id=integer(model, "bos_token_id", "model.", required=False, minimum=0),
            pad_token_id=integer(model, "pad_token_id", "model.", required=False, minimum=0),
            input_ids_name=name(inputs, "input_ids", w + "inputs.", "input_ids"),
            attention_mask_name=name(inputs, "attention_mask", w + "inputs.", None),
            position_ids_name=name(inputs, "position_ids", w + "inputs.", None),
            past_key_pattern=name(inputs, "past_key_names", w + "inputs.", "past_key_values.%d.key", pattern=True),
            past_value_pattern=name(
                inputs, "past_value_names", w + "inputs.", "past_key_values.%d.value", pattern=True
            ),
            logits_name=name(outputs, "logits", w + "outputs.", "logits"),
            present_key_pattern=name(outputs, "present_key_names", w + "outputs.", "present.%d.key", pattern=True),
            present_value_pattern=name(
                outputs, "present_value_names", w + "outputs.", "present.%d.value", pattern=True
            ),
            past_present_share_buffer=share,
            search_max_length=integer(search, "max_length", "search.", required=False),
            session_options={k: v for k, v in session.items() if k != "provider_options"},
            provider_options=provider_options,
        )
