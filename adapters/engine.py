"""``Engine``: a model folder, its tokenizer and a backend, behind the ``onnx_genai.Engine`` API.

    engine = Engine.from_dir(path)
    result = engine.generate("Repeat: ...", max_tokens=128, speculative="prompt-lookup")
    engine.generate_stream(prompt, lambda text, token_id, finish_reason: ..., max_tokens=64)
    for chunk in engine.stream(prompt): ...

Decoding is greedy; ``speculative`` only changes how fast the same tokens arrive.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ortspec.adapters.model_dir import ModelFolder
from ortspec.adapters.tokenizer import Tokenizer
from ortspec.backends.base import Backend
from ortspec.core import CostAwareWidth, Options, PromptLookup, Proposer, WidthPolicy
from ortspec.driver import GenerateResult, Generation, GenerationAborted

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
StreamCallback = Callable[[str, int, str | None], object]

SPECULATIVE_CHOICES = ("prompt-lookup",)
# Verify-vs-decode logit drift above which speculative output is no longer guaranteed to equal greedy output.
DRIFT_WARNING = 1e-3


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


class Engine:
    """Greedy and speculative generation on one model folder. Not re-entrant: one generation at a time."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, eos_token_ids: Sequence[int] = (),
                 folder: ModelFolder | None = None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.folder = folder
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
    ) -> Engine:
        """Load an ONNX Runtime GenAI folder (``genai_config.json``, the model, ``tokenizer.json``).

        ``provider``: ``"cpu"`` or ``"cuda"``; ``threads``: intra-op threads (default: physical cores);
        ``max_length``: KV capacity in tokens (default: the config's context length)."""
        from ortspec.backends.onnx import OrtBackend

        folder = ModelFolder.load(Path(path))
        tokenizer = Tokenizer.from_folder(folder.path)
        backend = OrtBackend.from_folder(folder, provider=provider, threads=threads, max_length=max_length)
        return cls(backend, tokenizer, eos_token_ids=folder.eos_token_ids, folder=folder)

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
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))
        else:
            ids = list(prompt)
            if chat:
                raise ValueError("chat=True needs a text prompt or chat messages, not token ids")
        if not ids:
            raise ValueError("the prompt is empty: it must encode to at least one token")
        return ids

    # -- generation -------------------------------------------------------------------------------------------
    def start(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 128,
        stop: str | Sequence[str] | Sequence[Sequence[int]] | None = None,
        speculative: str | Proposer | None = None,
        draft_width: int | WidthPolicy | str = "auto",
        chat: bool = False,
        system: str | None = None,
        ignore_eos: bool = False,
        top_logprobs: int = 0,
        tie_margin: float = 0.0,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> Generation:
        """A ``Generation`` (an iterator of commits) with the options that ``generate`` documents."""
        if temperature not in (None, 0, 0.0) or top_p not in (None, 1, 1.0) or top_k not in (None, 1):
            raise ValueError(
                "ortspec decodes greedily (exact speculative decoding): leave temperature, top_p and top_k "
                "unset (or temperature=0)"
            )
        del seed  # greedy decoding has no randomness; accepted for onnx_genai compatibility
        stop_strings, stop_sequences = _split_stop(stop)
        proposer = make_proposer(speculative)
        if proposer is not None and self.verify_drift() > DRIFT_WARNING and not self._drift_warned:
            self._drift_warned = True
            warnings.warn(
                f"on this model a verify pass differs from one-token decodes by up to {self._drift:.3g} logits "
                "(batch-dependent kernels, e.g. int8 MatMulNBits): speculative output can differ from greedy "
                "output here; use a float32 model where exactness matters",
                RuntimeWarning,
                stacklevel=3,
            )
        options = Options(
            max_new_tokens=max_tokens,
            eos_token_ids=() if ignore_eos else self.eos_token_ids,
            stop_strings=stop_strings,
            stop_token_sequences=stop_sequences,
            top_logprobs=top_logprobs,
            tie_margin=tie_margin,
        )
        ids = self.prompt_ids(prompt, chat=chat, system=system)
        if len(ids) >= self.backend.max_length:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context holds {self.backend.max_length}: "
                "shorten the prompt (or load the engine with a larger max_length)"
            )
        if draft_width == "auto":
            draft_width = CostAwareWidth(self.pass_costs()) if proposer is not None else 1
        elif isinstance(draft_width, str):
            raise ValueError(f"draft_width={draft_width!r}: expected 'auto', an int >= 1 or a width policy")
        return Generation(
            self.backend, ids, options, proposer, draft_width=draft_width, detokenize=self.tokenizer.decode
        )

    def verify_drift(self) -> float:
        """Largest logit difference between this backend's verify passes and one-token decodes (measured once,
        ~30 passes; see ``ortspec.costs.measure_verify_drift``): 0 or ~1e-5 on float32 kernels, tenths of a logit
        on int8 kernels with batch-dependent activation quantization. Above ``DRIFT_WARNING`` the first
        speculative generation warns that its output can differ from greedy output."""
        if self._drift is None:
            from ortspec.costs import measure_verify_drift

            n = min(self.backend.vocab_size, 1000)
            context = max(1, min(256, self.backend.max_length - 40))
            ids = [(i * 7919) % n for i in range(context + 27)]
            self._drift = measure_verify_drift(self.backend, ids[:context], ids[context:], windows=3)
        return self._drift

    def pass_costs(self, kmax: int = 16) -> tuple[float, ...]:
        """This backend's verify cost curve (pass over 1 + K tokens ÷ a decode step, K = 0..kmax), measured
        once per model folder, provider and thread count (a few seconds) and cached in the user cache."""
        if self._pass_costs is None or len(self._pass_costs) != kmax + 1:
            import hashlib

            import platformdirs

            from ortspec.costs import cached_pass_costs

            key = "|".join(str(x) for x in (
                self.folder.model_path.resolve() if self.folder else id(self.backend),
                self.folder.model_path.stat().st_mtime_ns if self.folder else "",
                getattr(self.backend, "provider", "?"), getattr(self.backend, "threads", "?"), kmax,
            ))
            cache = Path(os.environ.get("ORTSPEC_CACHE") or platformdirs.user_cache_dir("ortspec"))
            cache_file = cache / "pass_costs" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
            ids = list(range(min(self.backend.vocab_size, 1000)))
            self._pass_costs = cached_pass_costs(self.backend, cache_file, ids, kmax)
        return self._pass_costs

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerateResult:
        """Generate up to ``max_tokens`` tokens after ``prompt``.

        ``stop``: a string, strings, or token-id sequences that end generation (stop strings are cut from the
        text); ``speculative``: ``None`` (plain greedy), ``"prompt-lookup"``, or a proposer object;
        ``draft_width``: ``"auto"`` (default: the cost-aware policy on this backend's measured verify cost curve),
        the most draft tokens per pass, or a width policy; ``chat``: format a text prompt with
        the folder's chat template; ``ignore_eos``; ``top_logprobs``; ``tie_margin`` (near-tie guard, logits).
        """
        run = self.start(prompt, **kwargs)
        for _ in run:
            pass
        return run.result()

    def generate_stream(self, prompt: Prompt, callback: StreamCallback, **kwargs: Any) -> GenerateResult:
        """``generate``, calling ``callback(text, token_id, finish_reason)`` for every generated token, in order.
        ``finish_reason`` is None except on the last token. If the callback raises, generation stops and
        ``GenerationAborted`` (with the partial result) is raised from the callback's exception."""
        if not callable(callback):
            raise ValueError("callback must be callable as callback(text, token_id, finish_reason)")
        run = self.start(prompt, **kwargs)
        for commit in run:
            reason = run.state.finish_reason if run.done else None
            try:
                callback(commit.text, commit.token_id, None if reason is None else str(reason))
            except Exception as exc:
                raise GenerationAborted(run.result()) from exc
        return run.result()

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        """Yield the generated text in chunks as it is decided (empty chunks are skipped)."""
        for commit in self.start(prompt, **kwargs):
            if commit.text:
                yield commit.text


def _split_stop(stop: Any) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        return (stop,), ()
    strings, sequences = [], []
    for item in stop:
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            sequences.append(tuple(item))
        else:
            raise ValueError(f"stop: {item!r} is neither a string nor a sequence of token ids")
    return tuple(strings), tuple(sequences)
