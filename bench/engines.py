"""The engines under test, behind one interface: ``warmup(ids)``, ``run(ids, max_new) -> EngineRun``,
``describe()`` and ``close()``; and ``TimingBackend``, the proxy through which the suite times what happens
outside the backend.

``OrtspecEngine`` is one ortspec setting (a proposer, a draft width and, for the sampled settings, the sampling
options) on a shared ``Engine``; the drafter settings (``DRAFTER_ENGINES``) name the Engine's own choices
(``speculative="shared-kv"`` / ``"auto"``, ``draft_width="auto"``), so they measure what a user gets.
``PeerEngine`` wraps a ``bench.peers`` runner. Every engine reports the new tokens without a final EOS token (the
peers drop it, ortspec keeps it) and the finish reason in OpenAI's words, ``"stop"`` or ``"length"``
(ortspec's ``FinishReason.openai``; the peer runners turn their peers' own reports into it).

Sampled engines (``SAMPLED_ENGINES``) sample at ``SAMPLING`` with the seed the suite gives each prompt
(``prompt_seed``: the same for every engine on that prompt); their identity is checked against the plain sampled
run of the same family (``identity_reference``), not against greedy.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.genai_draft_model import DEFAULT_DRAFT_TOKENS, DRAFT_MODEL_PEER
from bench.peer_base import PeerRun, PeerRunner
from bench.peers import make_peer
from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.suffix_cache import SuffixCache
from ortspec.core import AdditiveWidth, CostAwareWidth, PromptLookup, Proposer, SuffixSnapshot, WidthPolicy
from ortspec.driver import Generation

SAMPLED_REFERENCE = "ortspec-sampled"  # plain sampling: the sampled settings' identity is checked against it
SAMPLED_SPEC = "ortspec-lookup-adaptive-sampled"  # ortspec-lookup-adaptive, sampling
SAMPLED_AUTO = "ortspec-auto-sampled"  # ortspec-auto, sampling
AUTO_TREE = "ortspec-auto-tree"  # ortspec-auto with trees (TREE_BRANCHES): the suffix lookup's and the drafter's
SAMPLED_AUTO_TREE = "ortspec-auto-tree-sampled"  # ortspec-auto-tree, sampling
TREE_BRANCHES = 3  # the tree settings' Engine.tree_branches: the suffix lookup's and the drafter's
DRAFT_MODEL = "ortspec-draft-model"  # speculative="draft-model": the suite's --draft-model folder drafts
SAMPLED_DRAFT_MODEL = "ortspec-draft-model-sampled"  # ortspec-draft-model, sampling
AUTO_DRAFT_MODEL = "ortspec-auto-draft-model"  # ortspec-auto on an Engine that has the --draft-model folder too
SAMPLED_AUTO_DRAFT_MODEL = "ortspec-auto-draft-model-sampled"  # ortspec-auto-draft-model, sampling
# The settings that run on an Engine with the suite's --draft-model (missing without it); every other setting runs
# on an Engine without one, so ortspec-auto and ortspec-auto-draft-model differ by the draft model alone.
DRAFT_MODEL_ENGINES = (DRAFT_MODEL, SAMPLED_DRAFT_MODEL, AUTO_DRAFT_MODEL, SAMPLED_AUTO_DRAFT_MODEL)
SAMPLED_SPECS = (
    SAMPLED_SPEC,
    SAMPLED_AUTO,
    SAMPLED_AUTO_TREE,
    SAMPLED_DRAFT_MODEL,
    SAMPLED_AUTO_DRAFT_MODEL,
)  # the sampled speculative settings
# The settings that need the Engine's shared-KV drafter (the shipped one, or ``ortspec train-drafter``'s); without
# one they are missing.
DRAFTER_ENGINES = ("ortspec-shared-kv", "ortspec-auto", SAMPLED_AUTO, AUTO_TREE, SAMPLED_AUTO_TREE)
SPEC_ENGINES = (
    "ortspec-lookup-w8",
    "ortspec-lookup-w4",
    "ortspec-lookup-adaptive",
    "ortspec-lookup-additive",
    "ortspec-suffix",
    "ortspec-shared-kv",
    "ortspec-auto",
    AUTO_TREE,
    DRAFT_MODEL,
    AUTO_DRAFT_MODEL,
)
ORTSPEC_ENGINES = ("ortspec-greedy", *SPEC_ENGINES)
SAMPLED_ORTSPEC_ENGINES = (
    SAMPLED_REFERENCE,
    SAMPLED_SPEC,
    SAMPLED_AUTO,
    SAMPLED_AUTO_TREE,
    SAMPLED_DRAFT_MODEL,
    SAMPLED_AUTO_DRAFT_MODEL,
)
# ortgenai-draft-model (DRAFT_MODEL_PEER): ORT GenAI's own draft-model speculation, drafting with the suite's
# --draft-model folder (missing without it)
PEER_ENGINES = ("ortgenai", "ortgenai-ngram", DRAFT_MODEL_PEER, "onnx_genai", "llamacpp")
SAMPLED_PEER = "ortgenai-sampled"  # ORT GenAI plain sampling
SAMPLED_NGRAM_PEER = "ortgenai-ngram-sampled"  # ORT GenAI n-gram speculation, sampling
SAMPLED_PEER_ENGINES = (SAMPLED_PEER, SAMPLED_NGRAM_PEER)
SAMPLED_ENGINES = (*SAMPLED_ORTSPEC_ENGINES, *SAMPLED_PEER_ENGINES)
ALL_ENGINES = (*ORTSPEC_ENGINES, *SAMPLED_ORTSPEC_ENGINES, *PEER_ENGINES, *SAMPLED_PEER_ENGINES)
REFERENCE = "ortspec-greedy"  # identity is checked against its tokens (greedy engines)
BASELINE = "ortgenai"
NGRAM_PEER = "ortgenai-ngram"
DEFAULT_NGRAM = (3, 8)  # the n-gram peers' (ngram_size, max_draft_tokens) unless a run chooses another
DEFAULT_GENAI_DRAFT_TOKENS = DEFAULT_DRAFT_TOKENS  # ortgenai-draft-model's max_draft_tokens (GenAI's own default)
KMAX = 16  # the widest draft of the adaptive settings, and the verify cost curve's last K

# The sampled column: temperature 0.7, top_p 0.9 (no top_k, min_p or penalties), one seed per prompt.
SAMPLING: Mapping[str, float] = {"temperature": 0.7, "top_p": 0.9}
# The driver-overhead runs also time sampling with every filter and a penalty on (the sampler's worst case).
ALL_FILTERS: Mapping[str, float] = {
    "temperature": 0.7,
    "top_k": 50,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
}
SEED_RULE = "first 4 bytes of sha256('ortspec-bench|' + workload name), big-endian, & 0x7fffffff"


def prompt_seed(workload: str) -> int:
    """The sampling seed of a workload (``SEED_RULE``): fixed by its name, the same for every engine, and below
    2**31 so that ORT GenAI's ``random_seed`` takes it as it is."""
    digest = hashlib.sha256(f"ortspec-bench|{workload}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def identity_reference(name: str) -> str:
    """The engine whose tokens ``name``'s are compared with on the same prompt (and seed): ortspec's and ORT
    GenAI's sampled speculation against their own plain sampling (ORT GenAI's RNG is not ortspec's, so its sampled
    tokens are never compared with ortspec's); every greedy engine against ``ortspec-greedy``. A reference is its
    own reference."""
    if name in SAMPLED_ORTSPEC_ENGINES:
        return SAMPLED_REFERENCE
    if name in SAMPLED_PEER_ENGINES:
        return SAMPLED_PEER
    return REFERENCE


def is_reference(name: str) -> bool:
    """Whether ``name`` is the identity reference of its family."""
    return identity_reference(name) == name


@attrs.frozen
class EngineRun:
    """One generation, as every engine reports it.

    ``token_ids``: the new tokens, a final EOS removed. ``finish_reason``: ``"stop"`` (EOS) or ``"length"`` (``""``
    when a peer gave none). ``ttft_s`` / ``total_s``: seconds from the prompt ids in hand to the first new token /
    to the end. ``proposed`` / ``accepted``: draft tokens (speculative engines). ``passes``: target forward passes
    (prefill included where the engine reports it); ``decode_passes``: the passes that ``tokens/step`` divides by.
    ``extra``: engine-specific details, recorded as they are.
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float
    total_s: float
    proposed: int | None = None
    accepted: int | None = None
    passes: int | None = None
    decode_passes: int | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


class OrtspecEngine:
    """One ortspec setting on a shared ``Engine``: a proposer factory (``None``: plain decoding; a fresh proposer
    per generation, or the name of one the Engine makes: ``"shared-kv"``, ``"auto"``), a draft width (an int, a
    width policy, or ``"auto"``: the Engine's own), the sampling options (``Engine`` keywords; empty: greedy) and
    the Engine's ``tree_branches`` (1: chains), set on the Engine for its runs."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        make_proposer: Callable[[], Proposer | str] | None,
        draft_width: int | WidthPolicy | str,
        description: dict[str, Any],
        sampling: Mapping[str, float] | None = None,
        tree_branches: int = 1,
    ) -> None:
        self.name = name
        self.tree_branches = tree_branches
        self.engine = engine
        self.make_proposer = make_proposer
        self.draft_width = draft_width
        self.sampling = dict(sampling or {})
        self.description = description | ({"sampling": dict(self.sampling)} if self.sampling else {})
        # This setting's own suffix cache, on the shared Engine during its runs: it learns from this setting's
        # outputs only, in the suite's order. A prompt run again (``--repeat``) starts from the cache its first
        # run saw, in a fork that records nothing here, so no run drafts its own earlier output.
        self.suffix_cache = SuffixCache()
        self._cache_before: dict[tuple[int, ...], SuffixSnapshot] = {}

    @property
    def sampled(self) -> bool:
        """Whether this setting samples (and so takes a seed)."""
        return bool(self.sampling)

    def start(
        self, ids: Sequence[int], max_new: int, seed: int | None = None, cache: SuffixCache | None = None
    ) -> Generation:
        """A generation of ``max_new`` tokens at most after ``ids`` with this setting (an iterator of commits);
        ``seed``: the sampler's seed (sampled settings; 0 when not given); ``cache``: the suffix cache it drafts
        from and records into (default: this setting's)."""
        self.engine.suffix_cache = cache if cache is not None else self.suffix_cache
        self.engine.tree_branches = self.tree_branches
        proposer = self.make_proposer() if self.make_proposer else None
        sampling: dict[str, Any] = {**self.sampling, "seed": 0 if seed is None else seed} if self.sampled else {}
        return self.engine.start(
            list(ids), max_tokens=max_new, speculative=proposer, draft_width=self.draft_width, **sampling
        )

    def warmup(self, ids: Sequence[int]) -> None:
        self.start(ids, 8, cache=SuffixCache()).run()  # recorded nowhere

    def cache_for(self, ids: Sequence[int]) -> SuffixCache:
        """The suffix cache a measured run of ``ids`` uses (see ``__init__``): this setting's on the first run of
        ``ids``, a fork of what that run started from on any later one."""
        key = tuple(ids)
        if key in self._cache_before:
            return SuffixCache(start=self._cache_before[key])
        self._cache_before[key] = self.suffix_cache.snapshot()
        return self.suffix_cache

    def run(self, ids: Sequence[int], max_new: int, seed: int | None = None) -> EngineRun:
        r = self.start(ids, max_new, seed, self.cache_for(ids)).run()
        s = r.stats
        tokens = r.token_ids[:-1] if r.token_ids and r.token_ids[-1] in self.engine.eos_token_ids else r.token_ids
        speculative = self.make_proposer is not None
        return EngineRun(
            token_ids=tuple(tokens),
            finish_reason=r.finish_reason.openai,
            ttft_s=r.timings.first_token_s,
            total_s=r.timings.total_s,
            proposed=s.proposed_tokens if speculative else None,
            accepted=s.accepted_tokens if speculative else None,
            passes=s.steps,
            decode_passes=s.steps,
            extra={
                "verification_steps": s.verification_steps,
                "multi_token_accepts": s.multi_token_accepts,
                "prefill_s": r.timings.prefill_s,
                **({"seed": r.seed} if self.sampled else {}),
            },
        )

    def describe(self) -> dict[str, Any]:
        return dict(self.description)

    def close(self) -> None:
        """Nothing to release: the shared ``Engine`` outlives its settings."""


def sampled_variant(setting: OrtspecEngine, name: str, sampling: Mapping[str, float]) -> OrtspecEngine:
    """``setting`` (a greedy one) sampling with ``sampling``, called ``name``."""
    description = {k: v for k, v in setting.describe().items() if k != "sampling"}
    return OrtspecEngine(
        name, setting.engine, setting.make_proposer, setting.draft_width, description, sampling, setting.tree_branches
    )


def ortspec_engine(name: str, engine: Engine, pass_costs: Sequence[float] = ()) -> OrtspecEngine:
    """The ortspec setting called ``name`` (one of ``ORTSPEC_ENGINES`` or ``SAMPLED_ORTSPEC_ENGINES``) on
    ``engine``; ``pass_costs`` is the verify cost curve that the cost-aware width policy uses. A sampled setting is
    its greedy twin (``ortspec-sampled``: ``ortspec-greedy``; ``ortspec-lookup-adaptive-sampled``:
    ``ortspec-lookup-adaptive``) sampling at ``SAMPLING``."""
    twins = {
        SAMPLED_REFERENCE: "ortspec-greedy",
        SAMPLED_SPEC: "ortspec-lookup-adaptive",
        SAMPLED_AUTO: "ortspec-auto",
        SAMPLED_AUTO_TREE: AUTO_TREE,
        SAMPLED_DRAFT_MODEL: DRAFT_MODEL,
        SAMPLED_AUTO_DRAFT_MODEL: AUTO_DRAFT_MODEL,
    }
    if name in twins:
        return sampled_variant(ortspec_engine(twins[name], engine, pass_costs), name, SAMPLING)
    if name == "ortspec-greedy":
        return OrtspecEngine(name, engine, None, 8, {"speculative": None})
    if name in ("ortspec-lookup-w8", "ortspec-lookup-w4"):
        width = 8 if name.endswith("w8") else 4
        lookup = functools.partial(PromptLookup, ngram=3, max_draft=8)
        return OrtspecEngine(
            name, engine, lookup, width, {"proposer": "PromptLookup(ngram=3, max_draft=8)", "draft_width": width}
        )
    lookup = functools.partial(PromptLookup, ngram=3, max_draft=KMAX)
    described = f"PromptLookup(ngram=3, max_draft={KMAX})"
    if name == "ortspec-lookup-adaptive":
        policy = CostAwareWidth(pass_costs=tuple(float(c) for c in pass_costs))
        return OrtspecEngine(
            name,
            engine,
            lookup,
            policy,
            {
                "proposer": described,
                "draft_width": "CostAwareWidth(pass_costs=measured verify cost curve)",
                "pass_costs": [round(c, 4) for c in pass_costs],
            },
        )
    if name == "ortspec-lookup-additive":
        policy = AdditiveWidth(maximum=KMAX)
        description = {"proposer": described, "draft_width": f"AdditiveWidth(current=4, maximum={KMAX}, +2/-1)"}
        return OrtspecEngine(name, engine, lookup, policy, description)
    if name == "ortspec-suffix":
        description = {"speculative": "suffix", "draft_width": "auto (the Engine's cost-aware policy)"}
        return OrtspecEngine(name, engine, lambda: "suffix", "auto", description)
    if name in (DRAFT_MODEL, AUTO_DRAFT_MODEL):
        if engine.draft_model is None:
            raise ValueError(f"{name} needs a draft model: run the suite with --draft-model DIR")
        folder = getattr(getattr(engine.draft_model, "backend", None), "folder", None)
        how = "draft-model" if name == DRAFT_MODEL else "auto"
        description = {
            "speculative": how,
            "draft_width": "auto (the Engine's cost-aware policies, priced with each model's measured step)",
            "draft_model": str(getattr(folder, "path", engine.draft_model)),
        }
        return OrtspecEngine(name, engine, lambda: how, "auto", description)
    if name in DRAFTER_ENGINES:
        if engine.drafter is None:
            raise ValueError(f"{name} needs a shared-KV drafter for the model: run `ortspec train-drafter`")
        how = "shared-kv" if name == "ortspec-shared-kv" else "auto"
        folder = getattr(getattr(engine.drafter, "folder", None), "path", None)
        tree = name == AUTO_TREE
        description = {
            "speculative": how,
            "draft_width": "auto (the Engine's cost-aware policies, priced with the drafter's measured step)",
            "drafter": str(folder) if folder else repr(engine.drafter),
            **({"tree_branches": f"{TREE_BRANCHES}: trees where the pass prices them"} if tree else {}),
        }
        branches = TREE_BRANCHES if tree else 1
        return OrtspecEngine(name, engine, lambda: how, "auto", description, tree_branches=branches)
    known = ", ".join((*ORTSPEC_ENGINES, *SAMPLED_ORTSPEC_ENGINES))
    raise ValueError(f"unknown ortspec engine {name!r}; known: {known}")


class PeerEngine:
    """A ``bench.peers`` runner behind the engines' interface."""

    def __init__(self, name: str, runner: PeerRunner) -> None:
        self.name = name
        self.runner = runner

    @property
    def sampled(self) -> bool:
        """Whether this peer samples (and so takes a seed)."""
        return self.name in SAMPLED_PEER_ENGINES

    def warmup(self, ids: Sequence[int]) -> None:
        self.runner.warmup(list(ids), 8)

    def run(self, ids: Sequence[int], max_new: int, seed: int | None = None) -> EngineRun:
        r = self.runner.run(list(ids), max_new, seed=seed) if self.sampled else self.runner.run(list(ids), max_new)
        proposed, accepted, passes = self._counts(r)
        return EngineRun(
            token_ids=tuple(r.token_ids),
            finish_reason=r.finish_reason,
            ttft_s=r.ttft_s,
            total_s=r.total_s,
            proposed=proposed,
            accepted=accepted,
            passes=passes,
            decode_passes=passes,
            extra=dict(r.extra),
        )

    def _counts(self, r: PeerRun) -> tuple[int | None, int | None, int | None]:
        """(proposed, accepted, target passes) as far as the peer reports them."""
        spec = r.extra.get("speculative_stats")
        if spec:
            passes = None
            if "target_forward_passes" in spec and "standard_fallback_steps" in spec:
                passes = int(spec["target_forward_passes"]) + int(spec["standard_fallback_steps"])
            return spec.get("draft_tokens_evaluated"), spec.get("draft_tokens_accepted"), passes
        if self.name in ("ortgenai", "onnx_genai", "llamacpp", SAMPLED_PEER):
            # plain: the prefill pass yields the first token, then one pass per further token (EOS included)
            return None, None, r.new_tokens + (1 if r.finish_reason == "stop" else 0)
        return None, None, None

    def describe(self) -> dict[str, Any]:
        return self.runner.describe()

    def close(self) -> None:
        self.runner.close()


def load_peer(
    name: str,
    model_dir: Path,
    threads: int,
    cache_root: Path | None = None,
    ngram: tuple[int, int] = DEFAULT_NGRAM,
    draft_model: Path | None = None,
    draft_tokens: int = DEFAULT_GENAI_DRAFT_TOKENS,
) -> tuple[PeerEngine, None] | tuple[None, str]:
    """The peer ``name`` (one of ``PEER_ENGINES`` or ``SAMPLED_PEER_ENGINES``) on ``model_dir``, or ``(None, why
    it is missing)``. The n-gram peers draft with ``ngram`` (ngram_size, max_draft_tokens); ``ortgenai-draft-model``
    drafts with the folder ``draft_model`` (missing when None), ``draft_tokens`` tokens per draft (GenAI's
    ``max_draft_tokens``); the sampled peers sample at ``SAMPLING``;
    onnx_genai gets a fresh engine per run (no prefix-cache hits), its time to first token from a probe, and its
    patched folder under ``cache_root`` when given."""
    options: dict[str, Any] = {"ngram_size": ngram[0], "max_draft_tokens": ngram[1]}
    if name == DRAFT_MODEL_PEER:
        options = {"draft_model": draft_model, "draft_tokens": draft_tokens}
    if name in SAMPLED_PEER_ENGINES:
        options["sampling"] = dict(SAMPLING)
    if name == "onnx_genai":
        options.update(fresh_engine="always", ttft="probe")
        if cache_root is not None:
            options["cache_root"] = str(cache_root)
    runner, why = make_peer(name, model_dir, threads=threads, **options)
    if runner is None:
        return None, why or "unavailable"
    return PeerEngine(name, runner), None


BenchEngine = OrtspecEngine | PeerEngine


class TimingBackend:
    """Forwards the backend protocol to ``inner`` and adds up the wall time spent inside its calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def decode(self, tokens, past):
        return self._timed(self.inner.decode, tokens, past)

    def decode_verify(self, tokens, base):
        return self._timed(self.inner.decode_verify, tokens, base)

    def rewind(self, length):
        return self._timed(self.inner.rewind, length)

    def reset(self):
        return self._timed(self.inner.reset)

    def current_len(self):
        return self._timed(self.inner.current_len)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_length(self) -> int:
        return self.inner.max_length
