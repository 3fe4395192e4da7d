"""``Engine``: a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)
    result = engine.generate("Repeat: ...", max_tokens=128, speculative="prompt-lookup")
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
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from ortspec.adapters.cache import cache_root
from ortspec.adapters.tokenizer import Tokenizer
from ortspec.backends.base import Backend
from ortspec.backends.onnx import ModelFolder
from ortspec.core import CostAwareWidth, Options, PromptLookup, Proposer, WidthPolicy
from ortspec.core.checks import int_at_least
from ortspec.driver import GenerateResult, Generation

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
StreamCallback = Callable[[str, int, str | None], object]
Stop = str | Sequence[str] | Sequence[Sequence[int]] | None

SPECULATIVE_CHOICES = ("prompt-lookup",)
# Verify-vs-decode logit drift (in logits) above which speculative output is no longer guaranteed to equal greedy.
DRIFT_WARNING_THRESHOLD = 1e-3


def make_proposer(speculative: str | Proposer | None) -> Proposer | None:
    """``None`` (plain greedy), ``"prompt-lookup"`` (3-gram lookup drafting up to 16 tokens), or any proposer."""
    if speculative is None:
        return None
    if isinstance(speculative, str):
        if speculative == "prompt-lookup":
            return PromptLookup(ngram=3, max_draft=16)
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


def _check_greedy(instance: GenerationOptions, attribute: Any, value: Any) -> None:
    greedy = {"temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, 0, 1)}[attribute.name]
    if value not in greedy:
        raise ValueError(
            f"{attribute.name}={value!r}: ortspec decodes greedily (exact speculative decoding): leave "
            "temperature, top_p and top_k unset (or temperature=0)"
        )


def _check_draft_width(instance: GenerationOptions, attribute: Any, value: Any) -> None:
    if value == "auto" or isinstance(value, WidthPolicy):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"draft_width={value!r}: expected 'auto', an int >= 1 or a width policy")


@attrs.frozen(kw_only=True)
class GenerationOptions:
    """The keywords of every ``Engine`` generation method, validated (a ``ValueError`` names the keyword).

    ``max_tokens``: most new tokens. ``stop``: a string, strings, or token-id sequences that end generation
    (stop strings are cut from the text). ``speculative``: ``None`` (plain greedy), ``"prompt-lookup"``, or a
    proposer object. ``draft_width``: ``"auto"`` (the cost-aware policy on this backend's measured verify cost
    curve), the most draft tokens per pass, or a width policy. ``chat``: format a text prompt as one user turn
    with the folder's chat template (``system``: an optional system turn). ``ignore_eos``: do not stop at the
    model's EOS tokens. ``top_logprobs``: report each token's log-probability and the N most likely
    alternatives. ``tie_margin``: the near-tie guard, in logits (0 = off). ``temperature``, ``top_p``, ``top_k``
    and ``seed`` are accepted for ``onnx_genai`` compatibility at their greedy values only.
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
    temperature: float | None = attrs.field(default=None, validator=_check_greedy)
    top_p: float | None = attrs.field(default=None, validator=_check_greedy)
    top_k: int | None = attrs.field(default=None, validator=_check_greedy)
    seed: int | None = None  # greedy decoding has no randomness


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
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.folder = folder
        self.prefix_reuse = prefix_reuse
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
        sliding_window: str = "config",
        matmul_accuracy_level: int | None = None,
    ) -> Engine:
        """Load an ONNX Runtime GenAI folder (``genai_config.json``, the model, ``tokenizer.json``).

        ``provider``: ``"cpu"`` or ``"cuda"``; ``threads``: intra-op threads (default: physical cores);
        ``max_length``: KV capacity in tokens (default: the config's context length); ``prefix_reuse``: see the
        class docstring. ``sliding_window`` and ``matmul_accuracy_level``: the load-time rewrites of
        ``OrtBackend.from_folder`` (``matmul_accuracy_level=1`` makes speculation exact on a quantized folder
        built at the builder's default level 4; see docs/quantization.md)."""
        from ortspec.backends.onnx import OrtBackend

        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        backend = OrtBackend.from_folder(
            folder,
            provider=provider,
            threads=threads,
            max_length=max_length,
            sliding_window=sliding_window,
            matmul_accuracy_level=matmul_accuracy_level,
        )
        return cls(backend, tokenizer, eos_token_ids=folder.eos_token_ids, folder=folder, prefix_reuse=prefix_reuse)

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
        proposer = make_proposer(options.speculative)
        if proposer is not None:
            self._warn_if_inexact()
        core_options = Options(
            max_new_tokens=options.max_tokens,
            eos_token_ids=() if options.ignore_eos else self.eos_token_ids,
            stop_strings=stop_strings,
            stop_token_sequences=stop_sequences,
            top_logprobs=options.top_logprobs,
            tie_margin=options.tie_margin,
        )
        ids = self.prompt_ids(prompt, chat=options.chat, system=options.system)
        draft_width = options.draft_width
        with self._lock:
            if draft_width == "auto":
                draft_width = CostAwareWidth(self.pass_costs()) if proposer is not None else 1
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
        """Warn once when speculative output may differ from greedy output here: the measured verify drift
        exceeds ``DRIFT_WARNING_THRESHOLD``, or (CPU) the graph has ``MatMulNBits`` nodes at accuracy level 4,
        whose int8-activation kernels give results that depend on how many tokens a pass holds (a one-off
        measurement can miss that on some contexts; see docs/quantization.md)."""
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
            "load it with matmul_accuracy_level=1 (float32 compute; see docs/quantization.md) or use a float32 model"
            if any(level != 1 for (_bits, level) in levels)
            else "use a float32 model where exactness matters"
        )
        warnings.warn(
            f"on this model {why}: speculative output can differ from greedy output here; {remedy}",
            RuntimeWarning,
            stacklevel=4,
        )

    def pass_costs(self, kmax: int = 16) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured
        once per model folder, provider and thread count (a few seconds) and cached in the user cache."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            from ortspec.costs import cached_pass_costs

            parts: list[object] = [
                self.folder.model_path.resolve() if self.folder else id(self.backend),
                self.folder.model_path.stat().st_mtime_ns if self.folder else "",
                getattr(self.backend, "provider", "?"),
                getattr(self.backend, "threads", "?"),
                kmax,
            ]
            # a load-time rewrite or session setting makes another model: its own curve (none: the key as before)
            variant = getattr(self.backend, "variant", "")
            if variant:
                parts.append(variant)
            key = "|".join(str(x) for x in parts)
            cache_file = cache_root() / "pass_costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
            with self._lock:
                self._take_backend()
                self._pass_costs = cached_pass_costs(self.backend, cache_file, kmax)
        return self._pass_costs
