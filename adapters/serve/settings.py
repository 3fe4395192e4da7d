"""``ServerSettings``: what the server does with requests (the Engine is made by the caller)."""

from __future__ import annotations

import attrs

from ortspec.adapters.engine.options import DEFAULT_SPECULATIVE, SPECULATIVE_CHOICES
from ortspec.core.checks import ArgumentError, int_at_least

# The proposers the server offers: every name (docs/drafter.md: "auto" and "shared-kv" use the Engine's shared-KV
# drafter; "suffix" drafts from the Engine's suffix cache).
SERVED_PROPOSERS = SPECULATIVE_CHOICES


def _check_speculative(instance: object, attribute: object, value: object) -> None:
    if value is not None and value not in SERVED_PROPOSERS:
        raise ArgumentError("speculative", f"speculative={value!r}: expected None or one of {SERVED_PROPOSERS}")


@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the server does with requests (the Engine is made by the caller).

    ``model_name``: the id served by ``/v1/models``; a request naming another model is a 404. ``speculative``: the
    proposer every request uses unless it asks otherwise (one of ``SERVED_PROPOSERS`` or None; ``"shared-kv"``
    needs an Engine with a drafter, ``"auto"`` without one is its lookup alone). ``max_queue``: requests
    that may wait beyond the slots; one more is refused with 429. ``request_timeout_s``: from arrival to the end of
    the generation (queue wait included); past it the request ends with 504. ``default_max_tokens``: for a request
    without ``max_tokens`` (None: until EOS or the context is full). ``max_body_bytes``: a larger request body
    (by its Content-Length) is refused with 413. ``measure_at_startup``: measure what a speculative request
    needs before serving (``Engine.warm``: the verify drift, the verify cost curve, the drafter's cost, the batch
    backend's decode costs; a measurement holds the slots, so it is done once, before any request)."""

    model_name: str
    speculative: str | None = attrs.field(default=DEFAULT_SPECULATIVE, validator=_check_speculative)
    max_queue: int = attrs.field(default=64, validator=int_at_least(0))
    request_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    default_max_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    max_body_bytes: int = attrs.field(default=16 << 20, validator=int_at_least(1))
    measure_at_startup: bool = True
