"""A worker's records on its Engine's batch driver: up to ``slots`` sequences decode together, one backend pass
for all of them, and each record's line is ready the pass it finishes.

``BatchedRecords`` is the batched half of a ``BatchWorker`` (``worker.py``): ``submit`` hands it a task, ``step``
runs one pass and returns the records that finished. A task submitted while every slot is taken waits in the
driver and joins at the first pass after a slot frees (the driver admits first come first). Each record is a
request of ``adapters/engine/many.py`` (``batch_request``, ``submit``: what ``Engine.generate_many`` submits), so
its output is what ``Engine.generate`` gives that record alone; a record that fails (bad input, its proposer, a
failed pass) gets its error line and the others go on. One thread uses it (and the Engine) at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ortspec.adapters.engine.many import batch_driver, batch_request, submit
from ortspec.adapters.engine.options import GenerationOptions
from ortspec.adapters.engine.tools import ToolUse
from ortspec.batch_driver import BatchSequence

from .output import failure_lines, result_lines
from .records import Task

if TYPE_CHECKING:
    from ortspec.adapters.engine import Engine

# A finished record: its task, its output line and its metrics (``output.result_lines``, ``failure_lines``).
Finished = tuple[Task, dict[str, Any], dict[str, Any]]


class BatchedRecords:
    """The records of one worker running on ``engine``'s batch backend (an Engine opened with ``batch_slots``: its
    slots decode together). ``defaults``: the job's generation keywords (a record's own win); ``name``: the
    worker's, in the metrics."""

    def __init__(self, engine: Engine, defaults: Mapping[str, Any], name: str) -> None:
        self.engine = engine
        engine.shared_passes.hand_over()  # the batch backend's slots are this driver's
        self.defaults = dict(defaults)
        self.name = name
        self.driver = batch_driver(engine)
        self.slots = engine.batch_backend().slots
        self._running: list[tuple[Task, BatchSequence, ToolUse | None]] = []
        self._refused: list[Finished] = []  # records that failed before they joined

    @property
    def held(self) -> int:
        """Records submitted whose line ``step`` has not returned yet."""
        return len(self._running) + len(self._refused)

    def submit(self, task: Task) -> None:
        """Queue ``task`` on the driver (it joins at the next pass with a free slot); a record that cannot start
        (a bad prompt or option, a failed measurement) gets its error line at the next ``step``."""
        try:
            options = GenerationOptions(**{**self.defaults, **task.options})
            sequence = submit(self.engine, self.driver, batch_request(self.engine, task.prompt, options))
        except Exception as exc:  # a bad record never stops the run
            self._refused.append((task, *failure_lines(task, exc, self.name)))
            return
        self._running.append((task, sequence, options.tool_use()))

    def step(self) -> list[Finished]:
        """One pass over the running records (none when nothing runs); the records finished since the last call."""
        if self._running:
            self.driver.step()
        finished, self._refused = self._refused, []
        still = []
        for task, sequence, tools in self._running:
            if not sequence.done:
                still.append((task, sequence, tools))
            elif sequence.error is not None:
                finished.append((task, *failure_lines(task, sequence.error, self.name)))
            else:
                finished.append((task, *result_lines(task, sequence.result(), self.name, tools)))
        self._running = still
        return finished
