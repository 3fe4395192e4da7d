"""``Engine``: a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)            # with the shared-KV drafter trained for it, when there is one
    result = engine.generate("Repeat: ...", max_tokens=128, speculative="prompt-lookup")   # or "shared-kv", "auto"
    engine.generate_stream(prompt, lambda text, token_id, finish_reason: ..., max_tokens=64)
    for chunk in engine.stream(prompt): ...

Every generation method takes the keywords of ``GenerationOptions`` (declared once, there). Decoding is greedy unless
the sampling keywords say otherwise; ``speculative`` only changes how fast the same tokens arrive.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs

from ortspec.adapters.engine.cache import cache_root, find_drafter
from ortspec.adapters.engine.options import (
    DRIFT_WARNING_THRESHOLD,
    GenerationOptions,
    Prompt,
    make_proposer,
    takes_callback_and_options,
    takes_options,
    takes_prompts_and_options,
)
from ortspec.adapters.engine.structured import GrammarCompiler, LlgGrammar, ResponseFormat
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.base import Backend, BatchBackend
from ortspec.backends.onnx import BackendConfig, ModelFolder, ModelFolderError
from ortspec.core import (
    MAX_DRAFT,
    CostAwareWidth,
    FixedWidth,
    LookupOrDraft,
    Options,
    PromptLookup,
    Proposer,
    WidthPolicy,
    check_prompt_fits,
)
from ortspec.core.checks import ArgumentError, ids_in_vocab
from ortspec.core.forced import forcing
from ortspec.core.prefix import common_prefix_length
from ortspec.driver import GenerateResult, Generation, PassGuard, StreamCallback

R = TypeVar("R")
# The sequences generate_many runs at once (the KV caches of its batch backend).
BATCH_SLOTS = 16


class GenerationSuperseded(RuntimeError):
    """Another generation started on the same Engine before this one finished; this one cannot continue."""


class Engine:
    """Plain and speculative generation (greedy or seeded sampling) on one model folder, one sequence at a time.

    Threads: ``generate`` and ``generate_stream`` hold the Engine's lock for the whole generation, so concurrent
    calls from several threads run one after another, each correct. An iterator from ``start`` or ``stream`` holds
    it for each pass; if another generation starts on the Engine before the iterator is exhausted, the iterator's
    next pass raises ``GenerationError`` (caused by ``GenerationSuperseded``): two sequences never share the KV.

    ``prefix_reuse``: keep the KV of the last sequence and, when the next prompt starts with some of the same
    tokens (the next turn of a chat, another question about the same document), rewind to the longest common
    prefix and prefill only the rest. The output is the same as without it (the KV of a token depends only on the
    tokens before it); only the time to the first token changes. Off by default, so timings compare like with
    like; the server turns it on. :meth:`generate_many` follows it too: with it on, a prompt takes the batch slot
    holding its longest prefix (``BatchDriver``'s ``prefix_reuse``).
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
    ) -> None:
        """``drafter``: a proposer bound to ``backend`` that reads the target (a ``SharedKvProposer``), used by
        ``speculative="shared-kv"`` and ``"auto"``; :meth:`from_dir` opens the one found beside the model.
        ``backend_config``: how ``folder`` was opened (what :meth:`generate_many` opens its batch backend with)."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.folder = folder
        self.prefix_reuse = prefix_reuse
        self.drafter = drafter
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
        (``cache.find_drafter``: ``<model>/drafter`` or where ``ortspec train-drafter`` puts it; one
        found that does not fit the model is skipped with a warning). See docs/drafter.md.

        ``batch_slots``: open the folder once, for batching: an ``OrtBatchBackend`` of that many slots is the
        Engine's :meth:`batch_backend`, and the Engine's own one-sequence backend is its lone slot
        (``OrtBatchBackend.lone``), so the weights are in memory once (what ``ortspec serve`` runs); no drafter
        (``drafter`` must not ask for one); ``BackendError`` or ``ValueError`` when the folder cannot run batched.

        Raises ``ValueError`` for a bad argument, ``ModelFolderError`` (a ``ValueError``) naming the file and the
        field or tensor when the folder cannot be used (missing or invalid files, a graph that does not match its
        config, a tokenizer for another vocabulary), and ``BackendError`` when onnxruntime fails otherwise."""
        from ortspec.backends.onnx import OrtBackend
        from ortspec.backends.onnx.drafter import DrafterError, SharedKvProposer

        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        check_tokenizer_fits(folder, tokenizer)
        if batch_slots is not None:
            return cls._batched(folder, tokenizer, backend_config, batch_slots, prefix_reuse, drafter)
        backend = OrtBackend.from_folder(folder, backend_config)
        proposer = None
        found = find_drafter(folder.path) if drafter in (None, True) else None
        if drafter not in (None, False, True):
            proposer = SharedKvProposer.open(backend, Path(drafter))  # type: ignore[arg-type]
        elif found is not None:
            try:
                proposer = SharedKvProposer.open(backend, found)
            except DrafterError as exc:
                if drafter is True:
                    raise
                warnings.warn(f"not using the drafter found at {found}: {exc}", RuntimeWarning, stacklevel=2)
        elif drafter is True:
            raise DrafterError(
                f"no drafter found for {folder.path}; train one with: ortspec train-drafter --model {folder.path}"
            )
        return cls(
            backend,
            tokenizer,
            eos_token_ids=folder.eos_token_ids,
            folder=folder,
            prefix_reuse=prefix_reuse,
            drafter=proposer,
            backend_config=backend_config,
        )

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
        """``from_dir`` with ``batch_slots``: one ``OrtBatchBackend``, the Engine's backend its lone slot."""
        from ortspec.backends.onnx import OrtBatchBackend

        if drafter not in (None, False):
            raise ArgumentError("drafter", "an Engine opened for batching (batch_slots) runs no shared-KV drafter")
        batch = OrtBatchBackend.from_folder(folder, config, slots=slots)
        engine = cls(
            batch.lone(),
            tokenizer,
            eos_token_ids=folder.eos_token_ids,
            folder=folder,
            prefix_reuse=prefix_reuse,
            backend_config=config,
        )
        engine._batch, engine._backend_is_lone_slot = batch, True
        return engine

    # -- text -------------------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def prompt_ids(self, prompt: Prompt, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt: text (chat-formatted as one user turn when ``chat``), a list of chat
        messages (always chat-formatted), or token ids (used as they are). ``ValueError`` names ``prompt`` for an
        empty prompt (an empty text is refused with ``chat`` too: it is not a question), ids that are not ints in
        the vocabulary, or anything else."""
        if isinstance(prompt, str):
            if not prompt:
                raise ArgumentError("prompt", "the prompt is empty: give some text (or token ids)")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                prompt = self.tokenizer.apply_chat_template(messages)
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)):
            raise ArgumentError("prompt", "the prompt is bytes: decode it to str (or give token ids)")
        elif isinstance(prompt, Mapping) or not isinstance(prompt, Sequence) and not hasattr(prompt, "__array__"):
            raise ArgumentError(
                "prompt",
                f"the prompt must be text, a list of chat messages or a list of token ids, got {type(prompt).__name__}",
            )
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))  # type: ignore[arg-type]
        else:
            if chat:
                raise ArgumentError("prompt", "chat=True needs a text prompt or chat messages, not token ids")
            ids = list(ids_in_vocab("prompt", list(prompt), self.backend.vocab_size))
        if not ids:
            raise ArgumentError("prompt", "the prompt is empty: it must encode to at least one token")
        return ids

    # -- generation -------------------------------------------------------------------------------------------
    def start_with(self, prompt: Prompt, options: GenerationOptions) -> Generation:
        """A ``Generation`` (an iterator of commits) for ``prompt`` with ``options``: the one place the Engine
        turns its options into the core's ``Options``, a proposer and a width policy.

        Everything the caller gave is checked first (``ValueError`` naming it); only then, for a speculative
        generation, are this model's verify drift and cost curve measured (once; ``BackendError`` if that fails)."""
        proposer, auto_width = self._proposer(options.speculative)
        ids, core_options = self.prepare(prompt, options)
        draft_width = options.draft_width
        with self._lock:
            if proposer is not None:
                self._warn_if_inexact()
                if draft_width == "auto":
                    proposer, draft_width = auto_width()
                elif isinstance(proposer, LookupOrDraft) and isinstance(draft_width, int):
                    proposer, _ = auto_width()  # prices both sources
                    draft_width = FixedWidth(draft_width)  # a cap: each source's own policy picks below it
            elif draft_width == "auto":
                draft_width = 1
            assert not isinstance(draft_width, str)
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
            )
            self._last = generation
            return generation

    @takes_prompts_and_options(GenerationOptions)
    def generate_many(self, prompts: Sequence[Prompt], options: GenerationOptions) -> list[GenerateResult]:
        """Generate for every prompt of ``prompts`` with the same options, many sequences per target pass; result
        ``i`` is what ``generate(prompts[i], **options)`` gives alone (for sampling without a ``seed``, each prompt
        draws its own). Continuous batching (``ortspec.BatchDriver``) on a second session of this folder with
        ``BATCH_SLOTS`` KV caches, opened on first use (its own copy of the weights). ``speculative``: None (plain
        decoding, the default) or prompt lookup (``"prompt-lookup"``, ``"auto"`` or a proposer); the shared-KV
        drafter does not run in batches. With ``prefix_reuse``, a prompt reuses the KV of a prompt that shares its
        prefix (a system prompt) and ran earlier in the same call (each call starts with empty slots).
        ``ValueError`` names a bad prompt or option before anything runs; a generation that fails raises its
        ``GenerationError`` once the others have finished."""
        from ortspec.adapters.engine.many import generate_many

        return generate_many(self, prompts, options)

    def prepare(self, prompt: Prompt, options: GenerationOptions) -> tuple[list[int], Options]:
        """The prompt's token ids and the core's ``Options`` for ``options`` (checked; a seed drawn when sampling
        without one): what every generation of this Engine starts from."""
        core_options = Options(
            **options.limits(),
            eos_token_ids=() if options.ignore_eos else self.eos_token_ids,
            sampling=options.sampling(),
            grammar=self._grammar(options.response_format),
        )
        ids = self.prompt_ids(prompt, chat=options.chat, system=options.system)
        self._check_prompt_fits(ids)
        ids_in_vocab("stop", [t for seq in core_options.stop_token_sequences for t in seq], self.backend.vocab_size)
        return ids, core_options

    def _grammar(self, response_format: ResponseFormat | None) -> LlgGrammar | None:
        """``response_format`` compiled for this model (``ArgumentError`` naming it when it is refused)."""
        if response_format is None:
            return None
        with self._grammar_lock:
            if self._grammars is None:
                vocab = self.backend.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), vocab, sorted(self.eos_token_ids))
            return self._grammars.grammar(response_format)

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
        from ortspec.backends.onnx import OrtBatchBackend

        # each slot holds what this Engine's own backend holds, so a request's context limit is what it is alone
        config = attrs.evolve(self.backend_config, max_length=self.backend.max_length)
        self._batch = OrtBatchBackend.from_folder(self.folder, config, slots=slots or BATCH_SLOTS)
        self._batch_decode_costs = None
        return self._batch

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
        with self._lock:
            return self.start_with(prompt, options).run(callback)

    @takes_options(GenerationOptions)
    def stream(self, prompt: Prompt, options: GenerationOptions) -> Iterator[str]:
        """Yield the generated text in chunks as it is decided (empty chunks are skipped)."""
        return (commit.text for commit in self.start_with(prompt, options) if commit.text)

    def resident_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV the backend holds from the last sequence (what ``prefix_reuse`` can reuse; empty
        after a measurement or before the first generation). A router can send a request to the Engine whose
        resident tokens share the longest prefix with the request's prompt."""
        with self._lock:
            return self._last.resident_tokens() if self._last is not None else ()

    def _proposer(
        self, speculative: str | Proposer | None
    ) -> tuple[Proposer | None, Callable[[], tuple[Proposer, WidthPolicy]]]:
        """The proposer for ``speculative`` and how to price it for ``draft_width="auto"``: a function giving the
        (priced) proposer and its width policy (called under the lock: it may measure)."""
        if speculative == "shared-kv":
            if self.drafter is None:
                raise ArgumentError(
                    "speculative",
                    "speculative='shared-kv' needs a drafter: train one with 'ortspec train-drafter' (Engine.from_dir "
                    "finds it) or pass Engine.from_dir(..., drafter=DIR)",
                )
            drafter = self.drafter
            limit = int(getattr(drafter, "max_draft", MAX_DRAFT))
            return drafter, lambda: (
                drafter,
                CostAwareWidth(self.pass_costs()[: limit + 1], draft_cost=self.draft_cost()),
            )
        if speculative == "auto" and self.drafter is not None:
            auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=MAX_DRAFT), self.drafter)

            def priced() -> tuple[Proposer, WidthPolicy]:
                costs = self.pass_costs()
                limit = int(getattr(auto.drafter, "max_draft", MAX_DRAFT))
                drafter_policy = CostAwareWidth(costs[: limit + 1], draft_cost=self.draft_cost())
                return auto.priced(CostAwareWidth(costs), drafter_policy), FixedWidth(len(costs) - 1)

            return auto, priced
        proposer = make_proposer("prompt-lookup" if speculative == "auto" else speculative)
        assert proposer is not None or speculative is None
        return proposer, lambda: (proposer, CostAwareWidth(self.pass_costs()))  # type: ignore[return-value]

    # -- measurements -----------------------------------------------------------------------------------------
    def verify_drift(self) -> float:
        """Largest logit difference between this backend's verify passes and one-token decodes (~30 passes; see
        ``measurements.measure_verify_drift``): 0 or ~1e-5 on float32 kernels, tenths of a logit on int8 kernels
        with batch-dependent activation quantization. Measured once per model file, provider, thread count and
        onnxruntime version and kept in the user cache (``measurement_file``), with a probe that fits any
        ``max_length``. Above ``DRIFT_WARNING_THRESHOLD`` the first speculative generation warns that its output can
        differ from plain output. ``BackendError`` if the measurement fails."""
        if self._drift is None:
            from ortspec.adapters.engine.measurements import cached_verify_drift

            self._drift = self._measured(
                "verify drift", lambda before: cached_verify_drift(self.backend, self.measurement_file(), before=before)
            )
        return self._drift

    def pass_costs(self, kmax: int = MAX_DRAFT) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured once
        (a few seconds) and kept like ``verify_drift``. ``BackendError`` if the measurement fails."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            from ortspec.adapters.engine.measurements import cached_pass_costs

            self._pass_costs = self._measured(
                "verify cost curve",
                lambda before: cached_pass_costs(self.backend, self.measurement_file(), kmax, before=before),
            )
        return self._pass_costs

    def batch_decode_costs(self) -> tuple[float, ...]:
        """The batch backend's ``decode_costs`` (a pass of ``n`` one-token rows ÷ one alone, ``n = 0 .. slots``;
        ``measurements.measure_batch_decode_costs``): how the batch driver prices a plain step so that speculation
        fades as the batch fills. Measured once (a second or two) and kept like ``verify_drift``. It empties the
        batch backend's slots: call it before the batch backend is in use. ``BackendError`` if it fails."""
        if self._batch_decode_costs is None:
            from ortspec.adapters.engine.measurements import cached_batch_decode_costs

            backend = self.batch_backend()
            self._batch_decode_costs = self._measured(
                "batch decode costs", lambda before: cached_batch_decode_costs(backend, self.measurement_file())
            )
        return self._batch_decode_costs

    def draft_cost(self) -> float:
        """The drafter's time per draft token ÷ a decode step (``measurements.measure_draft_cost``), measured once
        per model, drafter, provider and thread count (a second or two) and kept like ``verify_drift``; 0.0
        without a drafter. ``BackendError`` if the measurement fails."""
        if self.drafter is None:
            return 0.0
        if self._draft_cost is None:
            from ortspec.adapters.engine.measurements import cached_draft_cost

            drafter, path = self.drafter, getattr(getattr(self.drafter, "folder", None), "path", None)
            if path is not None:
                files = sorted(p for p in Path(path).iterdir() if p.is_file())
                key = "|".join(
                    [str(Path(path).resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
                )
            else:
                key = f"{type(drafter).__name__}@{id(drafter)}"
            self._draft_cost = self._measured(
                "drafter's cost",
                lambda before: cached_draft_cost(self.backend, drafter, self.measurement_file(), key, before=before),
            )
        return self._draft_cost

    def measurement_file(self) -> Path | None:
        """Where this engine's measurements are kept (``measurements.cached_measurement``): one file per model
        file (its path, and the size and modification time of it and of its external data), provider, thread
        count, onnxruntime version and load-time rewrites (``OrtBackend.variant``), under the user cache. None
        without a model folder: nothing to key it on, so the measurements are made once per Engine."""
        if self.folder is None:
            return None
        import onnxruntime

        model = self.folder.model_path.resolve()
        files = sorted(p for p in model.parent.iterdir() if p.name.startswith(model.name))
        key = "|".join(
            [str(model)]
            + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
            + [str(getattr(self.backend, "provider", "?")), str(getattr(self.backend, "threads", "?"))]
            + [onnxruntime.__version__]
            # a load-time rewrite or session setting makes another model: its own measurements
            + ([variant] if (variant := str(getattr(self.backend, "variant", ""))) else [])
        )
        return cache_root() / "measurements" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")

    def _measured(self, what: str, measure: Callable[[Callable[[], None]], R]) -> R:
        """Run ``measure(before)`` under the lock; ``before()`` is called just before the backend is used (a cache
        hit never calls it), and takes the backend. A failure becomes a ``BackendError`` saying what was measured."""
        from ortspec.backends.base import BackendError

        with self._lock:
            try:
                return measure(self._take_backend)
            except Exception as exc:
                raise BackendError(
                    f"measuring this model's {what} failed (a speculative generation measures it once, then reads it "
                    f"from the cache): {type(exc).__name__}: {exc}"
                ) from exc

    def _check_still_current(self, epoch: int) -> None:
        """Before each pass of the generation started at ``epoch`` (the caller holds the lock): raise
        ``GenerationSuperseded`` when a newer generation (or a measurement) has taken the backend since."""
        if self._epoch != epoch:
            raise GenerationSuperseded(
                "another generation started on this Engine before this one finished (one sequence at a time per "
                "Engine: use one Engine per thread or worker)"
            )

    def _take_backend(self) -> None:
        """A measurement is about to use (and reset) the backend (the caller holds the lock): it supersedes any
        generation in flight, and the KV of the last sequence is gone."""
        self._epoch += 1
        self._last = None

    def _warn_if_inexact(self) -> None:
        """Warn once when speculative output may differ from plain output here: the measured verify drift
        exceeds ``DRIFT_WARNING_THRESHOLD``, or (CPU) the graph has ``MatMulNBits`` nodes at accuracy level 4,
        whose int8-activation kernels give results that depend on how many tokens a pass holds (a one-off
        measurement can miss that on some contexts; see docs/quantization-data.md)."""
        if self._drift_warned:
            return
        drift = self.verify_drift()
        levels = dict(getattr(getattr(self.backend, "graph_facts", None), "matmul_nbits", {}) or {})
        level4 = sum(count for (_bits, level), count in levels.items() if level == 4)
        batch_dependent = bool(level4) and getattr(self.backend, "provider", "cpu") == "cpu"
        if drift <= DRIFT_WARNING_THRESHOLD and not batch_dependent:
            return
        self._drift_warned = True
        why = f"a verify pass differed from one-token decodes by up to {drift:.3g} logits"
        if batch_dependent:
            why += (
                f", and its {level4} MatMulNBits nodes run at accuracy level 4 (int8 activations), whose results "
                "depend on how many tokens a pass holds"
            )
        remedy = (
            "load it with matmul_accuracy_level=1 (float32 compute; see docs/quantization-data.md) or use a float32 "
            "model"
            if any(level != 1 for (_bits, level) in levels)
            else "use a float32 model where exactness matters"
        )
        warnings.warn(
            f"on this model {why}: speculative output can differ from plain output here; {remedy}",
            RuntimeWarning,
            stacklevel=4,
        )


def check_tokenizer_fits(folder: ModelFolder, tokenizer: Tokenizer) -> None:
    """``ModelFolderError`` when ``tokenizer.json`` cannot be this model's: it makes ids past the model's vocabulary,
    or lacks its EOS ids. (A tokenizer with fewer entries than the vocabulary is normal: vocabularies are padded.)"""
    size = tokenizer.vocab_size
    config = folder.path / "genai_config.json"
    if size > folder.vocab_size:
        raise ModelFolderError(
            f"{tokenizer.path} has {size} tokens but {config} says model.vocab_size = {folder.vocab_size}: "
            "the tokenizer is for another model"
        )
    for eos in folder.eos_token_ids:
        if tokenizer.id_to_token(eos) is None:
            raise ModelFolderError(
                f"{tokenizer.path} has no token {eos}, the model.eos_token_id of {config}: "
                "the tokenizer is for another model"
            )
