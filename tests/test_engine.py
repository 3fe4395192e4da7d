"""Engine, tokenizer and CLI on a tiny random-weight model folder (same layout as the real model)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from ortspec import FinishReason, GenerationAborted, PromptLookup
from ortspec.adapters.cli.main import main as cli_main
from ortspec.adapters.engine import Engine
from ortspec.backends.onnx import BackendConfig, ModelFolderError
from ortspec.core.checks import ArgumentError
from tests.support.conformance import GreedyReplay


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


def test_generate_greedy_and_speculative_agree(engine):
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    g = engine.generate(prompt, max_tokens=40, ignore_eos=True)
    ids = engine.tokenize(prompt)
    vocab = engine.backend.vocab_size
    for speculative in (
        "prompt-lookup",
        PromptLookup(ngram=2, max_draft=4),
        GreedyReplay(ids, g.token_ids, vocab),
        GreedyReplay(ids, g.token_ids, vocab, wrong_every=3),
    ):
        s = engine.generate(prompt, max_tokens=40, ignore_eos=True, speculative=speculative, draft_width=6)
        assert s.token_ids == g.token_ids and s.text == g.text
        assert s.stats.verification_steps > 0, (speculative, s.stats)
        if isinstance(speculative, GreedyReplay):
            assert s.stats.accepted_tokens >= 10 and s.stats.multi_token_accepts > 0, s.stats
    assert len(g.token_ids) == 40 and g.finish_reason == FinishReason.MAX_TOKENS


def test_prompt_as_ids_and_chat(engine):
    ids = engine.tokenize("hello world")
    a = engine.generate(ids, max_tokens=5, ignore_eos=True)
    b = engine.generate("hello world", max_tokens=5, ignore_eos=True)
    assert a.token_ids == b.token_ids
    chat = engine.prompt_ids("hi", chat=True)
    assert engine.tokenizer.decode(chat).count("hi") >= 1
    msgs = engine.prompt_ids([{"role": "user", "content": "hi"}])
    assert msgs == chat


def test_decode_can_spell_out_special_tokens(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi there"}]))
    assert "<|im_start|>" not in tok.decode(ids)
    text = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in text and tok.encode(text) == ids


def test_stream_callback_signature_and_abort(engine):
    seen = []
    r = engine.generate_stream("abc abc abc", lambda t, i, f: seen.append((t, i, f)), max_tokens=12, ignore_eos=True)
    assert "".join(t for t, _, _ in seen) == r.text
    assert seen[-1][2] == "max_tokens"

    def boom(text, token_id, finish_reason):
        if len(seen2) == 3:
            raise RuntimeError("stop here")
        seen2.append(token_id)

    seen2: list[int] = []
    with pytest.raises(GenerationAborted) as info:
        engine.generate_stream("abc abc abc", boom, max_tokens=12, ignore_eos=True, speculative="prompt-lookup")
    assert info.value.partial.token_ids[:3] == tuple(seen2)
    assert isinstance(info.value.__cause__, RuntimeError)
    # the engine is usable afterwards
    assert engine.generate("abc", max_tokens=3, ignore_eos=True).token_ids


def test_stop_strings_and_token_sequences(engine):
    base = engine.generate("one two three", max_tokens=30, ignore_eos=True)
    assert len(base.text) >= 6, base.text  # the tiny model is built deterministically: this never varies
    stop = base.text[3:6]
    replay = GreedyReplay(engine.tokenize("one two three"), base.token_ids, engine.backend.vocab_size)
    r = engine.generate("one two three", max_tokens=30, ignore_eos=True, stop=[stop], speculative=replay)
    assert r.finish_reason == FinishReason.STOP_SEQUENCE and stop not in r.text
    assert r.text == base.text[: base.text.index(stop)]
    assert r.stats.accepted_tokens > 0  # the stop string was completed inside an accepted block
    seq = list(base.token_ids[2:4])
    r = engine.generate("one two three", max_tokens=30, ignore_eos=True, stop=[seq])
    assert r.finish_reason == FinishReason.STOP_SEQUENCE and r.token_ids[-2:] == tuple(seq)


@pytest.mark.parametrize(
    "prompt, options, argument, match",
    [
        ("x", dict(temperature=-0.7), "temperature", "temperature"),
        ("x", dict(temperature=0.7, top_p=0.0), "top_p", "top_p"),
        ("x", dict(speculative="medusa"), "speculative", "speculative"),
        ("", dict(max_tokens=3), "prompt", "empty"),
        ("x", dict(max_tokens=0), "max_tokens", "max_tokens"),
        ("x", dict(stop=[""]), "stop", "stop"),
        ("x", dict(draft_width=0), "draft_width", "draft_width"),
        ("x", dict(logit_bias={10**9: 1.0}), "logit_bias", "logit_bias"),
        ([10**9], dict(max_tokens=3), "prompt", "prompt"),
        (None, dict(max_tokens=3), "prompt", "context"),
    ],
)
def test_bad_arguments_raise_an_argument_error_naming_the_keyword(engine, prompt, options, argument, match):
    """``ArgumentError`` (a ``ValueError``) with ``argument`` the keyword as the caller typed it: what a front end
    maps to its own field (the server to a request field)."""
    prompt = prompt if prompt is not None else [3] * (engine.backend.max_length + 5)
    with pytest.raises(ArgumentError, match=match) as info:
        engine.generate(prompt, **options)
    assert info.value.argument == argument and isinstance(info.value, ValueError)


def test_bad_input_is_refused(engine, tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        Engine.from_dir(tmp_path / "missing")
    with pytest.raises(ModelFolderError, match="genai_config.json"):
        Engine.from_dir(tmp_path)


def test_prompt_that_fills_the_context_ends_at_once(engine):
    """The core's prompt-length rule, as the Engine applies it: a prompt of exactly the context ends with
    CONTEXT_FULL and no token; one token less gets exactly one token."""
    full = engine.generate([3] * engine.backend.max_length, max_tokens=3)
    assert full.token_ids == () and full.finish_reason is FinishReason.CONTEXT_FULL
    one = engine.generate([3] * (engine.backend.max_length - 1), max_tokens=3, speculative="prompt-lookup")
    assert len(one.token_ids) == 1 and one.finish_reason is FinishReason.CONTEXT_FULL


def test_folder_without_tokenizer_is_refused(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises((ModelFolderError, FileNotFoundError), match="tokenizer"):
        Engine.from_dir(copy)


def test_cli_generate_and_bench(tiny_model_dir, capsys):
    assert (
        cli_main(
            [
                "generate",
                "hello hello hello",
                "--model",
                str(tiny_model_dir),
                "--max-tokens",
                "8",
                "--threads",
                "1",
                "--no-chat",
                "--ignore-eos",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "8 tokens" in out.err and "tok/s" in out.err
    assert (
        cli_main(
            [
                "bench",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "a b a b a b",
                "--repeat",
                "1",
                "--cost-repeat",
                "3",
                "--max-tokens",
                "8",
                "--threads",
                "1",
                "--no-chat",
                "--ignore-eos",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("identical to greedy 1/1") == 2 and "verify K=8" in out


def test_cli_reports_bad_input(tiny_model_dir, tmp_path, capsys):
    assert cli_main(["generate", "--file", str(tmp_path / "nope.txt"), "--model", str(tiny_model_dir)]) == 2
    assert "nope.txt does not exist" in capsys.readouterr().err
    code = cli_main(["generate", "x", "--model", str(tmp_path / "missing")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "ortspec.adapters.cli", "--help"], capture_output=True, text=True)
    for word in ("demo", "generate", "bench", "convert"):
        assert word in out.stdout


def test_verify_drift_is_measured_and_warned_about(engine, tiny_model_dir):
    """Exact fp32 kernels: no drift and no warning. A backend whose verify rows drift from its decode rows
    (as int8 MatMulNBits kernels do) gets a warning on its first speculative generation."""
    import warnings

    from ortspec.backends.onnx import OrtBackend

    assert engine.measurements.verify_drift() < 1e-3

    class Drifting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode_verify(self, tokens, base):
            return self.inner.decode_verify(tokens, base) + 0.25

    drifting = Engine(
        Drifting(OrtBackend.from_folder(tiny_model_dir, BackendConfig(threads=1))),
        engine.tokenizer,
        eos_token_ids=engine.eos_token_ids,
    )
    assert drifting.measurements.verify_drift() == pytest.approx(0.25, abs=1e-3)
    with pytest.warns(RuntimeWarning, match="can differ from plain"):
        drifting.generate("abc abc", max_tokens=4, speculative="prompt-lookup", draft_width=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drifting.generate("abc abc", max_tokens=4, speculative="prompt-lookup", draft_width=2)  # warned once
        drifting.generate("abc abc", max_tokens=4)  # greedy never warns


def test_concurrent_generate_calls_on_one_engine_each_give_what_they_give_alone(engine):
    """Threads sharing an Engine share its passes: each generation is what it is alone (each has its own slot)."""
    import threading

    prompts = ["alpha beta gamma", "one two three four", "the quick brown fox", "x y z x y z"]
    alone = {p: engine.generate(p, max_tokens=24, ignore_eos=True, speculative="prompt-lookup").token_ids
             for p in prompts}  # fmt: skip
    got: dict[tuple[int, str], tuple[int, ...]] = {}
    errors: list[BaseException] = []

    def worker(i: int, prompt: str) -> None:
        try:
            for _ in range(3):
                r = engine.generate(prompt, max_tokens=24, ignore_eos=True, speculative="prompt-lookup")
                got[(i, prompt)] = r.token_ids
                assert r.token_ids == alone[prompt]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(prompts * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == len(threads)


def test_an_iterator_and_another_generation_share_the_engine_each_as_alone(engine):
    """A started call and a generation made while it is half consumed both run on the Engine's one scheduler:
    each gives what it gives alone."""
    alone = engine.generate("alpha beta gamma", max_tokens=30, ignore_eos=True).token_ids
    call = engine.start("alpha beta gamma", max_tokens=30, ignore_eos=True)
    it = iter(call)
    first = next(it)
    other = engine.generate("one two three", max_tokens=5, ignore_eos=True)
    assert (first.token_id, *(c.token_id for c in it)) == alone
    assert call.result().token_ids == alone
    assert engine.generate("one two three", max_tokens=5, ignore_eos=True).token_ids == other.token_ids


def test_separate_engines_in_threads_run_in_parallel_correctly(tiny_model_dir):
    import threading

    engines = [Engine.from_dir(tiny_model_dir, BackendConfig(threads=1)) for _ in range(2)]
    want = engines[0].generate("the quick brown fox", max_tokens=32, ignore_eos=True).token_ids
    results: list[tuple[int, ...]] = []

    def worker(e: Engine) -> None:
        for _ in range(3):
            results.append(e.generate("the quick brown fox", max_tokens=32, ignore_eos=True).token_ids)

    threads = [threading.Thread(target=worker, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 6


def test_prefix_reuse_prefills_only_the_new_tokens_and_changes_nothing(tiny_model_dir):
    fresh = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    reuse = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), prefix_reuse=True)
    reuse.measurements.verify_drift(), reuse.measurements.pass_costs()  # measured once (it empties the slots)
    turn1 = [{"role": "user", "content": "tell me about the quick brown fox"}]
    r1 = reuse.generate(turn1, max_tokens=20, ignore_eos=True)
    assert r1.cached_prompt_tokens == 0
    turn2 = [*turn1, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "and the lazy dog?"}]
    for speculative in (None, "prompt-lookup"):
        want = fresh.generate(turn2, max_tokens=20, ignore_eos=True, speculative=speculative)
        got = reuse.generate(turn2, max_tokens=20, ignore_eos=True, speculative=speculative)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.cached_prompt_tokens > 0 and want.cached_prompt_tokens == 0
    # The same prompt again reuses all but its last token; a different one reuses only the common prefix.
    again = reuse.generate(turn2, max_tokens=20, ignore_eos=True)
    assert again.cached_prompt_tokens == again.prompt_tokens - 1
    other = reuse.generate("completely different", max_tokens=5, ignore_eos=True)
    assert other.token_ids == fresh.generate("completely different", max_tokens=5, ignore_eos=True).token_ids


def test_sampling_draws_and_reports_a_seed_and_replays_it(engine):
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    first = engine.generate(prompt, max_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95)
    assert first.seed is not None
    again = engine.generate(prompt, max_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95, seed=first.seed)
    assert again.token_ids == first.token_ids
    replay = GreedyReplay(engine.tokenize(prompt), first.token_ids, engine.backend.vocab_size)
    for speculative in ("prompt-lookup", replay):
        spec = engine.generate(prompt, max_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.95,
                               seed=first.seed, speculative=speculative, draft_width=6)  # fmt: skip
        assert spec.token_ids == first.token_ids and spec.seed == first.seed
    assert spec.stats.accepted_tokens >= 10
    greedy = engine.generate(prompt, max_tokens=30, ignore_eos=True)
    assert greedy.seed is None and greedy.token_ids != first.token_ids
