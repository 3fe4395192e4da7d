"""The README's numbers tables are what ``scripts/readme_numbers.py`` writes from the results files of
``python -m bench`` (the suite's and bench.slots'; ``python scripts/readme_numbers.py`` rewrites them, this test only
compares), and the tool reads its numbers as the benchmarks reported them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "readme_numbers.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_holds_the_table_the_tool_writes(tool):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(tool.BEGIN) == 1 and readme.count(tool.END) == 1
    assert tool.readme_block(readme) == tool.block(tool.DEFAULT_RESULTS, tool.DEFAULT_SLOTS), (
        "README.md's numbers differ from the results file: run python scripts/readme_numbers.py"
    )


def test_the_table_names_its_run_and_reads_the_reported_ratios(tool):
    result = json.loads(tool.DEFAULT_RESULTS.read_text(encoding="utf-8"))
    text = tool.block(tool.DEFAULT_RESULTS)
    assert result["git_commit"][:10] in text and result["machine"]["cpu"] in text
    assert result["date_utc"][:10] in text
    assert result["config"]["split"] == "evaluation" and "evaluation split" in text
    suite_text = text.split("Many requests at once", 1)[0]
    rows = [line.split(" | ") for line in suite_text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert {row[0].strip("| ") for row in rows} == set(result["config"]["categories"])
    for row in rows:
        cat = row[0].strip("| ")
        engine = "ortspec-auto" if row[1] == "auto, greedy" else "ortspec-auto-sampled"
        key = "spec_vs_ortspec_greedy_e2e" if engine == "ortspec-auto" else "sampled_spec_vs_sampled_plain_e2e"
        assert row[3] == f"{result['summary']['ratios'][key][engine][cat]['median']:.2f}x"
        summary = result["summary"]["table"][cat][engine]
        assert row[-1].strip(" |") == f"{summary['identical']}/{summary['compared']}"


def test_the_batched_table_reads_the_slots_results(tool):
    slots = json.loads(tool.DEFAULT_SLOTS.read_text(encoding="utf-8"))
    text = tool.block(tool.DEFAULT_RESULTS, tool.DEFAULT_SLOTS).split("Many requests at once", 1)[1]
    assert slots["split"] == "evaluation" and slots["commit"] in text and slots["date_utc"][:10] in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    for row in slots["summary"]:
        cells = rows[row["column"]]
        assert cells[1] == f"{row['median']:.1f}" and cells[2] == f"{row['min']:.1f}–{row['max']:.1f}"
        assert cells[3].strip(" |") == f"{row['vs_best_genai']:.2f}x"


def test_the_tool_rewrites_the_block_and_checks_it(tool, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{tool.BEGIN}\nstale\n{tool.END}\n\nafter\n", encoding="utf-8")
    assert tool.main(["--readme", str(readme), "--check"]) == 1
    assert tool.main([str(tool.DEFAULT_RESULTS), "--readme", str(readme)]) == 0
    assert tool.main(["--readme", str(readme), "--check"]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# x\n\n") and text.endswith(f"{tool.END}\n\nafter\n") and "stale" not in text
