"""The GPU benchmark's report: the issue's targets (``TARGET_GREEDY``, ``TARGET_VERIFY8``, ``TARGET_SPEC``, judged
on the setting ``PRICED``) against what a run measured (``targets``), and the markdown of a run
(``render_markdown``)."""

from __future__ import annotations

import statistics
from typing import Any

# The targets on the H200 (greedy only for the Qwen2.5-0.5B-shaped int4 model on CUDA).
TARGET_GREEDY = ("qwen2.5-0.5b", "int4", "cuda", 762.0)
TARGET_VERIFY8 = 1.2  # verify(8)/decode at most
TARGET_SPEC = {"code_edit": 1.5, "open_ended": 0.97}  # priced speculative / our greedy, at least
PRICED = "lookup n3 w16 cost-aware"  # the setting the targets are judged on (the suite's headline setting)


# ----------------------------------------------------------------------------------------------------------------
# report


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def targets(report: dict) -> list[dict[str, Any]]:
    """The issue's targets, judged on what this run measured (a target whose model or mode did not run is
    "not measured")."""
    provider = report["machine"]["provider"]
    rows: list[dict[str, Any]] = []
    shape, precision, target_provider, goal = TARGET_GREEDY
    for name, model in report["models"].items():
        for mode, result in model.get("modes", {}).items():
            if "greedy" not in result:
                continue
            label = f"{name} {mode}"
            if (model["shape"], model["precision"], provider) == (shape, precision, target_provider):
                rate = result["greedy"]["decode_tok_s"]
                rows.append(
                    {"target": f"greedy >= {goal:g} tok/s", "where": label, "measured": rate, "met": rate >= goal}
                )
            ratio = result.get("verify8_over_decode")
            if ratio is not None:
                rows.append(
                    {
                        "target": f"verify(8)/decode <= {TARGET_VERIFY8}",
                        "where": label,
                        "measured": ratio,
                        "met": ratio <= TARGET_VERIFY8,
                    }
                )
            for category, goal_ratio in TARGET_SPEC.items():
                item = result.get("priced", {}).get(category, {}).get(PRICED)
                if item is not None:
                    value = item["speedup_with_host"]
                    rows.append(
                        {
                            "target": f"priced speculative / greedy on {category} >= {goal_ratio}",
                            "where": label,
                            "measured": value,
                            "met": value >= goal_ratio,
                        }
                    )
            ident = result.get("identity", {})
            if ident:
                same = bool(ident.get("oracle_drafts_identical")) and bool(ident.get("prompt_lookup_identical"))
                rows.append({"target": "speculative == greedy", "where": label, "measured": same, "met": same})
    return rows


def render_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# GPU benchmark: {m['device']} ({m['provider']}), {m['date_utc'][:10]}",
        "",
        f"`{report['command']}`",
        "",
        f"- machine: {m.get('gpu') or '-'}; CPU {m['cpu']}, {m['cores']}, {m['memory_gib']} GiB; {m['python']}; "
        f"{m['os']}",
        f"- onnxruntime {m['versions'].get('onnxruntime')} ({', '.join(m['onnxruntime_providers'])}); "
        f"CuPy {m['versions'].get('cupy')}; torch {m['versions'].get('torch')}; "
        f"onnxruntime-genai {m['versions'].get('onnxruntime_genai')}",
        f"- random-weight folders of the published shapes (built here, {report['config']['models_dir']}); prompt "
        f"{report['config']['prompt_tokens']} tokens, {report['config']['new_tokens']} new tokens, median of "
        f"{report['config']['repeats']} runs; KV capacity {report['config']['max_length']}",
        f"- speculation priced with the acceptance of `{report['config']['replay_inputs']}` "
        f"({report.get('replay_source', '-')}), setting `{PRICED}`",
        "",
        "Modes: `eager` = the default binding; `static` = static shapes (on CUDA also stream-ordered: no host sync "
        "but the read-back); `graphs` = static shapes + one CUDA graph per pass width.",
        "",
    ]
    for name, model in report["models"].items():
        lines += [f"## {name}", ""]
        if "error" in model:
            lines += [f"not measured: {model['error']}", ""]
            continue
        lines += [f"build: {_fmt(model.get('build_s'))} s (None: already built)", ""]
        lines += [
            "| mode | greedy decode tok/s | e2e tok/s | prefill ms | verify(8)/decode | greedy pass µs (host / run / "
            "sync / readback) | driver µs/step | spec == greedy | drift |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
        ]
        for mode, r in model["modes"].items():
            if "error" in r:
                lines.append(f"| {mode} | error: {r['error'][:200]} | | | | | | | |")
                continue
            g, s, ident = r["greedy"], r["step_us"], r["identity"]
            p = s["greedy_pass"]
            same = "yes" if ident["oracle_drafts_identical"] and ident["prompt_lookup_identical"] else "NO"
            lines.append(
                f"| {mode} | {_fmt(g['decode_tok_s'], 1)} | {_fmt(g['e2e_tok_s'], 1)} | {_fmt(g['prefill_ms'], 1)} | "
                f"{_fmt(r['verify8_over_decode'])} | {p['host']:.0f} / {p['run']:.0f} / {p['sync']:.0f} / "
                f"{p['readback']:.0f} | {_fmt(s['driver_per_step'], 0)} | {same} "
                f"({ident['oracle_drafts_acceptance']}) | {ident['verify_drift_logits']:.2g} |"
            )
        lines.append("")
        lines += ["verify(K)/decode, K = 0..16:", ""]
        for mode, r in model["modes"].items():
            if "costs" in r:
                curve = ", ".join(f"{c:.2f}" for c in r["costs"]["curve"])
                lines.append(f"- {mode} (decode step {r['costs']['decode_step_s'] * 1e6:.0f} µs): {curve}")
            if r.get("graphs"):
                gr = r["graphs"]
                lines.append(
                    f"  - CUDA graphs: {'on' if gr.get('enabled') else 'off'}"
                    f"{'' if gr.get('enabled') else ' (' + str(gr.get('disabled_reason'))[:300] + ')'}; "
                    f"captured widths {gr.get('captured_widths')}; capture {r.get('capture_s')} s"
                )
        lines.append("")
        priced_modes = [(mode, r) for mode, r in model["modes"].items() if r.get("priced")]
        if priced_modes:
            categories = list(priced_modes[0][1]["priced"])
            lines += [
                f"Speculation priced (`{PRICED}`): expected decode tok/s from this mode's pass times K = 0..16 and the "
                "host time per pass the replay measured here (driver, core, prompt lookup); in brackets ÷ greedy "
                "priced the same way. Last column: priced greedy ÷ measured greedy (how well the pricing "
                "reproduces the measured loop).",
                "",
                "| mode | " + " | ".join(categories) + " | priced greedy ÷ measured |",
                "| --- |" + " ---: |" * (len(categories) + 1),
            ]
            for mode, r in priced_modes:
                cells = []
                for entry in r["priced"].values():
                    item = entry[PRICED]
                    cells.append(f"{item['expected_tok_s']:.0f} ({item['speedup_with_host']:.2f}x)")
                checks = [entry["greedy"]["over_measured_greedy"] for entry in r["priced"].values()]
                lines.append(f"| {mode} | " + " | ".join(cells) + f" | {statistics.median(checks):.2f} |")
            lines.append("")
        genai = model.get("ortgenai", {})
        if genai:
            lines += ["ONNX Runtime GenAI greedy on the same folder:", ""]
            for key, r in genai.items():
                if "skipped" in r:
                    lines.append(f"- {key}: not run ({r['skipped'][:300]})")
                else:
                    lines.append(f"- {key}: {r['decode_tok_s']:.1f} decode tok/s, {r['e2e_tok_s']:.1f} e2e tok/s")
            lines.append("")
    rows = targets(report)
    if rows:
        lines += [
            "## Targets (as measured in this run)",
            "",
            "| target | where | measured | met |",
            "| --- | --- | ---: | --- |",
        ]
        for row in rows:
            value = row["measured"]
            shown = ("yes" if value else "no") if isinstance(value, bool) else _fmt(value)
            lines.append(f"| {row['target']} | {row['where']} | {shown} | {'met' if row['met'] else 'missed'} |")
        lines.append("")
    return "\n".join(lines)
