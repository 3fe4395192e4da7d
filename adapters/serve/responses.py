"""The response side of the HTTP API, in the OpenAI shapes: a ``GenerateResult`` becomes a completion or chat
completion (or its stream chunks), with the usage, the token logprobs and the ``ortspec`` extension field.

Nothing here decides what is committed: finish reasons come from ``FinishReason.openai``, text and token counts
from the result.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.engine.tool_format import CallReader, ContentPiece, Piece
from ortspec.adapters.engine.tools import ToolUse
from ortspec.core.state import TokenLogprob
from ortspec.driver import GenerateResult


def usage(result: GenerateResult) -> dict[str, Any]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
    }


def ortspec_stats(result: GenerateResult, *, speculative: bool, worker: int) -> dict[str, Any]:
    """The extension field ``ortspec`` of a response: how the tokens were decided (``worker``: its index)."""
    s = result.stats
    stats: dict[str, Any] = {
        "speculative": speculative,
        "passes": s.steps,
        "proposed": s.proposed_tokens,
        "accepted": s.accepted_tokens,
        "acceptance": round(s.acceptance_rate, 4),
        "worker": worker,
    }
    if result.seed is not None:  # sampled
        stats["seed"] = result.seed
    return stats


class LogprobFormatter:
    """Token logprobs in the two OpenAI shapes, with token strings from the model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, alternatives: int) -> None:
        self.decode, self.alternatives = tokenizer.decode, alternatives

    def token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def top(self, lp: TokenLogprob) -> tuple[tuple[int, float], ...]:
        """The alternatives to report: at most ``alternatives`` (the core never reports one at -inf)."""
        return lp.top[: self.alternatives]

    def chat(self, items: Sequence[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in self.top(lp)]} for lp in items
        ]
        return {"content": content, "refusal": None}

    def completion(self, items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [self.token(lp.token_id) for lp in items]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self.token(t): p for t, p in self.top(lp)} for lp in items],
            "text_offset": offsets,
        }


class ResponseShape:
    """One endpoint's response shapes (completion or chat), for a whole response and for stream chunks. ``tools``: a
    chat request's tools; when the model may call them, its output is read as content or ``tool_calls``
    (``tool_format``), whole or, streamed, as it grows (``stream_chunks``)."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        formatter: LogprobFormatter | None,
        tools: ToolUse | None = None,
    ) -> None:
        self.chat, self.id, self.model, self.logprobs = chat, request_id, model, formatter
        self.created = int(time.time())
        self.text_offset = 0
        self.tools = tools if tools is not None and tools.calls else None
        self._reader = CallReader() if self.tools is not None else None

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
            reply = self.tools.read(result.text) if self.tools is not None else None
            if reply is not None and reply.content is None:
                choice["message"] |= {"content": None, "tool_calls": [call.openai() for call in reply.calls]}
                choice["finish_reason"] = reply.finish_reason(choice["finish_reason"])
        else:
            choice["text"] = result.text
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": [choice], "usage": usage(result), "ortspec": extension}

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

    def stream_chunks(
        self, text: str, logprobs: Sequence[TokenLogprob], *, usage_field: bool = False
    ) -> list[dict[str, Any]]:
        """The chunks for ``text``, the output's next piece, and the ``logprobs`` of its tokens (on the first chunk):
        a content chunk, or, for a request whose tools the model may call, the pieces ``CallReader`` releases
        (content, or ``delta.tool_calls``: a call's start with its index, id and name, then pieces of its
        arguments); none while it waits to know."""
        if self._reader is None:
            return [self.chunk(text, logprobs, usage_field=usage_field)] if text else []
        out = [self._piece_chunk(p, usage_field) for p in self._reader.feed(text)]
        if out and logprobs:
            out[0]["choices"][0]["logprobs"] = self._logprobs(logprobs)
        return out

    def last_chunks(
        self, result: GenerateResult, logprobs: Sequence[TokenLogprob], *, usage_field: bool = False
    ) -> list[dict[str, Any]]:
        """What the reader still holds, then the last chunk: the finish reason (``tool_calls`` for complete calls)
        and the ``logprobs`` not sent yet."""
        assert result.finish_reason is not None
        out = [self._piece_chunk(p, usage_field) for p in self._reader.finish()] if self._reader is not None else []
        finish = result.finish_reason.openai
        if self._reader is not None:
            finish = self._reader.finish_reason(finish)
        return [*out, self.chunk(None, logprobs, finish, usage_field=usage_field)]

    def _piece_chunk(self, piece: Piece, usage_field: bool) -> dict[str, Any]:
        if isinstance(piece, ContentPiece):
            return self.chunk(piece.text, usage_field=usage_field)
        call: dict[str, Any] = {"index": piece.index, "function": {"arguments": piece.arguments}}
        if piece.id is not None:
            call |= {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": ""}}
        out = self.chunk(None, usage_field=usage_field)
        out["choices"][0]["delta"]["tool_calls"] = [call]
        return out

    def usage_chunk(self, result: GenerateResult) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": usage(result)}
