"""Batch generation over a JSONL dataset, on this machine (in this process, or worker processes) or on a Ray
cluster (Ray Data).

    ortspec batch prompts.jsonl results.jsonl                       # one Engine in this process, 16 records at once
    ortspec batch prompts.jsonl results.jsonl --workers 2 --threads 1   # two worker processes
    ortspec batch prompts.jsonl results.jsonl --ray                 # a local Ray instance
    ortspec batch prompts.jsonl results.jsonl --ray auto --workers 8 --threads 4

    from ortspec.adapters.batch import BatchJob, run_batch
    summary = run_batch(BatchJob("prompts.jsonl", "results.jsonl", model=folder, max_batch=16))

Input: one JSON object per line: ``id`` (a string or an integer, unique in the file), ``prompt`` (text or token
ids) or ``messages`` (chat turns), and any of the Engine's generation keywords (``GenerationOptions``: max_tokens,
stop, temperature, seed, ...), which override the job's defaults for that record. Blank lines are skipped.

Output: one JSON object per line, in completion order: ``id``, ``text``, ``token_ids``, ``finish_reason`` and
``finish_reason_openai``, ``stop_matched`` (when a stop matched), ``seed`` (the sampler's seed when sampling,
drawn and reported when the record gave none; null when greedy), ``stats`` (``steps`` = target passes,
``proposed`` and ``accepted`` draft tokens), ``prompt_tokens``, ``logprobs`` (when asked for). A record that
cannot run gets ``{"id", "line", "error"}`` instead (``partial`` too when generation failed midway); it never
stops the run. A line whose id is missing or unusable gets ``"id": null`` and its line number.

The rooms, by role:

- ``job.py``: the values: ``BatchJob`` (what to run), ``BatchSummary`` (what a run did), ``BatchError``.
- ``records.py``: the input records: reading INPUT, a record's keys checked against ``GenerationOptions``,
  duplicate ids, the task messages sent to Ray workers.
- ``output.py``: the output records: their lines, the writer (one write and one flush per record),
  resumption (``prepare_output``), and ``BatchOutput``, through which every line of a run goes.
- ``worker.py``: ``BatchWorker``, one Engine whose one scheduler runs the records (``submit``; ``advance``: the
  lines finished since); ``WorkerSettings``, how it opens (its slots, and its drafter only when a record drafts
  with it).
- ``local.py``: the local runner: one worker in this process, or worker processes pinned to their cores
  (``--workers N``).
- ``ray.py``: the Ray runner: the same workers as a Ray Data actor pool (the ``ray`` extra).
- ``run.py``: ``run_batch``, the entry point: checks, reads, resumes, then runs one of the two runners.

The command line's ``ortspec batch`` (``adapters/cli/batch.py``) turns its arguments into a ``BatchJob``.
"""

from .job import BatchError, BatchJob, BatchSummary
from .run import run_batch

__all__ = ["BatchError", "BatchJob", "BatchSummary", "run_batch"]
