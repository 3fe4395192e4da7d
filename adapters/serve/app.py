"""``create_app``: the FastAPI app, its routes, streaming (server-sent events) and error handling.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent
events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text format).

A request is validated (``models``), made ready (token ids from the pool's tokenizer and chat template,
``GenerationOptions``), handed to the pool (``batch_pool.BatchPool``: the Engine's one scheduler; or ``--ray``'s
``RayPool``), and its job's events become the response (``responses``). A client that disconnects, while its
request waits or generates, cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ortspec.adapters.engine import Engine
from ortspec.adapters.serve.batch_pool import BatchPool
from ortspec.adapters.serve.errors import (
    APIError,
    Cancelled,
    QueueFull,
    job_error,
    named,
    queue_full_error,
)
from ortspec.adapters.serve.jobs import Failed, Finished, RequestGeneration, ServePool
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    Prepared,
    argument_fields,
    prepare_options,
    prompt_of,
    validation_error,
)
from ortspec.adapters.serve.openapi import RESPONSES, openapi_document
from ortspec.adapters.serve.responses import LogprobFormatter, ResponseShape, ortspec_stats
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.backends.onnx import route_onnxruntime_logging
from ortspec.core.checks import ArgumentError
from ortspec.core.state import Commit, TokenLogprob
from ortspec.driver import GenerateResult

T = TypeVar("T")


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


def _json(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class _Routes:
    """The endpoints of one app, sharing its pool, metrics and settings."""

    def __init__(self, pool: ServePool, metrics: Metrics, settings: ServerSettings) -> None:
        self.pool, self.metrics, self.settings = pool, metrics, settings
        self.created = int(time.time())

    async def health(self) -> dict[str, Any]:
        pool = self.pool
        return {"status": "ok", **pool.health(), "busy": pool.busy, "waiting": pool.waiting}

    async def metrics_text(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        model = {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "ortspec"}
        return {"object": "list", "data": [model]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate(body, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(body, request)

    async def _prepare(self, body: GenerationRequest) -> Prepared:
        name = self.settings.model_name
        if body.model != name:
            message = f"model {body.model!r} does not exist here; this server serves {name!r}"
            raise APIError(404, message, param="model", code="model_not_found")
        fields = argument_fields(body)
        options, speculative = prepare_options(body, self.settings, self.pool.context_length)
        prompt = prompt_of(body)
        try:
            ids = await run_in_threadpool(
                functools.partial(self.pool.texts.prompt_ids, prompt, tools=options.tool_use())
            )
        except ValueError as exc:  # prompt_ids refuses nothing but the prompt
            raise APIError(400, named(fields["prompt"], str(exc)), param=fields["prompt"]) from None
        if len(ids) > self.pool.context_length:
            raise APIError(
                400,
                f"{fields['prompt']}: the prompt has {len(ids)} tokens but the model's context is "
                f"{self.pool.context_length}",
                param=fields["prompt"],
                code="context_length_exceeded",
            )
        return Prepared(ids, options, fields, speculative)

    async def _submit(
        self, body: GenerationRequest, request: Request, prepared: Prepared, deadline: float
    ) -> RequestGeneration:
        """The job for a request, once the pool took it (429 when the queue is full)."""
        try:
            return await _unless_disconnected(
                request, self.pool.submit(prepared, stream=body.stream, deadline=deadline)
            )
        except QueueFull as exc:
            raise queue_full_error(exc) from None

    async def _generate(self, body: GenerationRequest, request: Request) -> Response:
        arrived = self.pool.clock()
        prepared = await self._prepare(body)
        try:
            job = await self._submit(body, request, prepared, arrived + self.settings.request_timeout_s)
        except Cancelled:
            return Response(status_code=499)  # the client went away while waiting; nobody reads this
        chat = isinstance(body, ChatCompletionRequest)
        alternatives = (body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs) or 0
        formatter = LogprobFormatter(job.texts.tokenizer, alternatives) if prepared.options.top_logprobs else None
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = ResponseShape(chat, request_id, self.settings.model_name, formatter, prepared.options.tool_use())
        streaming = False
        try:
            first = await _unless_disconnected(request, job.next())
            if isinstance(first, Failed):
                raise job_error(first.error, prepared.fields)
            self.metrics.ttft.observe(self.pool.clock() - arrived)
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                streaming = True  # from here the stream owns the job (and cancels it when the client goes)
                return EventSourceResponse(_stream(job, shape, include_usage), ping=15)
            event = await _unless_disconnected(request, job.next())
            if isinstance(event, Failed):
                raise job_error(event.error, prepared.fields)
            assert isinstance(event, Finished)
            return JSONResponse(shape.response(event.result, _extension(event.result, job)))
        except Cancelled:
            return Response(status_code=499)  # the client went away; nobody reads this
        finally:
            if not streaming:
                job.cancel()  # a no-op once it finished; otherwise it stops within one pass


def _extension(result: GenerateResult, job: RequestGeneration) -> dict[str, Any]:
    return ortspec_stats(result, speculative=job.prepared.speculative, worker=job.worker)


async def _stream(job: RequestGeneration, shape: ResponseShape, include_usage: bool) -> AsyncIterator[dict[str, str]]:
    """The SSE events of a streamed response: a chunk per text delta (with the logprobs of the tokens since the
    last one), a last chunk with the finish reason and the ``ortspec`` statistics, the usage chunk when asked for,
    ``[DONE]``. A client that goes away cancels the generation (sse-starlette cancels this generator)."""

    def event(payload: dict[str, Any]) -> dict[str, str]:
        return {"data": _json(payload)}

    try:
        if shape.chat:
            yield event(shape.chunk("" if shape.tools is None else None, role=True, usage_field=include_usage))
        pending: list[TokenLogprob] = []
        while True:
            item = await job.next()
            if isinstance(item, Commit):
                if item.logprob is not None:
                    pending.append(item.logprob)
                chunks = shape.stream_chunks(item.text, pending, usage_field=include_usage)
                for chunk in chunks:
                    yield event(chunk)
                if chunks:
                    pending = []
                continue
            if isinstance(item, Finished):
                result = item.result
                *held, last = shape.last_chunks(result, pending, usage_field=include_usage)
                for chunk in held:
                    yield event(chunk)
                last["ortspec"] = _extension(result, job)
                yield event(last)
                if include_usage:
                    yield event(shape.usage_chunk(result))
            elif isinstance(item, Failed):
                yield event(job_error(item.error, job.prepared.fields).body())
            break
        yield {"data": "[DONE]"}
    finally:
        job.cancel()  # no-op once finished; otherwise it stops within one pass


def _handle_errors(app: FastAPI) -> None:
    """Every error becomes an OpenAI error object (a client's mistake a 4xx naming the field)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving ``engine`` (``make_pool``'s pool; ``app_for``): every request on the Engine's one
    scheduler. The measurements run at startup (``settings.measure_at_startup``: ``Engine.warm``). Request deadlines
    and durations are read on the Engine's clock (``Engine.from_dir(clock=...)``; tests pass one they move by hand).
    The Engine stays open when the app stops: its owner closes it. The pool, metrics and settings are on
    ``app.state``."""
    return app_for(make_pool(engine, settings, Metrics()), settings)


def make_pool(engine: Engine, settings: ServerSettings, metrics: Metrics) -> BatchPool:
    """The pool serving ``engine`` as ``create_app`` says, recording into ``metrics``: what ``ortspec serve`` runs
    in its process, and what each replica of ``ortspec serve --ray`` runs. ``ArgumentError`` for a default
    ``speculative="shared-kv"`` when the Engine has no drafter, or ``"draft-model"`` when it has no draft model."""
    if settings.speculative == "shared-kv" and engine.drafter is None:
        raise ArgumentError(
            "speculative",
            "speculative='shared-kv' needs a shared-KV drafter, and the Engine has none: train one with 'ortspec "
            "train-drafter' (found by default) or give --drafter DIR",
        )
    if settings.speculative == "draft-model" and getattr(engine, "draft_model", None) is None:
        raise ArgumentError(
            "speculative",
            "speculative='draft-model' needs a draft model, and the Engine has none: give --draft-model DIR",
        )
    return BatchPool(engine, max_queue=settings.max_queue, timeout_s=settings.request_timeout_s, metrics=metrics)


def app_for(pool: ServePool, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving requests with ``pool`` (its routes, streaming, errors, ``/metrics`` from
    ``pool.metrics``); ``pool.measure`` runs at startup (``settings.measure_at_startup``), ``pool.close`` at
    shutdown. The pool, metrics and settings are on ``app.state``."""
    metrics = pool.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        route_onnxruntime_logging()  # onnxruntime's own log lines go to Python logging (ortspec.onnxruntime)
        if settings.measure_at_startup:
            await run_in_threadpool(pool.measure)
        yield
        await run_in_threadpool(pool.close)

    app = FastAPI(title="ortspec", summary="OpenAI-compatible server for ortspec", lifespan=lifespan)
    app.state.pool, app.state.metrics, app.state.settings = pool, metrics, settings
    _handle_errors(app)
    routes = _Routes(pool, metrics, settings)
    app.openapi = functools.partial(openapi_document, app)  # type: ignore[method-assign]
    for path, endpoint, method in (
        ("/health", routes.health, "GET"),
        ("/metrics", routes.metrics_text, "GET"),
        ("/v1/models", routes.models, "GET"),
        ("/v1/completions", routes.completions, "POST"),
        ("/v1/chat/completions", routes.chat_completions, "POST"),
    ):  # each route's statuses and bodies: openapi.RESPONSES
        response_class = PlainTextResponse if path == "/metrics" else JSONResponse
        app.add_api_route(
            path,
            endpoint,
            methods=[method],
            response_model=None,
            response_class=response_class,
            responses=RESPONSES[path],
        )
    app.add_middleware(_Guard, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app
