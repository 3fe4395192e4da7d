"""ortspec: exact, fast speculative decoding for ONNX Runtime.

``generate`` is the decode loop over any backend; ``Engine`` (from ``ortspec.adapters``) wraps a model folder.
"""

from ortspec.backends.base import Backend, BackendError
from ortspec.core import (
    Commit,
    FinishReason,
    FixedWidth,
    Options,
    PromptLookup,
    Proposer,
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
    Timings,
    generate,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendError",
    "Commit",
    "Engine",
    "FinishReason",
    "FixedWidth",
    "GenerateResult",
    "Generation",
    "GenerationAborted",
    "GenerationError",
    "Options",
    "PromptLookup",
    "ProposerError",
    "Proposer",
    "Stats",
    "Timings",
    "TokenLogprob",
    "WidthPolicy",
    "generate",
]


def __getattr__(name: str):
    if name == "Engine":  # imported lazily: it loads onnxruntime and tokenizers
        from ortspec.adapters.engine import Engine

        return Engine
    raise AttributeError(f"module 'ortspec' has no attribute {name!r}")
