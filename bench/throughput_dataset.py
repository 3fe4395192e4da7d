"""The throughput dataset (``DATASET``, ``bench/data/throughput-prompts.json``): its requests (``Request``: chat
messages, exactly ``max_tokens`` new tokens, the seed of its id), how it is built from ``bench.workloads``
(``build_dataset``), loaded, split into the tuning and evaluation halves, cut for ``--quick`` and spread over."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.engines import SAMPLING, prompt_seed
from bench.workloads import CATEGORIES, Workload, build_workloads, encode_chat, half, python_version_tag
from ortspec.adapters.engine.tokenizer import Tokenizer

DATASET = Path(__file__).resolve().parent / "data" / "throughput-prompts.json"
DATASET_FORMAT = "ortspec-throughput-prompts/1"
DATASET_SEED = 19  # the random.Random seed of every request's number of new tokens
NEW_TOKENS = (64, 128)  # each request's number of new tokens is drawn in this range (inclusive)


@attrs.frozen
class Request:
    """One dataset request: chat ``messages``, exactly ``max_tokens`` new tokens (EOS ignored) and, when sampled,
    the ``seed`` of its id (``bench.engines.prompt_seed``)."""

    id: str
    messages: tuple[Mapping[str, str], ...] = attrs.field(converter=tuple)
    max_tokens: int
    kind: str

    @property
    def seed(self) -> int:
        return prompt_seed(self.id)

    def options(self, mode: str) -> dict[str, Any]:
        """The generation keywords of this request in ``mode`` (``greedy`` or ``sampled``), as the Engine and an
        ``ortspec batch`` record take them (without ``speculative``)."""
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "ignore_eos": True}
        if mode == "sampled":
            options.update(SAMPLING, seed=self.seed)
        return options


def spread(requests: Sequence[Request], n: int) -> list[Request]:
    """``n`` requests spread evenly over ``requests`` (all of them when ``n`` is larger), in order."""
    count = len(requests)
    return list(requests) if n >= count else [requests[(i * count) // n] for i in range(n)]


# --------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------


def _source(workload: Workload) -> str:
    """What a prompt is made from (its code unit, module docstring, target document or text): two prompts with the
    same source would share a prefix, which a prefix cache could reuse."""
    meta = workload.meta
    if workload.category == "summarize":
        return "summarize:" + workload.name.split("-")[1]
    return f"{workload.category}:{meta.get('source') or meta.get('target') or workload.messages[-1]['content']}"


def build_dataset(tokenizer: Tokenizer) -> dict[str, Any]:
    """The dataset file's content: the 32 prompts of ``bench.generate_many`` (8 per kind, at most 1000 prompt
    tokens) then, per kind, 8 more from ``build_workloads(n, 500)`` (shorter ones; n = 16, 24, ... until there are
    8 whose source no earlier prompt has), each with its number of new tokens drawn in ``NEW_TOKENS``."""
    chosen = build_workloads(8, 1000, tokenizer)
    for kind in CATEGORIES:
        taken, n = 0, 16
        while taken < 8:
            sources = {_source(w) for w in chosen}
            fresh = [w for w in build_workloads(n, 500, tokenizer, categories=[kind]) if _source(w) not in sources]
            chosen += fresh[: 8 - taken]
            taken += len(fresh[: 8 - taken])
            n += 8
    rng = random.Random(DATASET_SEED)
    records = [
        {
            "id": f"tp{i:02d}-{w.category}",
            "kind": w.category,
            "source": w.name,
            "messages": w.messages,
            "max_tokens": rng.randint(*NEW_TOKENS),
        }
        for i, w in enumerate(chosen)
    ]
    return {
        "format": DATASET_FORMAT,
        "python": python_version_tag(),
        "rule": "bench.throughput.build_dataset: bench.workloads prompts (text from this Python's stdlib); new "
        f"tokens random.Random({DATASET_SEED}).randint{NEW_TOKENS} per request in order",
        "records": records,
    }


def load_dataset(path: Path = DATASET) -> list[Request]:
    raw = json.loads(path.read_text(encoding="utf-8"))
    if raw.get("format") != DATASET_FORMAT:
        raise ValueError(f"{path}: not an {DATASET_FORMAT} file")
    return [Request(r["id"], r["messages"], r["max_tokens"], r["kind"]) for r in raw["records"]]


def split(requests: Sequence[Request], part: str) -> list[Request]:
    """The dataset's ``part`` (``bench.workloads.SPLITS``; ``bench.workloads.half`` by kind): every request has its
    own source text, so the two halves share none."""
    return half(requests, part, lambda q: q.kind)


def quick_requests(requests: Sequence[Request], tokenizer: Tokenizer) -> list[Request]:
    """The two shortest prompts of each kind (by prompt tokens), in dataset order."""
    length = {r.id: len(encode_chat(r.messages, tokenizer)) for r in requests}
    keep = {
        r.id
        for kind in CATEGORIES
        for r in sorted((q for q in requests if q.kind == kind), key=lambda q: length[q.id])[:2]
    }
    return [r for r in requests if r.id in keep]
