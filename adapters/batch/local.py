"""The local runner: the batch job on this machine, in this process (one worker, the default) or in worker
processes (``--workers N``, N > 1).

One worker runs in this process: one ``BatchWorker`` (one Engine, whose one scheduler runs the records), fed up to
its slots and one more (the next record waits in the scheduler, so it joins at the first pass after a slot frees;
with one slot, the next record is submitted only after the last is written). Tasks go in the order given (longest
prompt first) and each line is written as it finishes (completion order). A crash of this process (the OOM killer,
a fault in a native library) ends the run: rerun to resume.

N worker processes (``spawn``), each with its own ``BatchWorker`` and T intra-op threads pinned to its own cores
(N x T <= the cores this process may use). The parent keeps each ready worker holding its slots and one more (one
with one slot: the next only after the last is written), at most its share of what is left so that every worker
gets some; tasks go out in the order given, and each answer is written as it arrives.

A worker process that dies (a crash, the OOM killer) while it holds one task costs that record an error line; while
it holds several, any of them may be the cause, so each runs again alone (in a worker holding nothing else: the
first to drain, at the latest once the other records are handed out), where a record that kills its worker again
gets the error line. A new worker takes the dead one's place. A worker that cannot load the model stops the run
(``BatchError``).

Channels: each worker process reads tasks from its own queue and answers on its own pipe (one writer, no lock): a
worker killed in the middle of a write can then only break its own channel, never block the others' answers, as it
could while holding the write lock of a queue shared by all workers. Messages on the pipe: ``("ready", index,
load_s, slots, note)`` (``note``: why it does not batch, or None), ``("failed", index, error text)``, ``("done",
index, task key, output line, metrics)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ortspec.adapters.hosts import available_cores

from .job import BatchError
from .output import BatchOutput, encode_line
from .records import Task, error_record
from .worker import BatchWorker, WorkerSettings

# How the parent waits for worker messages before checking that its workers are alive (seconds).
_POLL_S = 0.5
# How long stopped workers get to exit before they are terminated (seconds).
_STOP_S = 5.0
# How long a worker process holding records waits for one to finish before it looks for new tasks (seconds).
_ADVANCE_S = 0.05


def take_waiting(inbox: Any, *, wait: bool, timeout: float | None = None) -> list[Any]:
    """Everything waiting in ``inbox`` (a multiprocessing queue), for a worker's next ``submit``; ``wait``: first
    wait up to ``timeout`` seconds for one item (a worker that holds no task), raising ``queue.Empty`` if none
    came. A worker that holds tasks never waits here: it waits for its records instead (``BatchWorker.advance``)."""
    items = [inbox.get(timeout=timeout)] if wait else []
    with contextlib.suppress(queue.Empty):
        while True:
            items.append(inbox.get_nowait())
    return items


def room(slots: int) -> int:
    """The most records a worker holds at once: its slots and the next record (one slot: that one alone, so the
    next is handed over only after the last is written)."""
    return slots + 1 if slots > 1 else 1


def plan_threads(workers: int, threads: int | None, cores: int, *, where: str = "here") -> int:
    """Intra-op threads per worker: ``threads``, or the cores shared out. ``BatchError`` when workers x threads
    would exceed ``cores``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BatchError(f"workers must be an int >= 1, got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BatchError(f"threads must be an int >= 1, got {threads!r}")
    if workers > cores:
        raise BatchError(f"{workers} workers need at least {workers} cores; {cores} available {where}")
    if threads is None:
        return max(1, cores // workers)
    if workers * threads > cores:
        raise BatchError(
            f"{workers} workers x {threads} threads = {workers * threads} intra-op threads, more than the {cores} "
            f"cores available {where}: choose workers x threads <= {cores} (e.g. --workers {workers} --threads "
            f"{max(1, cores // workers)})"
        )
    return threads


def _worker_main(
    index: int, cpus: list[int] | None, model_dir: str, settings: WorkerSettings, tasks: Any, results: Any
) -> None:
    """A worker process: pin to ``cpus``, load, then take tasks from its queue (waiting there only while it holds
    none), submit them and answer each finished record on ``results`` (the module docstring lists the messages),
    until ``None`` or its parent is gone. Ctrl-C is the parent's to handle (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        worker = BatchWorker(model_dir, settings, name=f"worker-{index}")
    except Exception as exc:
        results.send(("failed", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        return
    with worker:
        results.send(("ready", index, worker.load_s, worker.slots, worker.note))
        while True:
            try:
                new = take_waiting(tasks, wait=not worker.held, timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if None in new:
                return
            for task in new:
                worker.submit(task)
            for task, record, metrics in worker.advance(timeout=_ADVANCE_S):
                results.send(("done", index, task.key, encode_line(record), metrics))


class WorkerProcesses:
    """The worker processes of one embedded run and the parent's view of them: which are ready, how many records
    each takes, which tasks each holds, how many tasks are out. Every method runs in the parent."""

    def __init__(
        self,
        output: BatchOutput,
        model_dir: Path,
        settings: WorkerSettings,
        *,
        workers: int,
        pin: bool,
        say: Callable[[str], object],
    ) -> None:
        self.output, self.model_dir, self.settings = output, model_dir, settings
        self.workers, self.pin, self.say = workers, pin, say
        self._ctx = mp.get_context("spawn")
        self._cores = available_cores()
        self.procs: dict[int, Any] = {}
        self.inboxes: dict[int, Any] = {}
        self.outboxes: dict[int, Any] = {}  # the parent's end of each worker's answer pipe
        self.closed: set[int] = set()  # outboxes at end of file (their worker is gone)
        self.holding: dict[int, list[Task]] = {}
        self.room: dict[int, int] = {}  # the most tasks each ready worker holds at once
        self.ready: set[int] = set()
        self.alone: list[Task] = []  # tasks to run in a worker holding nothing else (next to pop: the last)
        self.lone: set[int] = set()  # workers running one of those
        self.outstanding = 0  # tasks handed to a worker, not yet written
        self.notes: set[str] = set()  # the workers' notes, each said once

    def start(self, index: int) -> None:
        """Start (or restart) worker ``index``."""
        threads = self.settings.threads
        cpus = self._cores[index * threads : (index + 1) * threads] if self.pin else None
        self.inboxes[index] = self._ctx.Queue()
        self.outboxes[index], writer = self._ctx.Pipe(duplex=False)
        self.closed.discard(index)
        args = (index, cpus, str(self.model_dir), self.settings, self.inboxes[index], writer)
        self.procs[index] = self._ctx.Process(
            target=_worker_main, args=args, name=f"ortspec-batch-{index}", daemon=True
        )
        self.procs[index].start()
        writer.close()  # the worker's copy stays open; when it exits, the parent's reader sees end of file
        self.holding[index] = []

    def receive(self, index: int) -> None:
        """Handle one message from worker ``index`` (or note that its pipe is at end of file)."""
        try:
            message = self.outboxes[index].recv()
        except (EOFError, OSError):
            self.closed.add(index)
            return
        kind = message[0]
        if kind == "failed":
            raise BatchError(f"worker {index} could not load the model: {message[2]}")
        if kind == "ready":
            _, _, load_s, slots, note = message
            self.ready.add(index)
            self.room[index] = room(slots)
            _loaded(self.output, load_s, slots, note, self.notes, self.say)
            return
        held = self.holding[index]
        for i, task in enumerate(held):
            if task.key == message[2]:
                del held[i]
                self.outstanding -= 1
                self.output.write(message[3], message[4])
                return

    def check_workers(self) -> None:
        """A worker that exited: before it was ready, the run cannot go on; after, the record it held (the
        likely cause) gets an error line, or the several it held each run again alone; a new worker takes its
        place."""
        for i, proc in list(self.procs.items()):
            if proc.exitcode is None:
                continue
            while i not in self.closed and self.outboxes[i].poll():  # what it sent before it died
                self.receive(i)
            if i not in self.ready:
                raise BatchError(f"worker {i} exited (code {proc.exitcode}) before it was ready (its error is above)")
            held = self.holding[i]
            if len(held) == 1:
                message = f"the worker process died (exit code {proc.exitcode}) while generating this record"
                self.output.write(error_record(held[0].id, held[0].line, message))
            else:
                self.alone.extend(reversed(held))  # their order kept: the first held runs first
            self.outstanding -= len(held)
            self.ready.discard(i)
            self.lone.discard(i)
            self.start(i)

    def hand_out(self, pending: list[Task]) -> None:
        """Give the ready workers tasks: one that must run alone to a worker holding nothing (which then takes
        nothing else until it is written), the others from ``pending`` (next to pop: the last) up to each worker's
        room and its share of what is left."""
        for i in sorted(self.ready):
            if not self.holding[i]:
                self.lone.discard(i)
                if self.alone:
                    self._give(i, self.alone.pop())
                    self.lone.add(i)
        share = -(-(len(pending) + self.outstanding) // len(self.procs))  # ceil
        for i in sorted(self.ready - self.lone):
            while pending and len(self.holding[i]) < min(self.room[i], share):
                self._give(i, pending.pop())

    def _give(self, index: int, task: Task) -> None:
        self.holding[index].append(task)
        self.inboxes[index].put(task)
        self.outstanding += 1

    def run(self, tasks: Sequence[Task]) -> None:
        """Run ``tasks`` in this order, writing each record as it completes; returns when every one is written."""
        pending = list(reversed(tasks))  # pop() takes the next one
        for i in range(min(self.workers, len(tasks))):
            self.start(i)
        while pending or self.outstanding or self.alone:
            self.hand_out(pending)
            open_ = {self.outboxes[i]: i for i in self.procs if i not in self.closed}
            for conn in mp_connection.wait(list(open_), timeout=_POLL_S):
                self.receive(open_[conn])
            if not open_:
                time.sleep(_POLL_S)
            self.check_workers()

    def stop(self) -> None:
        """Ask every live worker to exit; terminate those still running after ``_STOP_S`` seconds."""
        for i, proc in self.procs.items():
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    self.inboxes[i].put(None)
        deadline = time.monotonic() + _STOP_S
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)


def _loaded(
    output: BatchOutput, load_s: float, slots: int, note: str | None, notes: set[str], say: Callable[[str], object]
) -> None:
    """A worker is ready: its load time and slots into the summary, its note (why it does not batch) said once."""
    output.summary.load_s.append(float(load_s))
    output.summary.slots = max(output.summary.slots, slots)
    if note is not None and note not in notes:
        notes.add(note)
        say(note)


def run_in_process(
    output: BatchOutput, tasks: Sequence[Task], model_dir: Path, settings: WorkerSettings, say: Callable[[str], object]
) -> None:
    """Run ``tasks`` (in this order) on one ``BatchWorker`` in this process, writing each record to ``output`` as it
    finishes. ``BatchError`` when the model cannot be loaded."""
    try:
        worker = BatchWorker(model_dir, settings, name="worker-0")
    except Exception as exc:
        raise BatchError(f"the worker could not load the model: {type(exc).__name__}: {exc}") from exc
    with worker:
        _loaded(output, worker.load_s, worker.slots, worker.note, set(), say)
        pending = list(reversed(tasks))  # pop() takes the next one
        most = room(worker.slots)
        while pending or worker.held:
            while pending and worker.held < most:
                worker.submit(pending.pop())
            for _, record, metrics in worker.advance(timeout=_POLL_S):
                output.write(record, metrics)


def run_embedded(
    output: BatchOutput,
    tasks: Sequence[Task],
    model_dir: Path,
    settings: WorkerSettings,
    *,
    workers: int,
    pin: bool,
    say: Callable[[str], object],
) -> None:
    """Run ``tasks`` (in this order) on this machine, writing each record to ``output`` as it completes: one worker
    in this process, or ``workers`` > 1 worker processes (``pin``: each on its own ``settings.threads`` cores).
    ``say`` gets each worker note once (why the model does not batch)."""
    if workers == 1:
        run_in_process(output, tasks, model_dir, settings, say)
        return
    processes = WorkerProcesses(output, model_dir, settings, workers=workers, pin=pin, say=say)
    try:
        processes.run(tasks)
    finally:
        processes.stop()
