"""The ONNX Runtime backend: ``OrtBackend`` on a folder written by the onnxruntime-genai model builder.

Its parts, each knowing only its own concern: ``config`` (``BackendConfig``: how a folder is opened), ``folder``
(reading and validating the model folder), ``session`` (session options, opening the session, routing
onnxruntime's log), ``model_graph`` (checking the graph against the folder; the load-time rewrites), ``arrays``
(device buffers and the argmax/margin reductions), ``kv`` (the KV store), ``binding`` (the IO bindings: default
and static-shape), ``recurrent`` (hybrid models' recurrent states), ``cuda_graphs`` (CUDA graphs per pass width,
the phase timer) and ``backend`` (``OrtBackend``, the protocol composed from them); ``batch``
(``OrtBatchBackend``, the batched protocol on the CPU; ``SlotTarget``, one of its slots as a drafter's target);
``drafter`` (the shared-KV drafter, which reads an ``OrtBackend`` through its ``SharedKvTarget`` protocol; its
folder's format in ``drafter_folder``) and
``slot_drafters`` (``SlotDrafters``: the drafter on a batch backend's slots, one session, one binding per slot).
"""

from .arrays import argmax_margin
from .backend import OrtBackend
from .batch import OrtBatchBackend
from .config import DEFAULT_PREFILL_CHUNK, BackendConfig
from .folder import ModelFileError, ModelFolder, ModelFolderError
from .session import make_session_options, physical_cores, route_onnxruntime_logging

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "BackendConfig",
    "ModelFileError",
    "ModelFolder",
    "ModelFolderError",
    "OrtBackend",
    "OrtBatchBackend",
    "argmax_margin",
    "make_session_options",
    "physical_cores",
    "route_onnxruntime_logging",
]
