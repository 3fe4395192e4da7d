"""Requests on the batch driver: ``Engine.generate_many`` (many prompts with one set of options) and the pieces any
batched caller shares with it (``batch_request``, ``submit``): continuous batching on the Engine's folder.

Each prompt becomes a request of an ``ortspec.BatchDriver`` over the Engine's batch backend (``OrtBatchBackend``):
the same core options and proposer as ``Engine.generate`` would use, so every result is the prompt's alone. What
differs is only how the passes are shared (one-token rows of every running sequence go through one session run)
and, with the Engine's ``prefix_reuse``, how much of a prompt is prefilled (a slot's resident prefix is reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ortspec.adapters.engine.options import GenerationOptions, Prompt, make_proposer
from ortspec.batch_driver import BatchDriver, BatchSequence
from ortspec.core import CostAwareWidth, PricedWidth, Proposer, WidthPolicy
from ortspec.core.checks import ArgumentError
from ortspec.core.forced import forcing
from ortspec.core.state import Options
from ortspec.driver import GenerateResult, StreamCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine


class BatchRequest(NamedTuple):
    """One prompt made ready for the batch driver: what ``BatchDriver.submit`` (or ``BatchScheduler.submit``) takes
    for it, the same core options and proposer as ``Engine.generate`` would use."""

    ids: list[int]
    options: Options
    proposer: Proposer | None
    draft_width: int | WidthPolicy


def batch_request(engine: Engine, prompt: Prompt, options: GenerationOptions) -> BatchRequest:
    """``prompt`` with ``options`` made ready for a batched pass on ``engine``'s folder (``ValueError`` naming a bad
    prompt or option; ``speculative="shared-kv"`` is refused, ``"auto"`` is prompt lookup). A speculative request
    with ``draft_width="auto"`` measures the verify cost curve the first time (as ``generate`` does)."""
    proposer = batch_proposer(options.speculative)
    ids, core_options = engine.prepare(prompt, options)
    width = batch_width(engine, proposer, options.draft_width)
    return BatchRequest(ids, core_options, forcing(proposer, core_options, len(ids)), width)


def submit(
    engine: Engine, driver: BatchDriver, request: BatchRequest, callback: StreamCallback | None = None
) -> BatchSequence:
    """``request`` on ``driver`` (a driver over ``engine.batch_backend()``: ``batch_driver``), decoded as
    ``Engine.generate`` would decode it alone. The caller drives the passes and holds the Engine's lock while it
    does."""
    return driver.submit(
        request.ids,
        request.options,
        request.proposer,
        draft_width=request.draft_width,
        detokenize=engine.tokenizer.decode,
        callback=callback,
    )


def batch_driver(engine: Engine, *, priced: bool = True) -> BatchDriver:
    """A driver over the Engine's batch backend, reusing cached prefixes as the Engine's ``prefix_reuse`` says;
    ``priced``: give it the backend's measured ``decode_costs`` (measured once, kept on disk), so a ``PricedWidth``
    policy (``draft_width="auto"``) speculates less as the batch fills (other widths ignore them)."""
    return BatchDriver(
        engine.batch_backend(),
        decode_costs=engine.batch_decode_costs() if priced else None,
        prefix_reuse=engine.prefix_reuse,
    )


def generate_many(engine: Engine, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
    """See ``Engine.generate_many``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ArgumentError("prompts", f"prompts must be a list of prompts, got {type(prompts).__name__}")
    return generate_requests(engine, [batch_request(engine, prompt, options) for prompt in prompts])


def generate_requests(engine: Engine, requests: Sequence[BatchRequest]) -> list[GenerateResult]:
    """Every request (``batch_request``: each with its own options) on one batch driver of ``engine``, run until
    all are done; their results in order, each what ``Engine.generate`` gives it alone. The first failure raises
    (``GenerationError`` with its partial result)."""
    with engine._lock:  # the measurements and the batch backend are the Engine's
        driver = batch_driver(engine, priced=any(isinstance(r.draft_width, PricedWidth) for r in requests))
        sequences = [submit(engine, driver, request) for request in requests]
        driver.run()
    for sequence in sequences:
        if sequence.error is not None:
            raise sequence.error
    return [sequence.result() for sequence in sequences]


def batch_proposer(speculative: object) -> Proposer | None:
    """The proposer of a batched generation: prompt lookup for ``"auto"`` (the drafter reads one sequence's KV, so
    it does not run in batches); ``"shared-kv"`` is refused."""
    if speculative == "shared-kv":
        raise ArgumentError("speculative", "speculative='shared-kv': the shared-KV drafter does not run in batches")
    return make_proposer("prompt-lookup" if speculative == "auto" else speculative)  # type: ignore[arg-type]


def batch_width(engine: Engine, proposer: Proposer | None, draft_width: object) -> int | WidthPolicy:
    """The width policy every sequence starts with: ``"auto"`` is the cost-aware policy on this backend's measured
    verify costs (measured once, as for ``generate``)."""
    if proposer is None:
        return 1
    if draft_width == "auto":
        return CostAwareWidth(engine.pass_costs())
    assert not isinstance(draft_width, str)
    return draft_width  # type: ignore[return-value]
