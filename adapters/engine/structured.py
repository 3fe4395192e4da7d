"""Structured outputs on llguidance: ``response_format`` as the core's ``Grammar`` (``core/constraint.py``).

``response_format`` (an Engine keyword, a server request field, a batch record key, ``--response-format JSON`` on
the command line) is the OpenAI API's value, plus two ortspec extensions:

- ``{"type": "text"}`` (or None): unconstrained;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON matching the schema;
- ``{"type": "regex", "regex": "..."}``: text matching the regular expression (Rust ``regex`` syntax);
- ``{"type": "grammar", "grammar": "..."}``: text matching a Lark grammar (llguidance's dialect, ``start`` rule).

``ResponseFormat`` is the value checked for its shape (``ArgumentError`` naming ``response_format``); a
``GrammarCompiler`` (one per Engine: the model's tokenizer as llguidance reads it, built once, on first use) turns
it into an ``LlgGrammar`` and refuses what llguidance refuses (a bad schema, an unsupported keyword or format, a
regex or grammar that does not parse) or what can never match, before anything reaches the model. JSON is compact
(no whitespace between tokens), so more of it is forced (free drafts: ``core/forced.py``). Why llguidance and not
xgrammar, and what a mask costs: docs/structured-outputs.md. The same compiler compiles a generation's tool calls
(``tool_grammar``: ``tools.py``), naming ``tools`` for what it refuses.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from ortspec.core.checks import ArgumentError

if TYPE_CHECKING:
    from ortspec.adapters.engine.tools import ToolUse

KINDS = ("text", "json_object", "json_schema", "regex", "grammar")
_FIELDS = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}  # the kind's own field
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance.JsonCompileOptions


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:
        raise ImportError("response_format needs llguidance: pip install 'ortspec[serve]' (or llguidance)") from exc
    return llguidance


def _refuse(message: str) -> ArgumentError:
    return ArgumentError("response_format", f"response_format: {message}")


@attrs.frozen
class ResponseFormat:
    """A constraint's kind (one of ``KINDS`` but ``text``) and its source: the JSON schema (as JSON text),
    the regular expression or the Lark grammar."""

    kind: str
    source: str

    @classmethod
    def parse(cls, value: object) -> ResponseFormat | None:
        """``value`` as the Engine takes it (a mapping, its JSON text, or a ``ResponseFormat``); None for no
        constraint. ``ArgumentError`` naming ``response_format`` for anything else."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _refuse(f"not valid JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise _refuse(f'expected an object such as {{"type": "json_object"}}, got {value!r:.80}')
        kind = value.get("type")
        if kind not in KINDS:
            raise _refuse(f"type must be one of {', '.join(KINDS)}, got {kind!r:.80}")
        field = _FIELDS.get(kind)
        extra = sorted(str(k) for k in value if k not in ("type", field))
        if extra:
            raise _refuse(f"unrecognized field {extra[0]!r} for type {kind!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", json.dumps({"type": "object"}))
        assert field is not None
        if field not in value:
            raise _refuse(f"type {kind!r} needs the field {field!r}")
        if kind == "json_schema":
            return cls("json_schema", _schema_text(value[field]))
        source = value[field]
        if not isinstance(source, str) or not source:
            raise _refuse(f"{field} must be a non-empty string, got {source!r:.80}")
        return cls(kind, source)


def _schema_text(spec: object) -> str:
    """The ``json_schema`` object's schema as canonical JSON text (``name`` checked, ``strict`` accepted)."""
    if not isinstance(spec, Mapping):
        raise _refuse(f'json_schema must be an object {{"name", "schema", "strict"}}, got {spec!r:.80}')
    extra = sorted(str(k) for k in spec if k not in ("name", "schema", "strict", "description"))
    if extra:
        raise _refuse(f"json_schema: unrecognized field {extra[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _refuse("json_schema.name must be a non-empty string")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _refuse("json_schema.strict must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping) and not isinstance(schema, bool):
        raise _refuse(f"json_schema.schema must be a JSON Schema object, got {schema!r:.80}")
    try:
        return json.dumps(schema, allow_nan=False)  # key order kept: it is the order of the properties
    except (TypeError, ValueError) as exc:
        raise _refuse(f"json_schema.schema is not JSON ({exc})") from None


class LlgMatcher:
    """``core.constraint.Matcher`` on an ``llguidance.LLMatcher``; masks at the model's vocabulary."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = list(eos_ids)
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        mask[self._eos] = False
        return mask

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise ValueError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if not self._matcher.rollback(count):
            raise ValueError(f"the grammar could not roll back {count} tokens: {self._matcher.get_error()}")

    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())

    def complete(self) -> bool:
        return bool(self._matcher.is_accepting() and self._matcher.is_stopped())

    def forced(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self._matcher.compute_ff_tokens())


@attrs.frozen
class LlgGrammar:
    """``core.constraint.Grammar``: a compiled llguidance grammar on one model's tokenizer."""

    tokenizer: Any = attrs.field(repr=False)  # llguidance.LLTokenizer
    grammar: str = attrs.field(repr=False)
    vocab_size: int
    eos_ids: tuple[int, ...]

    def matcher(self) -> LlgMatcher:
        matcher = _llguidance().LLMatcher(self.tokenizer, self.grammar, log_level=0)
        return LlgMatcher(matcher, self.vocab_size, self.eos_ids)


class GrammarCompiler:
    """One model's ``response_format`` compiler: its tokenizer (``tokenizers`` JSON) as llguidance reads it, made
    on first use, and the grammars compiled so far (the last 64)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(eos_ids))
        self._compile = functools.lru_cache(maxsize=64)(self._compile_uncached)

    @functools.cached_property
    def tokenizer(self) -> Any:
        llguidance = _llguidance()
        eos = list(self.eos_ids) or None
        return llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)

    def grammar(self, value: ResponseFormat | None) -> LlgGrammar | None:
        """The grammar of ``value`` (None: unconstrained); ``ArgumentError`` naming ``response_format`` for a
        constraint llguidance refuses or that can never match."""
        return None if value is None else self._compile(value, "response_format", "response_format")

    def tool_grammar(self, tools: ToolUse | None) -> LlgGrammar | None:
        """The grammar of a generation's tool calls (None without tools, or with ``tool_choice`` ``none``);
        ``ArgumentError`` naming ``tools`` (and the function, e.g. ``tools[1].function.parameters``) for a schema
        llguidance refuses."""
        if tools is None or not tools.calls:
            return None
        for i, function in enumerate(tools.functions):
            schema = ResponseFormat("json_schema", function.parameters)
            self._compile(schema, "tools", f"tools[{i}].function.parameters")
        return self._compile(ResponseFormat("grammar", tools.grammar_source()), "tools", "tools")

    def _compile_uncached(self, value: ResponseFormat, argument: str, label: str) -> LlgGrammar:
        """``value`` compiled; ``ArgumentError`` naming ``argument``, its message led by ``label``."""
        m = _llguidance().LLMatcher

        def refuse(message: str) -> ArgumentError:
            return ArgumentError(argument, f"{label}: {message}")

        try:
            if value.kind == "regex":
                text = m.grammar_from_regex(value.source)
            elif value.kind == "grammar":
                text = m.grammar_from_lark(value.source)
            else:
                text = m.grammar_from_json_schema(value.source, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise refuse(str(exc)) from None
        failed, messages = m.validate_grammar_with_warnings(text, self.tokenizer)
        if failed:
            raise refuse(f"{value.kind}: {messages[0].strip()}")
        grammar = LlgGrammar(self.tokenizer, text, self.vocab_size, self.eos_ids)
        start = grammar.matcher()
        if not start.accepting() and not start.allowed().any():
            raise refuse(f"the {value.kind} can never match: no token can start it")
        return grammar
