"""ONNX Runtime sessions: thread counts, ``SessionOptions`` from a folder's settings, the execution providers
(with the CUDA library preload), onnxruntime's log messages, and opening one decoder's ``InferenceSession``.

``onnxruntime`` is imported inside the functions, so importing this module stays cheap.

Logging: left alone, onnxruntime writes its own ANSI-coloured lines to stderr (e.g. a kernel's error when a run
fails, beside the exception that already says it). Opening a session changes nothing process-wide: an application
that wants those lines in Python's logging calls :func:`route_onnxruntime_logging` once at start-up (the
``ortspec`` command and ``ortspec serve`` do), which sends them to the Python logger ``ortspec.onnxruntime``, at
the matching level, where the application decides what to show; that logger has a ``NullHandler``, so nothing
reaches stderr unless logging is configured. Messages from onnxruntime's own worker threads still go to its
stderr sink (its callback only runs on Python threads); ortspec runs sessions with one inter-op thread and logs
at error level, which they do not use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..base import BackendError
from .folder import ModelFileError, external_data_problem

logger = logging.getLogger(__name__)

ORT_LOGGER = logging.getLogger("ortspec.onnxruntime")
ORT_LOGGER.addHandler(logging.NullHandler())  # a library's log: shown only where the application configures it
# onnxruntime severities (0 verbose .. 4 fatal) -> Python logging levels
ORT_LOG_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_logging_routed = False

# ``graph_optimization_level`` argument -> ``onnxruntime.GraphOptimizationLevel`` member name
GRAPH_OPTIMIZATION_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "layout": "ORT_ENABLE_LAYOUT",
    "all": "ORT_ENABLE_ALL",
}


def check_graph_optimization_level(level: str) -> str:
    """``level`` in lower case; ``ValueError`` unless it is one of :data:`GRAPH_OPTIMIZATION_LEVELS`."""
    lowered = level.lower() if isinstance(level, str) else level
    if lowered not in GRAPH_OPTIMIZATION_LEVELS:
        raise ValueError(f"graph_optimization_level must be one of {sorted(GRAPH_OPTIMIZATION_LEVELS)}, got {level!r}")
    return lowered


def physical_cores() -> int:
    """Physical CPU cores: psutil if installed, else distinct (physical id, core id) pairs in /proc/cpuinfo, else
    ``os.cpu_count()`` (logical processors), else 1."""
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
        if count:
            return int(count)
    except Exception:  # noqa: BLE001 - psutil is optional
        pass
    try:
        cores: set[tuple[str, str]] = set()
        package_id = core_id = ""
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    package_id = value.strip()
                elif key == "core id":
                    core_id = value.strip()
                elif not key:  # a blank line ends one logical processor
                    if core_id:
                        cores.add((package_id, core_id))
                    package_id = core_id = ""
        if core_id:
            cores.add((package_id, core_id))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


def make_session_options(
    *,
    threads: int | None = None,
    inter_op_threads: int | None = None,
    graph_optimization_level: str = "all",
    allow_spinning: bool | None = None,
    enable_mem_pattern: bool | None = None,
    enable_cpu_mem_arena: bool | None = None,
    config_entries: Mapping[str, str] | None = None,
    genai_session_options: Mapping[str, Any] | None = None,
):
    """Build ``onnxruntime.SessionOptions`` for one decoder (sequential execution).

    ``threads`` (intra-op) defaults to :func:`physical_cores`, ``inter_op_threads`` to 1. ``genai_session_options``
    is the folder's ``model.decoder.session_options``: its thread counts, log settings, memory flags and
    ``config_entries`` apply first, and explicit arguments here override them. ``graph_optimization_level`` is
    one of :data:`GRAPH_OPTIMIZATION_LEVELS` (``ValueError`` otherwise).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    genai = dict(genai_session_options or {})
    if "log_id" in genai:
        options.logid = str(genai["log_id"])
    if "log_severity_level" in genai:
        options.log_severity_level = int(genai["log_severity_level"])
    else:
        options.log_severity_level = 3  # errors only: ORT warns about every node it leaves on the CPU
    if genai.get("enable_profiling"):
        options.enable_profiling = True
    if "enable_cpu_mem_arena" in genai:
        options.enable_cpu_mem_arena = bool(genai["enable_cpu_mem_arena"])
    if "enable_mem_pattern" in genai:
        options.enable_mem_pattern = bool(genai["enable_mem_pattern"])
    for key, value in dict(genai.get("config_entries", {}) or {}).items():
        options.add_session_config_entry(str(key), str(value))

    options.intra_op_num_threads = (
        int(threads) if threads is not None else int(genai.get("intra_op_num_threads") or physical_cores())
    )
    if inter_op_threads is None:
        inter_op_threads = int(genai.get("inter_op_num_threads") or 1)
    options.inter_op_num_threads = int(inter_op_threads)
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    level = check_graph_optimization_level(graph_optimization_level)
    level_enum = getattr(ort.GraphOptimizationLevel, GRAPH_OPTIMIZATION_LEVELS[level], None)
    if level_enum is None:  # older onnxruntime without ORT_ENABLE_LAYOUT
        level_enum = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.graph_optimization_level = level_enum
    if allow_spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "1" if allow_spinning else "0")
    if enable_mem_pattern is not None:
        options.enable_mem_pattern = enable_mem_pattern
    if enable_cpu_mem_arena is not None:
        options.enable_cpu_mem_arena = enable_cpu_mem_arena
    for key, value in dict(config_entries or {}).items():
        options.add_session_config_entry(str(key), str(value))
    return options


def _log_from_onnxruntime(severity: int, category: str, logid: str, code_location: str, message: str) -> None:
    """onnxruntime's logging callback: one record on ``ortspec.onnxruntime`` (its session's log id, the code
    location and the category go into the record's ``ort_*`` attributes)."""
    ORT_LOGGER.log(
        ORT_LOG_LEVELS.get(int(severity), logging.ERROR),
        "%s",
        _ANSI.sub("", str(message)),
        extra={"ort_logid": logid, "ort_category": category, "ort_code_location": code_location},
    )


def route_onnxruntime_logging() -> bool:
    """Send onnxruntime's log messages to the Python logger ``ortspec.onnxruntime`` (see the module docstring),
    at warning severity and above: a process-wide setting, for an application's start-up (call it before the
    first session opens). Once per process: an application that installs its own callback afterwards
    (``onnxruntime.set_default_logger_callback``) keeps it. Returns False when this onnxruntime has no logging
    callback (older versions); its messages then go to onnxruntime's own stderr sink."""
    global _logging_routed
    import onnxruntime as ort

    if _logging_routed:
        return True
    if not hasattr(ort, "set_default_logger_callback"):
        return False
    ort.set_default_logger_callback(_log_from_onnxruntime, 2)
    _logging_routed = True
    return True


_cuda_libraries_preloaded = False


def preload_cuda_libraries(ort) -> None:
    """Let onnxruntime-gpu find CUDA libraries installed as nvidia-* pip packages (``onnxruntime.preload_dlls``).

    Once per process, best effort: a failure is logged at debug level and the session creation reports the real
    problem."""
    global _cuda_libraries_preloaded
    if _cuda_libraries_preloaded or not hasattr(ort, "preload_dlls"):
        return
    _cuda_libraries_preloaded = True
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ort.preload_dlls()
    except Exception as exc:  # noqa: BLE001 - best effort: the session creation reports the real failure
        logger.debug("onnxruntime.preload_dlls() failed: %s", exc)


def execution_providers(provider: str, device_id: int, cuda_options: Mapping[str, str] | None = None) -> list:
    """The ``providers`` list for ``InferenceSession``: ``"cpu"`` -> the CPU provider; ``"cuda"`` -> CUDA on
    ``device_id`` with the CPU for nodes CUDA lacks, after preloading the CUDA libraries. ``cuda_options`` are
    further CUDA provider options (strings), e.g. ``enable_cuda_graph`` and ``user_compute_stream`` (see
    :func:`cuda_provider_options`). Raises ``BackendError`` when this onnxruntime has no CUDA execution provider."""
    import onnxruntime as ort

    if provider != "cuda":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise BackendError(
            "provider='cuda' but this onnxruntime has no CUDAExecutionProvider (available: "
            + ", ".join(available)
            + "); install onnxruntime-gpu (pip install 'ortspec[cuda]')"
        )
    preload_cuda_libraries(ort)
    options = {"device_id": str(device_id), **{str(k): str(v) for k, v in dict(cuda_options or {}).items()}}
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def cuda_provider_options(*, stream: int | None = None, cuda_graphs: bool = False) -> dict[str, str]:
    """CUDA provider options of the stream-ordered path: ``user_compute_stream`` (ONNX Runtime runs its kernels on
    that stream, the one the backend's array module enqueues its copies on, so neither side waits for the other
    on the host) and ``enable_cuda_graph`` (captured graphs per ``gpu_graph_id``; see ``cuda_graphs.py``)."""
    options: dict[str, str] = {}
    if stream is not None:
        options["user_compute_stream"] = str(int(stream))
    if cuda_graphs:
        options["enable_cuda_graph"] = "1"
    return options


# session config key: where a model given as bytes finds its external data files
EXTERNAL_DATA_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def open_session(model_path: Path, *, providers: list, session_options, model_bytes: bytes | None = None):
    """Open ``model_path`` as an ``InferenceSession`` (or, when ``model_bytes`` is given, that serialized model,
    a load-time rewrite of ``model_path`` whose external data lies beside it). Raises ``ModelFileError`` (a
    ``ModelFolderError``) naming the file when it cannot be loaded because of the folder (not an ONNX model;
    external data missing or truncated), ``BackendError`` when onnxruntime cannot load it otherwise, or when
    ``providers`` asks for CUDA and the session did not get it (its CUDA libraries failed to load)."""
    import onnxruntime as ort

    try:
        if model_bytes is None:
            session = ort.InferenceSession(str(model_path), sess_options=session_options, providers=providers)
        else:
            session_options.add_session_config_entry(EXTERNAL_DATA_FOLDER_KEY, str(Path(model_path).parent))
            session = ort.InferenceSession(model_bytes, sess_options=session_options, providers=providers)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        problem = external_data_problem(model_path)
        if problem is not None:
            raise ModelFileError(f"{problem} [onnxruntime: {exc}]") from exc
        raise BackendError(f"onnxruntime could not load {model_path}: {exc}") from exc
    wants_cuda = any(
        (entry[0] if isinstance(entry, tuple) else entry) == "CUDAExecutionProvider" for entry in providers
    )
    if wants_cuda and "CUDAExecutionProvider" not in session.get_providers():
        raise BackendError(
            f"the session for {model_path} did not get the CUDA execution provider: onnxruntime could "
            "not load its CUDA libraries (CUDA/cuBLAS of the major version this onnxruntime-gpu was built for, "
            "e.g. the nvidia-* pip packages that torch installs)"
        )
    return session
