"""Tiny random-weight models of every architecture the onnxruntime-genai 0.18 builder writes for the CPU.

:func:`make_tiny_arch_model` builds one: the architecture's transformers config class with tiny sizes (nothing is
downloaded), random weights, the tiny byte-level BPE tokenizer of :func:`tests.support.models.make_tiny_model`,
saved with ``save_pretrained`` and exported by the builder at a precision (``fp32``, ``int8`` and ``int4`` for the
CPU execution provider, ``fp16`` for CUDA; a float16 folder also runs on the CPU). ``scripts/arch_matrix.py``
runs every architecture at every precision through ortspec; ``tests/test_architectures.py`` runs a few in CI.

Each :class:`TinyArch` says what it builds and where the builder needed help (``note``):

* Gemma 3: transformers 5 keeps one RoPE setting per layer type (``rope_parameters = {"sliding_attention": ...,
  "full_attention": ...}``); the builder reads ``rope_parameters["rope_type"]`` and ``rope_local_base_freq``
  (transformers 4's layout) and fails with ``KeyError: 'rope_type'``. The config hook gives it that layout.
* SmolLM3: the builder fails on the no-RoPE layers real SmolLM3 checkpoints have (every 4th layer;
  ``KeyError: 'position_ids'``), so the tiny model has RoPE on every layer.
* Granite-MoE-Hybrid: the builder exports only attention layers (a ``mamba`` layer fails with ``'NoneType' object
  has no attribute 'q_proj'``), so the tiny model has attention layers only (no recurrent state).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.adapters.tools.convert import (
    BUILDER_EXTRA_OPTIONS,
    is_complete,
    publish_folder,
    require_convert_packages,
    resolve_accuracy_level,
)

from .models import TINY_SPECIAL_TOKENS, quiet, run_builder_in_process, train_tiny_tokenizer

# (precision, builder execution provider): the targets the builder supports that these tests run on the CPU
ARCH_PRECISIONS = {"fp32": "cpu", "fp16": "cuda", "int8": "cpu", "int4": "cpu"}
TINY_WINDOW = 32  # sliding window of the windowed architectures: shorter than the tests' sequences


def _flatten_rope_per_layer_type(config: Any) -> None:
    """Gemma 3 under transformers 5: per-layer-type RoPE settings -> the layout the builder reads."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        config.rope_local_base_freq = params["sliding_attention"]["rope_theta"]
        config.rope_parameters = dict(params["full_attention"])


@attrs.frozen
class TinyArch:
    """One architecture: ``label`` (for tables), the transformers ``config_class`` / ``model_class`` names,
    ``config`` (keywords over the common tiny sizes), an optional ``config_hook`` for the builder (see the module
    docstring), and ``note`` (what differs from a real checkpoint, or why)."""

    label: str
    config_class: str
    model_class: str
    config: Mapping[str, Any] = attrs.field(factory=dict)
    config_hook: Callable[[Any], None] | None = None
    note: str = ""
    sliding_window: bool = False  # the config names a sliding window
    recurrent_state: bool = False  # some layers carry a recurrent state instead of a KV cache


ARCHITECTURES: dict[str, TinyArch] = {
    "llama": TinyArch("Llama", "LlamaConfig", "LlamaForCausalLM"),
    "mistral": TinyArch(
        "Mistral",
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": TINY_WINDOW},
        note="the builder writes window_size 32 into genai_config.json but local_window_size -1 into the graph",
        sliding_window=True,
    ),
    "qwen2": TinyArch("Qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": TinyArch("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": None}),
    "phi3": TinyArch("Phi-3", "Phi3Config", "Phi3ForCausalLM", {"original_max_position_embeddings": None}),
    "gemma2": TinyArch(
        "Gemma 2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": None, "sliding_window": TINY_WINDOW},
        sliding_window=True,
    ),
    "gemma3": TinyArch(
        "Gemma 3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": None,
            "sliding_window": TINY_WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
        config_hook=_flatten_rope_per_layer_type,
        note="config hook: the builder reads transformers 4's RoPE layout",
        sliding_window=True,
    ),
    "granite": TinyArch(
        "Granite",
        "GraniteConfig",
        "GraniteForCausalLM",
        {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    ),
    "olmo": TinyArch("OLMo", "OlmoConfig", "OlmoForCausalLM"),
    "smollm3": TinyArch(
        "SmolLM3",
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 1], "use_sliding_window": False},
        note="RoPE on every layer: the builder fails on SmolLM3's no-RoPE layers",
    ),
    "lfm2": TinyArch(
        "LFM2 (hybrid: conv state)",
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "block_multiple_of": 32},
        recurrent_state=True,
    ),
    "granitemoehybrid": TinyArch(
        "Granite-MoE-Hybrid",
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            "layer_types": ["attention", "attention"],
            "num_local_experts": 0,
            "shared_intermediate_size": None,
            "position_embedding_type": "rope",
        },
        note="attention layers only: the builder cannot export its mamba layers",
    ),
}


def tiny_config(arch: str, *, hidden: int = 64, layers: int = 2, context: int = 256, vocab: int = 384) -> Any:
    """The transformers config of the tiny ``arch`` model (4 heads, 2 KV heads, intermediate 2 x hidden)."""
    import transformers

    spec = ARCHITECTURES[arch]
    heads = 4
    values: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "bos_token_id": 1,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    sized = {
        "head_dim": hidden // heads,
        "original_max_position_embeddings": context,
        "shared_intermediate_size": 2 * hidden,
    }
    for key, value in spec.config.items():
        values[key] = sized[key] if value is None else value
    return getattr(transformers, spec.config_class)(**values)


def make_tiny_arch_model(
    out_dir: str | os.PathLike[str],
    arch: str,
    precision: str = "fp32",
    *,
    hidden: int = 64,
    seed: int = 0,
    accuracy_level: int | None = None,
    hf_dir: str | os.PathLike[str] | None = None,
    hidden_states: bool = True,
) -> Path:
    """Build the tiny random-weight ``arch`` model (see :data:`ARCHITECTURES`) at ``precision`` into ``out_dir``.

    Weights come from ``torch.manual_seed(seed)`` (the LM head scaled by 10, as in ``make_tiny_model``, so that
    argmaxes are well separated); the tokenizer is ``make_tiny_model``'s (vocabulary 384). Quantized precisions
    use the builder's MatMulNBits accuracy level (4 on the CPU) unless ``accuracy_level`` is given. ``hf_dir``:
    also keep the Hugging Face checkpoint there (to compare with transformers). ``hidden_states``: the graph also
    outputs the final norm's output (``BUILDER_EXTRA_OPTIONS``, as ``ortspec convert`` makes it, what a shared-KV
    drafter reads); False builds the graph without it. Idempotent; returns ``out_dir``.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if precision not in ARCH_PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(ARCH_PRECISIONS)}, got {precision!r}")
    dest = Path(out_dir)
    keep = Path(hf_dir) if hf_dir is not None else None
    if is_complete(dest, hidden_states=hidden_states) and (keep is None or (keep / "config.json").is_file()):
        return dest
    require_convert_packages(("torch", "transformers", "onnx", "onnxruntime_genai"))
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    spec = ARCHITECTURES[arch]
    extra = list(BUILDER_EXTRA_OPTIONS) if hidden_states else []
    if precision in ("int8", "int4") and accuracy_level is not None:
        extra.append(f"accuracy_level={resolve_accuracy_level(precision, accuracy_level)}")
    tok = train_tiny_tokenizer(384)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=TINY_SPECIAL_TOKENS[1],
        eos_token=TINY_SPECIAL_TOKENS[0],
        pad_token=TINY_SPECIAL_TOKENS[0],
    )
    config = tiny_config(arch, hidden=hidden, vocab=tok.get_vocab_size())
    torch.manual_seed(seed)
    with torch.no_grad():
        model = getattr(transformers, spec.model_class)(config)
        model.lm_head.weight.mul_(10.0)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"ortspec-tiny-{arch}-") as tmp_str:
        tmp = Path(tmp_str)
        hf = tmp / "hf"
        with quiet():
            model.save_pretrained(str(hf))
            fast.save_pretrained(str(hf))
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(hf, keep)
        if is_complete(dest, hidden_states=hidden_states):
            return dest
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
        level = quantizer_log.level
        quantizer_log.setLevel(logging.WARNING)  # it logs every node at INFO
        try:
            run_builder_in_process(
                hf,
                staged,
                precision,
                tmp / "builder-cache",
                provider=ARCH_PRECISIONS[precision],
                extra_options=extra,
                config_hook=spec.config_hook,
            )
            return publish_folder(staged, dest, hidden_states=hidden_states)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        finally:
            quantizer_log.setLevel(level)
