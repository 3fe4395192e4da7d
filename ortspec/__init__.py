"""ortspec: exact, fast speculative decoding for ONNX Runtime.

``generate`` is the decode loop over any backend; ``Engine`` and ``GenerationOptions`` (from ``ortspec.adapters``,
imported on first use: they load onnxruntime and tokenizers) wrap a model folder.
"""

from ortspec.backends.base import Backend, BackendError
from ortspec.core import (
    MAX_DRAFT,
    AdditiveWidth,
    Commit,
    CostAwareWidth,
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
from ortspec.driver import (
    GenerateResult,
    Generation,
    GenerationAborted,
    GenerationError,
    ProposerError,
    StreamCallback,
    Timings,
    generate,
)

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "MAX_DRAFT",
    "AdditiveWidth",
    "Backend",
    "BackendError",
    "Commit",
    "CostAwareWidth",
    "Engine",
    "FinishReason",
    "FixedWidth",
    "GenerateResult",
    "Generation",
    "GenerationAborted",
    "GenerationError",
    "GenerationOptions",
    "GenerationSuperseded",
    "Learner",
    "Limits",
    "LookupOrDraft",
    "ModelFolderError",
    "Options",
    "PromptLookup",
    "Proposer",
    "ProposerError",
    "Sampling",
    "Stats",
    "StreamCallback",
    "Timings",
    "TokenLogprob",
    "WidthPolicy",
    "generate",
]

_LAZY = {
    "Engine": ("ortspec.adapters.engine", "Engine"),
    "GenerationOptions": ("ortspec.adapters.engine", "GenerationOptions"),
    "GenerationSuperseded": ("ortspec.adapters.engine", "GenerationSuperseded"),
    "ModelFolderError": ("ortspec.backends.onnx", "ModelFolderError"),
}


def __getattr__(name: str):
    if name in _LAZY:  # imported on first use: they load onnxruntime and tokenizers
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'ortspec' has no attribute {name!r}")
