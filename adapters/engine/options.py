"""The Engine's generation keywords: ``GenerationOptions`` (declared once, from the core's ``Limits`` and
``Sampling`` and the Engine's own), the proposers ``speculative`` names, and the decorators that give every
generation method those keywords.
"""

from __future__ import annotations

import functools
import inspect
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from ortspec.adapters.engine.structured import ResponseFormat
from ortspec.adapters.engine.tools import Function, Named, ToolUse, parse_tool_choice, parse_tools
from ortspec.core import Limits, Proposer, Sampling, WidthPolicy, option
from ortspec.core.checks import ArgumentError
from ortspec.core.speculative import (
    AUTO_LOOKUP,
    DEFAULT_SPECULATIVE,
    SPECULATIVE_CHOICES,
    SPECULATIVE_NAMES,
    check_speculative,
    speculative_value,
)
from ortspec.driver import StreamCallback

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]

__all__ = [
    "AUTO_LOOKUP",
    "DEFAULT_SPECULATIVE",
    "SPECULATIVE_CHOICES",
    "SPECULATIVE_NAMES",
    "GenerationOptions",
    "Prompt",
    "speculative_value",
]

# Verify-vs-decode logit drift (in logits) above which speculative output is no longer guaranteed to equal plain.
DRIFT_WARNING_THRESHOLD = 1e-3


def _check_speculative(instance: Any, attribute: Any, value: Any) -> None:
    check_speculative(value)


def _check_draft_width(instance: Any, attribute: Any, value: Any) -> None:
    if value == "auto" or isinstance(value, WidthPolicy):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError("draft_width", f"draft_width={value!r}: expected 'auto', an int >= 1 or a width policy")


@attrs.frozen(kw_only=True, slots=False)
class GenerationOptions(Sampling, Limits):
    """The keywords of every ``Engine`` generation method, validated (a ``ValueError`` names the keyword).

    Declared once: the shared options come from the core's ``Limits`` (``max_tokens``, ``stop``, ``top_logprobs``,
    ``tie_margin``) and ``Sampling`` (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
    ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``: every rule in
    ``core/sampling.py``; with the same seed, speculative output equals plain output token for token; sampling
    without a seed draws one, reported as ``result.seed``); the Engine's own are below. Each field's help is in
    its declaration (``ortspec.core.options_of(GenerationOptions)``), which the command line, the server and batch
    read too.
    """

    speculative: str | Proposer | None = option(
        DEFAULT_SPECULATIVE,
        f"how drafts are made (default {DEFAULT_SPECULATIVE!r}): None (plain decoding), "
        + ", ".join(f"{name!r} ({meaning})" for name, meaning in SPECULATIVE_NAMES.items())
        + ", or a proposer object ('none' is None)",
        converter=speculative_value,
        validator=_check_speculative,
        none_is_a_value=True,
    )
    draft_width: int | WidthPolicy | str = option(
        "auto",
        "'auto' (the cost-aware policy on this backend's measured verify costs), the most draft tokens per pass, or "
        "a width policy",
        validator=_check_draft_width,
    )
    chat: bool = option(False, "format a text prompt as one user turn with the model's chat template")
    system: str | None = option(None, "with chat: a system turn before the user turn")
    ignore_eos: bool = option(False, "do not stop at the model's EOS tokens")
    response_format: ResponseFormat | None = option(
        None,
        "constrain the output (structured outputs): {'type': 'json_object'}, {'type': 'json_schema', 'json_schema': "
        "{'name', 'schema', 'strict'}}, or ortspec's {'type': 'regex', 'regex': R} and {'type': 'grammar', 'grammar': "
        "LARK}; a dict or its JSON text",
        converter=ResponseFormat.parse,
    )
    tools: tuple[Function, ...] | None = option(
        None,
        "with chat: functions the model may call, as the OpenAI API's tools: [{'type': 'function', 'function': "
        "{'name', 'description', 'parameters'}}] (a list or its JSON text); calls are constrained to each function's "
        "parameters schema (docs/structured-outputs.md, Tools)",
        converter=parse_tools,
    )
    tool_choice: str | Named | None = option(
        None,
        "with tools: 'none', 'auto' (the default: text or calls), 'required' (calls), or {'type': 'function', "
        "'function': {'name': NAME}} (one call of NAME)",
        converter=parse_tool_choice,
    )
    parallel_tool_calls: bool = option(True, "with tools: allow several calls in one answer (false: at most one)")

    def __attrs_post_init__(self) -> None:
        tool_use = self.tool_use()
        if tool_use is not None and tool_use.calls and self.response_format is not None:
            raise ArgumentError(
                "response_format", "response_format: cannot be combined with tools unless tool_choice is 'none'"
            )

    def tool_use(self) -> ToolUse | None:
        """The tools, their choice and ``parallel_tool_calls`` as one checked value (None without tools)."""
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its fields (the slotted bases' state alone would drop this class's own fields): a request's
        options go to another process this way (``ortspec serve --ray``'s replicas)."""
        return (_generation_options, (attrs.asdict(self, recurse=False),))

    def limits(self) -> dict[str, Any]:
        """The ``Limits`` keywords of the core's ``Options``."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(Limits)}

    def sampling(self) -> Sampling:
        """The core's ``Sampling``; a seed is drawn when sampling without one."""
        values = {f.name: getattr(self, f.name) for f in attrs.fields(Sampling)}
        if values["seed"] is None and values["temperature"] > 0:
            values["seed"] = secrets.randbits(64)
        return Sampling(**values)


P = ParamSpec("P")
R = TypeVar("R")


def _bind_options(method: Callable[..., R], leading: int, options_type: Callable[..., GenerationOptions]) -> Any:
    """``method(*leading args, options)`` as ``method(*leading args, /, **keywords of options_type)``, with that
    signature for ``help()`` (the decorators below give it to type checkers)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        return method(*args[:leading], options_type(*args[leading:], **kwargs))

    head = [
        p.replace(kind=inspect.Parameter.POSITIONAL_ONLY)
        for p in list(inspect.signature(method).parameters.values())[:leading]
    ]
    keywords = list(inspect.signature(options_type).parameters.values())
    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        head + keywords, return_annotation=inspect.signature(method).return_annotation
    )
    return wrapper


def takes_options(
    options_type: Callable[P, GenerationOptions],
) -> Callable[[Callable[[Any, Prompt, GenerationOptions], R]], Callable[Concatenate[Any, Prompt, P], R]]:
    """Decorate ``method(self, prompt, options)`` to take ``options_type``'s keywords instead of ``options``."""
    return lambda method: _bind_options(method, 2, options_type)


def takes_callback_and_options(
    options_type: Callable[P, GenerationOptions],
) -> Callable[
    [Callable[[Any, Prompt, StreamCallback, GenerationOptions], R]],
    Callable[Concatenate[Any, Prompt, StreamCallback, P], R],
]:
    """``takes_options`` for ``method(self, prompt, callback, options)``."""
    return lambda method: _bind_options(method, 3, options_type)


def takes_prompts_and_options(
    options_type: Callable[P, GenerationOptions],
) -> Callable[
    [Callable[[Any, Sequence[Prompt], GenerationOptions], R]],
    Callable[Concatenate[Any, Sequence[Prompt], P], R],
]:
    """``takes_options`` for ``method(self, prompts, options)``."""
    return lambda method: _bind_options(method, 2, options_type)


def _generation_options(fields: dict[str, Any]) -> GenerationOptions:
    return GenerationOptions(**fields)
