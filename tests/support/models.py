"""Model folders for tests, benchmarks and scripts (not shipped): tiny random-weight Llamas
(:func:`make_tiny_model`) and random-weight models of a real model's shape (:func:`make_random_model`), built by
the onnxruntime-genai builder in the layout ``ortspec convert`` writes (``model.onnx``, ``genai_config.json``,
``tokenizer.json``, ...), with a small byte-level BPE tokenizer trained on standard-library docstrings.

The builder runs in this process by default (:func:`run_builder_in_process`: saves a second torch/transformers
import, seconds per tiny model), or as a subprocess (``ortspec.adapters.tools.convert.run_builder``). In process,
it sets ``TQDM_DISABLE=1`` and quiets the int4/int8 quantizer's logger while it runs, and restores both after.
Needs the ``convert`` extra; nothing of it is imported at module import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ortspec.adapters.tools.convert import (
    BUILDER_EXTRA_OPTIONS,
    ConversionError,
    check_builder_outputs,
    is_complete,
    publish_folder,
    require_convert_packages,
    run_builder,
)

# What make_tiny_model accepts: (precision, execution provider) pairs the builder supports.
TINY_TARGETS = {("fp32", "cpu"), ("int8", "cpu"), ("int4", "cpu"), ("fp32", "cuda"), ("fp16", "cuda")}
# What make_random_model accepts: the same, and int4 (MatMulNBits with 4-bit weights) on CUDA.
RANDOM_TARGETS = TINY_TARGETS | {("int4", "cuda")}
RANDOM_ARCHITECTURES = ("llama", "qwen2")
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: eos/pad, bos, end-of-turn

BUILDER_PATH_ENV = "ORTSPEC_GENAI_BUILDER"


@contextlib.contextmanager
def _builder_quiet() -> Iterator[io.StringIO]:
    """Around an in-process builder run: its stdout and stderr into the yielded buffer, ``TQDM_DISABLE=1``, and the
    onnxruntime int4/int8 quantizer's logger (every node at INFO) at WARNING; all restored on exit."""
    log = io.StringIO()
    quantizer_log = logging.getLogger("onnxruntime.quantization")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.WARNING)
    env_before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield log
    finally:
        quantizer_log.setLevel(level)
        if env_before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = env_before


def run_builder_in_process(
    hf_dir: Path,
    out_dir: Path,
    precision: str,
    cache_dir: Path,
    *,
    provider: str = "cpu",
    extra_options: Sequence[str] = (),
    config_hook: Callable[[Any], None] | None = None,
) -> None:
    """Call the two functions the builder's ``__main__`` calls (see ``run_builder`` for the arguments).
    ``config_hook`` may adjust the Hugging Face config the builder loaded before it exports (see
    ``tests/support/architectures.py``)."""
    builder = builder_module()
    with _builder_quiet() as log:
        try:
            options = builder.parse_extra_options(
                None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), list(extra_options) or None
            )
            if config_hook is not None:
                config_hook(options["hf_details"]["hf_config"])
            builder.create_model(None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), **options)
        except Exception as exc:
            raise ConversionError(f"the onnxruntime-genai builder failed: {exc}\n{log.getvalue()[-2000:]}") from exc
    check_builder_outputs(out_dir)


def _run_builder(
    hf_dir: Path,
    out_dir: Path,
    precision: str,
    cache_dir: Path,
    *,
    in_process: bool,
    provider: str,
    extra_options: Sequence[str],
) -> None:
    if in_process:
        run_builder_in_process(hf_dir, out_dir, precision, cache_dir, provider=provider, extra_options=extra_options)
    else:
        run_builder(hf_dir, out_dir, precision, cache_dir, provider=provider, extra_options=extra_options)


def builder_module():
    """The onnxruntime-genai model builder module: ``onnxruntime_genai.models.builder``, or, when the package
    cannot be imported (not installed, or its native library does not load, as on a GPU machine without the
    matching onnxruntime-genai build), ``builder`` from the folder named by ``$ORTSPEC_GENAI_BUILDER``: a copy of
    the package's pure-Python ``models/`` folder (``scripts/gpu_check.sh --prepare`` carries one)."""
    try:
        from onnxruntime_genai.models import builder

        return builder
    except Exception as exc:  # noqa: BLE001 - ImportError, or the native library failing to load
        where = os.environ.get(BUILDER_PATH_ENV)
        if not where:
            raise ConversionError(
                f"onnxruntime_genai.models.builder is not importable ({type(exc).__name__}: {exc}) and "
                f"${BUILDER_PATH_ENV} names no copy of its models/ folder"
            ) from exc
        if where not in sys.path:
            sys.path.insert(0, where)
        import builder  # the standalone models/builder.py

        return builder


def builder_available() -> bool:
    """Whether a builder can be had (see :func:`builder_module`)."""
    return importlib.util.find_spec("onnxruntime_genai") is not None or bool(os.environ.get(BUILDER_PATH_ENV))


def _tiny_corpus() -> str:
    """A few KB of deterministic English and code-ish text: docstrings of standard-library modules."""
    import collections
    import functools
    import itertools
    import json
    import string
    import textwrap

    parts = [
        mod.__doc__ or ""
        for mod in (collections, functools, itertools, json, string, textwrap, os, subprocess, tempfile, zipfile)
    ]
    parts += [
        fn.__doc__ or ""
        for fn in (sorted, zip, enumerate, print, open, range, map, filter, isinstance, len, round, str.split)
    ]
    return "\n\n".join(p for p in parts if p)


def train_tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_tiny_corpus()], trainer)
    return tok


def quiet() -> contextlib.ExitStack:
    """stdout and stderr into a discarded buffer while the returned context is entered."""
    stack = contextlib.ExitStack()
    sink = io.StringIO()
    stack.enter_context(contextlib.redirect_stdout(sink))
    stack.enter_context(contextlib.redirect_stderr(sink))
    return stack


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int | None = None,
    context: int = 256,
    seed: int = 0,
    precision: str = "fp32",
    execution_provider: str = "cpu",
    in_process_builder: bool = True,
    accuracy_level: int | None = None,
    hidden_states: bool = True,
) -> Path:
    """Build a random-weight Llama folder in the builder's layout (``model.onnx``, ``genai_config.json``, ...).

    The tokenizer is a small byte-level BPE trained on standard-library docstrings (``min(vocab, 512)`` entries,
    384 by default; ids 0/1/2 are ``<|endoftext|>`` (eos, pad), ``<|im_start|>`` (bos) and ``<|im_end|>``). The
    model's vocabulary is ``vocab`` when given (ids the tokenizer never produces are still valid model ids, which
    gives a realistic logits width, e.g. 49152, for speed tests), else the tokenizer's. Weights come from
    ``torch.manual_seed(seed)``: same arguments, same folder.
    ``precision``/``execution_provider`` pick the builder's target (``fp16``/``cuda`` makes a float16 model with
    float16 KV for the CUDA execution provider; it builds without a GPU). Quantized precisions use the builder's
    MatMulNBits accuracy level (4 on the CPU) unless ``accuracy_level`` is given. ``hidden_states``: the graph also
    outputs the final norm's output (:data:`BUILDER_EXTRA_OPTIONS`), as ``ortspec convert`` makes it; False builds
    the graph an older ortspec made (for tests of what refuses it).
    Idempotent like ``convert_smollm2``. The builder runs in this process unless ``in_process_builder`` is
    false (it then runs as a subprocess, a few seconds slower). Returns ``out_dir``.
    """
    if (precision, execution_provider) not in TINY_TARGETS:
        raise ValueError(
            f"(precision, execution_provider) must be one of {sorted(TINY_TARGETS)}, "
            f"got {(precision, execution_provider)}"
        )
    dest = Path(out_dir)
    if is_complete(dest, hidden_states=hidden_states):
        return dest
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    require_convert_packages(("torch", "transformers", "onnx", "onnxruntime_genai"))

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = train_tiny_tokenizer(min(vocab, 512) if vocab is not None else 384)
    n_vocab = max(tok.get_vocab_size(), vocab or 0)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    config = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)
        # Default init is N(0, 0.02): the logits of such a small random model are nearly flat. Widen them a bit
        # so that argmaxes are well separated and tests exercise realistic-looking distributions.
        model.lm_head.weight.mul_(10.0)
    return build_folder(
        model, fast, dest, precision, execution_provider, in_process_builder, accuracy_level, hidden_states
    )


def build_folder(
    model,
    tokenizer,
    dest: Path,
    precision: str,
    provider: str,
    in_process_builder: bool,
    accuracy_level: int | None = None,
    hidden_states: bool = True,
) -> Path:
    """Save ``model`` and ``tokenizer`` as a Hugging Face folder in a temporary directory, run the builder on it
    into a staging folder beside ``dest`` (at MatMulNBits ``accuracy_level`` when given; with the
    ``hidden_states`` output unless ``hidden_states`` is false), and publish that as ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ortspec-tiny-", dir=dest.parent) as tmp_str:
        tmp = Path(tmp_str)
        hf_dir = tmp / "hf"
        with quiet():
            model.save_pretrained(str(hf_dir))
            tokenizer.save_pretrained(str(hf_dir))
        del model
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _run_builder(
                hf_dir,
                staged,
                precision,
                tmp / "builder-cache",
                in_process=in_process_builder,
                provider=provider,
                extra_options=[
                    *(BUILDER_EXTRA_OPTIONS if hidden_states else ()),
                    *([f"accuracy_level={accuracy_level}"] if accuracy_level is not None else []),
                ],
            )
            return publish_folder(staged, dest, hidden_states=hidden_states)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise


def make_random_model(
    out_dir: str | os.PathLike[str],
    *,
    architecture: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    rope_theta: float,
    tie_embeddings: bool,
    context: int,
    rms_norm_eps: float = 1e-6,
    precision: str = "fp32",
    execution_provider: str = "cpu",
    seed: int = 0,
    logit_scale: float = 10.0,
    in_process_builder: bool = True,
) -> Path:
    """Build a random-weight model folder of a given shape with the builder, the way :func:`make_tiny_model` does
    (same tokenizer: a small BPE, with the model's vocabulary widened to ``vocab``), for speed measurements of a
    real model's shape without its weights.

    ``architecture``: ``"llama"`` (``LlamaForCausalLM``: SmolLM2's) or ``"qwen2"`` (``Qwen2ForCausalLM``, with its
    q/k/v biases: Qwen2.5's). The dimensions are the Hugging Face config's (``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``rope_theta``,
    ``tie_word_embeddings``, ``max_position_embeddings`` = ``context``, ``rms_norm_eps``). Weights are the model
    class's default initialisation from ``torch.manual_seed(seed)``, with the final norm scaled by
    ``logit_scale`` so that the logits are spread out and argmaxes well separated. Saved in float16 unless the
    target is fp32. ``precision``/``execution_provider``: one of :data:`RANDOM_TARGETS`. Idempotent. Returns the
    folder.
    """
    if (precision, execution_provider) not in RANDOM_TARGETS:
        raise ValueError(
            f"(precision, execution_provider) must be one of {sorted(RANDOM_TARGETS)}, "
            f"got {(precision, execution_provider)}"
        )
    if architecture not in RANDOM_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {RANDOM_ARCHITECTURES}, got {architecture!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden} must divide by heads={heads}, and heads by kv_heads={kv_heads}")
    dest = Path(out_dir)
    if is_complete(dest):
        return dest
    require_convert_packages(
        ("torch", "transformers", "onnx", *(() if builder_available() else ("onnxruntime_genai",)))
    )

    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    tok = train_tiny_tokenizer(min(vocab, 512))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[architecture]
    config = config_class(
        vocab_size=max(tok.get_vocab_size(), vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        rms_norm_eps=rms_norm_eps,
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(tie_embeddings),
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        model = model_class(config)
        model.model.norm.weight.mul_(float(logit_scale))
        if precision != "fp32":
            model = model.to(torch.float16)
    return build_folder(model, fast, dest, precision, execution_provider, in_process_builder)
