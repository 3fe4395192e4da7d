"""The wire types of a request body: what a JSON value of the OpenAPI document's types is here (``JSONInt``,
``JSONNumber``, ...), and the parts of a request: its messages (one model per role), ``response_format``, ``tools``
and ``tool_choice``, the prompt and ``stop`` values. Each model's JSON Schema states every rule its validation
applies (``models.py``'s module docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ortspec.adapters.engine.tools import _NAME as FUNCTION_NAME
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
