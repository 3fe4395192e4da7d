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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from ortspec.adapters.cache import cache_root, find_drafter
from ortspec.adapters.tokenizer import Tokenizer
from ortspec.backends.base import Backend
from ortspec.backends.onnx import ModelFolder
from ortspec.core import CostAwareWidth, FixedWidth, LookupOrDraft, Options, PromptLookup, Proposer, WidthPolicy
from ortspec.core.checks import int_at_least
from ortspec.driver import GenerateResult, Generation

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
StreamCallback = Callable[[str, int, str | None], object]
Stop = str | Sequence[str] | Sequence[Sequence[int]] | None

SPECULATIVE_CHOICES = ("prompt-lookup", "shared-kv", "auto")
# Verify-vs-decode logit drift (in logits) above which speculative output is no longer guaranteed to equal greedy.
DRIFT_WARNING_THRESHOLD = 1e-3


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


def _split_stop(stop: Stop) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """``stop`` as (stop strings, stop token sequences)."""
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        return (stop,), ()
    strings: list[str] = []
    sequences: list[tuple[int, ...]] = []
    for item in stop:
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            sequences.append(tuple(int(t) for t in item))
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
    (prompt lookup where it matches strongly, the drafter otherwise, each priced by its own cost-aware width
    policy; prompt lookup alone without a drafter), or a proposer object. ``draft_width``: ``"auto"`` (the
    cost-aware policy on this backend's measured verify cost curve), the most draft tokens per pass, or a width
    policy. ``chat``: format a text prompt as one user turn
    with the folder's chat template (``system``: an optional system turn). ``ignore_eos``: do not stop at the
    model's EOS tokens. ``top_logprobs``: report each token's log-probability and the N most likely
    alternatives. ``tie_margin``: the near-tie guard, in logits (0 = off).

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


class _Lease:
    """Held around every pass of one generation: the Engine's lock, and a check that no newer generation has
    taken the backend since this one started."""

    def __init__(self, engine: Engine, epoch: int) -> None:
        self.engine, self.epoch = engine, epoch

    def __enter__(self) -> None:
        self.engine._lock.acquire()
        if self.engine._epoch != self.epoch:
            self.engine._lock.release()
            raise GenerationSuperseded(
                "another generation started on this Engine before this one finished (one sequence at a time per "
                "Engine: use one Engine per thread or worker)"
            )

    def __exit__(self, *exc: object) -> None:
        self.engine._lock.release()


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
        *,
        provider: str = "cpu",
        threads: int | None = None,
        max_length: int | None = None,
        prefix_reuse: bool = False,
        drafter: str | os.PathLike[str] | bool | None = None,
    ) -> Engine:
        """Load an ONNX Runtime GenAI folder (``genai_config.json``, the model, ``tokenizer.json``).

        ``provider``: ``"cpu"`` or ``"cuda"``; ``threads``: intra-op threads (default: physical cores);
        ``max_length``: KV capacity in tokens (default: the config's context length); ``prefix_reuse``: see the
        class docstring. ``drafter``: a shared-KV drafter folder to open (errors raise ``DrafterError``), ``False``
        for none, or ``None`` (default) for the one found beside the model (``ortspec.adapters.cache.find_drafter``:
        ``<model>/drafter`` or where ``ortspec train-drafter`` puts it); one found that does not fit the model is
        skipped with a warning."""
        from ortspec.backends.onnx import OrtBackend
        from ortspec.backends.onnx.drafter import DrafterError, SharedKvProposer

        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        backend = OrtBackend.from_folder(folder, provider=provider, threads=threads, max_length=max_length)
        proposer = None
        found = find_drafter(folder.path) if drafter is None else None
        if drafter not in (None, False, True):
            proposer = SharedKvProposer.open(backend, Path(drafter))  # type: ignore[arg-type]
        elif found is not None:
            try:
                proposer = SharedKvProposer.open(backend, found)
            except DrafterError as exc:
                warnings.warn(f"not using the drafter found at {found}: {exc}", RuntimeWarning, stacklevel=2)
        elif drafter is True:
            raise DrafterError(
                f"no drafter found for {folder.path}; train one with `ortspec train-drafter --model {folder.path}`"
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
        messages (always chat-formatted), or token ids (used as they are)."""
        if isinstance(prompt, str):
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                prompt = self.tokenizer.apply_chat_template(messages)
            ids = self.tokenizer.encode(prompt)
        elif len(prompt) and all(isinstance(m, Mapping) for m in prompt):
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))  # type: ignore[arg-type]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            if chat:
                raise ValueError("chat=True needs a text prompt or chat messages, not token ids")
        if not ids:
            raise ValueError("the prompt is empty: it must encode to at least one token")
        return ids

    # -- generation -------------------------------------------------------------------------------------------
    def start_with(self, prompt: Prompt, options: GenerationOptions) -> Generation:
        """A ``Generation`` (an iterator of commits) for ``prompt`` with ``options``: the one place the Engine
        turns its options into the core's ``Options``, a proposer and a width policy."""
        stop_strings, stop_sequences = _split_stop(options.stop)
        proposer, auto_width = self._proposer(options.speculative)
        if proposer is not None:
            self._warn_if_inexact()
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
        draft_width = options.draft_width
        with self._lock:
            if draft_width == "auto":
                draft_width = auto_width() if proposer is not None else 1
            elif isinstance(proposer, LookupOrDraft) and isinstance(draft_width, int):
                draft_width = FixedWidth(draft_width)  # a cap: each source's own policy picks below it
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
                lease=_Lease(self, self._epoch),
            )
            self._last = generation
            return generation

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
        """The proposer for ``speculative`` and how to make its width policy for ``draft_width="auto"``."""
        if speculative == "shared-kv":
            if self.drafter is None:
                raise ValueError(
                    "speculative='shared-kv' needs a drafter: train one with `ortspec train-drafter` (Engine.from_dir "
                    "finds it) or pass Engine.from_dir(..., drafter=DIR)"
                )
            drafter = self.drafter
            limit = getattr(drafter, "max_draft", 16)
            return drafter, lambda: CostAwareWidth(self.pass_costs()[: limit + 1], draft_cost=self.draft_cost())
        if speculative == "auto" and self.drafter is not None:
            drafter = self.drafter
            limit = getattr(drafter, "max_draft", 16)

            def make() -> LookupOrDraft:
                costs = self.pass_costs()
                return LookupOrDraft(
                    PromptLookup(ngram=3, max_draft=16),
                    drafter,
                    CostAwareWidth(costs),
                    CostAwareWidth(costs[: limit + 1], draft_cost=self.draft_cost()),
                )

            auto = make()
            return auto, lambda: FixedWidth(len(auto.lookup_policy.pass_costs) - 1)
        proposer = make_proposer("prompt-lookup" if speculative == "auto" else speculative)
        return proposer, lambda: CostAwareWidth(self.pass_costs())

    # -- measurements -----------------------------------------------------------------------------------------
    def verify_drift(self) -> float:
        """Largest logit difference between this backend's verify passes and one-token decodes (measured once,
        ~30 passes; see ``ortspec.costs.measure_verify_drift``): 0 or ~1e-5 on float32 kernels, tenths of a logit
        on int8 kernels with batch-dependent activation quantization. Above ``DRIFT_WARNING_THRESHOLD`` the first
        speculative generation warns that its output can differ from greedy output."""
        if self._drift is None:
            from ortspec.costs import measure_verify_drift, probe_ids

            context = max(1, min(256, self.backend.max_length - 40))
            ids = probe_ids(self.backend.vocab_size, context + 27)
            with self._lock:
                self._take_backend()
                self._drift = measure_verify_drift(self.backend, ids[:context], ids[context:], windows=3)
        return self._drift

    def _take_backend(self) -> None:
        """A measurement is about to use (and reset) the backend (the caller holds the lock): it supersedes any
        generation in flight, and the KV of the last sequence is gone."""
        self._epoch += 1
        self._last = None

    def _warn_if_inexact(self) -> None:
        if self._drift_warned or self.verify_drift() <= DRIFT_WARNING_THRESHOLD:
            return
        self._drift_warned = True
        warnings.warn(
            f"on this model a verify pass differs from one-token decodes by up to {self._drift:.3g} logits "
            "(batch-dependent kernels, e.g. int8 MatMulNBits): speculative output can differ from greedy "
            "output here; use a float32 model where exactness matters",
            RuntimeWarning,
            stacklevel=4,
        )

    def draft_cost(self) -> float:
        """The drafter's time per draft token ÷ a decode step (``ortspec.costs.measure_draft_cost``), measured once
        per model folder, drafter, provider and thread count (a second or two) and cached in the user cache; 0.0
        without a drafter."""
        if self.drafter is None:
            return 0.0
        if self._draft_cost is None:
            from ortspec.costs import cached_draft_cost, probe_ids

            drafter_path = getattr(getattr(self.drafter, "folder", None), "path", None)
            key = "|".join(
                str(x)
                for x in (
                    self.folder.model_path.resolve() if self.folder else id(self.backend),
                    Path(drafter_path).resolve() if drafter_path else id(self.drafter),
                    (Path(drafter_path) / "drafter.json").stat().st_mtime_ns if drafter_path else "",
                    getattr(self.backend, "provider", "?"),
                    getattr(self.backend, "threads", "?"),
                )
            )
            cache_file = cache_root() / "draft_costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
            context = probe_ids(self.backend.vocab_size, max(3, min(256, self.backend.max_length - 8)))
            with self._lock:
                self._take_backend()
                self._draft_cost = cached_draft_cost(self.backend, self.drafter, cache_file, context)
        return self._draft_cost

    def pass_costs(self, kmax: int = 16) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured
        once per model folder, provider and thread count (a few seconds) and cached in the user cache."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            from ortspec.costs import cached_pass_costs

            key = "|".join(
                str(x)
                for x in (
                    self.folder.model_path.resolve() if self.folder else id(self.backend),
                    self.folder.model_path.stat().st_mtime_ns if self.folder else "",
                    getattr(self.backend, "provider", "?"),
                    getattr(self.backend, "threads", "?"),
                    kmax,
                )
            )
            cache_file = cache_root() / "pass_costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
            with self._lock:
                self._take_backend()
                self._pass_costs = cached_pass_costs(self.backend, cache_file, kmax)
        return self._pass_costs
