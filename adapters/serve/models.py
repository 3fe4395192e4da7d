"""The request side of the HTTP API: pydantic request models, the tables from request fields to the Engine's
keywords and back, and ``prepare_options`` (a request -> ``GenerationOptions``).

Two tables, one per direction:

- The sampling fields are the core's sampling options under their own names: the request fields are built from
  their declarations (``ortspec.adapters.engine.surfaces.request_fields``; type, help and documented bounds), so a
  new sampling option is a new request field with nothing to write here.
- ``argument_fields(request)``: the Engine's argument name (``ArgumentError.argument``) -> the request field it
  came from, so an Engine error is reported on the field the client typed (``max_completion_tokens`` for the
  Engine's ``max_tokens`` when the request set that one).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ortspec.adapters.engine.options import MANY_REQUESTS_SPECULATIVE, GenerationOptions
from ortspec.adapters.engine.surfaces import SAMPLING_OPTIONS, json_logit_bias, request_fields
from ortspec.adapters.serve.errors import APIError, client_error, named
from ortspec.adapters.serve.settings import ServerSettings

# ------------------------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OrtspecOptions(_Strict):
    """The ``ortspec`` extension field of a request: ``{"speculative": false}`` decodes this request with plain
    steps, ``true`` with the server's proposer (its ``--speculative``, or ``MANY_REQUESTS_SPECULATIVE`` when that is
    none); unset: the server's default. The output is the same either way."""

    speculative: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (``tool_calls[i]`` of its message)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    """A turn. An assistant turn may carry ``tool_calls`` (its content may then be null); a ``tool`` turn is a
    call's result (``tool_call_id`` names the call)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _turn_shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant turn makes calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant turn with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool turn names the call it answers")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template takes it (``developer`` is a system turn; text parts joined; calls in
        the OpenAI shape)."""
        role = "system" if self.role == "developer" else self.role
        text = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# The sampling options as request fields, from their one declaration (optional; None: the option's default).
_SamplingRequest: type[_Strict] = create_model(  # type: ignore[call-overload]
    "_SamplingRequest", __base__=_Strict, **request_fields(SAMPLING_OPTIONS)
)


class _GenerationRequest(_SamplingRequest):  # type: ignore[valid-type, misc]
    """Fields common to both endpoints. ``user`` is accepted and ignored."""

    model: str
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, json_schema_extra={"minimum": 1, "maximum": 1})  # documented: n=1 only
    user: str | None = None
    ortspec: OrtspecOptions | None = None
    response_format: dict[str, Any] | None = Field(
        default=None,
        description=(
            'structured outputs: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": '
            '{"name", "schema", "strict"}}, or ortspec\'s {"type": "regex", "regex": R} and {"type": "grammar", '
            '"grammar": LARK}; the output obeys it (a 400 names response_format when it cannot be used)'
        ),
    )

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
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description='functions the model may call: [{"type": "function", "function": {"name", "description", '
        '"parameters"}}]; a call\'s arguments obey its parameters schema (a 400 names tools when one cannot be used)',
    )
    tool_choice: str | dict[str, Any] | None = Field(
        default=None,
        description='"none", "auto" (the default with tools), "required", or {"type": "function", "function": '
        '{"name": NAME}}',
    )
    parallel_tool_calls: bool | None = Field(default=None, description="several calls in one answer (default true)")


GenerationRequest = CompletionRequest | ChatCompletionRequest

# Every field name of every request model: what a pydantic error location may name (validation_error).
_REQUEST_FIELDS = frozenset(
    name
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        TextPart,
        OrtspecOptions,
        StreamOptions,
        MessageToolCall,
        CalledFunction,
    )
    for name in model.model_fields
)


def validation_error(exc: RequestValidationError) -> APIError:
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
    return APIError(400, named(param or None, msg), param=param or None)


# ------------------------------------------------------------------------------------------------------------------
# The field tables
# ------------------------------------------------------------------------------------------------------------------


def argument_fields(request: GenerationRequest) -> dict[str, str]:
    """The one table from the Engine's argument names (``ArgumentError.argument``) to this request's fields."""
    prompt_field, max_field, logprobs_field = "prompt", "max_tokens", "logprobs"
    if isinstance(request, ChatCompletionRequest):
        prompt_field = "messages"
        if request.max_completion_tokens is not None:
            max_field = "max_completion_tokens"
        if request.logprobs:
            logprobs_field = "top_logprobs"
    fields = {
        "prompt": prompt_field,
        "max_tokens": max_field,
        "stop": "stop",
        "top_logprobs": logprobs_field,
        "speculative": "ortspec.speculative",
        "response_format": "response_format",
        "tools": "tools",
        "tool_choice": "tool_choice",
        "parallel_tool_calls": "parallel_tool_calls",
    }
    return fields | {name: name for name in SAMPLING_OPTIONS}


# ------------------------------------------------------------------------------------------------------------------
# A request made ready for a worker
# ------------------------------------------------------------------------------------------------------------------


class Prepared(NamedTuple):
    """A request made ready for a worker: prompt ids, options, the table from the Engine's argument names to the
    request's fields (for errors), and whether the request speculates."""

    ids: list[int]
    options: GenerationOptions
    fields: dict[str, str]
    speculative: bool


def _request_value(name: str, value: object) -> object:
    if name == "logit_bias" and isinstance(value, dict):
        try:
            return json_logit_bias(value)
        except ValueError as exc:
            raise APIError(400, str(exc), param="logit_bias") from None
    return value


def _logprob_options(request: GenerationRequest) -> int:
    """``top_logprobs`` for the Engine: the alternatives to report (the Engine reports the chosen token's logprob
    with at least one alternative; a request for 0 shows none of them)."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return max(1, request.top_logprobs or 0) if request.logprobs else 0
    return 0 if request.logprobs is None else max(1, request.logprobs)


def prepare_options(
    request: GenerationRequest, settings: ServerSettings, context_length: int
) -> tuple[GenerationOptions, bool]:
    """``GenerationOptions`` for a request (400 naming the field for values it refuses) and whether the request
    speculates. Without ``max_tokens`` (and no ``settings.default_max_tokens``) the context ends the generation."""
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = settings.default_max_tokens or context_length
    speculative = settings.speculative is not None
    if request.ortspec is not None and request.ortspec.speculative is not None:
        speculative = request.ortspec.speculative
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": request.stop,
        "top_logprobs": _logprob_options(request),
        "speculative": (settings.speculative or MANY_REQUESTS_SPECULATIVE) if speculative else None,
        "response_format": request.response_format,
    }
    if isinstance(request, ChatCompletionRequest):
        kwargs |= {"tools": request.tools, "tool_choice": request.tool_choice}
        if request.parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = request.parallel_tool_calls
    for name in SAMPLING_OPTIONS:
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = _request_value(name, value)
    try:
        options = GenerationOptions(**kwargs)
    except ValueError as exc:
        raise client_error(exc, argument_fields(request)) from None
    return options, speculative


def prompt_of(request: GenerationRequest) -> str | list[int] | list[dict[str, Any]]:
    """The prompt as the Engine takes it: text, token ids, or chat messages."""
    if isinstance(request, ChatCompletionRequest):
        return [m.as_template_message() for m in request.messages]
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list of one string or token list)", param="prompt")
        return prompt[0]
    return prompt  # type: ignore[return-value]  # list[str] / list[list[int]] were handled above
