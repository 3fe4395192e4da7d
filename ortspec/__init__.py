"""ortspec: exact, fast speculative decoding for ONNX Runtime.

``generate`` is the decode loop over any backend; ``Engine`` and ``GenerationOptions`` (from ``ortspec.adapters``,
imported on first use: they load onnxruntime and tokenizers) wrap a model folder.
"""

from ortspec.backends.base import Backend, BackendError, BatchBackend, BatchRow
from ortspec.batch_driver import BatchDriver, BatchSequence
from ortspec.core import (
    MAX_DRAFT,
    AdditiveWidth,
    Commit,
    CostAwareWidth,
    DraftContext,
    DraftTree,
    FinishReason,
    FixedWidth,
    Learner,
    Limits,
    LookupOrDraft,
    Options,
    PromptLookup,
    Proposer,
    Sampling,
    Stats,
    TokenLogprob,
    WidthPolicy,
)
from ortspec.core.checks import ArgumentError
from ortspec.driver import (
    GenerateResult,
    Generation,
    GenerationAborted,
    GenerationError,
    ProposerError,
    Speculation,
    StreamCallback,
    Timings,
    generate,
)

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "MAX_DRAFT",
    "AdditiveWidth",
    "ArgumentError",
    "Backend",
    "BackendConfig",
    "BackendError",
    "BatchBackend",
    "BatchDriver",
    "BatchRow",
    "BatchSequence",
    "Commit",
    "CostAwareWidth",
    "DraftContext",
    "DraftTree",
    "Engine",
    "EngineClosed",
    "FinishReason",
    "FixedWidth",
    "GenerateResult",
    "Generation",
    "GenerationAborted",
    "GenerationError",
    "GenerationOptions",
    "Learner",
    "Limits",
    "LookupOrDraft",
    "ModelFolderError",
    "Options",
    "PromptLookup",
    "Proposer",
    "ProposerError",
    "Speculation",
    "Sampling",
    "Stats",
    "StreamCallback",
    "Timings",
    "TokenLogprob",
    "WidthPolicy",
    "generate",
]

_LAZY = {
    "Engine": ("ortspec.adapters.engine.engine", "Engine"),
    "EngineClosed": ("ortspec.adapters.engine.calls", "EngineClosed"),
    "GenerationOptions": ("ortspec.adapters.engine.options", "GenerationOptions"),
    "ModelFolderError": ("ortspec.backends.onnx", "ModelFolderError"),
    "BackendConfig": ("ortspec.backends.onnx", "BackendConfig"),
}


def __getattr__(name: str):
    if name in _LAZY:  # imported on first use: they load onnxruntime and tokenizers
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'ortspec' has no attribute {name!r}")
