"""The response side of the HTTP API, in the OpenAI shapes: a ``GenerateResult`` becomes a completion or chat
completion (or its stream chunks), with the usage, the token logprobs and the ``ortspec`` extension field.

Nothing here decides what is committed: finish reasons come from ``FinishReason.openai``, text and token counts
from the result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from ortspec.adapters.engine.tokenizer import Tokenizer
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

    def top(self, lp: TokenLogprob) -> list[tuple[int, float]]:
        """The alternatives to report: at most ``alternatives``, none at -inf (a token the row could never pick, e.g.
        one a ``response_format`` forbids; JSON has no -inf)."""
        return [(t, p) for t, p in lp.top[: self.alternatives] if p > -math.inf]

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
    """One endpoint's response shapes (completion or chat), for a whole response and for stream chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, formatter: LogprobFormatter | None) -> None:
        self.chat, self.id, self.model, self.logprobs = chat, request_id, model, formatter
        self.created = int(time.time())
        self.text_offset = 0

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

    def usage_chunk(self, result: GenerateResult) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return head | {"choices": [], "usage": usage(result)}
