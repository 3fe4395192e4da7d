"""Training data for a shared-KV drafter, made on this machine: chat prompts built from local text, the target's
own greedy continuations of them, and what the target computed on the way (its final hidden states, one layer's
KV cache and residual stream, and its greedy pick at every position).

* :func:`training_prompts` yields deterministic chat prompts: creative and explanatory requests assembled from word
  lists below (none of them is a prompt of ``bench.workloads``, whose open-ended prompts stay held out), and
  requests grounded in this Python's ``pydoc_data`` topics (:func:`grounded_texts`: no source of a benchmark
  prompt).
* :class:`TargetRunner` runs the target's own ONNX graph (the folder's ``model.onnx``, through onnxruntime, with an
  extra output: the residual stream entering the drafter's layer) on batches of prompts of one token length, so
  the batch needs no padding, and decodes greedily.
* :func:`collect` runs batches until it has the number of sequences asked for and returns the
  :class:`TargetSequence` records.

Positions: a record of ``n`` tokens holds, for every position ``i < n``, the token fed there, the final hidden state
``hidden[i]`` (which predicted ``tokens[i + 1]``), the greedy pick ``labels[i]`` (argmax of the logits at ``i``;
``labels[i] == tokens[i + 1]`` from the last prompt position on), the residual ``residual[i]`` entering the layer,
and the layer's post-RoPE keys and values ``keys[:, i]`` / ``values[:, i]``.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np

from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.tools.drafter_recipe import TrainConfig
from ortspec.backends.onnx import ModelFolder, make_session_options
from ortspec.backends.onnx.graph_features import append_features, residual_output_name
from ortspec.backends.onnx.session import open_session

# --------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------

_FORMS = (
    "Write a short story about {}.",
    "Write a poem about {}.",
    "Describe a day in the life of {}.",
    "Write a letter from {} to an old friend.",
    "Tell a bedtime story about {}.",
    "Write a fable about {}, with a moral at the end.",
    "Write a dialogue between {} and a curious stranger.",
    "Write a news report about {}.",
    "Write the first chapter of a novel about {}.",
    "Write a funny anecdote about {}.",
)
_CHARACTERS = (
    "a retired sailor",
    "a young inventor",
    "a talking fox",
    "a lonely dragon",
    "a mail carrier",
    "a street musician",
    "an old beekeeper",
    "a forgetful wizard",
    "a deep-sea diver",
    "a mountain guide",
    "a museum night guard",
    "a space station engineer",
    "a village teacher",
    "a tomato farmer",
    "a chess champion",
    "a stray dog",
    "a firefighter",
    "a night-shift nurse",
    "a shy giant",
    "a clever crow",
)
_SITUATIONS = (
    "who finds a hidden door in the attic",
    "who loses their voice before a big day",
    "caught in a thunderstorm",
    "on the first morning of spring",
    "in a city made of glass",
    "who befriends a ghost",
    "who must cross a desert",
    "at a crowded train station",
    "who wins a strange prize",
    "who moves to a new country",
    "during a power cut",
    "who plants a magic seed",
    "on a ship lost in fog",
    "who learns to dance",
    "at a midnight market",
    "who keeps a secret map",
)
_QUESTION_FORMS = (
    "Explain how {} works.",
    "Explain {} to a beginner.",
    "What are the most important facts about {}?",
    "Give practical tips about {}.",
    "Why does {} matter? Give several reasons.",
    "Write a short essay about {}.",
    "Describe the history of {}.",
    "What are common misconceptions about {}?",
)
_TOPICS = (
    "volcanoes",
    "the water cycle",
    "photosynthesis",
    "vaccines",
    "solar panels",
    "the stock market",
    "earthquakes",
    "the human immune system",
    "compound interest",
    "recycling",
    "growing tomatoes",
    "sleep",
    "the phases of the moon",
    "electric cars",
    "making coffee",
    "bird migration",
    "the internet",
    "coral reefs",
    "public libraries",
    "time management",
    "public speaking",
    "saving money",
    "healthy eating",
    "learning to swim",
    "writing a resume",
    "training a puppy",
    "the printing press",
    "wind turbines",
    "black holes",
    "the Roman Empire",
    "chess openings",
    "baking bread at home",
    "remote work",
    "plate tectonics",
    "the metric system",
    "first aid",
    "classical music",
    "ocean tides",
    "camping safely",
    "the history of maps",
)
_GROUNDED = (
    "Summarize the following text in a few sentences:\n\n{}",
    "Explain the following documentation in simple words:\n\n{}",
    "Read this text and list its main points:\n\n{}",
    "Rewrite the following text for a non-technical reader:\n\n{}",
)


def grounded_texts() -> list[str]:
    """Paragraphs of English (over 200 characters each) from this Python's ``pydoc_data`` topics (the language
    reference's text), in sorted topic order, so the list is the same on every run of the same Python. Empty where
    the Python ships no ``pydoc_data``.

    Not the standard library's modules or their docstrings: ``bench.workloads`` builds its summarize, qa_context and
    code_edit prompts from those, and a drafter trained on them would be measured on its own training source."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    texts: list[str] = []
    for key in sorted(topics):
        texts.extend(p.strip() for p in topics[key].split("\n\n") if len(p.strip()) > 200)
    return texts


def training_prompts(seed: int = 0) -> Iterator[tuple[str, str]]:
    """Endless deterministic ``(kind, user message)`` pairs: about 55% creative requests, 25% explanatory
    questions and 20% requests about a paragraph of :func:`grounded_texts` (explanatory questions instead where
    there is none), in an order fixed by ``seed``."""
    rng = random.Random(seed)
    creative = [f.format(f"{c} {s}") for f, c, s in itertools.product(_FORMS, _CHARACTERS, _SITUATIONS)]
    questions = [f.format(t) for f, t in itertools.product(_QUESTION_FORMS, _TOPICS)]
    texts = grounded_texts()
    rng.shuffle(creative)
    rng.shuffle(questions)
    rng.shuffle(texts)
    for i in itertools.count():
        r = rng.random()
        if r < 0.55:
            yield "creative", creative[i % len(creative)]
        elif r < 0.8 or not texts:
            yield "question", questions[i % len(questions)]
        else:
            yield "grounded", rng.choice(_GROUNDED).format(texts[i % len(texts)][:400])


def prompt_batches(
    tokenizer: Tokenizer, batch: int, seed: int = 0, max_prompt_tokens: int = 128
) -> Iterator[list[list[int]]]:
    """Batches of ``batch`` chat-formatted prompts (token ids) of one length each, so a batch needs no padding:
    prompts are bucketed by token length and a bucket is emitted when full. Prompts longer than
    ``max_prompt_tokens`` are skipped (grounded ones are cut to 400 characters of text first)."""
    buckets: dict[int, list[list[int]]] = {}
    for _, text in training_prompts(seed):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        if len(ids) > max_prompt_tokens:
            continue
        bucket = buckets.setdefault(len(ids), [])
        bucket.append(ids)
        if len(bucket) == batch:
            yield buckets.pop(len(ids))


# --------------------------------------------------------------------------------------------------------------
# The target, batched
# --------------------------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class TargetSequence:
    """One prompt and the target's greedy continuation with what it computed (see the module docstring):
    ``tokens`` int64 ``[n]``, ``prompt_len``, ``labels`` int64 ``[n]``, ``hidden`` float32 ``[n, (1 + F) * H]`` (the
    final hidden state, then the residual streams of the runner's ``F`` feature layers), ``residual`` float32
    ``[n, H]``, ``keys`` and ``values`` float32 ``[kv_heads, n, head_size]``."""

    tokens: np.ndarray
    prompt_len: int
    labels: np.ndarray
    hidden: np.ndarray
    residual: np.ndarray
    keys: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


class TargetRunner:
    """The target's graph on onnxruntime (CPU) for a batch of equal-length sequences, greedy, with its KV in
    preallocated ``[batch, kv_heads, capacity, head_size]`` buffers shared between past and present (the
    builder's ``GroupQueryAttention`` appends in place). ``layer`` is the layer whose residual stream and KV are
    kept; ``features``: layers whose residual streams follow the final hidden state in each ``hidden`` row, as the
    runtime gives them to a drafter with fused features (``graph_features.append_features``, the same rewrite).
    The graph is loaded with its weights and one more output (the residual) and the session made from its bytes
    (the folder is only read)."""

    def __init__(
        self, folder: ModelFolder, layer: int, *, threads: int | None = None, features: Sequence[int] = ()
    ) -> None:
        import onnx

        self.folder, self.layer = folder, layer
        # the graph alone, rewritten; the session reads the weights from the folder, as the backend's does
        model = onnx.load(str(folder.model_path), load_external_data=False)
        self.residual_name = residual_output_name(model, layer)
        model.graph.output.append(onnx.ValueInfoProto(name=self.residual_name))
        _apply_window(onnx, model, folder)
        if features:
            append_features(onnx, model, folder.hidden_states_name, features)
        options = make_session_options(threads=threads, genai_session_options=folder.session_options)
        self.session = open_session(
            folder.model_path,
            providers=["CPUExecutionProvider"],
            session_options=options,
            model_bytes=model.SerializeToString(),
        )
        del model
        outputs = {o.name: o for o in self.session.get_outputs()}
        if folder.hidden_states_name not in outputs:
            raise ValueError(f"{folder.model_path} has no {folder.hidden_states_name!r} output")
        self.row_size = int(outputs[folder.hidden_states_name].shape[2])  # (1 + len(features)) * H
        self.hidden_size = self.row_size // (1 + len(features))
        inputs = {i.name for i in self.session.get_inputs()}
        self.mask_name = next((n for n in (folder.attention_mask_name, "attention_mask") if n and n in inputs), None)

    def run(self, prompts: Sequence[Sequence[int]], max_new: int, eos: Sequence[int]) -> list[TargetSequence]:
        """Prefill ``prompts`` (equal lengths) and decode ``max_new`` greedy steps; a sequence ends after its first
        EOS. Returns one record per prompt (see the module docstring for the positions it covers). The prompts are
        prefilled in one run (``GroupQueryAttention`` takes several tokens per sequence only without a past), so
        the logits buffer is ``[batch, prompt length, vocab]``."""
        f = self.folder
        batch, plen = len(prompts), len(prompts[0])
        if any(len(p) != plen for p in prompts):
            raise ValueError("every prompt of a batch must have the same length")
        cap = plen + max_new
        kvh, size, hidden, vocab = f.num_kv_heads, f.head_size, self.hidden_size, f.vocab_size
        row_width = self.row_size
        shape = [batch, kvh, cap, size]
        kv = [np.zeros(shape, np.float32) for _ in range(2 * f.num_layers)]
        rows = plen
        logits = np.empty((batch, rows, vocab), np.float32)
        hid = np.empty((batch, rows, row_width), np.float32)
        res = np.empty((batch, rows, hidden), np.float32)
        tokens = np.zeros((batch, cap), np.int64)
        tokens[:, :plen] = np.asarray(prompts, np.int64)
        labels = np.zeros((batch, cap), np.int64)
        hidden_all = np.zeros((batch, cap, row_width), np.float32)
        residual_all = np.zeros((batch, cap, hidden), np.float32)
        mask = np.ones((batch, cap), np.int64)
        binding = self.session.io_binding()
        for layer in range(f.num_layers):
            for j, (past, present) in enumerate(
                ((f.past_key_pattern, f.present_key_pattern), (f.past_value_pattern, f.present_value_pattern))
            ):
                address = kv[2 * layer + j].ctypes.data
                binding.bind_input(past % layer, "cpu", 0, np.float32, shape, address)
                binding.bind_output(present % layer, "cpu", 0, np.float32, shape, address)
        eos_set = set(int(e) for e in eos)
        ended = np.full(batch, cap, np.int64)  # per sequence: positions kept (set when EOS is generated)

        def step(start: int, count: int) -> None:
            ids = np.ascontiguousarray(tokens[:, start : start + count])
            binding.bind_cpu_input(f.input_ids_name, ids)
            if self.mask_name:
                binding.bind_cpu_input(self.mask_name, np.ascontiguousarray(mask[:, : start + count]))
            for name, buffer, width in (
                (f.logits_name, logits, vocab),
                (f.hidden_states_name, hid, row_width),
                (self.residual_name, res, hidden),
            ):
                binding.bind_output(name, "cpu", 0, np.float32, [batch, count, width], buffer.ctypes.data)
            self.session.run_with_iobinding(binding)
            flat = logits.reshape(-1)[: batch * count * vocab].reshape(batch, count, vocab)
            labels[:, start : start + count] = flat.argmax(-1)
            hidden_all[:, start : start + count] = hid.reshape(-1)[: batch * count * row_width].reshape(
                batch, count, row_width
            )
            residual_all[:, start : start + count] = res.reshape(-1)[: batch * count * hidden].reshape(
                batch, count, hidden
            )

        step(0, plen)
        for position in range(plen, cap):
            picks = labels[:, position - 1]
            tokens[:, position] = picks
            for row in np.flatnonzero((ended == cap) & np.isin(picks, list(eos_set))):
                ended[row] = position  # keep positions < position: the EOS is the label of position - 1
            if (ended < cap).all() or position == cap - 1:
                break
            step(position, 1)
        out = []
        for b in range(batch):
            n = int(min(ended[b], cap - 1))  # positions 0 .. cap - 2 were fed at most
            out.append(
                TargetSequence(
                    tokens=tokens[b, :n].copy(),
                    prompt_len=plen,
                    labels=labels[b, :n].copy(),
                    hidden=hidden_all[b, :n].copy(),
                    residual=residual_all[b, :n].copy(),
                    keys=kv[2 * self.layer][b, :, :n].copy(),
                    values=kv[2 * self.layer + 1][b, :, :n].copy(),
                )
            )
        return out


def _apply_window(onnx, model, folder: ModelFolder) -> None:
    """Set on ``model``'s attention nodes the sliding window ``genai_config.json`` names and the graph ignores, as
    ``OrtBackend`` does at load (``graph_rewrites.window_rewrites``), so the data is the target ortspec runs."""
    from ortspec.backends.onnx.graph_rewrites import window_rewrites
    from ortspec.backends.onnx.model_graph import read_graph_facts

    if folder.sliding_window is None:
        return
    windows = window_rewrites(folder, read_graph_facts(folder.model_path), folder.sliding_window + 1, "config")
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > 3 and node.input[3] in windows:
            for attribute in node.attribute:
                if attribute.name == "local_window_size":
                    attribute.i = int(windows[node.input[3]])


def collect(
    folder: ModelFolder,
    layer: int,
    recipe: TrainConfig,
    *,
    threads: int | None = None,
    deadline: float | None = None,
    progress: Callable[[str], None] | None = None,
    runner: TargetRunner | None = None,
) -> list[TargetSequence]:
    """The first ``recipe.sequences`` sequences of :func:`prompt_batches` (``recipe.batch`` prompts at a time,
    ``recipe.seed``) run through :class:`TargetRunner` (``recipe.feature_layers`` too) for up to ``recipe.max_new``
    new tokens each, in order: the same count and seed give the same prompts. Stops early, after the batch under
    way, only once ``deadline`` (a ``time.perf_counter()`` value; None: never) has passed. ``runner``: the
    :class:`TargetRunner` to use (for ``folder``, ``layer`` and the recipe's features; None: one made here)."""
    count, batch, max_new, seed = recipe.sequences, recipe.batch, recipe.max_new, recipe.seed
    features = recipe.feature_layers
    say = progress or (lambda _m: None)
    tokenizer = Tokenizer.from_folder(folder.path)
    runner = runner or TargetRunner(folder, layer, threads=threads, features=features)
    t0 = time.perf_counter()
    sequences: list[TargetSequence] = []
    said = 0.0
    try:
        for prompts in prompt_batches(tokenizer, batch, seed):
            sequences.extend(runner.run(prompts[: count - len(sequences)], max_new, folder.eos_token_ids))
            elapsed = time.perf_counter() - t0
            finished = len(sequences) >= count or (deadline is not None and time.perf_counter() >= deadline)
            if elapsed - said >= 30.0 or finished:
                said = elapsed
                tokens = sum(len(s) for s in sequences)
                generated = sum(len(s) - s.prompt_len for s in sequences)
                say(
                    f"data: {len(sequences)} of {count} sequences, {tokens} positions ({generated} generated) in "
                    f"{elapsed:.0f} s, {elapsed / len(sequences):.2f} s per sequence"
                )
            if finished:
                break
    finally:
        del runner
    return sequences
