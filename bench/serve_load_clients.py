"""The client side of ``bench.serve_load``: the load prompts (the evaluation split of ``bench.workloads``) and
their reference texts, computed in process with plain greedy decoding; the reuse phase's conversations; and the
official ``openai`` client streaming each phase's requests (prefix reuse, load, overload) into ``Outcome`` records."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.machine import CpuContention
from bench.serve_load_report import Outcome, Prompt
from bench.serve_load_server import MODEL_NAME
from bench.workloads import build_workloads
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import BackendConfig

MAX_TOKENS = (64, 128, 32, 96)  # cycled over the prompts: mixed output lengths


# ----------------------------------------------------------------------------------------------------------------
# Prompts and references
# ----------------------------------------------------------------------------------------------------------------


def load_prompts(model_dir: Path, n_per_category: int, max_prompt_tokens: int) -> list[Prompt]:
    """``n_per_category`` chats of each category of the evaluation split (``bench.workloads``), each with its own
    source text, dropping any over ``max_prompt_tokens``."""
    tokenizer = Tokenizer.from_folder(model_dir)
    prompts = []
    for i, w in enumerate(build_workloads(n_per_category, max_prompt_tokens, tokenizer, split="evaluation")):
        ids = tokenizer.encode(tokenizer.apply_chat_template(w.messages))
        if len(ids) > max_prompt_tokens:  # the workloads' budget is approximate on very small vocabularies
            continue
        prompts.append(Prompt(w.name, w.messages, MAX_TOKENS[i % len(MAX_TOKENS)], len(ids)))
    return prompts


def conversation(tokenizer: Tokenizer, source: str, tokens: int) -> list[dict[str, str]]:
    """A first turn of about ``tokens`` tokens: a standard-library file cut to fit, and a question about it."""
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / source).read_text(encoding="utf-8")
    question = "\n\nWhat does this module do? Answer in two sentences."
    overhead = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}])))
    ids = tokenizer.encode(text)[: max(1, tokens - overhead)]
    return [{"role": "user", "content": tokenizer.decode(ids) + question}]


def compute_references(model_dir: Path, prompts: list[Prompt], threads: int) -> dict[str, Any]:
    """Each prompt's plain greedy text (no speculation, no prefix reuse), in process, one prompt at a time with
    ``threads`` threads: also a baseline measured on the machine as it is now (seconds, tokens, tokens/s)."""
    engine = Engine.from_dir(model_dir, BackendConfig(threads=threads))
    tokens = 0
    with CpuContention() as contention:
        for p in prompts:
            result = engine.generate(p.messages, max_tokens=p.max_tokens, speculative=None)
            assert result.finish_reason is not None
            p.reference, p.reference_finish = result.text, result.finish_reason.openai
            tokens += len(result.token_ids)
    wall = contention.wall_s
    return {
        "seconds": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "threads": threads,
        "other_processes_cores": contention.others_cores,
    }


# ----------------------------------------------------------------------------------------------------------------
# Clients
# ----------------------------------------------------------------------------------------------------------------


async def stream_once(
    client: openai.AsyncOpenAI, name: str, messages: list[dict[str, str]], max_tokens: int
) -> Outcome:
    out = Outcome(prompt=name, start=time.perf_counter())
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = (details.cached_tokens or 0) if details else 0
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
                    out.chunk_times.append(now)
                    if out.first is None:
                        out.first = now
                out.finish = choice.finish_reason or out.finish
    except openai.APIStatusError as exc:
        out.status, out.error = exc.status_code, f"{type(exc).__name__}: {exc.message}"
        out.retry_after = exc.response.headers.get("retry-after")
    except Exception as exc:  # noqa: BLE001 (every failure is counted and reported)
        out.status, out.error = 0, f"{type(exc).__name__}: {exc}"
    out.text = "".join(parts)
    return out


def _client(url: str, connections: int) -> openai.AsyncOpenAI:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0, connect=30.0))
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)


async def prefix_reuse_phase(url: str, turns: list[list[dict[str, str]]], max_tokens: int) -> list[dict[str, Any]]:
    """For each conversation: the cold first turn, then the second turn on the same server."""
    client = _client(url, 2)
    rows = []
    for i, first_turn in enumerate(turns):
        cold = await stream_once(client, f"conversation-{i}/turn-1", first_turn, max_tokens)
        second_turn = first_turn + [
            {"role": "assistant", "content": cold.text},
            {"role": "user", "content": "Which function in it would you read first, and why?"},
        ]
        warm = await stream_once(client, f"conversation-{i}/turn-2", second_turn, max_tokens)
        for o in (cold, warm):
            if o.error or o.first is None:
                raise RuntimeError(f"prefix-reuse phase: {o.prompt} failed: {o.error or 'no text'}")
        assert cold.first is not None and warm.first is not None
        rows.append(
            {
                "cold_ttft_s": cold.first - cold.start,
                "second_turn_ttft_s": warm.first - warm.start,
                "ratio": (warm.first - warm.start) / (cold.first - cold.start),
                "second_turn_cached_tokens": warm.cached_tokens,
            }
        )
    await client.close()
    return rows


def phase_offsets(concurrency: Sequence[int], requests: int) -> dict[int, int]:
    """Each load phase's first prompt: the phases (ascending concurrency) take consecutive runs of the prompts, so
    with ``sum(concurrency) * requests`` prompts or more no request repeats another's prompt (nothing cached)."""
    offsets, at = {}, 0
    for clients in concurrency:
        offsets[clients] = at
        at += clients * requests
    return offsets


async def load_phase(
    url: str, prompts: list[Prompt], concurrency: int, requests: int, offset: int = 0
) -> tuple[list[Outcome], float]:
    """``concurrency`` clients streaming ``requests`` requests each: client c's request r is prompt ``(offset + c x
    requests + r) mod len(prompts)``."""
    client = _client(url, concurrency)

    async def one_client(c: int) -> list[Outcome]:
        outcomes = []
        for r in range(requests):
            p = prompts[(offset + c * requests + r) % len(prompts)]
            outcomes.append(await stream_once(client, p.name, p.messages, p.max_tokens))
        return outcomes

    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(one_client(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return [o for outcomes in per_client for o in outcomes], wall


async def overload_phase(url: str, prompts: list[Prompt], concurrency: int) -> tuple[list[Outcome], float]:
    client = _client(url, concurrency)
    t0 = time.perf_counter()
    outcomes = await asyncio.gather(
        *(
            stream_once(client, prompts[i % len(prompts)].name, prompts[i % len(prompts)].messages, 32)
            for i in range(concurrency)
        )
    )
    wall = time.perf_counter() - t0
    await client.close()
    return list(outcomes), wall
