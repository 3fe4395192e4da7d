"""Suffix drafting, measured: a repetitive stream on the real model, and the proposer on recorded token streams.

``stream`` answers how speculation does on a stream of similar requests (and on copy-heavy prompts); ``replay``
what the suffix proposer costs per call and how much of the streams it drafts, against arctic-inference's suffix
tree when it is at hand.

    python -m bench.suffix stream [--model DIR] [--rounds 6] [--new-tokens 96] [--copy 4] [--streams FILE]
                                  [--out docs/bench/suffix-stream.md]
    python -m bench.suffix replay --streams FILE [--arctic DIR] [--width 16] [--context 4096]
                                  [--out docs/bench/suffix-replay.md]

``stream``: the stream is ``bench.repetitive``'s (what an agent or a batch job sends one Engine: requests of three
task shapes whose answers share text that is NOT in each prompt), ``--rounds`` rounds of the three shapes. Each mode
runs the whole stream on one Engine, in order, after a warm-up: plain decoding, prompt lookup, suffix (the Engine's
suffix cache starts empty and learns from the stream as it goes). Then ``--copy`` prompts of the bench suite's
copy-heavy category (``code_edit``: the answer copies the prompt), prompt lookup against suffix, each request on its
own (the cache emptied before each): what decides whether ``speculative="auto"`` should draft by suffix. Writes a
markdown table (tokens/s end to end, target passes, acceptance, speed-up over plain) and whether every output is
identical to plain; ``--streams FILE`` also writes the stream's prompts and plain outputs (token ids), the token
streams ``replay`` reads.

``replay``: no model needed. The streams (``--streams``, written by ``stream --streams FILE``) are requests in
order, each its prompt ids and the plain output ids. Each request is replayed as speculative decoding would run it:
from the prompt, a draft of at most ``--width`` tokens is asked for; its leading tokens that equal the true output
are accepted and the next true token is committed with them (the bonus token); repeat to the end of the output.
Then the request's output joins the cross-request cache (ortspec: ``SuffixCache.add``; arctic: the response added to
its global tree as it is committed, as vLLM does). Reports per proposer: target passes, drafted and accepted
tokens, and the CPU time per propose call after a request's first (median, p99; ``time.thread_time``, so other
processes on a loaded machine do not count; arctic builds its prompt's tree in ``start_request``, not timed). A last
row is the ceiling of drafting by matches (``Ceiling``: it knows the output, so it is not a proposer).
``--context N`` then measures the propose cost at an N-token context: every stream's prompt and output joined into
one long request (repeated to N + 200 tokens), replayed over its last 200 tokens, with the other requests' outputs in
the cache.

arctic-inference is not a dependency: its PyPI release (0.3.0) is an sdist whose build needs torch >= 2.10 and
vLLM; its suffix tree alone (``csrc/suffix_decoding``: C++20 and nanobind) builds with cmake in a scratch virtual
environment holding nanobind. Point ``--arctic`` at the unpacked sdist with the built ``_C`` module copied into
``arctic_inference/suffix_decoding/``; without it only ortspec's proposer runs.

Both print their report and write it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.machine import machine_info
from bench.repetitive import repetitive_stream
from bench.workloads import build_workloads
from ortspec import BackendConfig, Engine
from ortspec.adapters.engine.suffix_cache import PROMPT_TAIL, SuffixCache
from ortspec.core import DraftContext, DraftRule, SuffixProposer
from ortspec.core.tokens import Shared

OUT = {"stream": Path("docs/bench/suffix-stream.md"), "replay": Path("docs/bench/suffix-replay.md")}


def run_mode(engine: Engine, prompts: list, speculative: str | None, new_tokens: int, fresh_cache: bool) -> dict:
    """Every prompt in order on ``engine``; the totals and the outputs."""
    engine.suffix_cache = SuffixCache()
    outputs, seconds, tokens, steps, proposed, accepted = [], 0.0, 0, 0, 0, 0
    for prompt in prompts:
        if fresh_cache:
            engine.suffix_cache = SuffixCache()
        t0 = time.perf_counter()
        result = engine.generate(prompt, chat=True, max_tokens=new_tokens, speculative=speculative)
        seconds += time.perf_counter() - t0
        outputs.append(result.token_ids)
        tokens += len(result.token_ids)
        steps += result.stats.steps
        proposed += result.stats.proposed_tokens
        accepted += result.stats.accepted_tokens
    return dict(outputs=outputs, seconds=seconds, tokens=tokens, steps=steps, proposed=proposed, accepted=accepted)


def table(
    title: str, prompts: list, engine: Engine, modes: dict, new_tokens: int, fresh: bool
) -> tuple[list[str], dict[str, dict]]:
    runs = {name: run_mode(engine, prompts, spec, new_tokens, fresh) for name, spec in modes.items()}
    plain = runs["plain"]
    lines = [
        f"{title}: {len(prompts)} requests, up to {new_tokens} new tokens each",
        "",
        "| mode | tokens | seconds | tok/s | target passes | acceptance | speed-up | identical to plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        rate = run["tokens"] / run["seconds"]
        acc = f"{run['accepted']}/{run['proposed']}" if run["proposed"] else "-"
        same = sum(a == b for a, b in zip(run["outputs"], plain["outputs"], strict=True))
        lines.append(
            f"| {name} | {run['tokens']} | {run['seconds']:.1f} | {rate:.1f} | {run['steps']} | {acc} | "
            f"{plain['seconds'] / run['seconds']:.2f}x | {same}/{len(prompts)} |"
        )
    return lines, runs


# propose(request index, context, width) -> draft; commit(request index, new tokens); end(request index, prompt,
# output)
Propose = Callable[[int, Sequence[int], int], Sequence[int]]


class Ours:
    def __init__(self, rule: DraftRule) -> None:
        self.rule, self.cache, self.proposer = rule, SuffixCache(), SuffixProposer(rule)

    def start(self, i: int, prompt: Sequence[int]) -> None:
        self.proposer = SuffixProposer(self.rule, cache=self.cache.snapshot())

    def propose(self, i: int, context: Sequence[int], width: int) -> Sequence[int]:
        return self.proposer.propose(DraftContext(context, width))

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


def run_stream(args: argparse.Namespace) -> list[str]:
    """``stream``: the report's lines (module docstring)."""
    if args.model is None:
        from ortspec.adapters.tools.convert import convert_smollm2

        args.model = convert_smollm2(precision="fp32", progress=None)
    engine = Engine.from_dir(args.model, BackendConfig(threads=args.threads), drafter=False)
    engine.generate("Hello", max_tokens=4, speculative="prompt-lookup")  # warm-up and the verify cost curve
    modes = {"plain": None, "prompt lookup": "prompt-lookup", "suffix": "suffix"}
    prompts = repetitive_stream(3 * args.rounds)
    machine = machine_info()
    lines = [
        "# Suffix drafting: a repetitive stream and copy-heavy prompts",
        "",
        f"Measured {machine['date_utc']} (start) by `python -m bench.suffix stream` on {machine['cpu']} "
        f"({machine['cores'].get('usable')} usable cores; other processes used {machine['background_load_cores']} "
        f"cores at the start), {args.threads} intra-op threads, `{Path(args.model).name}`; {args.rounds} rounds of "
        f"the stream's three task shapes, {args.copy} copy-heavy prompts.",
        "",
    ]
    table_lines, runs = table("Repetitive stream", prompts, engine, modes, args.new_tokens, fresh=False)
    lines += table_lines
    print("\n".join(table_lines), flush=True)
    if args.streams is not None:
        ids = [engine.prompt_ids(p, chat=True) for p in prompts]
        args.streams.write_text(json.dumps({"prompts": ids, "outputs": [list(o) for o in runs["plain"]["outputs"]]}))
    if args.copy:
        copy = [w.messages for w in build_workloads(args.copy, 1000, engine.tokenizer, categories=["code_edit"])]
        copy = copy[: args.copy]
        table_lines, _ = table("\nCopy-heavy (code_edit), the cache emptied before each request", copy, engine,
                               modes, args.new_tokens * 2, fresh=True)  # fmt: skip
        lines += table_lines
        print("\n".join(table_lines), flush=True)
    return lines


def run_replay(args: argparse.Namespace) -> list[str]:
    """``replay``: the report's lines (module docstring)."""
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
    lines = [
        f"# The suffix proposer on replayed token streams (`python -m bench.suffix replay`, {args.streams.name})",
        "",
        f"{len(prompts)} requests, {sum(map(len, outputs))} output tokens, width {args.width}",
        "",
        "| proposer | target passes | drafted | accepted | tokens per pass | propose median | propose p99 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, proposer in runs.items():
        r = replay(proposer, prompts, outputs, args.width)
        lines.append(
            f"| {name} | {r['passes']} | {r['drafted']} | {r['accepted']} | {r['tokens'] / r['passes']:.2f} | "
            f"{r['median_us']:.0f} us | {r['p99_us']:.0f} us |"
        )
    if args.context:
        joined = [t for p, o in zip(prompts, outputs, strict=True) for t in (*p, *o)]
        long = (joined * (1 + (args.context + 200) // len(joined)))[: args.context + 200]
        lines += [
            "",
            f"At a {args.context}-token context (the last 200 tokens replayed, the cache full of the streams)",
            "",
            "| proposer | propose median | propose p99 | first call (indexes the prompt) |",
            "| --- | --- | --- | --- |",
        ]
        for name, proposer in runs.items():  # their caches hold every stream's output now
            if isinstance(proposer, Ceiling):
                continue
            r = replay(proposer, [long[: args.context]], [long[args.context :]], args.width)
            lines.append(f"| {name} | {r['median_us']:.0f} us | {r['p99_us']:.0f} us | {r['first_us'] / 1000:.1f} ms |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stream", help="a repetitive stream and copy-heavy prompts on the real model")
    s.add_argument("--model", type=Path, default=None)
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--new-tokens", type=int, default=96)
    s.add_argument("--copy", type=int, default=4)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--streams", type=Path, default=None, help="also write the stream's token ids here (for replay)")
    r = sub.add_parser("replay", help="recorded token streams through the suffix proposers, no model")
    r.add_argument("--streams", type=Path, required=True)
    r.add_argument("--arctic", type=Path, default=None)
    r.add_argument("--width", type=int, default=16)
    r.add_argument("--context", type=int, default=4096)
    for command, p in (("stream", s), ("replay", r)):
        p.add_argument("--out", type=Path, default=OUT[command], help=f"the report (default {OUT[command]})")
    args = ap.parse_args(argv)
    lines = run_stream(args) if args.command == "stream" else run_replay(args)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    if args.command == "replay":
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
