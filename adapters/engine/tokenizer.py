"""Text <-> token ids for a model folder, with the Hugging Face ``tokenizers`` library, and its chat template."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from tokenizers import Tokenizer as _HFTokenizer

from ortspec.adapters.engine import tool_format
from ortspec.adapters.engine.options import Prompt
from ortspec.backends.onnx.folder import ModelFolder, ModelFolderError
from ortspec.core.checks import ArgumentError, ids_in_vocab

if TYPE_CHECKING:
    from ortspec.adapters.engine.tools import ToolUse

_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """A folder's ``tokenizer.json`` (required) and chat template (``chat_template.jinja`` or the
    ``chat_template`` of ``tokenizer_config.json``, when present)."""

    def __init__(self, tokenizer: _HFTokenizer, chat_template: str | None = None, *, path: Path | None = None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.path = path  # the tokenizer.json it was read from, if any
        self._template: Any = None  # the compiled jinja2 template, made on first use

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """Read ``folder/tokenizer.json`` and the chat template; ``ModelFolderError`` names the file when it is
        missing or is not a tokenizer."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFolderError(f"model folder {folder} has no tokenizer.json")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise ModelFolderError(f"{path} is not a tokenizers tokenizer.json [tokenizers: {exc}]") from exc
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                cfg = {}
            if isinstance(cfg.get("chat_template"), str):
                template = cfg["chat_template"]
        return cls(tok, template, path=path)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine reads)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Entries of the tokenizer, added (special) tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id``, or None when the tokenizer has no such id."""
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special-token markup (``<|im_start|>``...) recognised, nothing added."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, special tokens skipped (pure: the same ids give the same text). With
        ``skip_special_tokens=False`` they are spelled out (``<|im_start|>``...), so a rendered prompt's ids decode
        to text that ``encode`` turns back into them (for engines that take a prompt as text only)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` itself (it reads a variable named ``tools``); when it does
        not, tools, calls and results are written in the trained format of ``tool_format``."""
        if self.chat_template is None:
            return False
        import jinja2.meta

        return "tools" in jinja2.meta.find_undeclared_variables(self._environment().parse(self.chat_template))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``; an assistant turn's content may be None when it
        has ``tool_calls``, a ``tool`` turn is a tool's result) with the folder's chat template (ChatML when the
        folder has none). ``tools``: the function definitions (``{"name", "description", "parameters"}``) to show
        the model: passed to a template that takes them (as ``[{"type": "function", "function": ...}]``), else
        written with the messages' calls and results in ``tool_format``'s trained format."""
        if isinstance(messages, str) or not all(isinstance(m, Mapping) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for m in messages:
            content = m.get("content")
            calls = m.get("role") == "assistant" and m.get("tool_calls")
            if not isinstance(m.get("role"), str) or not (isinstance(content, str) or content is None and calls):
                raise ValueError(f"chat message {m!r} needs string 'role' and 'content'")
        if self._template is None:
            self._template = self._environment().from_string(self.chat_template or _CHATML)
        if self.takes_tools:
            wrapped = None if tools is None else [{"type": "function", "function": dict(t)} for t in tools]
            return self._template.render(
                messages=list(messages), tools=wrapped, add_generation_prompt=add_generation_prompt
            )
        plain = tool_format.in_format(messages, tools)
        return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt)

    @staticmethod
    def _environment() -> Any:
        import jinja2.sandbox

        return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@attrs.frozen
class PromptReader:
    """A prompt into token ids, for a model of ``vocab_size`` ids whose text is ``tokenizer``'s: what an Engine, and
    a server that holds no Engine (``ortspec serve --ray``'s ingress), make requests ready with."""

    tokenizer: Tokenizer
    vocab_size: int

    def prompt_ids(
        self, prompt: Prompt, *, chat: bool = False, system: str | None = None, tools: ToolUse | None = None
    ) -> list[int]:
        """Token ids for a prompt: text (chat-formatted as one user turn when ``chat``), a list of chat
        messages (always chat-formatted), or token ids (used as they are). ``tools``: the generation's tools,
        shown to the model in a chat prompt (``Tokenizer.apply_chat_template``). ``ValueError`` names ``prompt``
        for an empty prompt (an empty text is refused with ``chat`` too: it is not a question), ids that are not
        ints in the vocabulary, or anything else; ``tools`` for tools with a prompt that is not a chat."""
        definitions = tools.definitions() if tools is not None else None
        if isinstance(prompt, str):
            if not prompt:
                raise ArgumentError("prompt", "the prompt is empty: give some text (or token ids)")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                prompt = self.tokenizer.apply_chat_template(messages, tools=definitions)
            elif definitions is not None:
                raise ArgumentError("tools", "tools: the model is shown its tools in a chat prompt: give chat=True")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)):
            raise ArgumentError("prompt", "the prompt is bytes: decode it to str (or give token ids)")
        elif isinstance(prompt, Mapping) or not isinstance(prompt, Sequence) and not hasattr(prompt, "__array__"):
            raise ArgumentError(
                "prompt",
                f"the prompt must be text, a list of chat messages or a list of token ids, got {type(prompt).__name__}",
            )
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), tools=definitions)  # type: ignore[arg-type]
            ids = self.tokenizer.encode(text)
        else:
            if chat:
                raise ArgumentError("prompt", "chat=True needs a text prompt or chat messages, not token ids")
            ids = list(ids_in_vocab("prompt", list(prompt), self.vocab_size))
        if not ids:
            raise ArgumentError("prompt", "the prompt is empty: it must encode to at least one token")
        return ids


def check_tokenizer_fits(folder: ModelFolder, tokenizer: Tokenizer) -> None:
    """``ModelFolderError`` when ``tokenizer.json`` cannot be this model's: it makes ids past the model's vocabulary,
    or lacks its EOS ids. (A tokenizer with fewer entries than the vocabulary is normal: vocabularies are padded.)"""
    size = tokenizer.vocab_size
    config = folder.path / "genai_config.json"
    if size > folder.vocab_size:
        raise ModelFolderError(
            f"{tokenizer.path} has {size} tokens but {config} says model.vocab_size = {folder.vocab_size}: "
            "the tokenizer is for another model"
        )
    for eos in folder.eos_token_ids:
        if tokenizer.id_to_token(eos) is None:
            raise ModelFolderError(
                f"{tokenizer.path} has no token {eos}, the model.eos_token_id of {config}: "
                "the tokenizer is for another model"
            )
