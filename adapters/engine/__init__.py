"""The Engine and what it needs around it, by role.

- ``engine.py``: ``Engine`` (a model folder loaded, and the one scheduler that owns its batch backend, behind the
  ``onnx_genai.Engine`` API).
- ``requests.py``: a prompt and its options made ready for the scheduler (``make_request``: the one path).
- ``calls.py``: a call on the scheduler consumed on the caller's thread (``Call``; ``EngineClosed``).
- ``scheduler.py``: ``BatchScheduler``, the batch driver on a thread of its own.
- ``options.py``: ``GenerationOptions``, the keywords of every generation method (declared once, from the core's
  ``Limits`` and ``Sampling`` and the Engine's own).
- ``surfaces.py``: those declarations as the command line's flags and the server's request fields.
- ``tokenizer.py``: ``Tokenizer`` (tokenizer.json and the folder's chat template; ``check_tokenizer_fits``).
- ``measured.py``: ``Measurements``, what an Engine measures of its model; ``measurements.py``: measuring a backend
  (the verify cost curve, the verify drift, a drafter's step) and the one on-disk cache for them.
- ``cache.py``: the cache folder (models, drafters, measurements); ``folders.py``: how a finished folder replaces the
  one at its destination.
- ``shipped.py``: the drafters shipped with the package; ``target_tables.py``: the target's embedding and RoPE tables
  (what a shipped drafter is completed with, and what training reads).
"""

from ortspec.adapters.engine.options import GenerationOptions

__all__ = ["Engine", "EngineClosed", "GenerationOptions"]


def __getattr__(name: str):
    if name == "Engine":  # imported on first use: it loads onnxruntime and tokenizers
        from ortspec.adapters.engine.engine import Engine

        return Engine
    if name == "EngineClosed":
        from ortspec.adapters.engine.calls import EngineClosed

        return EngineClosed
    raise AttributeError(f"module 'ortspec.adapters.engine' has no attribute {name!r}")
