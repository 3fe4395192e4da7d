"""Load test of ``ortspec serve``: concurrent streaming clients against real servers on this machine, one server
configuration after another (``SERVER_CONFIGS``: the server as ``ortspec serve`` runs it, ``batched``; on request,
the same without its prompt-token budget per pass, ``--prefill-budget none``, and ``--ray`` with one or two
replicas).

    python -m bench.serve_load                  # batched, at 16, 32, 64 clients
    python -m bench.serve_load --quick          # smoke test: 4 clients x 1 short request, ~1 minute
    python -m bench.serve_load --configs batched --concurrency 16 --requests 3
    python -m bench.serve_load --configs batched,batched-unbudgeted --concurrency 16 --out docs/serve/prefill-budget
    python -m bench.serve_load --configs batched,ray --baseline batched

It computes every prompt's reference text with an in-process ``Engine`` (plain greedy, no speculation, no prefix
reuse) before any server starts, then, for each configuration, starts ``ortspec serve`` as a subprocess on a free
loopback port with a queue bound of at least the largest concurrency, and runs with the official ``openai`` client
(``AsyncOpenAI``, streaming, no retries):

1. **Prefix reuse** (first configuration only). A ~1,000-token conversation (a standard-library source file and a
   question), then its second turn (the answer and a new question). Time to first token (TTFT) of the second turn
   ÷ TTFT of the cold first turn; the second turn's ``cached_tokens`` come from the usage.
2. **Load**, once per concurrency C (``--concurrency``, ascending). C concurrent clients, each sending R requests
   (``--requests``) one after another, over prompts of mixed lengths (the evaluation split of ``bench.workloads``:
   code edits, summaries, retrieval QA, open-ended; 37 to ~1,000 tokens) and ``max_tokens`` of 32 to 128; by
   default every request of the run has a prompt of its own (``phase_offsets``), so no prompt is served from the
   prefix cache (the report counts the cached prompt tokens). Requests/s, generated tokens/s and its ratio to one
   plain stream (the references' rate), TTFT and inter-chunk gap p50/p99, errors, whether every stream's text
   equals its reference,
   the server's peak RSS (VmHWM, reset before the phase where the kernel allows) and RSS after the phase, its CPU
   seconds, and the mean of every batch-size histogram its ``/metrics`` exposes (rows per batched pass).
3. **Overload** (first configuration only). More clients at once than slots + queue (one short request each): the
   excess must be refused with clean 429s (``Retry-After``, OpenAI error object), the rest served correctly.

The report puts each configuration's row beside the baseline's (``--baseline``, ``batched`` by default) at the same
concurrency (tokens/s, TTFT p50 and peak RSS ratios). Results go to ``<out>/serve_load.{json,md}`` (machine, date,
settings, every number); the exit status is 1 if any phase failed its condition (a load phase's errors or text
mismatches, the prefix-reuse TTFT target, an overload answer other than 200 or 429 + Retry-After).

Cost on this 2-core machine (SmolLM2-135M-Instruct fp32), estimated from earlier runs: per configuration 112
requests (16 + 32 + 64 clients x 1 request: 66,000 prompt tokens, at most 9,000 generated), plus the references
(640 tokens decoded alone), the server's start (it measures its pass costs first: up to a minute), the reuse phase
and the overload phase (~80 requests served, 32 tokens each): about 5 minutes on idle cores for ``batched`` (the
earlier runs took about 11 for it and the retired worker design together, half of it the workers); two to three
times that while other processes take most of the cores (the report says how many they took).

Layout: this module is the server configurations (``SERVER_CONFIGS``), the load phase's measurement
(``measure_load``), each configuration's run (``run_config``) and the command line; ``bench.serve_load_server``
holds the server under test (``ServerProcess``) and the CPU it uses in a phase (``contended``),
``bench.serve_load_clients`` the prompts, their references and the streaming clients of each phase,
``bench.serve_load_report`` the summaries, ratios and markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from bench.serve_load_clients import (
    compute_references,
    conversation,
    load_phase,
    load_prompts,
    overload_phase,
    phase_offsets,
    prefix_reuse_phase,
)
from bench.serve_load_report import (
    BASELINE_CONFIG,
    Outcome,
    Prompt,
    batch_histogram_means,
    counter_deltas,
    failures,
    markdown,
    ratios,
    summarize_load,
    summarize_overload,
)
from bench.serve_load_server import ServerProcess, contended
from bench.workloads import CATEGORIES
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.core.speculative import DEFAULT_SPECULATIVE

CONVERSATION_SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py")
CORES = "{cores}"  # in a configuration's arguments: the usable cores of this machine


@dataclass(frozen=True)
class ServerConfig:
    """One way to run ``ortspec serve``: the CLI arguments that select it (``CORES`` stands for the usable cores),
    how many requests it decodes at once (``slots``), and whether a run without ``--configs`` runs it."""

    args: tuple[str, ...]
    slots: int
    by_default: bool = True

    def cli_args(self, cores: int) -> list[str]:
        return [str(cores) if a == CORES else a for a in self.args]


SERVER_CONFIGS = {
    "batched": ServerConfig(("--max-batch", "16", "--threads", CORES), slots=16),
    # the same Engine without a prompt-token budget per pass (every prompt's next chunk in the same pass)
    "batched-unbudgeted": ServerConfig(
        ("--max-batch", "16", "--threads", CORES, "--prefill-budget", "none"), slots=16, by_default=False
    ),
    # ortspec serve --ray (a local Ray instance): the same Engine as a Ray Serve replica behind the same app (the Ray
    # path's overhead at the same slots and threads), and two replicas of half the slots and threads each
    "ray": ServerConfig(
        ("--ray", "--replicas", "1", "--max-batch", "16", "--threads", CORES), slots=16, by_default=False
    ),
    "ray-2": ServerConfig(
        ("--ray", "--replicas", "2", "--max-batch", "8", "--threads", "1"), slots=16, by_default=False
    ),
}

QUICK = {  # --quick: the defaults it changes (an option given explicitly wins)
    "concurrency": "4",
    "requests": 1,
    "prompts_per_category": 1,
    "max_prompt_tokens": 120,
    "conversation_tokens": 120,
    "conversations": 1,
    "reuse_max_tokens": 16,
    "overload_extra": 4,
    "ttft_target": 0.0,
}


def default_configs() -> list[str]:
    """What a run without ``--configs`` runs."""
    return [name for name, config in SERVER_CONFIGS.items() if config.by_default]


# ----------------------------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadRun:
    """What every load phase shares: the prompts (references computed), requests per client, and where the
    phase's outcomes go (``outcomes``: (configuration, concurrency) -> streamed outcomes)."""

    prompts: list[Prompt]
    requests: int
    outcomes: dict[tuple[str, int], list[Outcome]]
    offsets: dict[int, int]  # concurrency -> the phase's first prompt (phase_offsets)


def measure_load(server: ServerProcess, config: str, concurrency: int, run: LoadRun) -> tuple[dict[str, Any], bool]:
    """One load phase: its summary row (with memory, CPU, counters and batch-size means) and whether the peak RSS
    was reset for it."""
    reset = server.reset_peak()
    before = server.metrics()
    (outcomes, wall), cpu = contended(
        server,
        lambda: asyncio.run(load_phase(server.url, run.prompts, concurrency, run.requests, run.offsets[concurrency])),
    )
    after, memory = server.metrics(), server.memory_mib()
    run.outcomes[(config, concurrency)] = outcomes
    row = {"config": config, "concurrency": concurrency}
    row |= summarize_load(outcomes, wall, {p.name: p for p in run.prompts})
    row |= {"peak_rss_mib": memory["peak"], "rss_after_mib": memory["rss"], "server_cpu_s": cpu["server_s"]}
    row |= {"cpu": cpu, "server_counters": counter_deltas(before, after)}
    row["batch_histogram_means"] = batch_histogram_means(before, after)
    return row, reset


def _model_dir(arg: str | None) -> Path:
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

    if arg:
        return Path(arg)
    folder = default_model_dir("fp32")
    if not is_complete(folder):
        convert_smollm2(folder, "fp32", progress=lambda m: print(m, file=sys.stderr))
    return folder


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_load", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    add = p.add_argument
    add("--model", help="model folder (default: SmolLM2-135M-Instruct fp32, converted on first use)")
    add(
        "--configs",
        help=f"server configurations, in order, from {', '.join(SERVER_CONFIGS)} (default: "
        f"{','.join(default_configs())}; the first also runs the prefix-reuse and overload phases)",
    )
    add("--baseline", default=BASELINE_CONFIG, help=f"every ratio's denominator (default {BASELINE_CONFIG})")
    add("--concurrency", default="16,32,64", help="concurrent clients of each load phase (default 16,32,64)")
    add("--requests", type=int, default=1, help="requests per client in a load phase (default 1)")
    add("--max-queue", type=int, default=None, help="server queue bound (default and least: the largest concurrency)")
    add("--overload-extra", type=int, default=16, help="overload clients beyond slots + queue (default 16)")
    add(
        "--prompts-per-category",
        type=int,
        default=None,
        help="prompts per workload category (default: enough for every load request to have its own)",
    )
    add("--max-prompt-tokens", type=int, default=1000, help="longest load prompt (1000)")
    add(
        "--conversations",
        type=int,
        default=3,
        help=f"conversations of the reuse phase (3, at most {len(CONVERSATION_SOURCES)})",
    )
    add("--conversation-tokens", type=int, default=1000, help="first turn of the reuse phase (1000)")
    add("--reuse-max-tokens", type=int, default=64, help="answer length in the reuse phase (64)")
    add("--ttft-target", type=float, default=0.2, help="most second-turn ÷ cold TTFT (median) that passes; 0: none")
    add(
        "--quick",
        action="store_true",
        help="smoke test: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " unless given",
    )
    add("--out", default="docs/serve", help="folder for serve_load.{json,md} (default docs/serve)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, ``--quick`` applied, ``concurrency`` a sorted list and ``configs`` a list of configuration
    names; a clear error for anything else."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            option = "--" + key.replace("_", "-")
            if not any(a == option or a.startswith(option + "=") for a in argv):
                setattr(args, key, value)
    try:
        args.concurrency = sorted({int(c) for c in str(args.concurrency).split(",")})
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if args.concurrency[0] < 1 or args.requests < 1:
        parser.error("--concurrency and --requests must be at least 1")
    args.configs = args.configs.split(",") if args.configs else default_configs()
    unknown = [c for c in args.configs if c not in SERVER_CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(SERVER_CONFIGS)}")
    if args.baseline not in SERVER_CONFIGS:
        parser.error(f"--baseline: unknown {args.baseline!r}; known: {list(SERVER_CONFIGS)}")
    args.max_queue = args.max_queue or args.concurrency[-1]
    if args.max_queue < args.concurrency[-1]:
        parser.error("--max-queue must be at least the largest --concurrency (the load phases must see no 429)")
    args.conversations = max(1, min(args.conversations, len(CONVERSATION_SOURCES)))
    return args


@dataclass
class Collected:
    """Everything one invocation measured, filled configuration by configuration."""

    servers: list[dict[str, Any]]
    load: list[dict[str, Any]]
    reuse: dict[str, Any] | None = None
    overload: dict[str, Any] | None = None
    peak_reset: bool = True


@dataclass(frozen=True)
class Setup:
    """What every configuration's run shares: the options, the model, this machine's usable cores, the reuse
    phase's first turns and the tokenizer that counts them."""

    args: argparse.Namespace
    model_dir: Path
    cores: int
    turns: list[list[dict[str, str]]]
    tokenizer: Tokenizer


def run_config(name: str, first: bool, setup: Setup, run: LoadRun, collected: Collected) -> None:
    """Start ``name``'s server, run its phases (prefix reuse and overload only when ``first``), stop it."""
    args, config = setup.args, SERVER_CONFIGS[name]
    log = Path(tempfile.gettempdir()) / f"ortspec-serve_load-{name}.log"
    config_args = config.cli_args(setup.cores)
    server = ServerProcess(setup.model_dir, config_args, args.max_queue, log)
    try:
        ready_s = server.wait_ready()
        collected.servers.append(
            {"config": name, "command": ["ortspec", *server.command[3:]], "slots": config.slots}
            | {"max_queue": args.max_queue, "ready_s": ready_s, "ready_rss_mib": server.memory_mib()["rss"]}
        )
        _log(f"{name}: ready in {ready_s:.1f} s at {server.url}")
        if first:
            _log(f"{name}: prefix-reuse phase ...")
            turns = setup.turns
            rows, cpu = contended(
                server, lambda: asyncio.run(prefix_reuse_phase(server.url, turns, args.reuse_max_tokens))
            )
            for row, turn in zip(rows, turns, strict=True):
                row["prompt_tokens"] = len(setup.tokenizer.encode(setup.tokenizer.apply_chat_template(turn)))
            median = statistics.median(r["ratio"] for r in rows)
            collected.reuse = {"config": name, "conversations": rows, "median_ratio": median, "cpu": cpu}
        for c in args.concurrency:
            _log(f"{name}: load phase, {c} clients x {args.requests} request(s) ...")
            row, reset = measure_load(server, name, c, run)
            collected.load.append(row)
            collected.peak_reset &= reset
            _log(
                f"{name} @ {c}: {row['tokens_per_s']} tokens/s, TTFT p50 {row['ttft_ms_p50']} ms, "
                f"{row['errors']} errors, text == reference {row['text_equals_reference']}"
            )
        if first:
            clients = config.slots + args.max_queue + args.overload_extra
            _log(f"{name}: overload phase, {clients} clients at once ...")
            (outcomes, wall), cpu = contended(
                server, lambda: asyncio.run(overload_phase(server.url, run.prompts, clients))
            )
            over = summarize_overload(outcomes, wall, {p.name: p for p in run.prompts})
            capacity = config.slots + args.max_queue
            collected.overload = {"config": name, "capacity": capacity, **over, "cpu": cpu}
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args.model)
    machine = machine_info()
    cores = machine["cores"]["usable"] or os.cpu_count() or 1

    _log(f"prompts and references on {model_dir} ...")
    total = sum(args.concurrency) * args.requests
    per_category = args.prompts_per_category or -(-total // len(CATEGORIES))  # every request its own prompt
    prompts = load_prompts(model_dir, per_category, args.max_prompt_tokens)
    baseline = compute_references(model_dir, prompts, threads=cores)
    tokenizer = Tokenizer.from_folder(model_dir)
    sources = CONVERSATION_SOURCES[: args.conversations]
    turns = [conversation(tokenizer, src, args.conversation_tokens) for src in sources]
    setup = Setup(args, model_dir, cores, turns, tokenizer)
    run = LoadRun(prompts, args.requests, {}, phase_offsets(args.concurrency, args.requests))
    collected = Collected(servers=[], load=[])
    for i, name in enumerate(args.configs):
        run_config(name, i == 0, setup, run, collected)
    assert collected.reuse is not None and collected.overload is not None

    ratio_rows = ratios(collected.load, args.baseline)
    result = {
        "command": " ".join(["python -m bench.serve_load", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "settings": {
            "model": str(model_dir.name),
            "speculative": DEFAULT_SPECULATIVE,  # every server's default proposer (none passes --speculative)
            "configs": args.configs,
            "baseline": args.baseline,
            "max_queue": args.max_queue,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "distinct_prompts": len(prompts) >= total,
            "overload_extra": args.overload_extra,
            "ttft_target": args.ttft_target,
        },
        "servers": collected.servers,
        "in_process_baseline": baseline,
        "prompts": [{"name": p.name, "prompt_tokens": p.prompt_tokens, "max_tokens": p.max_tokens} for p in prompts],
        "conversation_sources": list(sources),
        "prefix_reuse": collected.reuse,
        "load": collected.load,
        "peak_rss_scope": "phase" if collected.peak_reset else "server's lifetime (the kernel refused a reset)",
        "ratios": ratio_rows,
        "overload": collected.overload,
        "outcomes": {
            f"{config}@{c}": [asdict(o) | {"chunk_times": len(o.chunk_times)} for o in outcomes]
            for (config, c), outcomes in run.outcomes.items()
        },
    }
    result["failures"] = failures(result)
    result["passed"] = not result["failures"]
    (out / "serve_load.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "serve_load.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    _log(f"wrote {out / 'serve_load.json'} and {out / 'serve_load.md'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
