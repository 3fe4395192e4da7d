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

from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple, Union

from fastapi.exceptions import RequestValidationError
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)

from ortspec.adapters.engine.options import DEFAULT_SPECULATIVE, GenerationOptions
from ortspec.adapters.engine.surfaces import (
    SAMPLING_OPTIONS,
    check_bounds,
    json_logit_bias,
    option_schema,
    request_fields,
)
from ortspec.adapters.engine.tools import _NAME as FUNCTION_NAME
from ortspec.adapters.serve.errors import APIError, client_error, named
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.core.options import MAX_STOP_LENGTH, MAX_STOPS

# ------------------------------------------------------------------------------------------------------------------
# The wire types: what a JSON value of the OpenAPI document's types is, here
# ------------------------------------------------------------------------------------------------------------------


def _integral(value: object) -> object:
    """A JSON number without a fraction (``5.0``, ``1.5e10``) as the int it is: JSON has one number type, and a
    JSON Schema ``integer`` is any number whose fraction is zero."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _double(value: object) -> object:
    """A JSON integer as the double a ``number`` field holds; one past the double range is refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ValueError("a number beyond the double range (format double)") from None
    return value


# A JSON integer: an int, or a number with no fraction (taken as that int). Strict otherwise: no bool, no string.
JSONInt = Annotated[int, BeforeValidator(_integral)]


# A JSON number: an IEEE double (``format: double``); an integer is taken as its double. No bool, no string.
JSONNumber = Annotated[
    float, AllowInfNan(False), BeforeValidator(_double), WithJsonSchema({"type": "number", "format": "double"})
]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral)]  # bounds first: the schema states them
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
# A function's name, as the OpenAI API allows it (``tools.py``'s rule).
FunctionName = Annotated[str, Field(pattern=f"^{FUNCTION_NAME.pattern}$")]


_TAG_ERRORS: dict[str, str] = {}  # the error type of each tagged union's unknown tag -> the field it names


def _tagged(field: str, choices: tuple[type[BaseModel], ...], kind: str) -> Any:
    """A union of ``choices`` told apart by the value of their ``field`` (each a ``Literal`` of one value); another
    value is an error naming ``field``. Each choice's tag is its value and ``kind`` (``"user message"``): a tag holds
    a space, so an error location's tag is never read as a field name (``validation_error``)."""
    tags = {model.model_fields[field].annotation.__args__[0]: model for model in choices}  # type: ignore[union-attr]

    def tag(value: object) -> str | None:
        if not isinstance(value, dict):
            return f"{next(iter(tags))} {kind}"  # not an object: the first choice says so
        chosen = value.get(field)
        return f"{chosen} {kind}" if isinstance(chosen, str) and chosen in tags else None

    members = tuple(Annotated[model, Tag(f"{value} {kind}")] for value, model in tags.items())
    message = f"{field} must be one of {', '.join(repr(v) for v in tags)}"
    union = Union[members]  # type: ignore[valid-type]  # noqa: UP007
    _TAG_ERRORS[f"invalid_{field}"] = field
    return Annotated[union, Discriminator(tag, custom_error_type=f"invalid_{field}", custom_error_message=message)]


# ------------------------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OrtspecOptions(_Strict):
    """The ``ortspec`` extension field of a request: ``{"speculative": false}`` decodes this request with plain
    steps, ``true`` with the server's proposer (its ``--speculative``, or ``DEFAULT_SPECULATIVE`` when that is
    none); unset: the server's default. The output is the same either way."""

    speculative: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MessageCalledFunction(_Strict):
    name: str
    arguments: str = Field(
        description="the arguments as JSON text", json_schema_extra={"contentMediaType": "application/json"}
    )


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (``tool_calls[i]`` of its message)."""

    id: str
    type: Literal["function"]
    function: MessageCalledFunction


Content = str | list[TextPart]


class _Turn(_Strict):
    """A chat turn; each role is its own model, with its own fields (``ChatMessage``)."""

    role: str
    content: Content | None

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template takes it (``developer`` is a system turn; text parts joined; calls in
        the OpenAI shape)."""
        content = self.content
        text = content if not isinstance(content, list) else "\n".join(p.text for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        calls = getattr(self, "tool_calls", None)
        if calls:
            out["tool_calls"] = [call.model_dump() for call in calls]
        call_id = getattr(self, "tool_call_id", None)
        if call_id is not None:
            out["tool_call_id"] = call_id
        return out


class SystemTurn(_Turn):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperTurn(_Turn):
    """A system turn (the OpenAI API's newer name for one)."""

    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserTurn(_Turn):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantTurn(_Turn):
    """An earlier answer: its text, or the calls it made (``content`` may then be null or left out), or both.
    ``refusal`` is accepted (a response's message sent back as it came) and not shown to the model."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"not": {"type": "null"}}}},
            ]
        }
    )

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _text_or_calls(self) -> AssistantTurn:
        if self.content is None and self.tool_calls is None:
            raise ValueError("content: required (null, or left out, only when the turn has tool_calls)")
        return self


class ToolTurn(_Turn):
    """A call's result: ``tool_call_id`` names the call it answers."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None


# A turn, by its role (each role's own fields: only an assistant turn makes calls, only a tool turn answers one).
if TYPE_CHECKING:
    ChatMessage = SystemTurn | DeveloperTurn | UserTurn | AssistantTurn | ToolTurn
else:
    ChatMessage = _tagged("role", (SystemTurn, DeveloperTurn, UserTurn, AssistantTurn, ToolTurn), "message")


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    name: NonEmptyText
    schema_: dict[str, Any] = Field(alias="schema", description="the output's JSON Schema (an object)")
    strict: bool | None = None
    description: str | None = None


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class RegexFormat(_Strict):
    """ortspec's extension: text matching a regular expression (Rust ``regex`` syntax)."""

    type: Literal["regex"]
    regex: NonEmptyText


class GrammarFormat(_Strict):
    """ortspec's extension: text matching a Lark grammar (llguidance's dialect, ``start`` rule)."""

    type: Literal["grammar"]
    grammar: NonEmptyText


# A response_format, by its type (``structured.KINDS``, each with its own fields).
RESPONSE_FORMATS = (TextFormat, JSONObjectFormat, JSONSchemaFormat, RegexFormat, GrammarFormat)
if TYPE_CHECKING:
    ResponseFormatValue = TextFormat | JSONObjectFormat | JSONSchemaFormat | RegexFormat | GrammarFormat
else:
    ResponseFormatValue = _tagged("type", RESPONSE_FORMATS, "format")


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="the arguments' JSON Schema: an object's (default: any object)",
        json_schema_extra={"properties": {"type": {"const": "object"}}},
    )
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _of_an_object(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters.get("type", "object") != "object":
            raise ValueError('a JSON Schema of an object ("type": "object")')
        return parameters


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


PromptValue = Union[  # noqa: UP007
    Annotated[NonEmptyText, Tag("prompt text")],
    Annotated[TokenIds, Tag("token ids")],
    Annotated[list[NonEmptyText], Field(min_length=1, max_length=1), Tag("one prompt text")],
    Annotated[list[TokenIds], Field(min_length=1, max_length=1), Tag("one token-id list")],
]


def _prompt_shape(value: object) -> str:
    """Which of ``PromptValue``'s shapes ``value`` is meant as (so an error speaks of that one)."""
    if not isinstance(value, list):
        return "prompt text"
    first = value[0] if value else None
    return (
        "one prompt text" if isinstance(first, str) else "one token-id list" if isinstance(first, list) else "token ids"
    )


# ``stop``: one string, or a list of them (as the core's ``MAX_STOPS`` and ``MAX_STOP_LENGTH`` allow).
StopValue = Annotated[
    Union[  # noqa: UP007
        Annotated[StopText, Tag("stop text")],
        Annotated[list[StopText], Field(max_length=MAX_STOPS), Tag("stop texts")],
    ],
    Discriminator(lambda value: "stop texts" if isinstance(value, list) else "stop text"),
]


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
