"""The Engine and what it needs around it, by role.

- ``engine.py``: ``Engine`` (a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API).
- ``options.py``: ``GenerationOptions``, the keywords of every generation method (declared once, from the core's
  ``Limits`` and ``Sampling`` and the Engine's own), and the proposers ``speculative`` names.
- ``surfaces.py``: those declarations as the command line's flags and the server's request fields.
- ``shared.py``: shared passes: an Engine opened with ``batch_slots`` runs calls from many threads on its one
  ``BatchScheduler`` (``shares_passes``: which calls; ``EngineClosed``).
- ``tokenizer.py``: ``Tokenizer`` (tokenizer.json and the folder's chat template; ``check_tokenizer_fits``).
- ``measurements.py``: measuring a backend (the verify cost curve, the verify drift, a drafter's step) and the one
  on-disk cache for them.
- ``cache.py``: the cache folder (models, drafters, measurements).
"""

from ortspec.adapters.engine.options import GenerationOptions

__all__ = ["Engine", "GenerationOptions", "GenerationSuperseded"]


def __getattr__(name: str):
    if name in ("Engine", "GenerationSuperseded"):  # imported on first use: they load onnxruntime and tokenizers
        from ortspec.adapters.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ortspec.adapters.engine' has no attribute {name!r}")
