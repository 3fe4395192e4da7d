"""``ortspec serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn, one ``Engine`` per worker.

    app = create_app([Engine.from_dir(path, prefix_reuse=True)], ServerSettings(model_name="smollm2"))
    uvicorn.run(app)                        # or: ortspec serve --model DIR --workers 2 --threads 1

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text format).

Layers, each knowing only the next:

- **HTTP shapes** (pydantic request models, response dicts, OpenAI error objects). A request becomes token ids
  (the Engine's tokenizer and chat template) and a ``GenerationOptions`` (``SAMPLING_FIELDS`` maps request fields
  to its keywords, one row per field); a ``GenerateResult`` becomes a response. Nothing here decides what is
  committed: finish reasons come from ``FinishReason.openai``, text and token counts from the result.
- **The worker pool** (``WorkerPool``). N workers, each its own ``Engine`` (own backend and KV, prefix reuse on)
  and its own thread (ONNX Runtime releases the GIL, so workers run in parallel). A request waits for an idle
  worker in a bounded FIFO queue (full: ``QueueFull``, answered 429 with ``Retry-After``); a free worker goes to the
  head of the queue, and a request finding several idle workers takes the one whose resident tokens
  (``Engine.resident_tokens()``) share the longest prefix with its prompt, net of the resident KV it would drop
  (``WorkerPool._best_idle``), so the next turn of a conversation prefills only its new tokens. The worker thread
  iterates the Engine's ``Generation`` one commit at a time and checks the request's cancel flag and deadline
  between commits: a client that disconnects, or a request past its timeout, stops its generation within one
  target pass.
- **The Engine** (``ortspec.adapters.engine``) does the rest. It serializes generations on one Engine and
  supersedes a stale iterator (a generation started on an Engine ends any older one still running there); the pool
  never gives one Engine two requests at once, so neither happens here.

Errors: a client's mistake (bad JSON, wrong types, unknown fields or model, an empty or too long prompt,
``max_tokens <= 0``, sampling values the Engine refuses, ``n != 1``) is a 400, 404 or 413 with an OpenAI error
object ``{"error": {"message", "type", "param", "code"}}`` naming the field; a ``ValueError`` from the Engine's
options or prompt checks is such a mistake. A ``GenerationError`` once generation started is a 500 (or, in a
stream, an error event followed by ``[DONE]``); the worker stays usable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import attrs
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ortspec.adapters.engine import Engine, GenerationOptions, common_prefix_length
from ortspec.backends.onnx import BackendConfig, route_onnxruntime_logging
from ortspec.core.checks import int_at_least
from ortspec.core.state import Commit, TokenLogprob
from ortspec.driver import GenerateResult, GenerationError

T = TypeVar("T")

# ------------------------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------------------------


# The server's proposers: prompt lookup only (its workers open no shared-KV drafter: see docs/drafter.md).
SPECULATIVE_CHOICES = ("prompt-lookup",)


def _check_speculative(instance: object, attribute: object, value: object) -> None:
    if value is not None and value not in SPECULATIVE_CHOICES:
        raise ValueError(f"speculative={value!r}: expected None or one of {SPECULATIVE_CHOICES}")


@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the server does with requests (the engines are made by the caller).

    ``model_name``: the id served by ``/v1/models``; a request naming another model is a 404. ``speculative``: the
    proposer every request uses unless it asks otherwise (``"prompt-lookup"`` or None). ``max_queue``: requests
    that may wait for a worker; one more is refused with 429. ``request_timeout_s``: from arrival to the end of
    the generation (queue wait included); past it the request ends with 504. ``default_max_tokens``: for a request
    without ``max_tokens`` (None: until EOS or the context is full). ``max_body_bytes``: a larger request body
    (by its Content-Length) is refused with 413. ``measure_at_startup``: measure each worker's verify drift and
    verify cost curve before serving (the speculative path needs them; a measurement drops the resident KV, so
    it is done once, before any request)."""

    model_name: str
    speculative: str | None = attrs.field(default="prompt-lookup", validator=_check_speculative)
    max_queue: int = attrs.field(default=64, validator=int_at_least(0))
    request_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    default_max_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    max_body_bytes: int = attrs.field(default=16 << 20, validator=int_at_least(1))
    measure_at_startup: bool = True


# ------------------------------------------------------------------------------------------------------------------
# Errors: the OpenAI error object
# ------------------------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error response: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class QueueFull(Exception):
    """Every worker is busy and ``max_queue`` requests are already waiting."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server is busy: every worker is busy and the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RequestTimeout(Exception):
    """The request ran past its deadline (waiting for a worker, or generating: ``partial`` then holds what was
    generated)."""

    def __init__(self, timeout_s: float, partial: GenerateResult | None = None) -> None:
        done = f" after {len(partial.token_ids)} generated tokens" if partial is not None else " waiting for a worker"
        super().__init__(f"the request timed out ({timeout_s:g} s){done}")
        self.partial = partial


class Cancelled(Exception):
    """The client went away; the generation was stopped."""


# ------------------------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OrtspecOptions(_Strict):
    """The ``ortspec`` extension field of a request: ``{"speculative": false}`` decodes this request with plain
    greedy steps, ``true`` with prompt lookup; unset: the server's default. The output is the same either way."""

    speculative: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as the chat template takes it (``developer`` is a system turn; text parts joined)."""
        role = "system" if self.role == "developer" else self.role
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": role, "content": text}


class _GenerationRequest(_Strict):
    """Fields common to both endpoints. ``user`` is accepted and ignored."""

    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ortspec: OrtspecOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n}: this server returns one choice per request (n=1 only)")
        return n


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt``: text or token ids (a list of one of either is taken as that one);
    ``logprobs``: how many alternatives to report per token (0-5; 0 = the chosen token's logprob only)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``; ``top_logprobs`` (0-20)
    needs ``logprobs: true``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


_REQUEST_FIELDS = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, OrtspecOptions, StreamOptions)
    for name in model.model_fields
)


class SamplingField(NamedTuple):
    """A request field passed to ``GenerationOptions`` as ``keyword``. ``neutral``: the value that asks for
    nothing, which an Engine without the keyword can still take (any other value is then a 400)."""

    request: str
    keyword: str
    neutral: object = None


# The one table from request fields to GenerationOptions keywords: passing a new field through is one row here
# (and a field on _GenerationRequest if the OpenAI API does not have it yet). Rows whose keyword GenerationOptions
# does not have yet are refused unless neutral; once it has it, they pass through as they are.
SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", "temperature"),
    SamplingField("top_p", "top_p"),
    SamplingField("top_k", "top_k"),
    SamplingField("seed", "seed"),
    SamplingField("min_p", "min_p", 0.0),
    SamplingField("repetition_penalty", "repetition_penalty", 1.0),
    SamplingField("presence_penalty", "presence_penalty", 0.0),
    SamplingField("frequency_penalty", "frequency_penalty", 0.0),
    SamplingField("logit_bias", "logit_bias", {}),
)


def _engine_keywords() -> frozenset[str]:
    return frozenset(attrs.fields_dict(GenerationOptions))


def _request_value(field: SamplingField, value: object) -> object:
    if field.request == "logit_bias" and isinstance(value, dict):
        try:
            return {int(k): v for k, v in value.items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
    return value


class Prepared(NamedTuple):
    """A request made ready for a worker: prompt ids, options, and which request field each option came from."""

    ids: list[int]
    options: GenerationOptions
    params: dict[str, str]  # GenerationOptions keyword / core name -> request field, for error messages
    speculative: bool


def _param_of(message: str, params: Mapping[str, str]) -> str | None:
    """The request field a ``ValueError`` from the Engine is about: its message starts with the keyword's name
    (the contract of ``GenerationOptions`` and the core's checks)."""
    match = re.match(r"\w+", message)
    if match and match.group() in params:
        return params[match.group()]
    return params["prompt_tokens"] if "prompt" in message else None


def prepare_options(
    request: CompletionRequest | ChatCompletionRequest, settings: ServerSettings, context_length: int
) -> tuple[GenerationOptions, dict[str, str], bool]:
    """``GenerationOptions`` for a request (400 naming the field for values it refuses), the map from option
    names to request fields, and whether the request speculates."""
    prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    max_field = "max_tokens"
    max_tokens = request.max_tokens
    top_logprobs, logprobs_field = 0, "logprobs"
    if isinstance(request, ChatCompletionRequest):
        if request.max_completion_tokens is not None:
            max_field, max_tokens = "max_completion_tokens", request.max_completion_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if request.logprobs:
            # The Engine reports the chosen token's logprob with at least one alternative; 0 shows none of them.
            top_logprobs, logprobs_field = max(1, request.top_logprobs or 0), "top_logprobs"
    elif request.logprobs is not None:
        top_logprobs = max(1, request.logprobs)
    if max_tokens is None:
        max_tokens = settings.default_max_tokens or context_length  # the context ends the generation first
    speculative = settings.speculative is not None
    if request.ortspec is not None and request.ortspec.speculative is not None:
        speculative = request.ortspec.speculative
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": request.stop,
        "top_logprobs": top_logprobs,
        "speculative": (settings.speculative or "prompt-lookup") if speculative else None,
    }
    params = {
        "max_tokens": max_field,
        "max_new_tokens": max_field,
        "stop": "stop",
        "stop_strings": "stop",
        "top_logprobs": logprobs_field,
        "speculative": "ortspec.speculative",
        "prompt_tokens": prompt_field,
    }
    known = _engine_keywords()
    for field in SAMPLING_FIELDS:
        value = getattr(request, field.request)
        if value is None:
            continue
        params[field.keyword] = field.request
        value = _request_value(field, value)
        if field.keyword in known:
            kwargs[field.keyword] = value
        elif value != field.neutral:
            raise APIError(
                400,
                f"{field.request}={value!r}: not supported by this server's engine (ortspec decodes greedily)",
                param=field.request,
            )
    try:
        options = GenerationOptions(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_param_of(str(exc), params)) from None
    return options, params, speculative


def prompt_of(request: CompletionRequest | ChatCompletionRequest) -> str | list[int] | list[dict[str, str]]:
    """The prompt as the Engine takes it: text, token ids, or chat messages."""
    if isinstance(request, ChatCompletionRequest):
        return [m.as_template_message() for m in request.messages]
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list of one string or token list)", param="prompt")
        return prompt[0]
    return prompt  # type: ignore[return-value]  # list[str] / list[list[int]] were handled above


# ------------------------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------------------------


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ortspec_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("ortspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter(
            "ortspec_cached_prompt_tokens", "prompt tokens whose KV was reused (prefix reuse)", registry=r
        )
        self.completion_tokens = Counter("ortspec_completion_tokens", "generated tokens", registry=r)
        self.passes = Counter("ortspec_target_passes", "target model passes (stats.steps)", registry=r)
        self.proposed = Counter("ortspec_draft_tokens_proposed", "draft tokens proposed for verification", registry=r)
        self.accepted = Counter("ortspec_draft_tokens_accepted", "draft tokens accepted", registry=r)
        self.generations = Counter(
            "ortspec_generations",
            "generations by outcome (finished, cancelled, timeout, error)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter("ortspec_rejected", "requests refused because the queue was full", registry=r)
        self.queue_wait = Histogram("ortspec_queue_wait_seconds", "time waiting for a worker", registry=r)
        self.ttft = Histogram(
            "ortspec_time_to_first_token_seconds", "request arrival to the first generated token", registry=r
        )
        self.duration = Histogram("ortspec_generation_seconds", "time a worker spent on a request", registry=r)
        self.waiting = Gauge("ortspec_queue_depth", "requests waiting for a worker", registry=r)
        self.busy = Gauge("ortspec_workers_busy", "workers running a generation", registry=r)
        self.workers = Gauge("ortspec_workers", "workers (engines)", registry=r)

    def record(self, result: GenerateResult) -> None:
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_prompt_tokens.inc(result.cached_prompt_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.passes.inc(result.stats.steps)
        self.proposed.inc(result.stats.proposed_tokens)
        self.accepted.inc(result.stats.accepted_tokens)


# ------------------------------------------------------------------------------------------------------------------
# The worker pool
# ------------------------------------------------------------------------------------------------------------------


class Started(NamedTuple):
    """The prompt pass is done: the first token is decided (the first ``Commit`` follows)."""


class Finished(NamedTuple):
    result: GenerateResult


class Failed(NamedTuple):
    error: BaseException


Event = Started | Commit | Finished | Failed


class Worker:
    """One Engine and the thread that runs it. ``resident`` mirrors ``engine.resident_tokens()`` as of the end of
    its last job (read by the router while the worker is idle)."""

    def __init__(self, index: int, engine: Engine) -> None:
        self.index, self.engine = index, engine
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ortspec-worker-{index}")
        self.resident: tuple[int, ...] = ()
        self.busy = False
        self.last_used = 0.0


class Job:
    """One request's generation on a worker. The worker thread puts events (``Started``, each ``Commit`` when
    streaming, then ``Finished`` or ``Failed``) on a queue the event loop reads; ``cancel()`` asks the thread to
    stop before its next target pass."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, worker: Worker, prepared: Prepared, *, stream: bool, deadline: float
    ) -> None:
        self.loop, self.worker, self.prepared = loop, worker, prepared
        self.stream, self.deadline = stream, deadline
        self.cancelled = threading.Event()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        """From the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def next(self) -> Event:
        return await self._events.get()


class WorkerPool:
    """N workers behind a bounded FIFO queue, routing by shared prefix (see the module docstring). Every method
    except ``measure`` and the worker threads' ``_execute`` runs on the event loop."""

    def __init__(self, engines: Sequence[Engine], *, max_queue: int, timeout_s: float, metrics: Metrics) -> None:
        if not engines:
            raise ValueError("the pool needs at least one engine")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.workers = [Worker(i, e) for i, e in enumerate(engines)]
        self.max_queue, self.timeout_s, self.metrics = max_queue, timeout_s, metrics
        self._waiters: deque[tuple[list[int], asyncio.Future[Worker]]] = deque()
        self._jobs: set[Job] = set()
        self._service_s = 1.0  # moving average of a job's time on a worker, for Retry-After
        metrics.workers.set(len(self.workers))

    @property
    def context_length(self) -> int:
        return min(w.engine.backend.max_length for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(w.busy for w in self.workers)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def measure(self) -> None:
        """Measure each worker's verify drift and verify cost curve (one after another, so they do not disturb
        each other). A measurement drops an Engine's resident KV: call this before serving."""
        for w in self.workers:
            w.engine.verify_drift()
            w.engine.pass_costs()
            w.resident = w.engine.resident_tokens()

    def close(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        for w in self.workers:
            w.executor.shutdown(wait=True, cancel_futures=True)

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the waiting requests' share of the mean service time."""
        return max(1, math.ceil(self._service_s * (len(self._waiters) + 1) / len(self.workers)))

    # -- routing ---------------------------------------------------------------------------------------------------
    def _best_idle(self, ids: Sequence[int]) -> Worker | None:
        """The idle worker whose resident tokens share the longest prefix with ``ids``, net of the resident KV the
        request would drop there (``shared - (resident - shared)``; least recently used on ties).

        The next turn of a conversation (or another question about the same document) shares most of a worker's
        resident tokens and goes there. A new conversation that shares only the chat template's opening (the
        system prompt) with every worker goes to the one with the least to lose (an empty one first) instead of
        dropping the KV of a conversation that may continue."""
        idle = [w for w in self.workers if not w.busy]
        if not idle:
            return None

        def score(w: Worker) -> tuple[int, float]:
            shared = common_prefix_length(w.resident, ids)
            return 2 * shared - len(w.resident), -w.last_used

        return max(idle, key=score)

    def _take(self, worker: Worker) -> Worker:
        worker.busy = True
        self.metrics.busy.set(self.busy)
        return worker

    def _release(self, worker: Worker) -> None:
        worker.busy, worker.last_used = False, time.monotonic()
        while self._waiters:
            ids, future = self._waiters[0]
            if future.done():  # its request gave up
                self._waiters.popleft()
                continue
            best = self._best_idle(ids)
            if best is None:
                break
            self._waiters.popleft()
            future.set_result(self._take(best))
        self.metrics.busy.set(self.busy)
        self.metrics.waiting.set(len(self._waiters))

    async def _acquire(self, ids: list[int], deadline: float) -> Worker:
        if not self._waiters:
            best = self._best_idle(ids)
            if best is not None:
                return self._take(best)
        if len(self._waiters) >= self.max_queue:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after())
        future: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        entry = (ids, future)
        self._waiters.append(entry)
        self.metrics.waiting.set(len(self._waiters))
        try:
            return await asyncio.wait_for(future, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)
            self.metrics.waiting.set(len(self._waiters))
            if future.done() and not future.cancelled():  # a worker was handed over as the request gave up
                self._release(future.result())
            if isinstance(exc, TimeoutError):
                raise RequestTimeout(self.timeout_s) from None
            raise

    # -- running ---------------------------------------------------------------------------------------------------
    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> Job:
        """Wait for a worker (``QueueFull`` when the queue is full, ``RequestTimeout`` past the deadline) and start
        the generation on it. The caller reads the job's events and cancels the job when it stops reading."""
        t0 = time.monotonic()
        worker = await self._acquire(prepared.ids, deadline)
        self.metrics.queue_wait.observe(time.monotonic() - t0)
        loop = asyncio.get_running_loop()
        job = Job(loop, worker, prepared, stream=stream, deadline=deadline)
        self._jobs.add(job)
        try:
            future = worker.executor.submit(self._execute, job)
        except BaseException:
            self._jobs.discard(job)
            self._release(worker)
            raise
        started = time.monotonic()

        def done(_: Future[None]) -> None:
            def on_loop() -> None:
                self._jobs.discard(job)
                self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - started)
                self._release(worker)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_loop)

        future.add_done_callback(done)
        return job

    def _execute(self, job: Job) -> None:
        """In the worker's thread: run the generation one commit at a time, checking the cancel flag and the
        deadline between commits (so a cancelled request stops within one target pass)."""
        worker, t0 = job.worker, time.monotonic()
        try:
            generation = worker.engine.start_with(job.prepared.ids, job.prepared.options)
            job.emit(Started())
            for commit in generation:
                if job.stream:
                    job.emit(commit)
                if job.cancelled.is_set():
                    self.metrics.generations.labels("cancelled").inc()
                    job.emit(Failed(Cancelled()))
                    return
                if time.monotonic() > job.deadline:
                    self.metrics.generations.labels("timeout").inc()
                    job.emit(Failed(RequestTimeout(self.timeout_s, generation.result())))
                    return
            result = generation.result()
            self.metrics.record(result)
            self.metrics.generations.labels("finished").inc()
            job.emit(Finished(result))
        except ValueError as exc:  # the Engine refused the prompt or options: nothing ran
            job.emit(Failed(exc))
        except Exception as exc:  # GenerationError, or a bug: reported as a server error
            self.metrics.generations.labels("error").inc()
            job.emit(Failed(exc))
        finally:
            worker.resident = worker.engine.resident_tokens()
            self.metrics.duration.observe(time.monotonic() - t0)


# ------------------------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------------------------


def _usage(result: GenerateResult) -> dict[str, Any]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
    }


def _ortspec_stats(result: GenerateResult, prepared: Prepared, worker: Worker) -> dict[str, Any]:
    """The extension field ``ortspec`` of a response: how the tokens were decided."""
    s = result.stats
    stats: dict[str, Any] = {
        "speculative": prepared.speculative,
        "passes": s.steps,
        "proposed": s.proposed_tokens,
        "accepted": s.accepted_tokens,
        "acceptance": round(s.acceptance_rate, 4),
        "worker": worker.index,
    }
    seed = getattr(result, "seed", None)  # set by engines that sample
    if seed is not None:
        stats["seed"] = seed
    return stats


class _LogprobFormatter:
    """Token logprobs in the two OpenAI shapes, with token strings from the worker's tokenizer."""

    def __init__(self, engine: Engine, alternatives: int) -> None:
        self.decode, self.alternatives = engine.tokenizer.decode, alternatives

    def token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def chat(self, items: Sequence[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top[: self.alternatives]]}
            for lp in items
        ]
        return {"content": content, "refusal": None}

    def completion(self, items: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        tokens = [self.token(lp.token_id) for lp in items]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self.token(t): p for t, p in lp.top[: self.alternatives]} for lp in items],
            "text_offset": offsets,
        }


class _Shape:
    """One endpoint's response shapes (completion or chat), for a whole response and for stream chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, formatter: _LogprobFormatter | None) -> None:
        self.chat, self.id, self.model, self.logprobs = chat, request_id, model, formatter
        self.created = int(time.time())
        self.text_offset = 0

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _logprobs(self, items: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return self.logprobs.chat(items)
        out = self.logprobs.completion(items, self.text_offset)
        self.text_offset = out["text_offset"][-1] + len(out["tokens"][-1]) if items else self.text_offset
        return out

    def response(self, result: GenerateResult, extension: dict[str, Any]) -> dict[str, Any]:
        assert result.finish_reason is not None
        logprobs = self._logprobs(result.logprobs or ())
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": result.finish_reason.openai}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
        else:
            choice["text"] = result.text
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": [choice], "usage": _usage(result), "ortspec": extension}

    def chunk(
        self,
        text: str | None,
        logprobs: Sequence[TokenLogprob] = (),
        finish_reason: str | None = None,
        *,
        role: bool = False,
        usage_field: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(logprobs) if logprobs else None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["finish_reason"] = finish_reason
        out = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [choice]}
        if usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, result: GenerateResult) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": _usage(result)}


def _error_for(exc: BaseException, prepared: Prepared) -> APIError:
    """The response for a job that failed."""
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=_param_of(str(exc), prepared.params))
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), type="timeout_error", code="timeout")
    if isinstance(exc, GenerationError):
        return APIError(500, str(exc), type="server_error", code="generation_failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")


async def _until_disconnected(request: Request) -> None:
    """Return when the client has gone away (the request body has been read, so the next ASGI message is the
    disconnect, or nothing until the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, raising ``Cancelled`` (and cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise Cancelled()
    return task.result()


# ------------------------------------------------------------------------------------------------------------------
# The application
# ------------------------------------------------------------------------------------------------------------------


class _Guard:
    """ASGI middleware: counts responses by endpoint and status, and refuses bodies over the size limit (413)."""

    ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"})

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            error = APIError(413, f"the request body is over {self.max_body_bytes} bytes", code="request_too_large")
            await error.response()(scope, receive, counting_send)
            return
        await self.app(scope, receive, counting_send)


def _validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic refused, e.g. ``messages[0].role``."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        reason = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return APIError(400, f"the request body is not valid JSON: {reason}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _REQUEST_FIELDS:
            param += f".{part}" if param else part
        else:
            break  # a union member's tag, not a field
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        param = param + (f".{loc[-1]}" if param else str(loc[-1])) if loc else param
        msg = "unrecognized request argument (this server does not support it)"
    elif first.get("type") == "missing":
        msg = "required"
    elif "input" in first and first.get("type") != "value_error":
        msg = f"{msg} (got {first['input']!r:.80})"
    text = f"{param}: {msg}" if param and not msg.startswith(param.split(".")[-1]) else msg
    return APIError(400, text, param=param or None)


def create_app(engines: Sequence[Engine], settings: ServerSettings) -> FastAPI:
    """The ASGI app serving ``engines`` (one worker each; give each its own Engine, with ``prefix_reuse=True`` for
    the prefix routing to pay). The workers' measurements run at startup (``settings.measure_at_startup``)."""
    metrics = Metrics()
    pool = WorkerPool(engines, max_queue=settings.max_queue, timeout_s=settings.request_timeout_s, metrics=metrics)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        route_onnxruntime_logging()  # onnxruntime's own log lines go to Python logging (ortspec.onnxruntime)
        if settings.measure_at_startup:
            await run_in_threadpool(pool.measure)
        yield
        await run_in_threadpool(pool.close)

    app = FastAPI(title="ortspec", summary="OpenAI-compatible server for ortspec", lifespan=lifespan)
    app.state.pool, app.state.metrics, app.state.settings = pool, metrics, settings

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "workers": len(pool.workers), "busy": pool.busy, "waiting": pool.waiting}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": settings.model_name, "object": "model", "created": created, "owned_by": "ortspec"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(body, request)

    async def _prepare(body: CompletionRequest | ChatCompletionRequest) -> Prepared:
        if body.model != settings.model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist here; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )
        prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        options, params, speculative = prepare_options(body, settings, pool.context_length)
        prompt = prompt_of(body)
        try:
            ids = await run_in_threadpool(pool.workers[0].engine.prompt_ids, prompt)
        except ValueError as exc:
            raise APIError(400, f"{prompt_field}: {exc}", param=prompt_field) from None
        if len(ids) > pool.context_length:
            raise APIError(
                400,
                f"{prompt_field}: the prompt has {len(ids)} tokens but the model's context is {pool.context_length}",
                param=prompt_field,
                code="context_length_exceeded",
            )
        return Prepared(ids, options, params, speculative)

    async def _generate(body: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        arrived = time.monotonic()
        prepared = await _prepare(body)
        deadline = arrived + settings.request_timeout_s
        try:
            job = await _unless_disconnected(request, pool.submit(prepared, stream=body.stream, deadline=deadline))
        except QueueFull as exc:
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        except RequestTimeout as exc:
            raise _error_for(exc, prepared) from None
        except Cancelled:
            return Response(status_code=499)
        chat = isinstance(body, ChatCompletionRequest)
        alternatives = (body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs) or 0
        formatter = _LogprobFormatter(job.worker.engine, alternatives) if prepared.options.top_logprobs else None
        shape = _Shape(chat, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, settings.model_name, formatter)
        streaming = False
        try:
            first = await _unless_disconnected(request, job.next())
            if isinstance(first, Failed):
                raise _error_for(first.error, prepared)
            metrics.ttft.observe(time.monotonic() - arrived)
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                streaming = True  # from here the stream owns the job (and cancels it when the client goes)
                return EventSourceResponse(_stream(job, shape, include_usage), ping=15)
            event = await _unless_disconnected(request, job.next())
            if isinstance(event, Failed):
                raise _error_for(event.error, prepared)
            assert isinstance(event, Finished)
            return JSONResponse(shape.response(event.result, _ortspec_stats(event.result, prepared, job.worker)))
        except Cancelled:
            return Response(status_code=499)  # the client went away; nobody reads this
        finally:
            if not streaming:
                job.cancel()  # a no-op once it finished; otherwise the worker stops within one pass

    async def _stream(job: Job, shape: _Shape, include_usage: bool) -> AsyncIterator[dict[str, str]]:
        """The SSE events of a streamed response: a chunk per text delta (with the logprobs of the tokens since the
        last one), a last chunk with the finish reason and the ``ortspec`` statistics, the usage chunk when asked
        for, ``[DONE]``. A client that goes away cancels the generation (sse-starlette cancels this generator)."""

        def event(payload: dict[str, Any]) -> dict[str, str]:
            return {"data": _json(payload)}

        try:
            if shape.chat:
                yield event(shape.chunk("", role=True, usage_field=include_usage))
            pending: list[TokenLogprob] = []
            while True:
                item = await job.next()
                if isinstance(item, Commit):
                    if item.logprob is not None:
                        pending.append(item.logprob)
                    if item.text:
                        yield event(shape.chunk(item.text, pending, usage_field=include_usage))
                        pending = []
                    continue
                if isinstance(item, Finished):
                    result = item.result
                    assert result.finish_reason is not None
                    last = shape.chunk(None, pending, result.finish_reason.openai, usage_field=include_usage)
                    last["ortspec"] = _ortspec_stats(result, job.prepared, job.worker)
                    yield event(last)
                    if include_usage:
                        yield event(shape.usage_chunk(result))
                elif isinstance(item, Failed):
                    yield event(_error_for(item.error, job.prepared).body())
                break
            yield {"data": "[DONE]"}
        finally:
            job.cancel()  # no-op once finished; otherwise the worker stops within one pass

    app.add_middleware(_Guard, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app


def _json(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------------------------


def default_threads(workers: int) -> int:
    """Intra-op threads per worker when not given: the usable cores shared out among the workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def load_engines(
    model_dir: str | os.PathLike[str],
    *,
    workers: int = 1,
    threads: int | None = None,
    provider: str = "cpu",
    max_length: int | None = None,
    prefix_reuse: bool = True,
    sliding_window: str = "config",
    matmul_accuracy_level: int | None = None,
) -> list[Engine]:
    """One Engine per worker on ``model_dir`` (each its own session and KV); the load options are
    ``Engine.from_dir``'s."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    threads = threads if threads is not None else default_threads(workers)
    return [
        Engine.from_dir(
            model_dir,
            BackendConfig(
                provider=provider,
                threads=threads,
                max_length=max_length,
                sliding_window=sliding_window,
                matmul_accuracy_level=matmul_accuracy_level,
            ),
            prefix_reuse=prefix_reuse,
            drafter=False,
        )
        for _ in range(workers)
    ]


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning") -> Iterator[str]:
    """Run ``app`` on uvicorn in a background thread, on a free port of ``host``; yield its base URL
    (``http://host:port``) once it serves (after the startup measurements), and stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def cmd_serve(args: argparse.Namespace, model_dir: Path) -> int:
    """``ortspec serve``: load one Engine per worker, measure them, serve until interrupted."""
    engines = load_engines(
        model_dir,
        workers=args.workers,
        threads=args.threads,
        provider=args.provider,
        max_length=args.max_length,
        prefix_reuse=args.prefix_reuse,
        sliding_window=args.sliding_window,
        matmul_accuracy_level=args.matmul_accuracy_level,
    )
    settings = ServerSettings(
        model_name=args.model_name or Path(model_dir).name,
        speculative=None if args.speculative == "none" else args.speculative,
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        default_max_tokens=args.default_max_tokens,
    )
    app = create_app(engines, settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Metrics",
    "SAMPLING_FIELDS",
    "ServerSettings",
    "WorkerPool",
    "cmd_serve",
    "create_app",
    "load_engines",
    "prepare_options",
    "serve_in_thread",
]
