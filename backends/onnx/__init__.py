"""The ONNX Runtime backend: ``OrtBackend`` on a folder written by the onnxruntime-genai model builder.

Its parts, each knowing only its own concern: ``folder`` (reading and validating the model folder), ``session``
(session options and opening the session), ``graph`` (checking the graph against the folder), ``arrays`` (device
buffers and the argmax/margin reductions) and ``backend`` (``OrtBackend``, the protocol on top of them).
"""

from .arrays import argmax_margin
from .backend import DEFAULT_PREFILL_CHUNK, OrtBackend
from .folder import ModelFileError, ModelFolder, ModelFolderError
from .session import make_session_options, physical_cores

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "ModelFileError",
    "ModelFolder",
    "ModelFolderError",
    "OrtBackend",
    "argmax_margin",
    "make_session_options",
    "physical_cores",
]
