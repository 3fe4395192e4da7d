"""Deterministic benchmark prompts built from text present on every machine.

The source text is the Python standard library itself (``.py`` files and their
docstrings, located through ``sysconfig.get_paths()["stdlib"]``). Files are
visited in sorted order and every choice is a fixed arithmetic rule, so the same
Python version (same stdlib) always yields the same prompts; the version is
recorded in every workload's ``meta`` and in :func:`describe_workloads`.

Four categories:

``code_edit``
    A 40-120 line function or class from a stdlib file, to be reproduced with a
    small change; the answer mostly copies the prompt.
``summarize``
    Extractive work on a long module docstring: quote sentences, repeat the first
    paragraph, then summarize.
``qa_context``
    Retrieval QA over several docstrings given as numbered documents, single- or
    multi-turn, asking for the relevant document to be quoted.
``open_ended``
    Short creative / explanatory prompts where nothing can be copied.

When a tokenizer (``ortspec.adapters.engine.tokenizer.Tokenizer``, the product's) is
given, each prompt, rendered with its chat template, is kept within
``max_prompt_tokens`` by choosing sources that fit or by cutting source text at
line / sentence boundaries; without one a characters/4 estimate is used.

``python -m bench.workloads [--model-dir DIR] [--n 8]`` prints a JSON summary.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench.repetitive import repetitive_prompt
from ortspec.adapters.engine.tokenizer import Tokenizer

# The categories of independent prompts (each prompt measured on its own; ``bench.throughput``'s dataset).
CATEGORIES = ("code_edit", "summarize", "qa_context", "open_ended")
# The repetitive stream (``bench.repetitive``): its prompts are measured in order on one Engine, each drafting from
# the outputs of the ones before it (``bench.engines.OrtspecEngine`` keeps a suffix cache per setting).
STREAM_CATEGORIES = ("repetitive",)
SUITE_CATEGORIES = (*CATEGORIES, *STREAM_CATEGORIES)

DEFAULT_MAX_TOKENS = 256

# Every workload's two disjoint halves: constants chosen by measurement are chosen on ``tuning`` and reported on
# ``evaluation`` (``half``).
SPLITS = ("tuning", "evaluation")
T = TypeVar("T")

# --------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------


@dataclass
class Workload:
    """One benchmark prompt.

    ``messages`` is a chat (list of ``{"role": ..., "content": ...}``); its
    token ids are :func:`encode_chat`'s. ``meta`` records where the text came from and the
    Python version whose stdlib supplied it.
    """

    category: str
    name: str
    messages: list[dict]
    max_new_tokens: int
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "category": self.category,
            "name": self.name,
            "messages": [dict(m) for m in self.messages],
            "max_new_tokens": self.max_new_tokens,
            "meta": dict(self.meta),
        }


def python_version_tag() -> str:
    """E.g. ``'CPython 3.11.7'`` — the stdlib that supplied the prompt text."""
    return f"{platform.python_implementation()} {platform.python_version()}"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# --------------------------------------------------------------------------
# Prompt token ids
# --------------------------------------------------------------------------


def encode_chat(messages: Sequence[dict], tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat rendered with the model folder's chat template (special tokens are spelled in the
    text), as every engine in the suite receives it."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


# --------------------------------------------------------------------------
# Stdlib scanning (cached, sorted, deterministic)
# --------------------------------------------------------------------------


@dataclass
class _CodeUnit:
    file: str
    name: str
    kind: str  # "function" | "class"
    source: str
    n_lines: int
    rename_from: str | None


@dataclass
class _Doc:
    file: str
    name: str  # module name or module.qualname
    text: str


_SCAN_CACHE: dict[str, tuple[list[_CodeUnit], list[_Doc], list[_Doc]]] = {}


def _stdlib_files() -> list[Path]:
    root = stdlib_dir()
    names = sorted(
        f
        for f in os.listdir(root)
        if f.endswith(".py") and not f.startswith("_") and f != "this.py" and f != "antigravity.py"
    )
    return [root / f for f in names]


def _rename_candidate(node: ast.AST) -> str | None:
    """A name the edit can rename: first real parameter, else first local assigned."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if a.arg not in ("self", "cls") and len(a.arg) >= 3:
                return a.arg
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and len(sub.id) >= 3:
                return sub.id
        return None
    # class: first method's first real parameter
    for item in getattr(node, "body", []):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = _rename_candidate(item)
            if name:
                return name
    return None


def _scan_stdlib() -> tuple[list[_CodeUnit], list[_Doc], list[_Doc]]:
    key = str(stdlib_dir())
    if key in _SCAN_CACHE:
        return _SCAN_CACHE[key]
    code_units: list[_CodeUnit] = []
    module_docs: list[_Doc] = []
    object_docs: list[_Doc] = []
    for path in _stdlib_files():
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        mod = path.stem
        mdoc = ast.get_docstring(tree)
        if mdoc and len(mdoc) >= 900 and mdoc.count("\n\n") >= 1:
            module_docs.append(_Doc(path.name, mod, mdoc.strip()))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n_lines = node.end_lineno - start + 1
            if 40 <= n_lines <= 120 and not node.name.startswith("_"):
                text = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
                if len(text) <= 5200 and "\t" not in text:
                    code_units.append(
                        _CodeUnit(
                            path.name,
                            node.name,
                            "class" if isinstance(node, ast.ClassDef) else "function",
                            text,
                            n_lines,
                            _rename_candidate(node),
                        )
                    )
            doc = ast.get_docstring(node)
            if doc and 300 <= len(doc) <= 1600 and not node.name.startswith("_"):
                object_docs.append(_Doc(path.name, f"{mod}.{node.name}", doc.strip()))
    _SCAN_CACHE[key] = (code_units, module_docs, object_docs)
    return _SCAN_CACHE[key]


def _spread(count: int, n: int, offset: int = 0) -> list[int]:
    """``n`` evenly spread indices into ``range(count)`` (distinct when count >= n)."""
    if count <= 0:
        return []
    return [((i * count) // n + offset) % count for i in range(n)]


# --------------------------------------------------------------------------
# Token budget helpers
# --------------------------------------------------------------------------


class _Budget:
    """Counts prompt tokens: exact with a tokenizer (the chat rendered with its template), estimated without."""

    def __init__(self, tokenizer: Tokenizer | None, max_prompt_tokens: int):
        self.tokenizer = tokenizer
        self.limit = max_prompt_tokens

    def count(self, messages: Sequence[dict]) -> int:
        if self.tokenizer is None:
            # ~4 characters per token is a fair guess for English/code.
            return sum(len(m["content"]) for m in messages) // 4 + 8 * len(messages) + 40
        return len(encode_chat(messages, self.tokenizer))

    def fits(self, messages: Sequence[dict]) -> bool:
        return self.count(messages) <= self.limit


def _shrink(units: list[str], build: Callable[[list[str]], list[dict]], budget: _Budget) -> tuple[list[dict], int]:
    """Largest prefix of ``units`` whose ``build`` fits; returns (messages, kept)."""
    full = build(units)
    if budget.fits(full):
        return full, len(units)
    lo, hi = 1, len(units) - 1
    best = 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if budget.fits(build(units[:mid])):
            best = mid
            lo = mid + 1
        else:
            hi = mid - 1
    return build(units[:best]), best


_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_RE.split(text) if s.strip()]


def _cut_prose(text: str, keep_sentences: int) -> str:
    """First ``keep_sentences`` sentences, keeping paragraph breaks."""
    out, kept = [], 0
    for para in text.split("\n\n"):
        sents = _sentences(para)
        if kept + len(sents) <= keep_sentences:
            out.append(para)
            kept += len(sents)
        else:
            rest = keep_sentences - kept
            if rest > 0:
                # Rejoin the kept sentences of this paragraph from its own text.
                piece = para
                cut = sents[rest - 1]
                pos = para.find(cut)
                if pos >= 0:
                    piece = para[: pos + len(cut)]
                out.append(piece)
            break
    return "\n\n".join(out)


# --------------------------------------------------------------------------
# Category builders
# --------------------------------------------------------------------------

_STOP = set(
    """
about above after again against all also and any are because been before being
below between both but can could did does doing down during each few for from
further had has have having here how into its itself just more most must not now
off once only other our out over own same should some such than that the their
them then there these they this those through too under until very was were what
when where which while who whom why will with would you your used uses using use
returns return value values given object objects none true false default
following first second called call calls instead otherwise either whether
""".split()
)


def _key_word(text: str) -> str:
    """Most frequent content word (>= 5 letters, not a stop word); ties -> alphabetical."""
    words = re.findall(r"[A-Za-z][a-z]{4,}", text)
    counts = collections.Counter(w.lower() for w in words if w.lower() not in _STOP)
    if not counts:
        return "the"
    best = max(counts.values())
    return sorted(w for w, c in counts.items() if c == best)[0]


_EDIT_KINDS = ("rename", "docstring", "comment_returns", "rename_def")


def _edit_kind(kind: str, unit: _CodeUnit) -> str:
    return "docstring" if kind == "rename" and not unit.rename_from else kind


def _code_edit_instruction(kind: str, unit: _CodeUnit) -> str:
    what = "function" if unit.kind == "function" else "class"
    if kind == "rename" and unit.rename_from:
        old = unit.rename_from
        return (
            f"Reproduce the {what} `{unit.name}` above exactly, with one change: rename "
            f"the variable `{old}` to `{old}_new` everywhere it appears. Keep every other "
            f"line, comment and blank line identical. Output only the code in a Python code block."
        )
    if kind == "comment_returns":
        return (
            f"Reproduce the {what} `{unit.name}` above exactly, but add the comment "
            f"`# checked` on its own line immediately before every `return` statement. "
            f"Keep everything else identical. Output only the code in a Python code block."
        )
    if kind == "rename_def":
        return (
            f"Copy the {what} `{unit.name}` above line for line, changing only its name "
            f"to `{unit.name}_v2`. Do not change anything else. Output only the code "
            f"in a Python code block."
        )
    # docstring (also the fallback when nothing can be renamed)
    return (
        f"Reproduce the {what} `{unit.name}` above exactly, adding the line "
        f"`Reviewed for the benchmark.` as the last line of its docstring (add a "
        f"docstring if it has none). Keep everything else identical. Output only the "
        f"code in a Python code block."
    )


def _code_edit_messages(kind0: str, unit: _CodeUnit, code_lines: list[str], truncated: bool = False) -> list[dict]:
    code = "\n".join(code_lines)
    head = (
        f"Here is the {unit.kind} `{unit.name}` from Python's standard library file "
        f"`{unit.file}`" + (" (its beginning only)" if truncated else "") + ":"
    )
    instruction = _code_edit_instruction(_edit_kind(kind0, unit), unit)
    return [{"role": "user", "content": f"{head}\n\n```python\n{code}\n```\n\n{instruction}"}]


def _build_code_edit(n: int, budget: _Budget, max_new_tokens: int, pyver: str) -> list[Workload]:
    units, _, _ = _scan_stdlib()
    out: list[Workload] = []
    used: set[int] = set()
    for i, start in enumerate(_spread(len(units), n)):
        kind0 = _EDIT_KINDS[i % len(_EDIT_KINDS)]
        chosen = None
        # Walk forward from the spread position to the first unused unit that fits.
        for step in range(len(units)):
            j = (start + step) % len(units)
            if j in used:
                continue
            msgs = _code_edit_messages(kind0, units[j], units[j].source.splitlines())
            if budget.fits(msgs):
                chosen = (j, units[j], msgs, False)
                break
        if chosen is None:  # nothing fits the budget: cut the spread one at line boundaries
            unit = units[start]
            cut = functools.partial(_code_edit_messages, kind0, unit, truncated=True)
            msgs, _ = _shrink(unit.source.splitlines(), cut, budget)
            chosen = (start, unit, msgs, True)
        j, unit, msgs, truncated = chosen
        used.add(j)
        kind = _edit_kind(kind0, unit)
        out.append(
            Workload(
                "code_edit",
                f"code_edit/{i:02d}-{Path(unit.file).stem}.{unit.name}-{kind}",
                msgs,
                max_new_tokens,
                {
                    "source": f"{unit.file}:{unit.name}",
                    "edit": kind,
                    "source_lines": unit.n_lines,
                    "truncated": truncated,
                    "python": pyver,
                },
            )
        )
    return out


_SUMMARIZE_TASKS = (
    "quote_keyword",
    "first_paragraph",
    "key_sentences",
    "bullets_verbatim",
)


def _summarize_instruction(kind: str, passage: str) -> str:
    if kind == "quote_keyword":
        word = _key_word(passage)
        return (
            f"Quote, word for word, every sentence of the passage that mentions "
            f'"{word}". Put each quoted sentence on its own line in double quotes. '
            f"Then explain in two sentences what these quotes say about {word}."
        )
    if kind == "first_paragraph":
        return (
            "Repeat the passage's first paragraph exactly as written, then summarize "
            "the rest of the passage in three to five sentences."
        )
    if kind == "key_sentences":
        return (
            "Copy the four most important sentences of the passage verbatim as a "
            "bulleted list, then write a one-paragraph summary of the whole passage."
        )
    return (
        "Rewrite the passage as a bulleted list with one bullet per sentence, keeping "
        "the original wording of each sentence. Then add a one-sentence summary."
    )


def _summarize_messages(doc: _Doc, kind: str, total_sentences: int, sents: list[str]) -> list[dict]:
    passage = doc.text if len(sents) >= total_sentences else _cut_prose(doc.text, len(sents))
    return [
        {
            "role": "user",
            "content": f"The following passage is the documentation of Python's `{doc.name}` module.\n\n"
            f'"""\n{passage}\n"""\n\n{_summarize_instruction(kind, passage)}',
        }
    ]


def _build_summarize(n: int, budget: _Budget, max_new_tokens: int, pyver: str) -> list[Workload]:
    _, docs, _ = _scan_stdlib()
    out: list[Workload] = []
    for i, j in enumerate(_spread(len(docs), n)):
        doc = docs[j]
        kind = _SUMMARIZE_TASKS[i % len(_SUMMARIZE_TASKS)]
        all_sents = [s for para in doc.text.split("\n\n") for s in _sentences(para)]
        make = functools.partial(_summarize_messages, doc, kind, len(all_sents))
        msgs, kept = _shrink(all_sents, make, budget)
        out.append(
            Workload(
                "summarize",
                f"summarize/{i:02d}-{doc.name}-{kind}",
                msgs,
                max_new_tokens,
                {"source": doc.file, "task": kind, "truncated": kept < len(all_sents), "python": pyver},
            )
        )
    return out


def _qa_messages(target: _Doc, multi_turn: bool, selection: list[_Doc], target_text: str | None = None) -> list[dict]:
    blocks = []
    for idx, d in enumerate(selection, start=1):
        text = target_text if (d is target and target_text is not None) else d.text
        blocks.append(f"Document {idx} — `{d.name}`:\n{text}")
    context = "\n\n".join(blocks)
    num = selection.index(target) + 1
    short = target.name.split(".")[-1]
    if not multi_turn:
        return [
            {
                "role": "user",
                "content": f"Answer using only the documents below.\n\n{context}\n\n"
                f"Question: what does `{short}` do? Start by quoting the relevant "
                f"document word for word, then answer in your own words.",
            }
        ]
    return [
        {
            "role": "user",
            "content": f"Here are some documents.\n\n{context}\n\nWhich document describes `{short}`? "
            f"Answer with its number.",
        },
        {"role": "assistant", "content": f"Document {num} describes `{target.name}`."},
        {
            "role": "user",
            "content": f"Quote document {num} exactly, then list its main points and say when one would use `{short}`.",
        },
    ]


def _qa_messages_cut(target: _Doc, multi_turn: bool, selection: list[_Doc], target_sents: list[str]) -> list[dict]:
    """:func:`_qa_messages` with the target document cut to ``target_sents``."""
    return _qa_messages(target, multi_turn, selection, " ".join(target_sents))


def _build_qa_context(
    n: int, budget: _Budget, max_new_tokens: int, pyver: str, docs_per_prompt: int = 5
) -> list[Workload]:
    _, _, docs = _scan_stdlib()
    out: list[Workload] = []
    count = len(docs)
    for i, start in enumerate(_spread(count, n)):
        # docs_per_prompt documents spread over the whole sorted list from this start.
        stride = count // docs_per_prompt + 1
        picked = []
        for k in range(docs_per_prompt):
            d = docs[(start + k * stride) % count]
            if d not in picked:
                picked.append(d)
        target_pos = i % len(picked)
        target = picked[target_pos]
        multi_turn = i % 2 == 1
        make = functools.partial(_qa_messages, target, multi_turn)
        selection = list(picked)
        msgs = make(selection)
        while not budget.fits(msgs) and len(selection) > 1:
            # Drop the non-target document furthest from the target first.
            others = [d for d in selection if d is not target]
            selection.remove(others[-1] if selection.index(target) < len(selection) - 1 else others[0])
            msgs = make(selection)
        truncated = False
        if not budget.fits(msgs):
            sents = _sentences(target.text)
            msgs, _ = _shrink(sents, functools.partial(_qa_messages_cut, target, multi_turn, selection), budget)
            truncated = True
        out.append(
            Workload(
                "qa_context",
                f"qa_context/{i:02d}-{target.name}-{'multi' if multi_turn else 'single'}",
                msgs,
                max_new_tokens,
                {
                    "documents": [d.name for d in selection],
                    "target": target.name,
                    "multi_turn": multi_turn,
                    "truncated": truncated,
                    "python": pyver,
                },
            )
        )
    return out


_OPEN_FORMS = (
    "Write a short story about {}.",
    "Write a poem of at least four stanzas about {}.",
    "Write a diary entry from the point of view of {}.",
    "Write the opening scene of a play about {}.",
)
_OPEN_SUBJECTS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a robot learning to bake bread",
    "two rival gardeners in a small village",
    "a cat that can read minds",
    "the last day of summer at a seaside town",
    "an astronaut who misses the sound of rain",
    "a librarian who discovers a book with no ending",
    "a city where it never stops snowing",
    "a clockmaker whose clocks run backwards",
)
_OPEN_QUESTIONS = (
    "Explain why the sky is blue.",
    "Explain how a refrigerator keeps food cold.",
    "Explain why the seasons change during the year.",
    "Give practical advice to someone who is learning to cook for the first time.",
    "Describe how bees make honey, step by step.",
    "Explain the difference between weather and climate.",
    "What are the benefits of learning a second language? Give several reasons.",
    "Explain how a bicycle stays upright while moving.",
    "Describe a good morning routine and why each part helps.",
    "Explain how rainbows form.",
    "Why do leaves change color in autumn? Explain in detail.",
)


def _build_open_ended(n: int, budget: _Budget, max_new_tokens: int, pyver: str) -> list[Workload]:
    out: list[Workload] = []
    n_creative = n_question = 0
    for i in range(n):
        if i % 2 == 0:
            k = n_creative
            n_creative += 1
            # len(forms)=4 and len(subjects)=9 are coprime: 36 distinct pairs.
            text = _OPEN_FORMS[k % len(_OPEN_FORMS)].format(_OPEN_SUBJECTS[k % len(_OPEN_SUBJECTS)])
            tag = f"creative{k:02d}"
        else:
            k = n_question
            n_question += 1
            text = _OPEN_QUESTIONS[k % len(_OPEN_QUESTIONS)]
            rounds = k // len(_OPEN_QUESTIONS)
            if rounds:
                text += f" Write it for an audience of {('children', 'students', 'experts')[rounds % 3]}."
            tag = f"explain{k:02d}"
        out.append(
            Workload(
                "open_ended",
                f"open_ended/{i:02d}-{tag}",
                [{"role": "user", "content": text}],
                max_new_tokens,
                {"python": pyver},
            )
        )
    return out


def _build_repetitive(n: int, budget: _Budget, max_new_tokens: int, pyver: str) -> list[Workload]:
    del budget, pyver  # short prompts of their own words
    out = []
    for i in range(n):
        shape, text = repetitive_prompt(i)
        messages = [{"role": "user", "content": text}]
        out.append(Workload("repetitive", f"repetitive/{i:02d}-{shape}", messages, max_new_tokens, {"order": i}))
    return out


_BUILDERS = {
    "code_edit": _build_code_edit,
    "summarize": _build_summarize,
    "qa_context": _build_qa_context,
    "open_ended": _build_open_ended,
    "repetitive": _build_repetitive,
}


def build_workloads(
    n_per_category: int = 8,
    max_prompt_tokens: int = 1500,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    *,
    max_new_tokens: int | dict[str, int] = DEFAULT_MAX_TOKENS,
    categories: Iterable[str] = CATEGORIES,
    split: str | None = None,
) -> list[Workload]:
    """Build ``n_per_category`` prompts for each category, in category order: with ``split`` (one of ``SPLITS``),
    that half of ``2 * n_per_category`` prompts per category (``half``), so the tuning and evaluation prompts of a
    category share no source text.

    ``tokenizer`` is an ortspec ``Tokenizer`` (or a model folder, read with
    ``Tokenizer.from_folder``): every prompt, rendered with its chat template, is
    kept within ``max_prompt_tokens``. Without a tokenizer a characters/4 estimate
    is used. ``max_new_tokens`` may be an int or a per-category dict.
    """
    if n_per_category < 1:
        raise ValueError("n_per_category must be >= 1")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = Tokenizer.from_folder(tokenizer)
    budget = _Budget(tokenizer, max_prompt_tokens)
    pyver = python_version_tag()
    result: list[Workload] = []
    for cat in categories:
        if cat not in _BUILDERS:
            raise ValueError(f"unknown category {cat!r}; expected one of {SUITE_CATEGORIES}")
        mnt = max_new_tokens.get(cat, DEFAULT_MAX_TOKENS) if isinstance(max_new_tokens, dict) else max_new_tokens
        built = _BUILDERS[cat](n_per_category * (2 if split else 1), budget, int(mnt), pyver)
        result.extend(half(built, split, lambda w: w.category) if split else built)
    return result


def half(items: Iterable[T], part: str, kind: Callable[[T], str]) -> list[T]:
    """``items``' half ``part`` (one of ``SPLITS``), in order: within each ``kind``, the items at even positions are
    the tuning half and those at odd positions the evaluation half. Raises ``ValueError`` for another ``part``."""
    if part not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {part!r}")
    position: dict[str, int] = {}
    chosen = []
    for item in items:
        at = position[kind(item)] = position.get(kind(item), -1) + 1
        if (at % 2 == 0) == (part == "tuning"):
            chosen.append(item)
    return chosen


def workloads_digest(workloads: Sequence[Workload]) -> str:
    """SHA-256 over the prompts: equal digests mean identical workloads."""
    h = hashlib.sha256()
    for w in workloads:
        h.update(
            json.dumps([w.category, w.name, w.messages, w.max_new_tokens], sort_keys=True, ensure_ascii=False).encode(
                "utf-8"
            )
        )
    return h.hexdigest()


def describe_workloads(workloads: Sequence[Workload], tokenizer: Tokenizer | None = None) -> dict:
    """Summary for a results file: Python version (source of the text), counts, digest, and with a tokenizer
    every prompt's token count."""
    info: dict[str, Any] = {
        "python": python_version_tag(),
        "python_full": sys.version,
        "stdlib": str(stdlib_dir()),
        "digest": workloads_digest(workloads),
        "count": len(workloads),
        "per_category": dict(collections.Counter(w.category for w in workloads)),
    }
    if tokenizer is not None:
        info["prompt_tokens"] = {w.name: len(encode_chat(w.messages, tokenizer)) for w in workloads}
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the benchmark workloads as JSON.")
    ap.add_argument("--model-dir", help="model folder (tokenizer.json + chat template)")
    ap.add_argument("--n", type=int, default=8, help="prompts per category")
    ap.add_argument("--max-prompt-tokens", type=int, default=1500)
    ap.add_argument("--full", action="store_true", help="include the prompt texts")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_folder(args.model_dir) if args.model_dir else None
    wls = build_workloads(args.n, args.max_prompt_tokens, tok)
    summary = describe_workloads(wls, tok)
    if args.full:
        summary["workloads"] = [w.to_dict() for w in wls]
    else:
        summary["names"] = [w.name for w in wls]
    json.dump(summary, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
