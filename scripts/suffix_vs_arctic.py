"""Replay token streams through ortspec's suffix proposer and arctic-inference's suffix tree: propose cost and
acceptance on the same streams, no model needed.

The streams (``--streams``, written by ``scripts/suffix_stream.py --streams FILE``) are requests in order, each
its prompt ids and the plain output ids. Each request is replayed as speculative decoding would run it: from the
prompt, a draft of at most ``--width`` tokens is asked for; its leading tokens that equal the true output are
accepted and the next true token is committed with them (the bonus token); repeat to the end of the output. Then
the request's output joins the cross-request cache (ortspec: ``SuffixCache.add``; arctic: the response added to
its global tree as it is committed, as vLLM does). Reports per proposer: target passes, drafted and accepted
tokens, and the CPU time per propose call after a request's first (median, p99; ``time.thread_time``, so other
processes on a loaded machine do not count; arctic builds its prompt's tree in ``start_request``, not timed).
A last row is the ceiling of drafting by matches (``Ceiling``: it knows the output, so it is not a proposer).
``--context N`` then measures the propose cost at an N-token context: every stream's prompt and output joined into
one long request (repeated to N + 200 tokens), replayed over its last 200 tokens, with the other requests' outputs
in the cache.

arctic-inference is not a dependency: its PyPI release (0.3.0) is an sdist whose build needs torch >= 2.10 and
vLLM; its suffix tree alone (``csrc/suffix_decoding``: C++20 and nanobind) builds with cmake in a scratch
virtual environment holding nanobind. Point ``--arctic`` at the unpacked sdist with the built ``_C`` module copied
into ``arctic_inference/suffix_decoding/``; without it only ortspec's proposer runs.

    python scripts/suffix_vs_arctic.py --streams streams.json [--arctic /tmp/arctic/arctic_inference-0.3.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ortspec.adapters.engine.suffix_cache import PROMPT_TAIL, SuffixCache  # noqa: E402
from ortspec.core import DraftRule, SuffixProposer  # noqa: E402
from ortspec.core.tokens import Shared  # noqa: E402

# propose(request index, context, width) -> draft; commit(request index, new tokens); end(request index, prompt,
# output)
Propose = Callable[[int, Sequence[int], int], Sequence[int]]


class Ours:
    def __init__(self, rule: DraftRule) -> None:
        self.rule, self.cache, self.proposer = rule, SuffixCache(), SuffixProposer(rule)

    def start(self, i: int, prompt: Sequence[int]) -> None:
        self.proposer = SuffixProposer(self.rule, cache=self.cache.snapshot())

    def propose(self, i: int, context: Sequence[int], width: int) -> Sequence[int]:
        return self.proposer.propose(context, width)

    def commit(self, i: int, tokens: Sequence[int]) -> None:
        pass

    def end(self, i: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.cache.add(prompt, output)


class Arctic:
    def __init__(self, depth: int, factor: float, min_prob: float) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
        self.factor, self.min_prob = factor, min_prob

    def start(self, i: int, prompt: Sequence[int]) -> None:
        self.cache.start_request(i, list(prompt))

    def propose(self, i: int, context: Sequence[int], width: int) -> Sequence[int]:
        draft = self.cache.speculate(
            i, list(context[-self.cache.max_tree_depth :]), max_spec_tokens=width, max_spec_factor=self.factor,
            min_token_prob=self.min_prob,
        )  # fmt: skip
        return draft.token_ids

    def commit(self, i: int, tokens: Sequence[int]) -> None:
        self.cache.add_active_response(i, list(tokens))

    def end(self, i: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.cache.stop_request(i)


class Ceiling:
    """Not a proposer: knows each request's output and drafts the longest run of it that follows any earlier
    occurrence of the context's last ``anchor`` tokens, in the earlier requests' documents (as ``SuffixCache``
    records them) or in the context itself, so it never drafts a token that is rejected. Its target passes are the
    fewest that drafting by a match in what was seen can reach on the streams."""

    def __init__(self, anchor: int = 2) -> None:
        self.anchor, self.corpus, self.output = anchor, [], []

    def start(self, i: int, prompt: Sequence[int]) -> None:
        pass

    def propose(self, i: int, context: Sequence[int], width: int) -> Sequence[int]:
        source, n, done = [*self.corpus, -1, *context], self.anchor, len(context) - self.prompt_length
        tail, want = list(context[-n:]), self.output[done : done + width]
        best = 0
        for j in range(len(source) - n):
            if source[j : j + n] == tail:
                k = 0
                while k < len(want) and j + n + k < len(source) and source[j + n + k] == want[k]:
                    k += 1
                best = max(best, k)
        return want[:best]

    def commit(self, i: int, tokens: Sequence[int]) -> None:
        pass

    def end(self, i: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.corpus += [*prompt[-PROMPT_TAIL:], *output, -1]


def replay(proposer: object, prompts: list[list[int]], outputs: list[list[int]], width: int) -> dict:
    passes = drafted = accepted = 0
    times: list[float] = []
    first: list[float] = []  # each request's first call, which indexes its prompt (once per request)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        proposer.start(i, prompt)
        if isinstance(proposer, Ceiling):
            proposer.output, proposer.prompt_length = list(output), len(prompt)
        context = Shared[int]().with_head(tuple(prompt))
        done = 0
        while done < len(output):
            t0 = time.thread_time()
            draft = list(proposer.propose(i, context, min(width, len(output) - done)))
            (times if done else first).append(time.thread_time() - t0)
            ok = 0
            while ok < len(draft) and done + ok < len(output) and draft[ok] == output[done + ok]:
                ok += 1
            new = output[done : done + ok + 1]
            passes, drafted, accepted = passes + 1, drafted + len(draft), accepted + ok
            proposer.commit(i, new)
            context = context.extended(new)
            done += len(new)
        proposer.end(i, prompt, output)
    times.sort()
    return dict(
        passes=passes,
        tokens=sum(map(len, outputs)),
        drafted=drafted,
        accepted=accepted,
        median_us=times[len(times) // 2] * 1e6,
        p99_us=times[int(len(times) * 0.99)] * 1e6,
        first_us=max(first) * 1e6,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=Path, required=True)
    ap.add_argument("--arctic", type=Path, default=None)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    data = json.loads(args.streams.read_text())
    prompts, outputs = data["prompts"], data["outputs"]
    runs: dict[str, object] = {
        "ortspec suffix (default rule: factor 2)": Ours(DraftRule()),
        "ortspec suffix (factor 1)": Ours(DraftRule(spec_factor=1.0)),
    }
    if args.arctic is not None:
        sys.path.insert(0, str(args.arctic))
        runs["arctic-inference 0.3.0 (depth 24, factor 1)"] = Arctic(24, 1.0, 0.1)
        runs["arctic-inference 0.3.0 (depth 64, factor 2)"] = Arctic(64, 2.0, 0.1)
    runs["ceiling (knows the output; the best run any earlier 2-token match offers)"] = Ceiling()
    print(f"{len(prompts)} requests, {sum(map(len, outputs))} output tokens, width {args.width}\n")
    print("| proposer | target passes | drafted | accepted | tokens per pass | propose median | propose p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, proposer in runs.items():
        r = replay(proposer, prompts, outputs, args.width)
        print(
            f"| {name} | {r['passes']} | {r['drafted']} | {r['accepted']} | {r['tokens'] / r['passes']:.2f} | "
            f"{r['median_us']:.0f} us | {r['p99_us']:.0f} us |"
        )
    if args.context:
        joined = [t for p, o in zip(prompts, outputs, strict=True) for t in (*p, *o)]
        long = (joined * (1 + (args.context + 200) // len(joined)))[: args.context + 200]
        print(f"\nAt a {args.context}-token context (the last 200 tokens replayed, the cache full of the streams)\n")
        print("| proposer | propose median | propose p99 | first call (indexes the prompt) |")
        print("| --- | --- | --- | --- |")
        for name, proposer in runs.items():  # their caches hold every stream's output now
            if isinstance(proposer, Ceiling):
                continue
            r = replay(proposer, [long[: args.context]], [long[args.context :]], args.width)
            print(f"| {name} | {r['median_us']:.0f} us | {r['p99_us']:.0f} us | {r['first_us'] / 1000:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
