"""Running ``ortspec serve --ray``: the engine replicas as a Ray Serve application (``deploy``), the app in front of
them (``ray_app``), and ``cmd_serve_ray``, what the command calls.

    with ray_app(model_dir, settings, RayOptions(address="local", replicas=2)) as app:
        uvicorn.run(app)    # or serve_in_thread(app): the same routes as ortspec serve

Where things run: the app (ingress: HTTP, tokenization, SSE, the prefix-affinity router) in this process, joined to
Ray (``address``: ``"local"`` starts a local instance with this machine's cores, ``"auto"`` joins the cluster this
node belongs to, or a GCS address); the replicas (``replica.EngineReplica``, ``threads`` Ray CPUs each) wherever
Ray places them. Ray Serve's HTTP proxies are not started: requests reach the replicas through the deployment's
handle. ``max_replicas`` above ``replicas`` turns on Ray Serve's autoscaling on queue length: between ``replicas``
and ``max_replicas`` replicas, aiming at ``slots`` ongoing requests per replica (every slot busy, nobody waiting).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import uvicorn
from fastapi import FastAPI

from ortspec.adapters.engine.tokenizer import PromptReader, Tokenizer
from ortspec.adapters.ray_support import RayError, model_source, plan_actors, ray_session
from ortspec.adapters.serve.app import app_for
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.ray.pool import RayPool
from ortspec.adapters.serve.ray.replica import EngineReplica, ReplicaInfo, ReplicaSettings
from ortspec.adapters.serve.ray.router import MIN_SHARE, PrefixAffinityRouter
from ortspec.core.checks import int_at_least

log = logging.getLogger("ortspec.serve")

APP_NAME = "ortspec"
DEPLOYMENT = "EngineReplica"
HEALTH_CHECK_PERIOD_S = 2.0  # how often Ray Serve checks a replica (a dead one is replaced after the next check)


class RayServeError(RuntimeError):
    """``ortspec serve --ray`` cannot start: Ray cannot be joined, or the replicas cannot load the model."""


@attrs.frozen(kw_only=True)
class RayOptions:
    """Where and how many: ``address`` (``"local"``, ``"auto"`` or a GCS address ``HOST:PORT``), ``replicas``
    (at the start; all the time without autoscaling), ``max_replicas`` (above ``replicas``: autoscaling up to it;
    None: a fixed count), ``ship_model`` (the folder's files go through the object store to each node instead of
    being read at the same path there), ``threads`` (Ray CPUs and intra-op threads per replica; None: the local
    cores shared out among the replicas, at most one node's: ``ray_support.plan_actors``)."""

    address: str = "local"
    replicas: int = attrs.field(default=1, validator=int_at_least(1))
    max_replicas: int | None = None
    ship_model: bool = False
    threads: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}")


def deployment_options(settings: ReplicaSettings, options: RayOptions, threads: int) -> dict[str, Any]:
    """Ray Serve's options for the replicas' deployment: CPUs, the requests a replica takes at once (its slots and
    its queue), the prefix-affinity router, health checks, and the replica count or the autoscaling on queue
    length."""
    from ray.serve.config import RequestRouterConfig

    slots = settings.slots
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type]  # a class or its import path
        request_router_kwargs={"held": slots, "min_share": MIN_SHARE},
    )
    out: dict[str, Any] = {
        "name": DEPLOYMENT,
        "ray_actor_options": {"num_cpus": threads},
        "max_ongoing_requests": slots + settings.server.max_queue,
        "request_router_config": router,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "logging_config": {"enable_access_log": False},  # no log line per request (the ingress's /metrics count)
    }
    if options.max_replicas is None or options.max_replicas == options.replicas:
        out["num_replicas"] = options.replicas
    else:
        out["autoscaling_config"] = {
            "min_replicas": options.replicas,
            "initial_replicas": options.replicas,
            "max_replicas": options.max_replicas,
            "target_ongoing_requests": slots,
        }
    return out


def deploy(ray: Any, settings: ReplicaSettings, options: RayOptions, threads: int) -> Any:
    """Run the replicas' application on Ray Serve (no HTTP proxy); its deployment handle once every replica serves.
    ``RayServeError`` naming the cause when they cannot start (e.g. the model folder missing on a node)."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(EngineReplica).options(  # type: ignore[attr-defined]
        **deployment_options(settings, options, threads)
    )
    try:
        return serve.run(deployment.bind(settings), name=APP_NAME, route_prefix=None)
    except Exception as exc:
        cause = _cause(str(exc))
        with contextlib.suppress(Exception):  # the replicas' own error, when Ray Serve kept it
            cause = _cause(serve.status().applications[APP_NAME].deployments[DEPLOYMENT].message) or cause
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        raise RayServeError(f"the engine replicas did not start: {cause}") from None


def _cause(text: str) -> str:
    """The line of a Ray error text that says what failed (Ray wraps a replica's exception in tracebacks)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line and not line.startswith(("File ", "ray.exceptions"))]
    return errors[-1] if errors else (lines[-1] if lines else "")


@contextlib.contextmanager
def ray_app(model_dir: Path, settings: ReplicaSettings, options: RayOptions) -> Iterator[FastAPI]:
    """The app serving ``model_dir`` on Ray Serve replicas (see the module docstring): joins or starts Ray (an
    already initialised Ray is used as it is), deploys the replicas (``settings``: everything but ``source``, which
    is filled here), yields the app, and deletes the application on exit."""
    from ray import serve

    with contextlib.ExitStack() as stack:
        try:
            ray = stack.enter_context(ray_session(options.address))
            _, threads = plan_actors(
                ray, options.address, options.replicas, options.threads, log.warning, noun="replica"
            )
        except RayError as exc:
            raise RayServeError(str(exc)) from None
        source = stack.enter_context(model_source(ray, model_dir, options.ship_model))
        replica = attrs.evolve(settings, source=source, backend=attrs.evolve(settings.backend, threads=threads))
        handle = deploy(ray, replica, options, threads)
        stack.callback(serve.delete, APP_NAME)
        info: ReplicaInfo = handle.describe.remote().result()
        server = settings.server
        pool = RayPool(
            handle,
            PromptReader(Tokenizer.from_folder(model_dir), info.vocab_size),
            info,
            options.max_replicas or options.replicas,
            max_queue=server.max_queue,
            timeout_s=server.request_timeout_s,
            metrics=Metrics(),
        )
        yield app_for(pool, attrs.evolve(server, measure_at_startup=False))  # each replica measured as it started


def cmd_serve_ray(args: argparse.Namespace, model_dir: Path, settings: ReplicaSettings) -> int:
    """``ortspec serve --ray``: the replicas on Ray Serve, the app here, until interrupted."""
    options = RayOptions(
        address=args.ray,
        replicas=args.replicas,
        max_replicas=args.max_replicas,
        ship_model=args.ship_model,
        threads=args.threads,
    )
    try:
        with ray_app(model_dir, settings, options) as app:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except RayServeError as exc:
        print(f"ortspec: {exc}", file=sys.stderr)
        return 2
    return 0
