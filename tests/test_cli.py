"""The ``ortspec`` command as a new user meets it: errors name the flags typed, bad values are refused at parse
time, an unknown flag gets the subcommand's usage, an empty prompt is not answered, help has examples, Ctrl-C
ends with status 130, a failed generation with status 1 and no traceback."""

from __future__ import annotations

import pytest

from ortspec.adapters.cli.main import build_parser, main
from ortspec.adapters.cli.options import speak_flags


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--threads", "0", "argument --threads: expected an int >= 1, got '0'"),
        ("--max-tokens", "0", "argument --max-tokens: expected an int >= 1, got '0'"),
        ("--max-tokens", "-3", "argument --max-tokens: expected an int >= 1"),
        ("--max-length", "0", "argument --max-length: expected an int >= 1"),
        ("--draft-width", "0", "argument --draft-width: expected 'auto' or an int >= 1, got '0'"),
        ("--tie-margin", "nan", "argument --tie-margin: expected a number >= 0"),
        ("--tie-margin", "-1", "argument --tie-margin: expected a number >= 0"),
        ("--stop", "", "argument --stop: a stop string must not be empty"),
        ("--ngram", "0", "argument --ngram: expected an int >= 1"),
    ],
)
def test_bad_flag_values_are_refused_naming_the_flag(capsys, flag, value, message):
    code, _, err = _run(capsys, "generate", "hi", flag, value)
    assert code == 2 and message in err and "usage: ortspec generate" in err


def test_an_unknown_flag_gets_the_subcommands_usage(capsys):
    code, _, err = _run(capsys, "generate", "hi", "--bogus")
    assert code == 2 and "usage: ortspec generate" in err and "unrecognized arguments: --bogus" in err
    code, _, err = _run(capsys, "bench", "--tie-margins", "0")  # the old second spelling is gone
    assert code == 2 and "usage: ortspec bench" in err


def test_an_unquoted_prompt_is_reported_as_an_extra_argument(capsys):
    code, _, err = _run(capsys, "generate", "hello", "world")
    assert code == 2 and "usage: ortspec generate" in err and "unrecognized arguments: world" in err


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_an_empty_prompt_is_not_answered(tiny_model_dir, capsys, prompt):
    code, out, err = _run(capsys, "generate", prompt, "--model", str(tiny_model_dir))
    assert code == 2 and "the prompt is empty" in err and out == ""


def test_an_empty_prompt_file_is_not_answered(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("\n")
    code, _, err = _run(capsys, "generate", "--file", str(tmp_path / "p.txt"), "--model", str(tiny_model_dir))
    assert code == 2 and f"prompt file {tmp_path / 'p.txt'} is empty" in err


def test_a_prompt_longer_than_max_length_is_about_the_prompt_and_the_flag(tiny_model_dir, capsys):
    code, _, err = _run(capsys, "generate", "a prompt of more than five tokens", "--model", str(tiny_model_dir),
                        "--max-length", "5", "--threads", "1")  # fmt: skip
    assert code == 2
    assert "the prompt has" in err and "the context holds 5 (--max-length" in err and "raise --max-length" in err
    assert "position" not in err and "KV capacity" not in err  # nothing about the drift probe


def test_speak_flags_names_the_flags():
    assert speak_flags("max_tokens must be an int >= 1, got 0") == "--max-tokens must be an int >= 1, got 0"
    assert speak_flags("top_p must be a finite number in (0, 1]") == "--top-p must be a finite number in (0, 1]"
    assert speak_flags("logit_bias[3] must be a finite number") == "--logit-bias[3] must be a finite number"
    assert speak_flags("tie_margin must be a finite number >= 0") == "--tie-margin must be a finite number >= 0"
    assert speak_flags("draft_width=0: expected") == "--draft-width=0: expected"
    assert speak_flags("min_ngram (4) must not exceed ngram (2)") == "--min-ngram (4) must not exceed --ngram (2)"
    assert speak_flags("stop: an empty string") == "--stop: an empty string"
    assert speak_flags("a stop string") == "a stop string"  # prose is left alone


@pytest.mark.parametrize("command", ["generate", "demo", "bench", "convert"])
def test_subcommand_help_describes_every_flag_and_has_examples(capsys, command):
    code, out, _ = _run(capsys, command, "--help")
    assert code == 0 and "examples:" in out and f"ortspec {command}" in out.split("examples:")[1]
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no description"


def test_bench_has_one_tie_margin_flag_taking_a_list(tiny_model_dir, capsys):
    code, out, _ = _run(capsys, "bench", "--model", str(tiny_model_dir), "--prompt", "a b a b a b", "--repeat", "1",
                        "--no-verify-cost", "--max-tokens", "6", "--threads", "1", "--no-chat", "--ignore-eos",
                        "--tie-margin", "0,0.5,1")  # fmt: skip
    assert code == 0 and out.count("identical to greedy 1/1") == 3


def test_ctrl_c_ends_with_status_130_and_no_traceback(tiny_model_dir, capsys, monkeypatch):
    from ortspec.adapters.engine import Engine

    def interrupted(self, prompt, callback, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate_stream", interrupted)
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tiny_model_dir), "--threads", "1")
    assert code == 130 and err.strip() == "ortspec: interrupted"


def test_a_failed_generation_ends_with_status_1_and_the_reason(tiny_model_dir, capsys, monkeypatch):
    from ortspec.backends.onnx import OrtBackend, OrtBatchBackend

    def failing(self, *args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(OrtBackend, "_run", failing)
    monkeypatch.setattr(OrtBatchBackend, "_run", failing)
    code, _, err = _run(capsys, "generate", "hi", "--model", str(tiny_model_dir), "--threads", "1",
                        "--speculative", "none")  # fmt: skip
    assert code == 1 and "ortspec: generation failed after 0 tokens: RuntimeError: device lost" in err
    assert "Traceback" not in err


def test_the_device_options_reach_the_backend_config():
    """The fast CUDA path is reachable from every command that opens a model: the flags become the one
    ``BackendConfig`` the Engine, the server's workers and batch's workers are opened with."""
    from ortspec.adapters.cli.engine_args import backend_config
    from ortspec.adapters.cli.main import build_parser

    for command in (["generate", "x"], ["serve"], ["batch", "in.jsonl", "out.jsonl"], ["demo"]):
        args = build_parser().parse_args([*command, "--provider", "cuda", "--static-shapes", "--cuda-graphs"])
        config = backend_config(args, threads=3)
        assert (config.provider, config.static_shapes, config.cuda_graphs, config.threads) == ("cuda", True, True, 3)
    args = build_parser().parse_args(["generate", "x", "--cuda-graphs"])
    with pytest.raises(ValueError, match="cuda_graphs"):
        backend_config(args, threads=None)


@pytest.mark.real_model
def test_the_demo_runs_greedy_and_sampled_and_finds_them_identical(real_model_dir, capsys):
    """The README's first command, short: greedy then sampled, plain then speculative, on the default model."""
    code, out, _ = _run(capsys, "demo", "--model", str(real_model_dir), "--max-tokens", "12", "--threads", "2")
    assert code == 0, out
    assert out.count("output identical to plain decoding: yes") == 2
    assert "--- greedy:" in out and "--- sampled (temperature 0.7, top_p 0.9, seed 1234):" in out
