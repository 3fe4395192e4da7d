"""``ortspec serve --ray``: the Engine as a Ray Serve deployment of replicas behind ``ortspec serve``'s own
app (the same routes, streaming, errors, metrics and extension fields). Needs the ``ray`` extra
(``pip install 'ortspec[ray]'``); import it only when serving on Ray. The package re-exports nothing.

Rooms, each knowing only the ones below it:

- ``run.py``: ``ray_app`` (join or start Ray, deploy the replicas, the app in front of them), ``RayOptions``,
  ``deployment_options`` (CPUs, the router, health checks, the replica count or autoscaling on queue length),
  ``cmd_serve_ray``.
- ``pool.py``: ``RayPool``, the app's pool on the ingress: a request's job relayed from a replica's stream.
- ``router.py``: ``PrefixAffinityRouter`` (Ray Serve's request router hook) and its rule, ``prefix_ranks``.
- ``replica.py``: ``EngineReplica`` (the deployment class: ``app.make_pool`` on the Engine ``run.load_serving`` opens),
  ``ReplicaSettings`` (``ortspec serve``'s options as one value), the messages between the two sides.

How it runs and what was measured: docs/serve/ray.md.
"""
