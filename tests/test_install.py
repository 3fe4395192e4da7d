"""The README's test command installs everything the tests need, so that on a clean machine nothing skips but the
CUDA tests: its extras cover every extra the tests import from, CI installs the same ones (plus ``dev``), and here
every distribution they name is installed. A run from a partial install (``pip install -e '.[test]'``) fails
here, once, naming what is missing, instead of silently skipping the server, Ray or builder tests."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The extras whose packages the tests import: test (pytest, hypothesis, the server tests' clients, schemathesis for
# tests/test_openapi_fuzz.py), convert (the tiny-model builder, the real model's conversion), bench (the benchmark's
# quick runs), serve (tests/test_server.py, tests/test_openapi_fuzz.py) and ray (tests/test_batch_ray.py,
# tests/test_serve_ray.py).
NEEDED = {"test", "convert", "bench", "serve", "ray"}
_COMMAND = re.compile(r"pip install -e '\.\[([a-z,]+)\]' && python -m pytest")


def _readme_extras() -> set[str]:
    commands = _COMMAND.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(commands) == 1, f"the README should hold one test command, found {commands}"
    return set(commands[0].split(","))


def _declared_extras() -> dict[str, list[str]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_the_readme_test_command_installs_every_extra_the_tests_need():
    extras = _readme_extras()
    assert NEEDED <= extras, f"the README's test command misses the extras {sorted(NEEDED - extras)}"
    assert extras <= set(_declared_extras()), f"undeclared extras {sorted(extras - set(_declared_extras()))}"


def test_ci_installs_the_readme_test_command_extras_and_dev():
    ci = re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", (ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert len(ci) == 1 and set(ci[0].split(",")) == _readme_extras() | {"dev"}, ci


def test_every_distribution_of_those_extras_is_installed():
    declared = _declared_extras()
    missing = []
    for extra in sorted(_readme_extras()):
        for requirement in declared[extra]:
            name = re.match(r"[A-Za-z0-9._-]+", requirement)
            assert name is not None, requirement
            try:
                importlib.metadata.version(name.group(0))
            except importlib.metadata.PackageNotFoundError:
                missing.append(f"{name.group(0)} ({extra})")
    assert not missing, (
        f"not installed: {', '.join(missing)}; the tests that need them would be skipped. Install with the "
        "README's test command: pip install -e '.[" + ",".join(sorted(_readme_extras())) + "]'"
    )


def test_the_shipped_drafter_is_package_data():
    """The default model's drafter ships inside the package (``ortspec/drafters/``, declared as package data, so a
    wheel has it too), without the target's input-embedding table, which is materialised from the model folder."""
    from ortspec.adapters.engine.shipped import shipped_root

    with (ROOT / "pyproject.toml").open("rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert "ortspec.drafters" in setuptools["packages"] and "*/*" in setuptools["package-data"]["ortspec.drafters"]
    folder = shipped_root() / "SmolLM2-135M-Instruct"
    assert {p.name for p in folder.iterdir()} == {"drafter.json", "drafter.onnx", "draft_to_target.i64"}
    assert (folder / "drafter.onnx").stat().st_size < 16 * 2**20  # int8 weights, no embedding table
