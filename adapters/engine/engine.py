"""``Engine``: a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)            # with the shared-KV drafter found for it (own, trained, shipped)
    result = engine.generate("Repeat: ...", max_tokens=128, speculative="prompt-lookup")   # or "shared-kv", "auto"
    engine.generate_stream(prompt, lambda text, token_id, finish_reason: ..., max_tokens=64)
    for chunk in engine.stream(prompt): ...

Every generation method takes the keywords of ``GenerationOptions`` (declared once, there). Decoding is greedy unless
the sampling keywords say otherwise; ``speculative`` only changes how fast the same tokens arrive.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from ortspec.adapters.engine import shared
from ortspec.adapters.engine.drafters import drafter_features, open_drafter, with_drafter_features
from ortspec.adapters.engine.measured import EngineMeasurements
from ortspec.adapters.engine.options import (
    AUTO_LOOKUP,
    GenerationOptions,
    Prompt,
    make_proposer,
    takes_callback_and_options,
    takes_options,
    takes_prompts_and_options,
)
from ortspec.adapters.engine.structured import GrammarCompiler, LlgGrammar, ResponseFormat
from ortspec.adapters.engine.suffix_cache import SuffixCache
from ortspec.adapters.engine.tokenizer import PromptReader, Tokenizer, check_tokenizer_fits
from ortspec.adapters.engine.tools import ToolUse
from ortspec.backends.base import Backend, BatchBackend
from ortspec.backends.onnx import BackendConfig, ModelFolder, OrtBatchBackend
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET, check_prefill_budget
from ortspec.core import (
    MAX_DRAFT,
    CostAwareWidth,
    DecodeState,
    DraftRule,
    FixedWidth,
    LookupOrDraft,
    Options,
    Proposer,
    WidthPolicy,
    check_prompt_fits,
)
from ortspec.core.checks import ArgumentError, ids_in_vocab
from ortspec.core.forced import forcing
from ortspec.core.prefix import common_prefix_length
from ortspec.driver import GenerateResult, Generation, PassGuard, StreamCallback

if TYPE_CHECKING:
    from ortspec.backends.onnx.slot_drafters import SlotDrafters

# The sequences generate_many runs at once (the KV caches of its batch backend).
BATCH_SLOTS = 16


class GenerationSuperseded(RuntimeError):
    """Another generation started on the same Engine before this one finished; this one cannot continue."""


class Engine(EngineMeasurements):
    """Plain and speculative generation (greedy or seeded sampling) on one model folder, one sequence at a time.

    Threads: ``generate`` and ``generate_stream`` hold the Engine's lock for the whole generation, so concurrent
    calls from several threads run one after another, each correct. An iterator from ``start`` or ``stream`` holds
    it for each pass; if another generation starts on the Engine before the iterator is exhausted, the iterator's
    next pass raises ``GenerationError`` (caused by ``GenerationSuperseded``): two sequences never share the KV.
    Opened with ``batch_slots``, the Engine's ``generate``, ``stream``, ``generate_stream`` and ``generate_many``
    calls from any threads share its passes instead (``shared.py``: one ``BatchScheduler``, ``shared_passes``;
    ``shared.shares_passes`` says which calls); ``start`` keeps the lone slot. ``close`` (or ``with``) ends them.

    ``prefix_reuse``: keep the KV of the last sequence and, when the next prompt starts with some of the same
    tokens (the next turn of a chat, another question about the same document), rewind to the longest common
    prefix and prefill only the rest. The output is the same as without it (the KV of a token depends only on the
    tokens before it); only the time to the first token changes. Off by default, so timings compare like with
    like; the server turns it on. :meth:`generate_many` follows it too: with it on, a prompt takes the batch slot
    holding its longest prefix (``BatchDriver``'s ``prefix_reuse``).

    ``prefill_budget``: the most prompt tokens one batched pass folds in, over every prefilling sequence
    (``BatchDriver``'s; ``None``: unbounded): what :meth:`generate_many`, the batched server and ``ortspec batch``
    run with (``from_dir`` sets it; default ``DEFAULT_PREFILL_BUDGET``).
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        folder: ModelFolder | None = None,
        prefix_reuse: bool = False,
        drafter: Proposer | None = None,
        backend_config: BackendConfig | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> None:
        """``drafter``: a proposer bound to ``backend`` that reads the target (a ``SharedKvProposer``), used by
        ``speculative="shared-kv"`` and ``"auto"``; :meth:`from_dir` opens the one found beside the model.
        ``backend_config``: how ``folder`` was opened (what :meth:`generate_many` opens its batch backend with).
        ``suffix_cache``: this Engine's recent outputs, what ``speculative="suffix"`` drafts from across requests
        (default: a new ``SuffixCache()``; an Engine is one model, so the cache is one model's)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.folder = folder
        self.prefix_reuse = prefix_reuse
        self.prefill_budget: int | None = DEFAULT_PREFILL_BUDGET
        self.drafter = drafter
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()
        self.suffix_rule = DraftRule()  # how "suffix" (and "auto"'s lookup) drafts: core.suffix's rule
        self._draft_cost: float | None = None
        self._lock = threading.RLock()
        self._epoch = 0  # bumped by every generation and measurement: the backend's current owner
        self._last: Generation | None = None  # the latest generation, whose KV the backend holds
        self._pass_costs: tuple[float, ...] | None = None
        self._drift: float | None = None
        self._drift_warned = False
        self.backend_config = backend_config if backend_config is not None else BackendConfig()
        self._batch: BatchBackend | None = None  # generate_many's, opened on first use
        self._backend_is_lone_slot = False  # opened for batching: ``backend`` is ``_batch``'s lone slot
        self._batch_decode_costs: tuple[float, ...] | None = None
        self.shared_passes = shared.SharedPasses(self, available=False)  # available once opened with batch_slots
        self._slot_drafters: SlotDrafters | None = None  # the drafter on the batch backend's slots
        self._grammars: GrammarCompiler | None = None  # response_format's compiler, made on first use
        self._grammar_lock = threading.Lock()  # not the Engine's lock: a request is checked while others generate

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        backend_config: BackendConfig | None = None,
        *,
        prefix_reuse: bool = False,
        drafter: str | os.PathLike[str] | bool | None = None,
        batch_slots: int | None = None,
        prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
    ) -> Engine:
        """Load an ONNX Runtime GenAI folder (``genai_config.json``, the model, ``tokenizer.json``).

        ``backend_config``: how the model is opened, a :class:`~ortspec.backends.onnx.BackendConfig` (default:
        ``BackendConfig()``: the CPU, physical cores, the config's context length): ``provider`` (``"cpu"`` or
        ``"cuda"``), ``threads`` (intra-op), ``max_length`` (KV capacity in tokens), the fast CUDA path
        (``static_shapes``, ``cuda_graphs``, ``graph_max_tokens``, ``array_module``, ``device_id``) and the
        load-time rewrites ``sliding_window`` and ``matmul_accuracy_level`` (``matmul_accuracy_level=1`` makes
        speculation exact on a quantized folder built at the builder's default level 4; see
        docs/quantization-data.md); its fields are checked when it is made (``ValueError``). ``prefix_reuse``: see
        the class docstring. ``drafter``: a shared-KV drafter
        folder to open (errors raise ``DrafterError``, a ``ValueError``), ``False`` for none, ``True`` for the one
        found beside the model (``DrafterError`` when there is none), or ``None`` (default) for that one if any
        (``drafters.find_drafter``: ``<model>/drafter``, where ``ortspec train-drafter`` puts it, or the drafter
        shipped with the package when it fits the folder; one found that does not fit the model is skipped with a
        warning). See docs/drafter.md.

        ``batch_slots``: open the folder once, for batching: an ``OrtBatchBackend`` of that many slots is the
        Engine's :meth:`batch_backend`, and the Engine's own one-sequence backend is its lone slot
        (``OrtBatchBackend.lone``), so the weights are in memory once (what ``ortspec serve`` runs); calls from many
        threads share passes (the class docstring); the drafter (found or given as above) is opened once, its session
        shared by every slot (:meth:`slot_drafters`) and the lone slot (``drafter``); ``BackendError`` or
        ``ValueError`` when the folder cannot run batched. ``prefill_budget``: see the class docstring (an int >= 1
        or None).

        Raises ``ValueError`` for a bad argument, ``ModelFolderError`` (a ``ValueError``) naming the file and the
        field or tensor when the folder cannot be used (missing or invalid files, a graph that does not match its
        config, a tokenizer for another vocabulary), and ``BackendError`` when onnxruntime fails otherwise."""
        from ortspec.backends.onnx import OrtBackend
        from ortspec.backends.onnx.drafter import SharedKvProposer

        check_prefill_budget(prefill_budget)
        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        check_tokenizer_fits(folder, tokenizer)
        backend_config = with_drafter_features(backend_config, drafter_features(folder, drafter))
        if batch_slots is not None:
            engine = cls._batched(folder, tokenizer, backend_config, batch_slots, prefix_reuse, drafter)
            engine.prefill_budget = prefill_budget
            return engine
        backend = OrtBackend.from_folder(folder, backend_config)
        proposer = open_drafter(folder, drafter, lambda found: SharedKvProposer.open(backend, found))
        engine = cls(
            backend,
            tokenizer,
            eos_token_ids=folder.eos_token_ids,
            folder=folder,
            prefix_reuse=prefix_reuse,
            drafter=proposer,
            backend_config=backend_config,
        )
        engine.prefill_budget = prefill_budget
        return engine

    @classmethod
    def _batched(
        cls,
        folder: ModelFolder,
        tokenizer: Tokenizer,
        config: BackendConfig | None,
        slots: int,
        prefix_reuse: bool,
        drafter: object,
    ) -> Engine:
        """``from_dir`` with ``batch_slots``: one ``OrtBatchBackend``, the Engine's backend its lone slot, the
        drafter's session shared by the slots."""
        from ortspec.backends.onnx.slot_drafters import SlotDrafters

        batch = OrtBatchBackend.from_folder(folder, config, slots=slots)
        drafters = open_drafter(folder, drafter, lambda found: SlotDrafters.open(batch, found))  # type: ignore[arg-type]
        engine = cls(
            batch.lone(),
            tokenizer,
            eos_token_ids=folder.eos_token_ids,
            folder=folder,
            prefix_reuse=prefix_reuse,
            drafter=drafters.lone() if drafters is not None else None,
            backend_config=config,
        )
        engine._batch, engine._backend_is_lone_slot, engine._slot_drafters = batch, True, drafters
        engine.shared_passes.available = True
        return engine

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

    # -- generation -------------------------------------------------------------------------------------------
    def start_with(self, prompt: Prompt, options: GenerationOptions) -> Generation:
        """A ``Generation`` (an iterator of commits) for ``prompt`` with ``options``: the one place the Engine
        turns its options into the core's ``Options``, a proposer and a width policy.

        Everything the caller gave is checked first (``ValueError`` naming it); only then, for a speculative
        generation, are this model's verify drift and cost curve measured (once; ``BackendError`` if that fails)."""
        if self.shared_passes.closed:
            raise shared.EngineClosed("this Engine is closed")
        proposer, auto_width = self._proposer(options.speculative, self.drafter)
        ids, core_options = self.prepare(prompt, options)
        with self._lock:
            if proposer is not None:
                self._warn_if_inexact()
            proposer, draft_width = self._priced(proposer, auto_width, options.draft_width)
            proposer = forcing(proposer, core_options, len(ids))
            cached = 0
            if self.prefix_reuse and self._last is not None:
                cached = common_prefix_length(self._last.resident_tokens(), ids)
            self._epoch += 1
            generation = Generation(
                self.backend,
                ids,
                core_options,
                proposer,
                draft_width=draft_width,
                detokenize=self.tokenizer.decode,
                cached_prefix=cached,
                guard=PassGuard(self._lock, functools.partial(self._check_still_current, self._epoch)),
                on_finish=self.record_output,
            )
            self._last = generation
            return generation

    @takes_prompts_and_options(GenerationOptions)
    def generate_many(self, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
        """Generate for every prompt of ``prompts`` with the same options, many sequences per target pass; result
        ``i`` is what ``generate(prompts[i], **options)`` gives alone (for sampling without a ``seed``, each prompt
        draws its own). Continuous batching (``ortspec.BatchDriver``) on a second session of this folder with
        ``BATCH_SLOTS`` KV caches, opened on first use (its own copy of the weights). ``speculative``: as for
        ``generate``; the shared-KV drafter (``"shared-kv"``, ``"auto"``) reads each sequence's own slot, its session
        shared by all (:meth:`slot_drafters`); ``"suffix"`` drafts from the suffix cache. With ``prefix_reuse``, a
        prompt reuses the KV of a prompt that shares its prefix (a system prompt) and ran earlier in the same call
        (each call starts with empty slots).
        ``ValueError`` names a bad prompt or option before anything runs; a generation that fails raises its
        ``GenerationError`` once the others have finished. Opened with ``batch_slots``: on the Engine's own slots,
        its shared passes (whose slots keep what they hold from call to call), beside other threads' calls."""
        from ortspec.adapters.engine.many import generate_many

        return generate_many(self, prompts, options)

    def prepare(self, prompt: Prompt, options: GenerationOptions) -> tuple[list[int], Options]:
        """The prompt's token ids and the core's ``Options`` for ``options`` (checked; a seed drawn when sampling
        without one): what every generation of this Engine starts from."""
        core_options = Options(
            **options.limits(),
            eos_token_ids=() if options.ignore_eos else self.eos_token_ids,
            sampling=options.sampling(),
            grammar=self._grammar(options.response_format, options.tool_use()),
        )
        ids = self.prompt_ids(prompt, chat=options.chat, system=options.system, tools=options.tool_use())
        self._check_prompt_fits(ids)
        ids_in_vocab("stop", [t for seq in core_options.stop_token_sequences for t in seq], self.backend.vocab_size)
        return ids, core_options

    def _grammar(self, response_format: ResponseFormat | None, tools: ToolUse | None) -> LlgGrammar | None:
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

    def batch_backend(self, slots: int | None = None) -> BatchBackend:
        """The batch backend of :meth:`generate_many` and the batched server: ``slots`` KV caches on this folder
        (None: the one open, else ``BATCH_SLOTS``), opened on first use and kept; asking for another slot count
        opens a new one in its place (and forgets :meth:`batch_decode_costs`). Each slot holds what the Engine's own
        backend holds (its ``max_length``), so every request's context limit is its limit alone; that is ``slots``
        times its KV memory (an Engine opened with ``batch_slots`` has slots of ``BackendConfig.capacity(...,
        batched=True)`` positions instead, its own backend one of them). Raises ``BackendError`` or
        ``ValueError`` saying why when the folder cannot run batched (a hybrid model, the CUDA provider, static
        shapes or CUDA graphs: see ``OrtBatchBackend``)."""
        batch = self._batch
        if batch is not None and slots in (None, batch.slots):
            return batch
        if batch is not None and self._backend_is_lone_slot:
            raise ValueError(
                f"this Engine was opened for batching with {batch.slots} slots (its own backend is their "
                f"session's lone slot); it cannot reopen them as {slots}"
            )
        if self.folder is None:
            raise ValueError("batching needs an Engine opened from a model folder (Engine.from_dir)")
        # each slot holds what this Engine's own backend holds, so a request's context limit is what it is alone
        config = attrs.evolve(self.backend_config, max_length=self.backend.max_length)
        self._batch = OrtBatchBackend.from_folder(self.folder, config, slots=slots or BATCH_SLOTS)
        self._batch_decode_costs = self._slot_drafters = None
        return self._batch

    def slot_drafters(self) -> SlotDrafters | None:
        """The Engine's drafter on the slots of :meth:`batch_backend` (``SlotDrafters``: its session shared, one
        binding per slot), made on first use; None without a shared-KV drafter (a ``drafter`` given to the
        constructor that is not a ``SharedKvProposer`` reads only the Engine's own backend)."""
        from ortspec.backends.onnx.drafter import SharedKvProposer
        from ortspec.backends.onnx.slot_drafters import SlotDrafters

        batch = self.batch_backend()
        if self._slot_drafters is None and isinstance(self.drafter, SharedKvProposer):
            assert isinstance(batch, OrtBatchBackend)
            self._slot_drafters = SlotDrafters.sharing(batch, self.drafter)
        return self._slot_drafters

    def _check_prompt_fits(self, ids: Sequence[int]) -> None:
        """``ValueError`` when the prompt is longer than the context (the core's rule, ``check_prompt_fits``; one
        that fills it exactly ends at once with ``context_full``, as the core decides), with this folder's hint."""
        capacity = self.backend.max_length
        model = f"; the model's context_length is {self.folder.context_length}" if self.folder else ""
        raise_it = self.folder is not None and capacity < self.folder.context_length
        check_prompt_fits(
            len(ids),
            capacity,
            holds=f"the context holds {capacity} (max_length{model})",
            advice="shorten the prompt" + (" or raise max_length" if raise_it else ""),
            argument="prompt",
        )

    @takes_options(GenerationOptions)
    def start(self, prompt: Prompt, options: GenerationOptions) -> Generation:
        """A ``Generation`` (an iterator of commits); its ``result()`` describes what was delivered."""
        return self.start_with(prompt, options)

    @takes_options(GenerationOptions)
    def generate(self, prompt: Prompt, options: GenerationOptions) -> GenerateResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (text, chat messages or token ids)."""
        if shared.shares_passes(self):
            return shared.generate(self, prompt, options)
        with self._lock:
            return self.start_with(prompt, options).run()

    @takes_callback_and_options(GenerationOptions)
    def generate_stream(self, prompt: Prompt, callback: StreamCallback, options: GenerationOptions) -> GenerateResult:
        """``generate``, calling ``callback(text, token_id, finish_reason)`` for every generated token, in order.
        ``finish_reason`` is None except on the last token, where it is the ``FinishReason`` value. If the
        callback raises, generation stops and ``GenerationAborted`` (with the partial result) is raised from the
        callback's exception."""
        if not callable(callback):
            raise ArgumentError("callback", "callback must be callable as callback(text, token_id, finish_reason)")
        if shared.shares_passes(self):
            return shared.generate_stream(self, prompt, callback, options)
        with self._lock:
            return self.start_with(prompt, options).run(callback)

    @takes_options(GenerationOptions)
    def stream(self, prompt: Prompt, options: GenerationOptions) -> Iterator[str]:
        """Yield the generated text in chunks as it is decided (empty chunks are skipped)."""
        if shared.shares_passes(self):
            return shared.stream(self, prompt, options)
        return (commit.text for commit in self.start_with(prompt, options) if commit.text)

    def close(self) -> None:
        """End the shared passes (``batch_slots``): the calls they run raise ``GenerationError`` caused by
        ``EngineClosed``; later generations raise ``EngineClosed``. Idempotent; ``with Engine.from_dir(...) as e``
        closes on exit."""
        self.shared_passes.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def resident_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV the backend holds from the last sequence (what ``prefix_reuse`` can reuse; empty
        after a measurement or before the first generation). A router can send a request to the Engine whose
        resident tokens share the longest prefix with the request's prompt."""
        with self._lock:
            return self._last.resident_tokens() if self._last is not None else ()

    def _priced(
        self, proposer: Proposer | None, auto_width: Callable[[], tuple[Proposer, WidthPolicy]], draft_width: object
    ) -> tuple[Proposer | None, int | WidthPolicy]:
        """The proposer and width policy a generation starts with, from ``_proposer``'s answer and the
        ``draft_width`` option: ``"auto"`` prices the proposer on this backend's measured costs (measured once,
        under the lock); an int caps ``"auto"``'s sources, each still priced."""
        with self._lock:
            if proposer is None:
                return None, 1 if draft_width == "auto" else draft_width  # type: ignore[return-value]
            if draft_width == "auto":
                return auto_width()
            if isinstance(proposer, LookupOrDraft) and isinstance(draft_width, int):
                priced, _ = auto_width()  # prices both sources
                return priced, FixedWidth(draft_width)  # a cap: each source's own policy picks below it
            return proposer, draft_width  # type: ignore[return-value]

    def _proposer(
        self, speculative: str | Proposer | None, drafter: Proposer | None
    ) -> tuple[Proposer | None, Callable[[], tuple[Proposer, WidthPolicy]]]:
        """The proposer for ``speculative`` with ``drafter`` (this Engine's, or None where it cannot run) and how to
        price it for ``draft_width="auto"``: a function giving the (priced) proposer and its width policy (called
        under the lock: it may measure). ``"auto"`` without a drafter is ``AUTO_LOOKUP``."""
        if speculative == "shared-kv":
            if drafter is None:
                raise ArgumentError(
                    "speculative",
                    "speculative='shared-kv' needs a drafter: train one with 'ortspec train-drafter' (Engine.from_dir "
                    "finds it) or pass Engine.from_dir(..., drafter=DIR)",
                )
            limit = int(getattr(drafter, "max_draft", MAX_DRAFT))
            return drafter, lambda: (
                drafter,
                CostAwareWidth(self.pass_costs()[: limit + 1], draft_cost=self.draft_cost()),
            )
        if speculative == "auto" and drafter is not None:
            auto = LookupOrDraft(self.context_proposer("auto"), drafter)  # type: ignore[arg-type]

            def priced() -> tuple[Proposer, WidthPolicy]:
                costs = self.pass_costs()
                limit = int(getattr(auto.drafter, "max_draft", MAX_DRAFT))
                drafter_policy = CostAwareWidth(costs[: limit + 1], draft_cost=self.draft_cost())
                return auto.priced(CostAwareWidth(costs), drafter_policy), FixedWidth(len(costs) - 1)

            return auto, priced
        proposer = self.context_proposer(speculative)
        assert proposer is not None or speculative is None
        return proposer, lambda: (proposer, CostAwareWidth(self.pass_costs()))  # type: ignore[return-value]

    def context_proposer(self, speculative: str | Proposer | None) -> Proposer | None:
        """The proposer for a ``speculative`` that drafts from the context alone (``make_proposer``): ``"auto"`` is
        ``AUTO_LOOKUP`` (what it is without a drafter); ``"suffix"`` drafts from the suffix cache's snapshot taken
        now (a request's proposer is made as it starts)."""
        name = AUTO_LOOKUP if speculative == "auto" else speculative
        return make_proposer(name, self.suffix_cache.snapshot() if name == "suffix" else None, self.suffix_rule)

    def record_output(self, state: DecodeState) -> None:
        """Record a finished generation's output in the suffix cache (every generation's ``on_finish``)."""
        self.suffix_cache.add(state.prompt_tokens, state.generated_tokens)

    def _check_still_current(self, epoch: int) -> None:
        """Before each pass of the generation started at ``epoch`` (the caller holds the lock): raise
        ``GenerationSuperseded`` when a newer generation (or a measurement) has taken the backend since."""
        if self._epoch != epoch:
            raise GenerationSuperseded(
                "another generation started on this Engine before this one finished (one sequence at a time per "
                "Engine: use one Engine per thread or worker, or open it with batch_slots to share passes)"
            )
