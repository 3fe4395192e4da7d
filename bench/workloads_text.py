"""The text the benchmark prompts are made of, and how they are kept within a token budget: the standard library
located (``stdlib_dir``) and scanned once per location, in sorted order, for functions and classes of 40-120 lines
and for long docstrings; evenly spread choices; the prompt-token budget (exact with a tokenizer, estimated without)
and the cuts at line and sentence boundaries that keep a prompt within it; a prompt's token ids as every engine gets
them (``encode_chat``)."""

from __future__ import annotations

import ast
import os
import platform
import re
import sysconfig
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ortspec.adapters.engine.tokenizer import Tokenizer


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
