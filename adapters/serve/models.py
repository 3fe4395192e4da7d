"""The request side of the HTTP API: pydantic request models, the tables from request fields to the Engine's
keywords and back, and ``prepare_options`` (a request -> ``GenerationOptions``).

The request models' JSON Schemas are the OpenAPI document's request bodies, and they state every rule the
validation applies, so the document accepts exactly what the server does:

- JSON's numbers as JSON Schema reads them: an ``integer`` is any number without a fraction (``JSONInt``: ``5.0``
  and ``1.5e10`` are integers), a ``number`` is a double (``JSONNumber``: an integer is one too);
- each option's bounds from its declaration (``surfaces.option_schema``: the bounds the Engine checks), and the
  core's limits on ``stop``;
- each message role with its own fields (only an assistant turn makes calls, only a tool turn answers one), and
  ``response_format``, ``tools`` and ``tool_choice`` by their shapes;
- the rules between fields (``top_logprobs`` needs ``logprobs``, ...: ``_CHAT_RULES``).

What no schema can state (the model's context and vocabulary, a compiler's verdict, ...) is the document's
``openapi.BEYOND_SCHEMA``, a 400 naming the field like every other refusal.

Two tables, one per direction:

- The sampling fields are the core's sampling options under their own names: the request fields are built from
  their declarations (``ortspec.adapters.engine.surfaces.request_fields``; type, help and bounds), so a new
  sampling option is a new request field with nothing to write here.
- ``argument_fields(request)``: the Engine's argument name (``ArgumentError.argument``) -> the request field it
  came from, so an Engine error is reported on the field the client typed (``max_completion_tokens`` for the
  Engine's ``max_tokens`` when the request set that one).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from fastapi.exceptions import RequestValidationError
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    create_model,
    field_validator,
)

from ortspec.adapters.engine.options import DEFAULT_SPECULATIVE, GenerationOptions
from ortspec.adapters.engine.surfaces import (
    SAMPLING_OPTIONS,
    check_bounds,
    json_logit_bias,
    option_schema,
    request_fields,
)
from ortspec.adapters.serve.errors import APIError, client_error, named
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.adapters.serve.wire import (
    _TAG_ERRORS,
    RESPONSE_FORMATS,
    AssistantTurn,
    ChatMessage,
    ChosenFunction,
    DeveloperTurn,
    FunctionDefinition,
    JSONInt,
    JSONNumber,
    JSONSchemaSpec,
    MessageCalledFunction,
    MessageToolCall,
    NamedToolChoice,
    OrtspecOptions,
    PromptValue,
    ResponseFormatValue,
    StopValue,
    StreamOptions,
    SystemTurn,
    TextPart,
    Tool,
    ToolTurn,
    UserTurn,
    _integral,
    _prompt_shape,
    _Strict,
)

# The sampling options as request fields, from their one declaration (optional; None: the option's default).
_SamplingRequest: type[_Strict] = create_model(  # type: ignore[call-overload]
    "_SamplingRequest", __base__=_Strict, **request_fields(SAMPLING_OPTIONS, integer=JSONInt, number=JSONNumber)
)
_MAX_TOKENS = option_schema("max_tokens")


class _GenerationRequest(_SamplingRequest):  # type: ignore[valid-type, misc]
    """Fields common to both endpoints. ``user`` is accepted and ignored."""

    model: str
    max_tokens: JSONInt | None = Field(default=None, json_schema_extra=_MAX_TOKENS)
    stop: StopValue | None = Field(
        default=None, description="stop strings: generation ends at the first match (the match is cut from the text)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: JSONInt = Field(default=1, json_schema_extra={"minimum": 1, "maximum": 1})  # documented: n=1 only
    user: str | None = None
    ortspec: OrtspecOptions | None = None
    response_format: ResponseFormatValue | None = Field(
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

    prompt: Annotated[PromptValue, Discriminator(_prompt_shape)]
    logprobs: Annotated[int, Field(ge=0, le=5), BeforeValidator(_integral)] | None = None


# A chat request's rules between fields (``dependentSchemas``: when the key is present, the request also obeys the
# schema); the Engine's checks refuse the same (``GenerationOptions``, ``ToolUse.of``) and ``_logprob_options``.
_NULL = {"type": "null"}
_CHAT_RULES: dict[str, Any] = {
    "top_logprobs": {  # top_logprobs needs logprobs: true
        "anyOf": [
            {"properties": {"top_logprobs": _NULL}},
            {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        ]
    },
    "tool_choice": {  # a tool_choice needs tools
        "anyOf": [
            {"properties": {"tool_choice": _NULL}},
            {"required": ["tools"], "properties": {"tools": {"type": "array"}}},
        ]
    },
    "response_format": {  # a constraint and tools (that may be called) exclude each other
        "anyOf": [
            {"properties": {"response_format": {"anyOf": [_NULL, {"properties": {"type": {"const": "text"}}}]}}},
            {"not": {"required": ["tools"]}},
            {"properties": {"tools": _NULL}},
            {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}},
        ]
    },
}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``; ``top_logprobs`` (0-20)
    needs ``logprobs: true``; ``tool_choice`` needs ``tools``; ``response_format`` (but ``text``) needs no tools, or
    ``tool_choice: "none"``."""

    model_config = ConfigDict(json_schema_extra={"dependentSchemas": _CHAT_RULES})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: JSONInt | None = Field(default=None, json_schema_extra=_MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = Field(
        default=None,
        description='functions the model may call: [{"type": "function", "function": {"name", "description", '
        '"parameters"}}]; a call\'s arguments obey its parameters schema (a 400 names tools when one cannot be used)',
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description='"none", "auto" (the default with tools), "required", or {"type": "function", "function": '
        '{"name": NAME}} (NAME one of the tools)',
    )
    parallel_tool_calls: bool | None = Field(default=None, description="several calls in one answer (default true)")


GenerationRequest = CompletionRequest | ChatCompletionRequest

# Every field name of every request model: what a pydantic error location may name (validation_error).
_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    SystemTurn,
    DeveloperTurn,
    UserTurn,
    AssistantTurn,
    ToolTurn,
    TextPart,
    OrtspecOptions,
    StreamOptions,
    MessageToolCall,
    MessageCalledFunction,
    *RESPONSE_FORMATS,
    JSONSchemaSpec,
    Tool,
    FunctionDefinition,
    NamedToolChoice,
    ChosenFunction,
)
_REQUEST_FIELDS = frozenset(f.alias or name for model in _MODELS for name, f in model.model_fields.items())


def _param(loc: list[Any]) -> str:
    """The request field an error location names (``messages[0].content``): indices, and field names up to the
    first part that is neither (a dict's key, a plain union's member); a tagged union's tag is skipped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif " " in part:
            continue  # a tag of ``_tagged`` or of the prompt's shapes: which choice was read, not a field
        elif part in _REQUEST_FIELDS:
            param += f".{part}" if param else part
        else:
            break
    return param


def validation_error(exc: RequestValidationError) -> APIError:
    """A 400 naming the first field pydantic refused, e.g. ``messages[0].role``."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        ctx = first.get("ctx")
        reason = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return APIError(400, f"the request body is not valid JSON: {reason}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = _param(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden" and loc:
        param = _param(loc[:-1])
        param = f"{param}.{loc[-1]}" if param else str(loc[-1])
        tags = [part for part in loc if isinstance(part, str) and " " in part]
        msg = (
            f"not a field of a {tags[-1]}"
            if tags
            else "unrecognized request argument (this server does not support it)"
        )
    elif kind == "missing":
        msg = "required"
    elif kind in _TAG_ERRORS and isinstance(given := first.get("input"), dict):  # an unknown tag (_tagged)
        field = _TAG_ERRORS[kind]
        param = f"{param}.{field}" if param else field
        msg = f"{msg} (got {given.get(field)!r:.80})"
    elif "input" in first and kind != "value_error":
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


def _as_given(value: object) -> object:
    """A request's object field as the client gave it (the JSON the Engine's own checks read), else the value."""
    return value.model_dump(by_alias=True, exclude_unset=True) if isinstance(value, BaseModel) else value


def _unpaired_surrogate(value: object, where: str) -> str | None:
    """The first place in ``value`` (a request, or a part of one) whose string holds an unpaired surrogate, else
    None. ``where``: the place of ``value`` itself."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        value = {field.alias or name: getattr(value, name) for name, field in fields.items()}
    if isinstance(value, dict):
        for key, item in value.items():
            place = f"{where}.{key}" if where else str(key)
            found = _unpaired_surrogate(key, place) or _unpaired_surrogate(item, place)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _unpaired_surrogate(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def check_text(request: GenerationRequest) -> None:
    """A 400 naming the first string of ``request`` that is not Unicode text: one with an unpaired surrogate
    (``"\\ud800"`` alone is valid JSON syntax, but no text: I-JSON, RFC 7493, refuses it, and a tokenizer cannot
    read it)."""
    where = _unpaired_surrogate(request, "")
    if where is not None:
        message = "holds an unpaired surrogate (a string must be Unicode text: I-JSON, RFC 7493)"
        raise APIError(400, named(where, message), param=where)


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
    check_text(request)
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
        if request.max_tokens is not None:  # not used, but held to what the schema says of it
            try:
                check_bounds("max_tokens", request.max_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), param="max_tokens") from None
    if max_tokens is None:
        max_tokens = settings.default_max_tokens or context_length
    speculative = settings.speculative is not None
    if request.ortspec is not None and request.ortspec.speculative is not None:
        speculative = request.ortspec.speculative
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "stop": request.stop,
        "top_logprobs": _logprob_options(request),
        "speculative": (settings.speculative or DEFAULT_SPECULATIVE) if speculative else None,
        "response_format": _as_given(request.response_format),
    }
    if isinstance(request, ChatCompletionRequest):
        tools = None if request.tools is None else [_as_given(tool) for tool in request.tools]
        kwargs |= {"tools": tools, "tool_choice": _as_given(request.tool_choice)}
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
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        return prompt[0]  # a list of one prompt (the schema's maxItems: 1)
    return prompt
