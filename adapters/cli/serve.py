"""``ortspec serve``: the OpenAI-compatible HTTP server. The server modules (they need the ``serve`` extra) are
imported only when the command runs, in :func:`run`: the Engine (``serve.run.load_serving``), measured, behind the
app (``serve.app.create_app``) on uvicorn until interrupted; with ``--ray``, Ray Serve replicas of that Engine
behind the same app (``serve.ray.run.cmd_serve_ray``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .engine_args import backend_config, draft_model, drafter, model_dir
from .options import add_command, default_proposer_option, model_options, port, positive_int, prefill_budget_option

EXAMPLES = """\
examples:
  ortspec serve                                # one engine, 16 slots
  ortspec serve --max-batch 32 --port 8080
  ortspec serve --prefill-budget 256           # newcomers' prompts: at most 256 tokens per pass
  ortspec serve --speculative auto              # the suffix lookup or the shared-KV drafter, per draft
  ortspec serve --model ./my-model-folder --speculative none
  ortspec serve --ray --replicas 2 --threads 1  # two batched engines as Ray Serve replicas (local Ray)
  ortspec serve --ray auto --replicas 4 --max-replicas 8 --ship-model   # on this node's Ray cluster, autoscaled

Then point the openai client at http://127.0.0.1:8000/v1 (any api_key)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = add_command(
        sub,
        "serve",
        "OpenAI-compatible HTTP server (needs the 'serve' extra: pip install 'ortspec[serve]')",
        "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics over HTTP. One Engine (its "
        "slots share one session) runs every request holding one of its --max-batch slots in each pass; the others "
        "queue for a free slot.",
        EXAMPLES,
    )
    model_options(p, drafter=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="port; 0 picks a free one (default %(default)s)")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="slots of the engine: requests decoded together (default 16)",
    )
    prefill_budget_option(p)
    default_proposer_option(p)
    p.add_argument("--max-queue", type=positive_int, default=64, help="requests that may wait for a slot; more: 429")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument(
        "--default-max-tokens", type=positive_int, default=None, help="when a request has none (default: context)"
    )
    p.add_argument("--model-name", help="model id served (default: the model folder's name)")
    p.add_argument(
        "--prefix-reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request takes the free slot holding its longest prefix (default on)",
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
    return cmd_serve(args, model_dir(args))


def cmd_serve(args: argparse.Namespace, model: Path) -> int:
    """Load the Engine (``load_serving``), measure it, serve until interrupted, then close it; with ``--ray``, the
    Engine as Ray Serve replicas (``cmd_serve_ray``) behind the same app."""
    import uvicorn  # the server's imports: they need the 'serve' extra

    from ortspec.adapters.engine.options import speculative_value
    from ortspec.adapters.serve.app import create_app
    from ortspec.adapters.serve.run import load_serving
    from ortspec.adapters.serve.settings import ServerSettings

    settings = ServerSettings(
        model_name=args.model_name or Path(model).name,
        speculative=speculative_value(args.speculative),
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        default_max_tokens=args.default_max_tokens,
    )
    backend = backend_config(args, threads=args.threads)
    if args.ray is not None:
        from ortspec.adapters.serve.ray.replica import ReplicaSettings  # needs the 'ray' extra
        from ortspec.adapters.serve.ray.run import cmd_serve_ray

        replica = ReplicaSettings(
            backend=backend,
            server=settings,
            max_batch=args.max_batch,
            prefill_budget=args.prefill_budget,
            prefix_reuse=args.prefix_reuse,
            drafter=drafter(args),
            draft_model=draft_model(args),
            tree_branches=args.tree_branches,
        )
        return cmd_serve_ray(args, model, replica)
    engine = load_serving(
        model,
        backend,
        max_batch=args.max_batch,
        prefix_reuse=args.prefix_reuse,
        prefill_budget=args.prefill_budget,
        drafter=drafter(args),
        draft_model=draft_model(args),
        tree_branches=args.tree_branches,
    )
    with engine:
        uvicorn.run(create_app(engine, settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0
