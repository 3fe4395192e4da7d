"""Load test of ``ortspec serve``: concurrent streaming clients against a real server on this machine.

    python -m bench.serve_load                 # SmolLM2-135M-Instruct fp32, 2 workers x 1 thread, C = 16, R = 3
    python -m bench.serve_load --concurrency 8 --requests 2 --workers 1 --threads 2

It starts ``ortspec serve`` as a subprocess on a free loopback port, computes every prompt's reference text with
an in-process ``Engine`` (plain greedy, no speculation, no prefix reuse) before the server starts, then runs
three phases with the official ``openai`` client (``AsyncOpenAI``, streaming, no retries):

1. **Prefix reuse.** A ~1,000-token conversation (a standard-library source file and a question), then its second
   turn (the answer and a new question). Time to first token (TTFT) of the second turn ÷ TTFT of the cold first
   turn, for a few conversations; the second turn's ``cached_tokens`` come from the usage.
2. **Load.** C concurrent clients, each sending R requests one after another, round-robin over prompts of mixed
   lengths (``bench.workloads``: code edits, summaries, retrieval QA, open-ended; 37 to ~1,000 tokens) and
   ``max_tokens`` of 32 to 128. Requests/s, generated tokens/s, TTFT and inter-token latency p50/p99, errors, and
   whether every stream's text equals its reference. Errors must be 0 (C must fit in workers + ``--max-queue``).
3. **Overload.** More clients at once than workers + queue slots (one short request each): the excess must be
   refused with clean 429s (``Retry-After``, OpenAI error object), the rest served correctly, nothing else.

Results go to ``<out>/serve_load.{json,md}`` (machine, date, settings, every number); the exit status is 1 if any
phase failed its condition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai

from bench.machine import CpuContention, machine_info
from bench.workloads import build_workloads
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import BackendConfig

T = TypeVar("T")
MODEL_NAME = "served"
MAX_TOKENS = (64, 128, 32, 96)  # cycled over the prompts: mixed output lengths
CONVERSATION_SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py")


@dataclass
class Prompt:
    name: str
    messages: list[dict[str, str]]
    max_tokens: int
    prompt_tokens: int
    reference: str = ""
    reference_finish: str = ""


@dataclass
class Outcome:
    """One streamed request as the client saw it."""

    prompt: str
    text: str = ""
    finish: str | None = None
    start: float = 0.0
    first: float | None = None  # first non-empty content chunk
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error: str | None = None
    retry_after: str | None = None


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------------------------------------------
# Prompts and references
# ----------------------------------------------------------------------------------------------------------------


def load_prompts(model_dir: Path, n_per_category: int, max_prompt_tokens: int) -> list[Prompt]:
    tokenizer = Tokenizer.from_folder(model_dir)
    prompts = []
    for i, w in enumerate(build_workloads(n_per_category, max_prompt_tokens, tokenizer)):
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
            result = engine.generate(p.messages, max_tokens=p.max_tokens)
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
# The server
# ----------------------------------------------------------------------------------------------------------------


class ServerProcess:
    """``ortspec serve`` in a subprocess on a free loopback port; ``url`` once ``/health`` answers."""

    def __init__(self, model_dir: Path, args: argparse.Namespace, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "ortspec.adapters.cli",
            "serve",
            "--model",
            str(model_dir),
            "--model-name",
            MODEL_NAME,
            "--port",
            str(self.port),
            "--workers",
            str(args.workers),
            "--threads",
            str(args.threads),
            "--max-queue",
            str(args.max_queue),
            "--log-level",
            "warning",
        ]
        self.command = cmd
        self._log = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout_s} s")

    def cpu_seconds(self) -> float:
        """CPU time the server process has used (user + system, its threads included)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> dict[str, float]:
        """The server's counters, summed over labels (``name_total`` -> value)."""
        totals: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("ortspec_") and "_total" in line:
                name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


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


async def load_phase(url: str, prompts: list[Prompt], concurrency: int, requests: int) -> tuple[list[Outcome], float]:
    client = _client(url, concurrency)

    async def one_client(c: int) -> list[Outcome]:
        outcomes = []
        for r in range(requests):
            p = prompts[(c * requests + r) % len(prompts)]
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


# ----------------------------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------------------------


def summarize_load(outcomes: list[Outcome], wall: float, prompts: dict[str, Prompt]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.first - o.start for o in ok if o.first is not None]
    gaps = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:], strict=False)]
    tpot = [
        (o.chunk_times[-1] - o.first) / (o.completion_tokens - 1)
        for o in ok
        if o.first is not None and o.completion_tokens > 1
    ]
    mismatches = [
        o.prompt for o in ok if o.text != prompts[o.prompt].reference or o.finish != prompts[o.prompt].reference_finish
    ]
    tokens = sum(o.completion_tokens for o in ok)

    def ms(x: float | None) -> float | None:
        return round(x * 1000, 1) if x is not None else None

    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "errors": len(outcomes) - len(ok),
        "error_messages": sorted({o.error for o in outcomes if o.error})[:10],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "completion_tokens": tokens,
        "cached_prompt_tokens": sum(o.cached_tokens for o in ok),
        "ttft_ms_p50": ms(_percentile(ttft, 0.5)),
        "ttft_ms_p99": ms(_percentile(ttft, 0.99)),
        "inter_chunk_ms_p50": ms(_percentile(gaps, 0.5)),
        "inter_chunk_ms_p99": ms(_percentile(gaps, 0.99)),
        "time_per_output_token_ms_p50": ms(_percentile(tpot, 0.5)),
        "time_per_output_token_ms_p99": ms(_percentile(tpot, 0.99)),
        "text_equals_reference": f"{len(ok) - len(mismatches)}/{len(ok)}",
        "mismatched_prompts": sorted(set(mismatches)),
    }


def summarize_overload(outcomes: list[Outcome], wall: float, prompts: dict[str, Prompt]) -> dict[str, Any]:
    refused = [o for o in outcomes if o.status == 429]
    clean = [o for o in refused if o.retry_after and o.retry_after.isdigit()]
    served = [o for o in outcomes if o.error is None]
    other = [o for o in outcomes if o.error is not None and o.status != 429]
    # An overload request asks for 32 tokens: its reference is the reference prefix only if that ran to 32 tokens,
    # so check the text is a prefix of the longer reference's text (same prompt, greedy).
    wrong = [o for o in served if not prompts[o.prompt].reference.startswith(o.text)]
    return {
        "requests": len(outcomes),
        "served": len(served),
        "refused_429": len(refused),
        "refused_429_with_retry_after": len(clean),
        "other_errors": len(other),
        "other_error_messages": sorted({o.error for o in other if o.error})[:10],
        "served_text_consistent_with_reference": f"{len(served) - len(wrong)}/{len(served)}",
        "wall_s": round(wall, 2),
    }


def _cpu_line(cpu: dict[str, Any]) -> str:
    return (
        f"CPU during the phase (average cores): server {cpu['server_cores']}, clients {cpu['client_cores']}, "
        f"other processes (not the benchmark) {cpu['other_cores']}."
    )


def markdown(result: dict[str, Any]) -> str:
    m, s, load, over = result["machine"], result["settings"], result["load"], result["overload"]
    base = result["in_process_baseline"]
    reuse = result["prefix_reuse"]
    lines = [
        "# `ortspec serve` under load",
        "",
        f"Measured {m['date_utc']} on {m['cpu']} ({m['cores']['usable']} usable cores, {m['memory_gib']} GiB; "
        f"other processes were using {m['background_load_cores']} cores at the start), "
        f"{m['python']}, onnxruntime {m['versions'].get('onnxruntime')}. Written by `{result['command']}`.",
        "",
        f"Server: `{' '.join(result['server_command'])}` (model {s['model']}; {s['workers']} workers x "
        f"{s['threads']} threads, queue {s['max_queue']}, speculative prompt lookup by default, prefix reuse on); "
        f"ready {result['server_ready_s']:.1f} s after launch (engines loaded, drift and verify costs measured). "
        "Clients: the official `openai` AsyncOpenAI client, streaming, no retries, in one process on the same "
        "machine.",
        "",
        "## Prefix reuse (time to first token, client side)",
        "",
        "| conversation | cold TTFT (turn 1) | second-turn TTFT | ratio | cached tokens (turn 2) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(reuse["conversations"]):
        lines.append(
            f"| {i} ({result['conversation_sources'][i]}, {r['prompt_tokens']} tokens) | "
            f"{r['cold_ttft_s'] * 1000:.0f} ms | {r['second_turn_ttft_s'] * 1000:.0f} ms | {r['ratio']:.3f} | "
            f"{r['second_turn_cached_tokens']} |"
        )
    lines += [
        "",
        f"{_cpu_line(reuse['cpu'])} Median ratio {reuse['median_ratio']:.3f} "
        f"({'target <= ' + str(s['ttft_target']) if s['ttft_target'] else 'no target set'}).",
        "",
        f"## Load: {s['concurrency']} concurrent streaming clients x {s['requests']} requests",
        "",
        f"Prompts: {len(result['prompts'])} chats of {min(p['prompt_tokens'] for p in result['prompts'])}-"
        f"{max(p['prompt_tokens'] for p in result['prompts'])} tokens (bench.workloads), max_tokens "
        f"{sorted({p['max_tokens'] for p in result['prompts']})}. The references, computed in process before the "
        f"server started with plain greedy decoding, one prompt at a time on {base['threads']} threads, double as a "
        f"baseline on the machine as it was: {base['completion_tokens']} tokens in {base['seconds']} s = "
        f"{base['tokens_per_s']} tokens/s end to end (other processes used {base['other_processes_cores']} cores "
        "meanwhile).",
        "",
        "| requests | errors | text == reference | wall | requests/s | tokens/s | TTFT p50 / p99 | "
        "inter-chunk p50 / p99 | time per output token p50 / p99 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {load['requests']} | {load['errors']} | {load['text_equals_reference']} | {load['wall_s']} s | "
        f"{load['requests_per_s']} | {load['tokens_per_s']} | {load['ttft_ms_p50']} / {load['ttft_ms_p99']} ms | "
        f"{load['inter_chunk_ms_p50']} / {load['inter_chunk_ms_p99']} ms | "
        f"{load['time_per_output_token_ms_p50']} / {load['time_per_output_token_ms_p99']} ms |",
        "",
        _cpu_line(load["cpu"]),
        "",
        "Inter-chunk: the gap between consecutive streamed content chunks (one chunk per committed token that "
        "releases text; an accepted draft block arrives as several chunks at once). Time per output token: "
        "(last chunk - first chunk) / (tokens - 1) per request. Server counters over the run: "
        f"{result['server_counters'].get('passes', 0):.0f} target passes for "
        f"{result['server_counters'].get('completion_tokens', 0):.0f} tokens, draft acceptance "
        f"{result['server_counters'].get('acceptance', 0):.0%}, "
        f"{result['server_counters'].get('cached_prompt_tokens', 0):.0f} of "
        f"{result['server_counters'].get('prompt_tokens', 0):.0f} prompt tokens reused.",
        "",
        f"## Overload: {over['requests']} clients at once (workers + queue = {s['workers'] + s['max_queue']})",
        "",
        f"Served {over['served']}, refused {over['refused_429']} with 429 ({over['refused_429_with_retry_after']} "
        f"with a Retry-After header), other errors {over['other_errors']}; served text consistent with the "
        f"reference {over['served_text_consistent_with_reference']}. {_cpu_line(over['cpu'])}",
        "",
        f"Verdict: {'PASS' if result['passed'] else 'FAIL'} "
        f"({'; '.join(result['failures']) or 'every condition met'}).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def contended(server: ServerProcess, phase: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """Run ``phase`` and say how many cores the server, this process (the clients) and every other process used
    on average meanwhile (other processes: load that does not belong to the benchmark)."""
    cpu0 = server.cpu_seconds()
    with CpuContention() as c:
        value = phase()
    server_cores = (server.cpu_seconds() - cpu0) / c.wall_s if c.wall_s else 0.0
    others = None if c.others_cores is None else round(max(0.0, c.others_cores - server_cores), 2)
    return value, {"server_cores": round(server_cores, 2), "client_cores": c.self_cores, "other_cores": others}


def _model_dir(arg: str | None) -> Path:
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

    if arg:
        return Path(arg)
    folder = default_model_dir("fp32")
    if not is_complete(folder):
        convert_smollm2(folder, "fp32", progress=lambda m: print(m, file=sys.stderr))
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct fp32, converted on first use)")
    parser.add_argument("--workers", type=int, default=2, help="server workers (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per worker (default 1)")
    parser.add_argument("--max-queue", type=int, default=16, help="server queue bound (default 16)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients in the load phase (16)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client in the load phase (3)")
    parser.add_argument("--overload", type=int, default=None, help="clients in the overload phase (workers+queue+16)")
    parser.add_argument("--prompts-per-category", type=int, default=2, help="prompts per workload category (2)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1000, help="longest load prompt (1000)")
    parser.add_argument("--conversation-tokens", type=int, default=1000, help="first turn of the reuse phase (1000)")
    parser.add_argument("--reuse-max-tokens", type=int, default=64, help="answer length in the reuse phase (64)")
    parser.add_argument(
        "--ttft-target", type=float, default=0.2, help="most second-turn ÷ cold TTFT (median) that passes; 0: none"
    )
    parser.add_argument("--out", default="docs/serve", help="folder for serve_load.{json,md} (default docs/serve)")
    args = parser.parse_args(argv)
    if args.concurrency > args.workers + args.max_queue:
        parser.error("--concurrency must fit in workers + --max-queue (the load phase must see no 429)")
    overload = args.overload or args.workers + args.max_queue + 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args.model)
    machine = machine_info()

    print(f"prompts and references on {model_dir} ...", file=sys.stderr)
    prompts = load_prompts(model_dir, args.prompts_per_category, args.max_prompt_tokens)
    baseline = compute_references(model_dir, prompts, threads=args.workers * args.threads)
    by_name = {p.name: p for p in prompts}
    tokenizer = Tokenizer.from_folder(model_dir)
    turns = [conversation(tokenizer, src, args.conversation_tokens) for src in CONVERSATION_SOURCES]

    server = ServerProcess(model_dir, args, Path(tempfile.gettempdir()) / "ortspec-serve_load-server.log")
    failures: list[str] = []
    try:
        ready_s = server.wait_ready()
        print(f"server ready in {ready_s:.1f} s at {server.url}; prefix-reuse phase ...", file=sys.stderr)
        reuse_rows, reuse_cpu = contended(
            server, lambda: asyncio.run(prefix_reuse_phase(server.url, turns, args.reuse_max_tokens))
        )
        for row, turn in zip(reuse_rows, turns, strict=True):
            row["prompt_tokens"] = len(tokenizer.encode(tokenizer.apply_chat_template(turn)))
        before = server.metrics()
        print(f"load phase: {args.concurrency} clients x {args.requests} requests ...", file=sys.stderr)
        (outcomes, wall), load_cpu = contended(
            server, lambda: asyncio.run(load_phase(server.url, prompts, args.concurrency, args.requests))
        )
        after = server.metrics()
        print(f"overload phase: {overload} clients at once ...", file=sys.stderr)
        (over_outcomes, over_wall), over_cpu = contended(
            server, lambda: asyncio.run(overload_phase(server.url, prompts, overload))
        )
    finally:
        server.stop()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    counters = {
        "passes": delta("ortspec_target_passes_total"),
        "completion_tokens": delta("ortspec_completion_tokens_total"),
        "prompt_tokens": delta("ortspec_prompt_tokens_total"),
        "cached_prompt_tokens": delta("ortspec_cached_prompt_tokens_total"),
        "proposed": delta("ortspec_draft_tokens_proposed_total"),
        "accepted": delta("ortspec_draft_tokens_accepted_total"),
    }
    counters["acceptance"] = counters["accepted"] / counters["proposed"] if counters["proposed"] else 0.0
    load = summarize_load(outcomes, wall, by_name)
    over = summarize_overload(over_outcomes, over_wall, by_name)
    ratios = [r["ratio"] for r in reuse_rows]
    reuse = {"conversations": reuse_rows, "median_ratio": statistics.median(ratios), "cpu": reuse_cpu}
    load["cpu"], over["cpu"] = load_cpu, over_cpu
    if args.ttft_target and reuse["median_ratio"] > args.ttft_target:
        failures.append(f"second-turn TTFT ratio {reuse['median_ratio']:.3f} > {args.ttft_target}")
    if load["errors"]:
        failures.append(f"{load['errors']} errors in the load phase")
    if load["mismatched_prompts"]:
        failures.append(f"text differs from the reference for {load['mismatched_prompts']}")
    if over["other_errors"]:
        failures.append(f"{over['other_errors']} overload errors other than 429")
    if over["refused_429"] != over["refused_429_with_retry_after"]:
        failures.append("a 429 without Retry-After")
    if over["served_text_consistent_with_reference"].split("/")[0] != str(over["served"]):
        failures.append("overload text differs from the reference")
    result = {
        "command": " ".join(["python -m bench.serve_load", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "settings": {
            "model": str(model_dir.name),
            "workers": args.workers,
            "threads": args.threads,
            "max_queue": args.max_queue,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "overload": overload,
            "ttft_target": args.ttft_target,
        },
        "server_command": ["ortspec", *server.command[3:]],
        "server_ready_s": ready_s,
        "in_process_baseline": baseline,
        "prompts": [{"name": p.name, "prompt_tokens": p.prompt_tokens, "max_tokens": p.max_tokens} for p in prompts],
        "conversation_sources": list(CONVERSATION_SOURCES),
        "prefix_reuse": reuse,
        "load": load,
        "server_counters": counters,
        "overload": over,
        "passed": not failures,
        "failures": failures,
        "outcomes": [asdict(o) | {"chunk_times": len(o.chunk_times)} for o in outcomes],
    }
    (out / "serve_load.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "serve_load.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    print(f"wrote {out / 'serve_load.json'} and {out / 'serve_load.md'}", file=sys.stderr)
    return 0 if not failures else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
