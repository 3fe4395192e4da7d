"""``ortspec serve``: the OpenAI-compatible HTTP server. The server module (it needs the ``serve`` extra) is
imported only when the command runs, in :func:`run`."""

from __future__ import annotations

import argparse
from typing import Any

from .engine_args import model_dir
from .options import add_command, default_proposer_option, model_options, port, positive_int, prefill_budget_option

EXAMPLES = """\
examples:
  ortspec serve                                # one batched engine, 16 slots
  ortspec serve --max-batch 32 --port 8080
  ortspec serve --prefill-budget 256           # newcomers' prompts: at most 256 tokens per pass
  ortspec serve --speculative auto              # the suffix lookup or the shared-KV drafter, per draft
  ortspec serve --workers 2 --threads 1        # two engines of one sequence each
  ortspec serve --model ./my-model-folder --speculative none
  ortspec serve --ray --replicas 2 --threads 1  # two batched engines as Ray Serve replicas (local Ray)
  ortspec serve --ray auto --replicas 4 --max-replicas 8 --ship-model   # on this node's Ray cluster, autoscaled

Then point the openai client at http://127.0.0.1:8000/v1 (any api_key)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "serve",
        "OpenAI-compatible HTTP server (needs the 'serve' extra: pip install 'ortspec[serve]')",
        "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics over HTTP. By default one "
        "batched Engine (its slots share one session) runs every request holding one of its --max-batch slots in each "
        "pass; with --workers N (or --max-batch 1) every worker is its own Engine of one sequence (own KV, prefix "
        "reuse). Requests queue for a free slot or worker.",
        EXAMPLES,
    )
    model_options(p, drafter=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="port; 0 picks a free one (default %(default)s)")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="slots of the one batched engine (default 16); 1: the worker design (--workers)",
    )
    prefill_budget_option(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="engines of one sequence each, with their own KV and prefix reuse, instead of the batched engine "
        "(default 1; not with --max-batch above 1)",
    )
    default_proposer_option(p)
    p.add_argument(
        "--max-queue", type=positive_int, default=64, help="requests that may wait for a slot or worker; more: 429"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument(
        "--default-max-tokens", type=positive_int, default=None, help="when a request has none (default: context)"
    )
    p.add_argument("--model-name", help="model id served (default: the model folder's name)")
    p.add_argument(
        "--prefix-reuse", action=argparse.BooleanOptionalAction, default=True, help="reuse KV (workers; default on)"
    )
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    ray = p.add_argument_group("Ray Serve (needs the 'ray' extra: pip install 'ortspec[ray]'; docs/serve/ray.md)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="serve from batched engines that are Ray Serve replicas, behind this same app: a local Ray instance "
        "(no ADDRESS), the cluster of this node ('auto') or a GCS address HOST:PORT",
    )
    ray.add_argument("--replicas", type=positive_int, default=1, help="engine replicas (default 1; with --ray)")
    ray.add_argument(
        "--max-replicas",
        type=positive_int,
        default=None,
        help="autoscale on queue length between --replicas and this many replicas (with --ray; default: fixed)",
    )
    ray.add_argument(
        "--ship-model",
        action="store_true",
        help="send the model folder's files to each node through the object store (with --ray; default: the folder "
        "must be at the same path on every node)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from ortspec.adapters.serve.run import cmd_serve  # the one import of the server; needs the 'serve' extra

    return cmd_serve(args, model_dir(args))
