"""The batch job's values: what a run is asked to do (``BatchJob``), what it did (``BatchSummary``), and the one
error that stops it (``BatchError``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.backends.onnx.config import BackendConfig
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET
from ortspec.core.width import acceptance_rate


class BatchError(Exception):
    """The run as a whole cannot start or go on (a bad argument, an unreadable file, duplicate ids, a worker that
    cannot load the model). A bad record is not one: it gets an error line and the run goes on."""


def _path(value: str | os.PathLike[str]) -> Path:
    return Path(value)


def _model_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value).expanduser()


@attrs.frozen
class BatchJob:
    """One batch job: generate for every record of ``input_path`` (JSONL) not yet in ``output_path``.

    ``model``: the model folder (``None``: SmolLM2-135M-Instruct fp32, converted on first use). ``options``:
    ``GenerationOptions`` keywords for every record (a record's own fields win; ``speculative`` may be a proposer
    object, e.g. ``PromptLookup(...)``). ``workers`` x ``threads``: Engines, and intra-op threads for each
    (``threads`` None: the cores shared out); on this machine the product may not exceed the cores this process
    may use; one worker runs in this process, more run as worker processes, each pinned to its own cores
    (``pin``). ``max_batch``: the records each worker decodes at once, the slots of its Engine's one scheduler
    (continuous batching: the next record joins as soon as a slot frees); None (the default): sized from the work,
    each worker's share of the records to do, up to ``worker.AUTO_MAX_BATCH``; a folder that cannot be batched (a
    hybrid model, CUDA, static shapes) runs one record at a time (a note says why). ``prefill_budget``: the most
    prompt tokens one of a worker's passes folds in (``BatchDriver``'s; None: unbounded). ``ray``: run on Ray
    Data instead: ``"local"`` starts a local Ray instance, any other value is the address for ``ray.init``
    (``"auto"``, ``"ray://host:10001"``); ``ship_model`` then puts the model folder into Ray's object store for
    nodes that do not have it.
    ``backend``: how each worker's Engine opens its model (``BackendConfig``: ``provider``, ``max_length``, the
    fast CUDA path's ``static_shapes`` / ``cuda_graphs``, ...; its ``threads`` must be None: each worker's
    threads are the job's ``threads``).
    ``retry_errors``: drop OUTPUT's error lines first and run those records again. ``drafter``: the shared-KV
    drafter each worker's Engine opens (``Engine.from_dir``'s: None, the one found for the model, if any; a folder;
    False, none), which ``speculative`` ``"auto"`` and ``"shared-kv"`` use (its session shared by the worker's
    slots). It is opened only when a record the run has to do drafts with it (its own ``speculative``, or the
    job's default, is ``"auto"`` or ``"shared-kv"``): a run whose records all decode plainly or with a lookup
    loads no drafter, whatever ``drafter`` says. ``draft_model``: a draft model folder of the same vocabulary
    (``Engine.from_dir``'s), which ``speculative="draft-model"`` uses; opened only when a record the run has to do
    drafts with it. ``tree_branches``: each worker's Engine's (``Engine.from_dir``'s: 1, chains).

    The value is not checked when it is made: ``run_batch`` checks it before anything runs (``BatchError``)."""

    input_path: Path = attrs.field(converter=_path)
    output_path: Path = attrs.field(converter=_path)
    model: Path | None = attrs.field(default=None, converter=_model_path)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    workers: int = 1
    threads: int | None = None
    max_batch: int | None = None
    prefill_budget: int | None = DEFAULT_PREFILL_BUDGET
    ray: str | None = None
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    retry_errors: bool = False
    pin: bool = True
    ship_model: bool = False
    drafter: str | os.PathLike[str] | bool | None = None
    draft_model: str | os.PathLike[str] | None = None
    tree_branches: int = 1

    @property
    def mode(self) -> str:
        """``"embedded"`` (on this machine: in this process, or worker processes) or ``"ray"``."""
        return "embedded" if self.ray is None else "ray"


@attrs.define
class BatchSummary:
    """What a run did. ``records`` in INPUT (non-blank lines), ``skipped`` (already in OUTPUT), ``written``
    this run (``errors`` of them error lines), ``lost`` (sent to a worker, no line written: a rerun retries
    them). ``tokens`` generated and ``prompt_tokens`` read by the successful records; ``wall_s`` from the start
    of the run (reading INPUT) to the last line; ``first_line_s`` to the first generated line (startup: worker
    start and model load); ``load_s`` per worker (Engine load and warm-up); ``ray_init_s``: starting or joining
    Ray; ``slots``: the records a worker decodes at once (the most over the workers: ``max_batch``, or 1 for a
    folder that cannot batch); ``prefill_s``/``decode_s``/``generate_s``: sums over records of the Engine's
    timings (prompt pass, the steps after it, whole call; a record's times start when it reaches its worker's
    scheduler, so its wait for a slot counts as prefill); ``steps``/``proposed``/``accepted``: summed ``stats``."""

    mode: str
    workers: int
    threads: int
    records: int = 0
    skipped: int = 0
    written: int = 0
    errors: int = 0
    lost: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    first_line_s: float | None = None
    load_s: list[float] = attrs.field(factory=list)
    ray_init_s: float | None = None
    slots: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generate_s: float = 0.0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def records_per_second(self) -> float:
        return (self.written - self.errors) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted, self.proposed)

    def add(self, metrics: Mapping[str, Any] | None, elapsed_s: float) -> None:
        """Count one written line: a worker's ``metrics`` for a generated record (``ok``), or an error line
        (``metrics`` None or not ``ok``). ``elapsed_s``: seconds since the run started."""
        self.written += 1
        if not (metrics and metrics.get("ok")):
            self.errors += 1
            return
        if self.first_line_s is None:
            self.first_line_s = elapsed_s
        self.tokens += metrics["tokens"]
        self.prompt_tokens += metrics["prompt_tokens"]
        self.prefill_s += metrics["prefill_s"]
        self.decode_s += metrics["decode_s"]
        self.generate_s += metrics["total_s"]
        self.steps += metrics["steps"]
        self.proposed += metrics["proposed"]
        self.accepted += metrics["accepted"]

    def line(self) -> str:
        acc = f", acceptance {self.accepted}/{self.proposed} = {self.acceptance_rate:.0%}" if self.proposed else ""
        lost = f", {self.lost} lost (rerun to retry them)" if self.lost else ""
        load = f", model load and warm-up {max(self.load_s):.1f} s" if self.load_s else ""
        return (
            f"{self.written} records written ({self.errors} errors), {self.skipped} already done{lost}; "
            f"{self.tokens} tokens in {self.wall_s:.1f} s: {self.records_per_second:.2f} records/s, "
            f"{self.tokens_per_second:.1f} tok/s{acc} ({self.mode}, {self.workers} x {self.threads} threads, "
            f"{self.slots} slots each{load})"
        )
