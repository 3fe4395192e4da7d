"""``Engine``: a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)            # with the shared-KV drafter trained for it, when there is one
    result = engine.generate("Repeat: ...", max_tokens=128, speculative="prompt-lookup")   # or "shared-kv", "auto"
    engine.generate_stream(prompt, lambda text, token_id, finish_reason: ..., max_tokens=64)
    for chunk in engine.stream(prompt): ...

Every generation method takes the keywords of ``GenerationOptions`` (declared once, there). Decoding is greedy;
``speculative`` only changes how fast the same tokens arrive.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import secrets
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from ortspec.adapters.cache import cache_root, find_drafter
from ortspec.adapters.tokenizer import Tokenizer
from ortspec.backends.base import Backend
from ortspec.backends.onnx import BackendConfig, ModelFolder, ModelFolderError
from ortspec.core import CostAwareWidth, FixedWidth, Options, PromptLookup, Proposer, WidthPolicy
from ortspec.core.checks import ids_in_vocab, int_at_least
from ortspec.driver import GenerateResult, Generation
from ortspec.lookup_or_draft import LookupOrDraft

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
StreamCallback = Callable[[str, int, str | None], object]
Stop = str | Sequence[str] | Sequence[Sequence[int]] | None

SPECULATIVE_CHOICES = ("prompt-lookup", "shared-kv", "auto")
# Verify-vs-decode logit drift (in logits) above which speculative output is no longer guaranteed to equal greedy.
DRIFT_WARNING_THRESHOLD = 1e-3
# Stop strings are searched in the text after every token (cost ~ the number and length of the strings), and a
# stop token sequence is compared with the newest tokens: these bounds keep that a small part of a step.
MAX_STOPS = 64
MAX_STOP_LENGTH = 1000


def make_proposer(speculative: str | Proposer | None) -> Proposer | None:
    """``None`` (plain greedy), ``"prompt-lookup"`` (3-gram lookup drafting up to 16 tokens), or any proposer.
    (``"shared-kv"`` and ``"auto"`` need an Engine's drafter: ``Engine.start_with`` resolves them.)"""
    if speculative is None:
        return None
    if isinstance(speculative, str):
        if speculative == "prompt-lookup":
            return PromptLookup(ngram=3, max_draft=16)
        if speculative in SPECULATIVE_CHOICES:
            raise ValueError(f"speculative={speculative!r} needs an Engine (it reads the Engine's drafter)")
        raise ValueError(f"speculative={speculative!r}: expected None, one of {SPECULATIVE_CHOICES} or a proposer")
    if not callable(getattr(speculative, "propose", None)):
        raise ValueError(f"speculative={speculative!r} has no propose(context_tokens, width) method")
    return speculative


def _split_stop(stop: object, vocab_size: int) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """``stop`` as (stop strings, stop token sequences); ``ValueError`` naming ``stop`` for anything that could
    never match or is not a stop: an empty string or sequence, bytes, a lone surrogate (no decoded text holds one:
    e.g. half of a character cut from UTF-16, or bytes decoded with ``surrogateescape``), a token id outside the
    vocabulary, more than ``MAX_STOPS`` entries, or one longer than ``MAX_STOP_LENGTH``. ``None`` and ``[]``: no
    stops."""
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)):
        raise ValueError("stop: bytes are not a stop string; decode them to str (stop strings match decoded text)")
    if isinstance(stop, Mapping) or not isinstance(stop, Iterable):
        raise ValueError(
            f"stop must be a string, a list of strings or a list of token-id lists, got {type(stop).__name__}"
        )
    items = list(stop)
    if len(items) > MAX_STOPS:
        raise ValueError(f"stop holds {len(items)} entries; at most {MAX_STOPS} are allowed")
    strings: list[str] = []
    sequences: list[tuple[int, ...]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError("stop: an empty string would match before any text; remove it")
            if len(item) > MAX_STOP_LENGTH:
                raise ValueError(
                    f"stop: a stop string of {len(item)} characters; at most {MAX_STOP_LENGTH} are allowed"
                )
            for i, ch in enumerate(item):
                if "\ud800" <= ch <= "\udfff":
                    raise ValueError(
                        f"stop: {item!r} holds a lone surrogate (U+{ord(ch):04X} at index {i}), which no decoded text "
                        "contains: it could never match (was it cut from UTF-16, or decoded with surrogateescape?)"
                    )
            strings.append(item)
        elif isinstance(item, (bytes, bytearray)):
            raise ValueError(f"stop: {item!r} is bytes; decode it to str (stop strings match decoded text)")
        elif isinstance(item, Iterable) and not isinstance(item, Mapping):
            ids = list(item)
            if not ids:
                raise ValueError("stop: an empty token-id sequence would match before any token; remove it")
            if len(ids) > MAX_STOP_LENGTH:
                raise ValueError(f"stop: a token-id sequence of {len(ids)} ids; at most {MAX_STOP_LENGTH} are allowed")
            sequences.append(ids_in_vocab("stop", ids, vocab_size))
        else:
            raise ValueError(f"stop: {item!r} is neither a string nor a sequence of token ids")
    return tuple(strings), tuple(sequences)


def _check_draft_width(instance: GenerationOptions, attribute: Any, value: Any) -> None:
    if value == "auto" or isinstance(value, WidthPolicy):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"draft_width={value!r}: expected 'auto', an int >= 1 or a width policy")


@attrs.frozen(kw_only=True)
class GenerationOptions:
    """The keywords of every ``Engine`` generation method, validated (a ``ValueError`` names the keyword).

    ``max_tokens``: most new tokens. ``stop``: a string, strings, or token-id sequences that end generation
    (stop strings are cut from the text). ``speculative``: ``None`` (plain greedy), ``"prompt-lookup"``,
    ``"shared-kv"`` (the Engine's drafter: a draft head reading the target's hidden state and KV), ``"auto"``
    (per draft, prompt lookup or the drafter, whichever has earned more tokens per unit time, each priced by its own
    cost-aware width policy; prompt lookup alone without a drafter), or a proposer object. ``draft_width``:
    ``"auto"`` (the cost-aware policy on this backend's measured verify cost curve), the most draft tokens per pass,
    or a width policy. ``chat``: format a text prompt as one user turn with the folder's chat template (``system``: an
    optional system turn). ``ignore_eos``: do not stop at the model's EOS tokens. ``top_logprobs``: report each
    token's log-probability and the N most likely alternatives. ``tie_margin``: the near-tie guard, in logits (0 = off).

    Sampling (onnx_genai's names; every rule in ``ortspec/core/sampling.py``): ``temperature`` (unset or 0:
    greedy), ``top_k`` (unset or 0: off), ``top_p`` (unset or 1: off), ``min_p``, ``seed`` (any int in
    [0, 2**64); unset while sampling: the Engine draws one and reports it as ``result.seed``, so every run can be
    replayed), ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` ({token id:
    bias}). With the same seed, speculative output equals plain output token for token.
    """

    max_tokens: int = attrs.field(default=128, validator=int_at_least(1))
    stop: Stop = None
    speculative: str | Proposer | None = None
    draft_width: int | WidthPolicy | str = attrs.field(default="auto", validator=_check_draft_width)
    chat: bool = False
    system: str | None = None
    ignore_eos: bool = False
    top_logprobs: int = attrs.field(default=0, validator=int_at_least(0))
    tie_margin: float = 0.0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None

    def sampling_options(self) -> dict[str, Any]:
        """The core ``Options`` keywords for sampling; a seed is drawn when sampling without one."""
        temperature = 0.0 if self.temperature is None else self.temperature
        seed = self.seed
        if seed is None and isinstance(temperature, (int, float)) and temperature > 0:
            seed = secrets.randbits(64)
        return dict(
            temperature=temperature,
            top_k=0 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p,
            seed=seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


P = ParamSpec("P")
R = TypeVar("R")


def _bind_options(method: Callable[..., R], leading: int, options_type: Callable[..., GenerationOptions]) -> Any:
    """``method(*leading args, options)`` as ``method(*leading args, /, **keywords of options_type)``, with that
    signature for ``help()`` (the decorators below give it to type checkers)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        return method(*args[:leading], options_type(*args[leading:], **kwargs))

    head = [
        p.replace(kind=inspect.Parameter.POSITIONAL_ONLY)
        for p in list(inspect.signature(method).parameters.values())[:leading]
    ]
    keywords = list(inspect.signature(options_type).parameters.values())
    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        head + keywords, return_annotation=inspect.signature(method).return_annotation
    )
    return wrapper


def takes_options(
    options_type: Callable[P, GenerationOptions],
) -> Callable[[Callable[[Any, Prompt, GenerationOptions], R]], Callable[Concatenate[Any, Prompt, P], R]]:
    """Decorate ``method(self, prompt, options)`` to take ``options_type``'s keywords instead of ``options``."""
    return lambda method: _bind_options(method, 2, options_type)


def takes_callback_and_options(
    options_type: Callable[P, GenerationOptions],
) -> Callable[
    [Callable[[Any, Prompt, StreamCallback, GenerationOptions], R]],
    Callable[Concatenate[Any, Prompt, StreamCallback, P], R],
]:
    """``takes_options`` for ``method(self, prompt, callback, options)``."""
    return lambda method: _bind_options(method, 3, options_type)


class GenerationSuperseded(RuntimeError):
    """Another generation started on the same Engine before this one finished; this one cannot continue."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """Greedy and speculative generation on one model folder, one sequence at a time.

    Threads: ``generate`` and ``generate_stream`` hold the Engine's lock for the whole generation, so concurrent
    calls from several threads run one after another, each correct. An iterator from ``start`` or ``stream`` holds
    it for each pass; if another generation starts on the Engine before the iterator is exhausted, the iterator's
    next pass raises ``GenerationError`` (caused by ``GenerationSuperseded``): two sequences never share the KV.

    ``prefix_reuse``: keep the KV of the last sequence and, when the next prompt starts with some of the same
    tokens (the next turn of a chat, another question about the same document), rewind to the longest common
    prefix and prefill only the rest. The output is the same as without it (the KV of a token depends only on the
    tokens before it); only the time to the first token changes. Off by default, so timings compare like with
    like; the server turns it on.
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
    ) -> None:
        """``drafter``: a proposer bound to ``backend`` that reads the target (a ``SharedKvProposer``), used by
        ``speculative="shared-kv"`` and ``"auto"``; :meth:`from_dir` opens the one found beside the model."""
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

    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        backend_config: BackendConfig | None = None,
        *,
        prefix_reuse: bool = False,
        drafter: str | os.PathLike[str] | bool | None = None,
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
        (``ortspec.adapters.cache.find_drafter``: ``<model>/drafter`` or where ``ortspec train-drafter`` puts it; one
        found that does not fit the model is skipped with a warning). See docs/drafter.md.

        Raises ``ValueError`` for a bad argument, ``ModelFolderError`` (a ``ValueError``) naming the file and the
        field or tensor when the folder cannot be used (missing or invalid files, a graph that does not match its
        config, a tokenizer for another vocabulary), and ``BackendError`` when onnxruntime fails otherwise."""
        from ortspec.backends.onnx import OrtBackend
        from ortspec.backends.onnx.drafter import DrafterError, SharedKvProposer

        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        check_tokenizer_fits(folder, tokenizer)
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
        )

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
                raise ValueError("the prompt is empty: give some text (or token ids)")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                prompt = self.tokenizer.apply_chat_template(messages)
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (bytes, bytearray)):
            raise ValueError("the prompt is bytes: decode it to str (or give token ids)")
        elif isinstance(prompt, Mapping) or not isinstance(prompt, Sequence) and not hasattr(prompt, "__array__"):
            raise ValueError(
                f"the prompt must be text, a list of chat messages or a list of token ids, got {type(prompt).__name__}"
            )
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))  # type: ignore[arg-type]
        else:
            if chat:
                raise ValueError("chat=True needs a text prompt or chat messages, not token ids")
            ids = list(ids_in_vocab("prompt", list(prompt), self.backend.vocab_size))
        if not ids:
            raise ValueError("the prompt is empty: it must encode to at least one token")
        return ids

    # -- generation -------------------------------------------------------------------------------------------
    def start_with(self, prompt: Prompt, options: GenerationOptions) -> Generation:
        """A ``Generation`` (an iterator of commits) for ``prompt`` with ``options``: the one place the Engine
        turns its options into the core's ``Options``, a proposer and a width policy.

        Everything the caller gave is checked first (``ValueError`` naming it); only then, for a speculative
        generation, are this model's verify drift and cost curve measured (once; ``BackendError`` if that fails)."""
        stop_strings, stop_sequences = _split_stop(options.stop, self.backend.vocab_size)
        proposer, auto_width = self._proposer(options.speculative)
        core_options = Options(
            max_new_tokens=options.max_tokens,
            eos_token_ids=() if options.ignore_eos else self.eos_token_ids,
            stop_strings=stop_strings,
            stop_token_sequences=stop_sequences,
            top_logprobs=options.top_logprobs,
            tie_margin=options.tie_margin,
            **options.sampling_options(),
        )
        ids = self.prompt_ids(prompt, chat=options.chat, system=options.system)
        self._check_prompt_fits(ids)
        draft_width = options.draft_width
        with self._lock:
            if proposer is not None:
                self._warn_if_inexact()
                if draft_width == "auto":
                    draft_width = auto_width()
                elif isinstance(proposer, LookupOrDraft) and isinstance(draft_width, int):
                    auto_width()  # prices both sources
                    draft_width = FixedWidth(draft_width)  # a cap: each source's own policy picks below it
            elif draft_width == "auto":
                draft_width = 1
            assert not isinstance(draft_width, str)
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
                lease=self._lock,
                before_pass=functools.partial(self._check_still_current, self._epoch),
            )
            self._last = generation
            return generation

    def _check_prompt_fits(self, ids: Sequence[int]) -> None:
        """``ValueError`` when the prompt is longer than the context (one that fills it exactly ends at once with
        ``context_full``, as the core decides)."""
        capacity = self.backend.max_length
        if len(ids) > capacity:
            model = f"; the model's context_length is {self.folder.context_length}" if self.folder else ""
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the context holds {capacity} (max_length{model}): "
                "shorten the prompt"
                + (" or raise max_length" if self.folder and capacity < self.folder.context_length else "")
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
            raise ValueError("callback must be callable as callback(text, token_id, finish_reason)")
        with self._lock:
            run = self.start_with(prompt, options)
            return run.run(lambda c: callback(c.text, c.token_id, str(run.state.finish_reason) if run.done else None))

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

    def _proposer(self, speculative: str | Proposer | None) -> tuple[Proposer | None, Callable[[], WidthPolicy]]:
        """The proposer for ``speculative`` and how to make its width policy for ``draft_width="auto"`` (called
        under the lock: it may measure)."""
        if speculative == "shared-kv":
            if self.drafter is None:
                raise ValueError(
                    "speculative='shared-kv' needs a drafter: train one with 'ortspec train-drafter' (Engine.from_dir "
                    "finds it) or pass Engine.from_dir(..., drafter=DIR)"
                )
            drafter = self.drafter
            limit = int(getattr(drafter, "max_draft", 16))
            return drafter, lambda: CostAwareWidth(self.pass_costs()[: limit + 1], draft_cost=self.draft_cost())
        if speculative == "auto" and self.drafter is not None:
            auto = LookupOrDraft(PromptLookup(ngram=3, max_draft=16), self.drafter)

            def width() -> WidthPolicy:
                costs = self.pass_costs()
                limit = int(getattr(auto.drafter, "max_draft", 16))
                auto.price(CostAwareWidth(costs), CostAwareWidth(costs[: limit + 1], draft_cost=self.draft_cost()))
                return FixedWidth(len(costs) - 1)

            return auto, width
        proposer = make_proposer("prompt-lookup" if speculative == "auto" else speculative)
        return proposer, lambda: CostAwareWidth(self.pass_costs())

    # -- measurements -----------------------------------------------------------------------------------------
    def verify_drift(self) -> float:
        """Largest logit difference between this backend's verify passes and one-token decodes (~30 passes; see
        ``ortspec.costs.measure_verify_drift``): 0 or ~1e-5 on float32 kernels, tenths of a logit on int8 kernels
        with batch-dependent activation quantization. Measured once per model file, provider, thread count and
        onnxruntime version and kept in the user cache (``measurement_file``), with a probe that fits any
        ``max_length``. Above ``DRIFT_WARNING_THRESHOLD`` the first speculative generation warns that its output can
        differ from greedy output. ``BackendError`` if the measurement fails."""
        if self._drift is None:
            from ortspec.costs import cached_verify_drift

            self._drift = self._measured(
                "verify drift", lambda before: cached_verify_drift(self.backend, self.measurement_file(), before=before)
            )
        return self._drift

    def pass_costs(self, kmax: int = 16) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured once
        (a few seconds) and kept like ``verify_drift``. ``BackendError`` if the measurement fails."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            from ortspec.costs import cached_pass_costs

            self._pass_costs = self._measured(
                "verify cost curve",
                lambda before: cached_pass_costs(self.backend, self.measurement_file(), kmax, before=before),
            )
        return self._pass_costs

    def draft_cost(self) -> float:
        """The drafter's time per draft token ÷ a decode step (``ortspec.costs.measure_draft_cost``), measured once
        per model, drafter, provider and thread count (a second or two) and kept like ``verify_drift``; 0.0
        without a drafter. ``BackendError`` if the measurement fails."""
        if self.drafter is None:
            return 0.0
        if self._draft_cost is None:
            from ortspec.costs import cached_draft_cost

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
        """Where this engine's measurements are kept (``ortspec.costs.cached_measurement``): one file per model
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
        """Warn once when speculative output may differ from greedy output here: the measured verify drift
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
            f"on this model {why}: speculative output can differ from greedy output here; {remedy}",
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
