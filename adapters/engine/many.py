"""Requests on the batch driver: ``Engine.generate_many`` (many prompts with one set of options) and the pieces any
batched caller shares with it (``batch_request``, ``submit``): continuous batching on the Engine's folder.

Each prompt becomes a request of an ``ortspec.BatchDriver`` over the Engine's batch backend (``OrtBatchBackend``):
the same core options and proposer as ``Engine.generate`` would use, so every result is the prompt's alone. What
differs is only how the passes are shared (one-token rows of every running sequence go through one session run)
and, with the Engine's ``prefix_reuse``, how much of a prompt is prefilled (a slot's resident prefix is reused).

The shared-KV drafter (``"shared-kv"``, and ``"auto"``'s drafter) is priced once per request as ``generate``
prices it (the Engine's measured verify costs and draft cost), then bound to the slot the request takes: the
request carries a ``SlotProposer`` that puts ``Engine.slot_drafters().for_slot(slot)`` where the Engine's own
drafter was (``bound_to_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import attrs

from ortspec.adapters.engine.options import GenerationOptions, Prompt
from ortspec.batch_driver import BatchDriver, BatchSequence, SlotProposer
from ortspec.core import LookupOrDraft, PricedProposer, PricedWidth, Proposer, WidthPolicy
from ortspec.core.checks import ArgumentError
from ortspec.core.forced import forcing
from ortspec.core.state import Options
from ortspec.driver import FinishCallback, GenerateResult, StreamCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine
    from ortspec.backends.onnx.slot_drafters import SlotDrafters


class BatchRequest(NamedTuple):
    """One prompt made ready for the batch driver: what ``BatchDriver.submit`` (or ``BatchScheduler.submit``) takes
    for it, the same core options and proposer as ``Engine.generate`` would use."""

    ids: list[int]
    options: Options
    proposer: Proposer | SlotProposer | None
    draft_width: int | WidthPolicy
    on_finish: FinishCallback  # records the finished output in the Engine's suffix cache (``Engine.record_output``)


def batch_request(engine: Engine, prompt: Prompt, options: GenerationOptions) -> BatchRequest:
    """``prompt`` with ``options`` made ready for a batched pass on ``engine``'s folder (``ValueError`` naming a bad
    prompt or option; ``speculative="shared-kv"`` without a shared-KV drafter is refused, ``"auto"`` without one is
    prompt lookup). A speculative request prices its proposer as ``generate`` does (``draft_width="auto"`` measures
    the verify cost curve, and a drafter's cost, the first time); a drafter is bound to the request's slot."""
    slots = engine.slot_drafters() if options.speculative in ("shared-kv", "auto") else None
    drafter = engine.drafter if slots is not None else None
    proposer, auto_width = engine._proposer(options.speculative, drafter)
    ids, core_options = engine.prepare(prompt, options)
    priced, width = engine._priced(proposer, auto_width, options.draft_width)
    forced = with_forced_tokens(bound_to_slots(priced, drafter, slots), core_options, len(ids))
    return BatchRequest(ids, core_options, forced, width, engine.record_output)


def with_forced_tokens(
    proposer: Proposer | SlotProposer | None, options: Options, prompt_len: int
) -> Proposer | SlotProposer | None:
    """``core.forced.forcing`` for a batched request: the grammar's forced tokens in front of its proposer, or of
    the proposer a ``SlotProposer`` binds to the sequence's slot."""
    if not isinstance(proposer, SlotProposer):
        return forcing(proposer, options, prompt_len)
    bind = proposer.bind

    def bound(slot: int) -> Proposer:
        forced = forcing(bind(slot), options, prompt_len)
        assert forced is not None  # forcing keeps a proposer a proposer
        return forced

    return SlotProposer(bound)


def bound_to_slots(
    proposer: Proposer | None, drafter: Proposer | None, slots: SlotDrafters | None
) -> Proposer | SlotProposer | None:
    """``proposer`` with ``drafter`` (the Engine's own, which ``proposer`` is or holds) replaced, per sequence, by
    the drafter bound to the sequence's slot (a ``SlotProposer``); ``proposer`` itself when it holds no drafter."""
    if proposer is None or drafter is None or slots is None:
        return proposer
    if proposer is drafter:
        return SlotProposer(slots.for_slot)
    if isinstance(proposer, LookupOrDraft) and proposer.drafter is drafter:
        auto = proposer
        return SlotProposer(lambda slot: attrs.evolve(auto, drafter=slots.for_slot(slot)))
    return proposer


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
        on_finish=request.on_finish,
    )


def batch_driver(engine: Engine, *, priced: bool = True) -> BatchDriver:
    """A driver over the Engine's batch backend, reusing cached prefixes as the Engine's ``prefix_reuse`` says and
    folding in at most the Engine's ``prefill_budget`` prompt tokens per pass; ``priced``: give it the backend's
    measured ``decode_costs`` (measured once, kept on disk), so a ``PricedWidth`` policy (``draft_width="auto"``)
    speculates less as the batch fills (other widths ignore them)."""
    return BatchDriver(
        engine.batch_backend(),
        decode_costs=engine.batch_decode_costs() if priced else None,
        prefix_reuse=engine.prefix_reuse,
        prefill_budget=engine.prefill_budget,
    )


def generate_many(engine: Engine, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
    """See ``Engine.generate_many``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ArgumentError("prompts", f"prompts must be a list of prompts, got {type(prompts).__name__}")
    return generate_requests(engine, [batch_request(engine, prompt, options) for prompt in prompts])


def generate_requests(engine: Engine, requests: Sequence[BatchRequest]) -> list[GenerateResult]:
    """Every request (``batch_request``: each with its own options) on one batch driver of ``engine``, run until
    all are done; their results in order, each what ``Engine.generate`` gives it alone. The first failure raises
    (``GenerationError`` with its partial result). On an Engine opened with ``batch_slots`` they run on its shared
    passes (``shared.generate_all``: its slots have one owner, whatever other threads run there too)."""
    from ortspec.adapters.engine import shared

    if engine.shared_passes.available:
        return shared.generate_all(engine, requests)
    if engine.shared_passes.closed:
        raise shared.EngineClosed("this Engine is closed")
    with engine._lock:  # the measurements and the batch backend are the Engine's
        driver = batch_driver(engine, priced=any(_reads_pass_price(request) for request in requests))
        sequences = [submit(engine, driver, request) for request in requests]
        driver.run()
    for sequence in sequences:
        if sequence.error is not None:
            raise sequence.error
    return [sequence.result() for sequence in sequences]


def _reads_pass_price(request: BatchRequest) -> bool:
    """Whether the request's speculation reads the price of a plain step (a ``PricedWidth`` policy, or ``"auto"``'s
    sources, each with its own)."""
    return isinstance(request.draft_width, PricedWidth) or isinstance(request.proposer, (SlotProposer, PricedProposer))
