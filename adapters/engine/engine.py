"""``Engine``: a model folder loaded, and the one scheduler that owns its batch backend, behind the
``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)            # the batch backend, its drafter (own, trained or shipped), measurements
    result = engine.generate("Repeat: ...", max_tokens=128)          # speculative="auto" unless told otherwise
    engine.generate_stream(prompt, lambda text, token_id, finish_reason: ..., max_tokens=64)
    for chunk in engine.stream(prompt): ...
    results = engine.generate_many(prompts, max_tokens=64)

What is loaded (the folder, the tokenizer, the batch backend and its one-sequence view, the drafter, the
measurements) is fixed at load. Every generation, from any thread, is a request of the Engine's one
``BatchScheduler`` (``calls.py``): a lone call is a batch of one, concurrent calls share passes. Every generation
method takes the keywords of ``GenerationOptions`` (declared once, there); ``speculative`` only changes how fast the
same tokens arrive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs

from ortspec.adapters.engine import calls
from ortspec.adapters.engine.calls import Call, EngineClosed
from ortspec.adapters.engine.draft_models import draft_slots, open_draft_model
from ortspec.adapters.engine.drafters import drafter_features, open_drafter, with_drafter_features
from ortspec.adapters.engine.measured import Measurements
from ortspec.adapters.engine.options import (
    GenerationOptions,
    Prompt,
    takes_callback_and_options,
    takes_options,
    takes_prompts_and_options,
)
from ortspec.adapters.engine.requests import Request, make_request
from ortspec.adapters.engine.scheduler import BatchScheduler, ScheduledRequest, Scheduling, Submission
from ortspec.adapters.engine.structured import GrammarCompiler, LlgGrammar, ResponseFormat
from ortspec.adapters.engine.suffix_cache import SuffixCache
from ortspec.adapters.engine.tokenizer import PromptReader, Tokenizer, check_tokenizer_fits
from ortspec.adapters.engine.tools import ToolUse
from ortspec.backends.base import Backend, BackendError, BatchBackend, OneSlot
from ortspec.backends.draft_model import DraftModelProposer
from ortspec.backends.onnx import BackendConfig, ModelFolder, ModelFolderError, OrtBatchBackend
from ortspec.backends.onnx.drafter import SharedKvProposer
from ortspec.backends.onnx.slot_drafters import SlotDrafters
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET, check_prefill_budget
from ortspec.core import DecodeState, DraftRule, Options, check_prompt_fits
from ortspec.core.checks import ArgumentError, check_int, ids_in_vocab
from ortspec.core.state import Commit
from ortspec.results import GenerateResult, StreamCallback

log = logging.getLogger("ortspec.engine")

# The sequences an Engine runs at once (its batch backend's slots) unless ``batch_slots`` says otherwise.
DEFAULT_SLOTS = 16


class Engine:
    """Plain and speculative generation (greedy or seeded sampling) on one model folder, for any number of calls
    from any threads (the module docstring).

    ``batch``: the batch backend the scheduler drives (an ``OrtBatchBackend``, or ``OneSlot`` over a one-sequence
    backend: a folder that cannot run batched, a fake); ``backend``: its one-sequence view, what the measurements
    run on (the batch backend's lone slot, ``lone_slot``, or the backend behind ``OneSlot``, slot 0); ``drafter``:
    the shared-KV drafter, a proposer that drafts in the slot its draft's context names (``SlotDrafters``, or one
    bound to the one-sequence backend; None without one); ``draft_model``: a separate draft model of the same
    vocabulary (``speculative="draft-model"``; ``backends.draft_model.DraftModelProposer``, one draft slot per slot;
    None without one). ``note``: why the folder runs one sequence at a time, when it does.

    ``prefix_reuse``: a request takes the free slot holding its longest prefix (the next turn of a chat, another
    question about the same document) and prefills only the rest; the output is the same either way, only the time
    to the first token changes. Off by default; the server turns it on. ``prefill_budget``: the most prompt tokens
    one pass folds in (``BatchDriver``'s). ``close`` (or ``with``) ends the scheduler.
    """

    def __init__(
        self,
        backend: Backend | BatchBackend,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        folder: ModelFolder | None = None,
        drafter: SharedKvProposer | SlotDrafters | None = None,
        backend_config: BackendConfig | None = None,
        scheduling: Scheduling | None = None,
        draft_model: DraftModelProposer | None = None,
    ) -> None:
        """``backend``: a ``BatchBackend`` with a one-sequence view (``lone()``, as ``OrtBatchBackend``), or a
        one-sequence ``Backend`` (run as ``OneSlot``). ``drafter``: see the class docstring
        (:meth:`from_dir` opens the one found beside the model); ``draft_model``: see the class docstring (its draft
        slot ``s`` serves the sequence in slot ``s``, ``lone_slot`` included). ``backend_config``: how ``folder`` was
        opened.
        ``scheduling``: how the scheduler runs (``Scheduling``: prefix reuse, the prefill budget, and the clock a
        request's ``deadline`` is read on; tests pass a clock they move by hand). ``suffix_cache`` (an attribute):
        this Engine's recent outputs, what ``speculative="suffix"`` and ``"auto"`` draft from across requests."""
        if isinstance(backend, BatchBackend):
            lone = getattr(backend, "lone", None)
            if not callable(lone):
                raise ValueError(f"an Engine's batch backend needs a one-sequence view (lone()): {backend!r}")
            self.batch: BatchBackend = backend
            self.backend: Backend = lone()
            self.lone_slot = backend.slots
        else:
            self.batch, self.backend, self.lone_slot = OneSlot(backend), backend, 0
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.folder = folder
        self.scheduling = scheduling if scheduling is not None else Scheduling()
        self.drafter = drafter
        self.draft_model = draft_model
        self.backend_config = backend_config if backend_config is not None else BackendConfig()
        self.suffix_cache = SuffixCache()
        self.suffix_rule = DraftRule()  # how "suffix" (and "auto"'s lookup) drafts: core.suffix's rule
        self.note: str | None = None
        self.measurements = Measurements(
            self.backend, self.batch, folder, (drafter, self.lone_slot), self._slots_held, draft_model=draft_model
        )
        self._scheduler: BatchScheduler | None = None
        self._closed = False
        self._starting = threading.Lock()  # held while the scheduler starts, or while a measurement runs before it
        self._grammars: GrammarCompiler | None = None  # response_format's compiler, made on first use
        self._grammar_lock = threading.Lock()

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        backend_config: BackendConfig | None = None,
        *,
        prefix_reuse: bool = False,
        drafter: str | os.PathLike[str] | bool | None = None,
        draft_model: str | os.PathLike[str] | None = None,
        batch_slots: int | None = None,
        prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
        clock: Callable[[], float] = time.monotonic,
        tree_branches: int = 1,
    ) -> Engine:
        """Load an ONNX Runtime GenAI folder (``genai_config.json``, the model, ``tokenizer.json``).

        ``backend_config``: how the model is opened (``BackendConfig``: provider, threads, ``max_length`` per
        sequence, the fast CUDA path, the load-time rewrites; checked when made). ``batch_slots``: the sequences
        run at once (default ``DEFAULT_SLOTS``), each slot's KV of ``BackendConfig.capacity(..., batched=True)``
        positions; a folder that cannot run batched (a hybrid model, the CUDA provider, static shapes, CUDA graphs)
        runs one sequence at a time on ``OrtBackend`` (``note`` says why). ``drafter``: a shared-KV drafter folder,
        ``False`` for none, ``True`` for the one found for the model (``DrafterError`` when there is none), ``None``
        (default) for that one if any (docs/drafter.md). ``draft_model``: a model folder of the same vocabulary
        to draft with (``speculative="draft-model"``; docs/draft-model.md), opened with ``backend_config`` and one
        draft slot per slot (``draft_models.open_draft_model``; ``VocabularyMismatch``, a ``ValueError``, names what
        differs when its vocabulary is not the target's). ``prefix_reuse`` and ``prefill_budget``: the class
        docstring; ``clock``: :meth:`__init__`'s; ``tree_branches``: the Engine's ``tree_branches``.

        Raises ``ValueError`` for a bad argument, ``ModelFolderError`` (a ``ValueError``) naming the file and the
        field or tensor when the folder cannot be used, and ``BackendError`` when onnxruntime fails otherwise."""
        from ortspec.backends.onnx import OrtBackend

        check_prefill_budget(prefill_budget)
        check_int("tree_branches", tree_branches, 1)
        slots = DEFAULT_SLOTS if batch_slots is None else check_int("batch_slots", batch_slots, 1)
        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        check_tokenizer_fits(folder, tokenizer)
        config = with_drafter_features(backend_config, drafter_features(folder, drafter))
        config = config if config is not None else BackendConfig()
        loaded = dict(eos_token_ids=folder.eos_token_ids, folder=folder, backend_config=config)
        settings = dict(scheduling=Scheduling(prefix_reuse, prefill_budget, clock))
        try:
            batch = OrtBatchBackend.from_folder(folder, config, slots=slots)
        except ModelFolderError:
            raise
        except (BackendError, ValueError) as exc:  # one sequence at a time, on the one-sequence backend
            backend = OrtBackend.from_folder(folder, config)
            proposer = open_drafter(folder, drafter, lambda found: SharedKvProposer.open(backend, found))
            drafts = None if draft_model is None else open_draft_model(folder, draft_model, config, 1)
            engine = cls(
                backend,
                tokenizer,
                drafter=proposer,
                draft_model=drafts,
                **loaded,  # type: ignore[arg-type]
                **settings,  # type: ignore[arg-type]
            )
            engine.note = f"this folder runs one sequence at a time: {exc}"
            log.info("%s", engine.note)
            engine.tree_branches = tree_branches
            return engine
        drafters = open_drafter(folder, drafter, lambda found: SlotDrafters.open(batch, found))
        drafts = None if draft_model is None else open_draft_model(folder, draft_model, config, draft_slots(batch))
        engine = cls(
            batch,
            tokenizer,
            drafter=drafters,
            draft_model=drafts,
            **loaded,  # type: ignore[arg-type]
            **settings,  # type: ignore[arg-type]
        )
        engine.tree_branches = tree_branches
        return engine

    @property
    def tree_branches(self) -> int:
        """The most candidate continuations a draft tree holds at one point, for the suffix lookup (its matches'
        other continuations: ``suffix_rule.branches``) and the drafter (the head's runner-up tokens: its
        ``branches``); 1 (the default): chains. Setting it sets both. Trees are verified where the backend runs
        tree rows, each source's nodes granted by its tree budget (docs/tree-attention.md); the output is the
        same either way. ``ArgumentError`` (a ``ValueError``) for a value below 1."""
        return self.suffix_rule.branches

    @tree_branches.setter
    def tree_branches(self, value: int) -> None:
        branches = check_int("tree_branches", value, 1)
        self.suffix_rule = attrs.evolve(self.suffix_rule, branches=branches)
        if self.drafter is not None:
            self.drafter.branches = branches

    # -- the scheduler ------------------------------------------------------------------------------------------
    @property
    def scheduler(self) -> BatchScheduler:
        """The one scheduler over ``batch``, started on first use; ``EngineClosed`` after ``close``."""
        scheduler = self._scheduler
        if scheduler is not None:
            return scheduler
        with self._starting:
            if self._closed:
                raise EngineClosed("this Engine is closed")
            if self._scheduler is None:
                scheduling = self.scheduling
                self._scheduler = BatchScheduler(
                    self.batch,
                    prefix_reuse=scheduling.prefix_reuse,
                    prefill_budget=scheduling.prefill_budget,
                    clock=scheduling.clock,
                    name="ortspec-engine-passes",
                )
            return self._scheduler

    @property
    def prefix_reuse(self) -> bool:
        return self.scheduling.prefix_reuse

    @property
    def prefill_budget(self) -> int | None:
        return self.scheduling.prefill_budget

    @property
    def clock(self) -> Callable[[], float]:
        return self.scheduling.clock

    @contextlib.contextmanager
    def _slots_held(self) -> Iterator[None]:
        """The batch backend's slots for a measurement: the scheduler paused (``BatchScheduler.exclusive``), or, before
        it starts, kept from starting."""
        with self._starting:
            scheduler = self._scheduler
            if scheduler is None:
                yield
                return
        with scheduler.exclusive():
            yield

    def request(self, prompt: Prompt, options: GenerationOptions) -> Request:
        """``prompt`` with ``options`` made ready for the scheduler (``requests.make_request``: ``ValueError`` naming
        a bad prompt or option before anything runs)."""
        if self._closed:
            raise EngineClosed("this Engine is closed")
        return make_request(self, prompt, options)

    def submit(
        self,
        request: Request,
        *,
        on_commit: Callable[[Commit], object] | None = None,
        on_done: Callable[[ScheduledRequest], object] | None = None,
        deadline: float | None = None,
    ) -> ScheduledRequest:
        """``request`` on the scheduler (``BatchScheduler.submit``: ``on_commit`` and ``on_done`` run on its pass
        thread; ``deadline`` on its clock). A request that reads the price of a plain step in its pass has the batch
        backend's decode costs measured first (once per model; kept on disk). ``EngineClosed`` after ``close``."""
        scheduler = self.scheduler
        if request.reads_pass_price and self.batch.slots > 1 and scheduler.decode_costs is None:
            scheduler.decode_costs = self.measurements.batch_decode_costs()
        try:
            submission = Submission(
                request.ids, request.options, request.proposer, request.draft_width, self.tokenizer.decode,
                request.on_finish, request.reads_target_state,
            )  # fmt: skip
            return scheduler.submit(submission, on_commit=on_commit, on_done=on_done, deadline=deadline)
        except RuntimeError as exc:  # the scheduler closed (it does only when the Engine closes)
            raise EngineClosed("this Engine is closed") from exc

    def warm(self) -> None:
        """Measure now what a speculative request would otherwise measure on first use (the verify drift, the verify
        cost curve, the drafter's and the draft model's steps, the batch backend's decode costs; each once per model
        on this machine, kept on disk) and give the scheduler its decode costs: what a server or a batch job does
        before its first request. ``BackendError`` if a measurement fails."""
        self.measurements.verify_drift()
        self.measurements.prices()
        if self.batch.slots > 1 and self.scheduler.decode_costs is None:
            self.scheduler.decode_costs = self.measurements.batch_decode_costs()

    def call(self, request: Request) -> Call:
        """``request`` on the scheduler, consumed on this thread (``calls.Call``)."""
        return Call(self, request)

    # -- generation -------------------------------------------------------------------------------------------
    @takes_options(GenerationOptions)
    def generate(self, prompt: Prompt, options: GenerationOptions) -> GenerateResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text, chat messages or token ids)."""
        return calls.generate(self, self.request(prompt, options))

    @takes_callback_and_options(GenerationOptions)
    def generate_stream(self, prompt: Prompt, callback: StreamCallback, options: GenerationOptions) -> GenerateResult:
        """``generate``, calling ``callback(text, token_id, finish_reason)`` for every generated token, in order, on
        this thread. ``finish_reason`` is None except on the last token, where it is the ``FinishReason`` value. If
        the callback raises, generation stops and ``GenerationAborted`` (with the partial result) is raised from the
        callback's exception."""
        if not callable(callback):
            raise ArgumentError("callback", "callback must be callable as callback(text, token_id, finish_reason)")
        return calls.generate(self, self.request(prompt, options), callback)

    @takes_options(GenerationOptions)
    def stream(self, prompt: Prompt, options: GenerationOptions) -> Iterator[str]:
        """Yield the generated text in chunks as it is decided (empty chunks are skipped). The request is checked
        now and queued on the first ``next``; closing the iterator cancels it."""
        return calls.texts(self, self.request(prompt, options))

    @takes_options(GenerationOptions)
    def start(self, prompt: Prompt, options: GenerationOptions) -> Call:
        """The request queued now, as a ``Call``: iterate it for its ``Commit``s, ``run(callback)`` for the rest,
        ``stop()`` to cancel it."""
        return self.call(self.request(prompt, options))

    @takes_prompts_and_options(GenerationOptions)
    def generate_many(self, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
        """Generate for every prompt of ``prompts`` with the same options, many sequences per target pass; result
        ``i`` is what ``generate(prompts[i], **options)`` gives alone (sampling without a ``seed``: each prompt draws
        its own). ``ValueError`` names a bad prompt or option before anything runs; a generation that fails raises
        its ``GenerationError`` once the others have finished."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ArgumentError("prompts", f"prompts must be a list of prompts, got {type(prompts).__name__}")
        return self.generate_requests([self.request(prompt, options) for prompt in prompts])

    def generate_requests(self, requests: Sequence[Request]) -> list[GenerateResult]:
        """Every request (``request``: each with its own options) at once; their results in order; the first
        failure raises (``GenerationError`` with its partial result)."""
        return calls.generate_all(self, requests)

    def close(self) -> None:
        """End the scheduler: the calls it runs raise ``GenerationError`` caused by ``EngineClosed``; later
        generations raise ``EngineClosed``. Idempotent; ``with Engine.from_dir(...) as e`` closes on exit."""
        with self._starting:
            self._closed = True
            scheduler = self._scheduler
        if scheduler is not None:
            scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prompt_ids(
        self, prompt: Prompt, *, chat: bool = False, system: str | None = None, tools: ToolUse | None = None
    ) -> list[int]:
        """Token ids for a prompt (``PromptReader.prompt_ids``: text, chat messages or token ids, with the
        generation's ``tools`` shown in a chat prompt; ``ValueError`` names the argument it refuses)."""
        reader = PromptReader(self.tokenizer, self.backend.vocab_size)
        return reader.prompt_ids(prompt, chat=chat, system=system, tools=tools)

    def prepare(self, prompt: Prompt, options: GenerationOptions) -> tuple[list[int], Options]:
        """The prompt's token ids and the core's ``Options`` for ``options`` (checked; a seed drawn when sampling
        without one): what every generation of this Engine starts from."""
        core_options = Options(
            **options.limits(),
            eos_token_ids=() if options.ignore_eos else self.eos_token_ids,
            sampling=options.sampling(),
            grammar=self.grammar(options.response_format, options.tool_use()),
        )
        ids = self.prompt_ids(prompt, chat=options.chat, system=options.system, tools=options.tool_use())
        self._check_prompt_fits(ids)
        ids_in_vocab("stop", [t for seq in core_options.stop_token_sequences for t in seq], self.backend.vocab_size)
        return ids, core_options

    def record_output(self, state: DecodeState) -> None:
        """Record a finished generation's output in the suffix cache (every request's ``on_finish``)."""
        self.suffix_cache.add(state.prompt_tokens, state.generated_tokens)

    def grammar(self, response_format: ResponseFormat | None, tools: ToolUse | None) -> LlgGrammar | None:
        """The constraint compiled for this model: the tool calls' grammar (``tools``, unless ``tool_choice`` is
        ``none``) or ``response_format`` (the options never hold both); ``ArgumentError`` naming the field whose
        value is refused."""
        if response_format is None and (tools is None or not tools.calls):
            return None
        with self._grammar_lock:
            if self._grammars is None:
                vocab = self.backend.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), vocab, sorted(self.eos_token_ids))
            return self._grammars.grammar(response_format) or self._grammars.tool_grammar(tools)

    def _check_prompt_fits(self, ids: Sequence[int]) -> None:
        """``ValueError`` when the prompt is longer than the context (the core's rule, ``check_prompt_fits``; one
        that fills it exactly ends at once with ``context_full``), with this folder's hint."""
        capacity = self.batch.max_length
        model = f"; the model's context_length is {self.folder.context_length}" if self.folder else ""
        raise_it = self.folder is not None and capacity < self.folder.context_length
        check_prompt_fits(
            len(ids),
            capacity,
            holds=f"the context holds {capacity} (max_length{model})",
            advice="shorten the prompt" + (" or raise max_length" if raise_it else ""),
            argument="prompt",
        )
