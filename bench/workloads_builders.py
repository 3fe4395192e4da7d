"""The benchmark prompts, category by category (``Workload``, one prompt): code edits of a standard-library
function or class, extractive work on a module docstring, retrieval QA over several docstrings, open-ended prompts
with nothing to copy, and the repetitive stream (``bench.repetitive``). Each builder takes the prompt count, the
token budget, the new tokens and the Python version, and makes every choice by a fixed arithmetic rule; ``_BUILDERS``
maps each category to its builder."""

from __future__ import annotations

import collections
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from bench.repetitive import repetitive_prompt
from bench.workloads_text import _Budget, _CodeUnit, _cut_prose, _Doc, _scan_stdlib, _sentences, _shrink, _spread


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
