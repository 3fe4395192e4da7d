"""``ortspec serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn: one batched ``Engine`` (the default),
or one ``Engine`` per worker.

    from ortspec.adapters.serve.app import create_app
    from ortspec.adapters.serve.settings import ServerSettings

    engine = Engine.from_dir(path)
    app = create_app([engine], ServerSettings(model_name="smollm2"), batch=engine.batch_backend(16))
    uvicorn.run(app)                        # or: ortspec serve --model DIR --max-batch 16
    # workers: create_app([Engine.from_dir(path, prefix_reuse=True), ...], settings); ortspec serve --workers 2

The command line calls ``ortspec.adapters.serve.run.cmd_serve(args, model_dir)`` (this package needs the
``serve`` extra; import it only when serving). The package re-exports nothing: import from the module that owns
a name.

Rooms, each knowing only the ones below it:

- ``app.py``: ``create_app`` (``make_pool``: the pool for the engines; ``app_for``: the app around any pool, a
  ``jobs.ServePool``), the routes, streaming (server-sent events), error handlers, the body-size guard.
- ``models.py``: the pydantic request models (the sampling fields built from their declarations),
  ``argument_fields`` (the Engine's ``ArgumentError.argument`` -> request field), ``prepare_options``.
- ``responses.py``: a ``GenerateResult`` in the OpenAI response and stream-chunk shapes (usage, logprobs, the
  ``ortspec`` extension field). Nothing here decides what is committed: finish reasons come from
  ``FinishReason.openai``, text and token counts from the result.
- ``jobs.py``: what the pools share: a request's job (``RequestGeneration``) and its events, its outcomes and their
  metrics, the queue limit, ``Retry-After`` and the busy/waiting gauges (``PoolCore``, ``SubmittedJobs``); what the
  app needs of a pool (``ServePool``) and of the model's text (``Texts``).
- ``batch_pool.py``: ``BatchPool``: every request on one batched Engine (``engine.scheduler.BatchScheduler``).
- ``pool.py``: ``WorkerPool``: the workers, the bounded queue, routing by the longest cached prefix, leases and
  cancellation (a cancelled or timed-out job stops within one target pass).
- ``openapi.py``: the OpenAPI document: every status each route returns and every body (``RESPONSES``).
- ``errors.py``: ``APIError`` and ``ErrorBody`` (the OpenAI error object) and the mapping from a failure to its
  response.
- ``metrics.py``: the Prometheus metrics. ``settings.py``: ``ServerSettings``.
- ``run.py``: ``load_serving`` (the ``--workers`` / ``--max-batch`` rule), ``load_batched``, ``load_engines``,
  ``serve_in_thread``, ``cmd_serve``.
- ``ray/``: ``ortspec serve --ray``: the batched Engine as Ray Serve replicas behind this same app (its own
  package docstring; needs the ``ray`` extra).

The Engine (``ortspec.adapters.engine``) does the rest. It serializes generations on one Engine and supersedes a
stale iterator (a generation started on an Engine ends any older one still running there); the worker pool never
gives one Engine two requests at once, so neither happens here. The batched pool runs its requests on the Engine's
batch backend, whose slots keep the sequences apart.

Errors: a client's mistake (bad JSON, wrong types, unknown fields or model, an empty or too long prompt,
``max_tokens <= 0``, sampling values the Engine refuses, ``n != 1``) is a 400, 404 or 413 with an OpenAI error
object ``{"error": {"message", "type", "param", "code"}}`` naming the field; a ``ValueError`` from the Engine's
options or prompt checks is such a mistake (an ``ArgumentError`` names the argument, which ``argument_fields``
maps to the field). A ``GenerationError`` once generation started is a 500 (or, in a stream, an error event
followed by ``[DONE]``); the pool stays usable.
"""
