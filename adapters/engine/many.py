"""Requests on the batch driver: ``Engine.generate_many`` (many prompts with one set of options) and the pieces any
batched caller shares with it (``batch_request``, ``submit``): continuous batching on the Engine's folder.

Each prompt becomes a request of an ``ortspec.BatchDriver`` over the Engine's batch backend (``OrtBatchBackend``):
the same core options and proposer as ``Engine.generate`` would use, so every result is the prompt's alone. What
differs is only how the passes are shared: one-token rows of every running sequence go through one session run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from ortspec.adapters.engine.options import GenerationOptions, Prompt, make_proposer
from ortspec.batch_driver import BatchDriver, BatchSequence
from ortspec.core import CostAwareWidth, Options, Proposer, WidthPolicy
from ortspec.core.checks import ArgumentError
from ortspec.driver import GenerateResult, StreamCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine


@attrs.frozen
class BatchRequest:
    """One prompt checked for a batch driver (``batch_request``): its token ids, the core's ``Options``, the
    proposer of a batched generation and the ``draft_width`` asked for (resolved by ``submit``)."""

    prompt_tokens: list[int]
    options: Options
    proposer: Proposer | None
    draft_width: object


def batch_request(engine: Engine, prompt: Prompt, options: GenerationOptions) -> BatchRequest:
    """``prompt`` with ``options`` checked as ``Engine.generate`` checks them (``ValueError`` naming a bad one; a seed
    drawn when sampling without one); nothing is measured or run."""
    proposer = _batch_proposer(options.speculative)
    ids, core_options = engine.prepare(prompt, options)
    return BatchRequest(ids, core_options, proposer, options.draft_width)


def submit(
    engine: Engine, driver: BatchDriver, request: BatchRequest, callback: StreamCallback | None = None
) -> BatchSequence:
    """``request`` on ``driver`` (a driver over ``engine.batch_backend()``), decoded as ``Engine.generate`` would
    decode it alone; ``draft_width="auto"`` measures the Engine's verify costs once (``BackendError`` if that
    fails). The caller drives the passes and holds the Engine's lock while it does."""
    width = _width(engine, request.proposer, request.draft_width)
    return driver.submit(
        request.prompt_tokens,
        request.options,
        request.proposer,
        draft_width=width,
        detokenize=engine.tokenizer.decode,
        callback=callback,
    )


def generate_many(engine: Engine, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
    """See ``Engine.generate_many``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ArgumentError("prompts", f"prompts must be a list of prompts, got {type(prompts).__name__}")
    requests = [batch_request(engine, prompt, options) for prompt in prompts]
    with engine._lock:  # the measurements and the batch backend are the Engine's
        driver = BatchDriver(engine.batch_backend())
        sequences = [submit(engine, driver, request) for request in requests]
        driver.run()
    for sequence in sequences:
        if sequence.error is not None:
            raise sequence.error
    return [sequence.result() for sequence in sequences]


def _batch_proposer(speculative: object) -> Proposer | None:
    """The proposer of a batched generation: prompt lookup for ``"auto"`` (the drafter reads one sequence's KV, so
    it does not run in batches); ``"shared-kv"`` is refused."""
    if speculative == "shared-kv":
        raise ArgumentError("speculative", "speculative='shared-kv': the shared-KV drafter does not run in batches")
    return make_proposer("prompt-lookup" if speculative == "auto" else speculative)  # type: ignore[arg-type]


def _width(engine: Engine, proposer: Proposer | None, draft_width: object) -> int | WidthPolicy:
    """The width policy a sequence starts with: ``"auto"`` is the cost-aware policy on this backend's measured
    verify costs (measured once, as for ``generate``)."""
    if proposer is None:
        return 1
    if draft_width == "auto":
        return CostAwareWidth(engine.pass_costs())
    assert not isinstance(draft_width, str)
    return draft_width  # type: ignore[return-value]
