"""The server's OpenAPI document: every status each route answers with, and the body of each.

``RESPONSES[path]`` is what a route declares (``add_api_route(..., responses=RESPONSES[path])``): its 200 body and
every error status it can return, each with the one error body (``errors.ErrorBody``). ``openapi_document`` is the
app's ``openapi()``: FastAPI's document without the 422 FastAPI adds to routes with a body (the server answers a
validation error with 400, declared here), and with the stream events' bodies among its components.

The models below describe what ``responses.py`` and the routes build; they are the document, not the code path
(the routes return their JSON as built). ``tests/test_openapi_fuzz.py`` holds the two together: Schemathesis
fuzzes the app from this document and checks every status, content type and body against it.

The request bodies are the request models' schemas (``models.py``): they state every rule the server's validation
applies, bounds and rules between fields included, so a request valid by the document is answered 200 but for the
refusals no JSON Schema can state (``BEYOND_SCHEMA``), which the 400's description lists; the fuzz test holds the
server to that too.

Statuses: 200; 400 (malformed JSON, a request the schema refuses, or one of ``BEYOND_SCHEMA``); 404 (``model`` is
not the served id); 413 (a body over ``max_body_bytes``, on any route); 429 (the queue is full, with
``Retry-After``); 500 (a generation that failed, or any other error); 504 (a request past its timeout). A client
that goes away gets nothing (the access log and metrics say 499).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from ortspec.adapters.engine import tool_format
from ortspec.adapters.serve.errors import ErrorBody
from ortspec.core.state import FinishReason

_REF = "#/components/schemas/"
# The finish reasons a response may carry: FinishReason's words for the OpenAI API.
_FINISH_REASONS = sorted({reason.openai for reason in FinishReason})
_CHAT_FINISH_REASONS = sorted({*_FINISH_REASONS, tool_format.FINISH_REASON})  # with an answer of complete calls


def _finish_reason(description: str, *, streamed: bool, reasons: list[str] = _FINISH_REASONS) -> Any:
    enum: list[str | None] = [*reasons, None] if streamed else list(reasons)
    return Field(description=description, json_schema_extra={"enum": enum})  # type: ignore[dict-item]


# ------------------------------------------------------------------------------------------------------------------
# 200 bodies
# ------------------------------------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]
    workers: int
    busy: int
    waiting: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV was reused (prefix reuse)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class OrtspecStats(BaseModel):
    """The ``ortspec`` extension field: how the tokens were decided (``seed``: the sampling seed, when sampled)."""

    speculative: bool
    passes: int
    proposed: int
    accepted: int
    acceptance: float
    worker: int
    seed: int | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str = _finish_reason("why the generation ended", streamed=False)


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments (cut short when the generation was)")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls")
    refusal: None
    tool_calls: list[ToolCall] | None = Field(default=None, description="the calls, when the answer is calls")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str = _finish_reason("why the generation ended", streamed=False, reasons=_CHAT_FINISH_REASONS)


class _Head(BaseModel):
    id: str
    created: int
    model: str


class Completion(_Head):
    """``POST /v1/completions`` without ``stream``."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage
    ortspec: OrtspecStats


class ChatCompletion(_Head):
    """``POST /v1/chat/completions`` without ``stream``."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    ortspec: OrtspecStats


# ------------------------------------------------------------------------------------------------------------------
# Stream events (``stream: true``): each event's data is a chunk, an error object, or ``[DONE]`` (the last event)
# ------------------------------------------------------------------------------------------------------------------


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None = _finish_reason("set on the last chunk only", streamed=True)


class CalledFunctionDelta(BaseModel):
    name: str | None = Field(default=None, description="on the call's first chunk")
    arguments: str = Field(description="the next piece of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = Field(default=None, description="on the call's first chunk")
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, description="on the first chunk only")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None = _finish_reason(
        "set on the last chunk only", streamed=True, reasons=_CHAT_FINISH_REASONS
    )


class _Chunk(_Head):
    """With ``stream_options.include_usage``: ``usage`` is null on every chunk but a last one with no choices and
    the usage."""

    usage: Usage | None = None
    ortspec: OrtspecStats | None = Field(default=None, description="on the chunk with the finish reason")


class CompletionChunk(_Chunk):
    """A streamed completion's chunk."""

    object: Literal["text_completion"]
    choices: list[CompletionChunkChoice]


class ChatCompletionChunk(_Chunk):
    """A streamed chat completion's chunk."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


_STREAM_MODELS: tuple[type[BaseModel], ...] = (CompletionChunk, ChatCompletionChunk, ErrorBody)


def _event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
    """The ``text/event-stream`` media type of a 200 whose events carry ``chunk`` (or an error, then ``[DONE]``)."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": _REF + chunk.__name__}, {"$ref": _REF + ErrorBody.__name__}]},
    }
    data = {"oneOf": [{"const": "[DONE]"}, json_data]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data, "event": {"type": "string"}}}
    return {"itemSchema": event}


# ------------------------------------------------------------------------------------------------------------------
# What each route declares
# ------------------------------------------------------------------------------------------------------------------

# What a request valid by the schema may still be refused for (400, ``param`` naming the field): what depends on the
# served model or on a compiler's verdict, and what no JSON Schema can state. The 400's description lists them.
BEYOND_SCHEMA: dict[str, str] = {
    "context": "`prompt` / `messages`: the prompt is longer than the model's context (code `context_length_exceeded`)",
    "vocabulary": "`prompt` / `logit_bias`: a token id outside the model's vocabulary",
    "empty_prompt": "`prompt` / `messages`: the text encodes to no token at all",
    "constraint": "`response_format`: a schema, regular expression or grammar that the constraint compiler "
    "(llguidance) refuses, or that no output can match",
    "tools": "`tools`: a function's parameters schema that the constraint compiler refuses, or two functions of one "
    "name",
    "tool_choice": "`tool_choice`: a function that is not one of `tools`",
    "call_arguments": "`messages`: an earlier tool call's `arguments` that are not JSON text",
    "unicode": "any string field: a string with an unpaired surrogate escape (not Unicode text; I-JSON, RFC 7493)",
}
_ERRORS: dict[int, str] = {
    400: "The request is malformed (not JSON), refused by the schema (a wrong type, an unknown field, a value out of "
    "range, a rule between fields), or valid by the schema but refused for what no schema states: "
    + "; ".join(BEYOND_SCHEMA.values())
    + ". `param` names the field. Validation errors are 400, not 422.",
    404: "`model` is not the served model (code `model_not_found`).",
    413: "The request body is over the server's limit (code `request_too_large`).",
    429: "Every worker is busy and the queue is full (code `queue_full`); retry after `Retry-After` seconds.",
    500: "The generation failed (code `generation_failed`) or the server erred (code `internal_error`).",
    504: "The request ran past the server's timeout, waiting or generating (code `timeout`).",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


Responses = dict[int | str, dict[str, Any]]  # FastAPI's ``responses=``: status -> the response's OpenAPI entry


def _errors(*statuses: int) -> Responses:
    out: Responses = {}
    for status in sorted(statuses):
        json = {"application/json": {"schema": {"$ref": _REF + ErrorBody.__name__}}}  # JSON whatever the route's 200
        out[status] = {"description": _ERRORS[status], "content": json}
        if status == 429:
            out[status]["headers"] = _RETRY_AFTER
    return out


_ANY_ROUTE = (413, 500)  # the body-size guard runs before every route; any route may fail


def _generation(body: type[BaseModel], chunk: type[BaseModel]) -> Responses:
    ok: dict[str, Any] = {
        "model": body,
        "description": "The completion; with `stream: true`, its server-sent events instead: each a chunk (or an "
        "error object, when the generation fails), the last `data: [DONE]`.",
        "content": {"text/event-stream": _event_stream(chunk)},
    }
    return {200: ok, **_errors(400, 404, 429, 504, *_ANY_ROUTE)}


_PROMETHEUS: dict[str, Any] = {"description": "The metrics in Prometheus text format."}
RESPONSES: dict[str, Responses] = {
    "/health": {200: {"model": Health}, **_errors(*_ANY_ROUTE)},
    "/metrics": {200: _PROMETHEUS, **_errors(*_ANY_ROUTE)},
    "/v1/models": {200: {"model": ModelList}, **_errors(*_ANY_ROUTE)},
    "/v1/completions": _generation(Completion, CompletionChunk),
    "/v1/chat/completions": _generation(ChatCompletion, ChatCompletionChunk),
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """``app.openapi()`` for the server (built once, then cached on the app as FastAPI does): FastAPI's document
    less the 422 responses and their schemas (the server answers validation errors with 400), plus the stream
    events' bodies as components (the ``text/event-stream`` 200s refer to them)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for operations in document["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _, stream = models_json_schema([(m, "serialization") for m in _STREAM_MODELS], ref_template=_REF + "{model}")
        schemas.update(stream.get("$defs", {}))
        app.openapi_schema = document
    return app.openapi_schema
