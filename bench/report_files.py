"""The suite's result files: the markdown (its sections in order, ``SECTIONS``, from ``bench.report_tables`` and
``bench.report_measurements``), the plot of tokens/s by engine and category, and ``write_results``, which writes
``results-<label>.json``, ``results-<label>.md`` and ``tokens_per_second-<label>.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.report_measurements import _drafter, _overhead, _physical
from bench.report_tables import _category_tables, _header, _identity, _ratio_tables, _sampled

SECTIONS = (_header, _category_tables, _ratio_tables, _sampled, _drafter, _physical, _overhead, _identity)


def markdown(result: dict[str, Any]) -> str:
    """The results file's markdown: header, per-category tables, ratios, the sampled column (when sampled
    engines ran), physical limits, driver overhead, prompt identity and identity failures."""
    return "\n".join([line for section in SECTIONS for line in section(result)] + [""])


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    path.write_text(markdown(result), encoding="utf-8")


def write_plot(path: Path, result: dict[str, Any]) -> str | None:
    """Bars of tokens/s (end to end, decode) by engine and category; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib unavailable: {exc}"
    cats = [*result["config"]["categories"], "all"]
    engines = result["engines_run"]
    table = result["summary"]["table"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    width = 0.8 / max(len(engines), 1)
    cmap = plt.get_cmap("tab10" if len(engines) <= 10 else "tab20")
    colors = 10 if len(engines) <= 10 else 20
    for ax, metric, title in (
        (axes[0], "e2e_tok_s", "tokens/s end to end (prefill included)"),
        (axes[1], "decode_tok_s", "decode tokens/s (after the first token)"),
    ):
        for i, e in enumerate(engines):
            vals = [(table.get(c, {}).get(e) or {}).get(metric) or 0.0 for c in cats]
            xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(cats))]
            ax.bar(xs, vals, width, label=e, color=cmap(i % colors))
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats)
        ax.set_ylabel("tokens/s (median over prompts)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    cfg = result["config"]
    fig.suptitle(
        f"{Path(cfg['model_dir']).name}, {cfg['threads']} threads, {cfg['max_new_tokens']} new tokens, "
        f"{cfg['n_per_category']} prompts/category"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_results(out_dir: Path, label: str, result: dict[str, Any]) -> list[Path]:
    """``results-<label>.json``, ``results-<label>.md`` and ``tokens_per_second-<label>.png`` in ``out_dir``
    (without the plot, and ``result["plot_error"]`` saying why, when it cannot be drawn); returns the paths
    written."""
    json_path = out_dir / f"results-{label}.json"
    md_path = out_dir / f"results-{label}.md"
    png_path = out_dir / f"tokens_per_second-{label}.png"
    plot_error = write_plot(png_path, result)
    if plot_error:
        result["plot_error"] = plot_error
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    write_markdown(md_path, result)
    return [json_path, md_path] + ([] if plot_error else [png_path])
