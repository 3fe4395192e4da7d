"""What every peer runner shares (``bench.peers`` lists the peers and builds them): the result of one generation
(``PeerRun``) and of one static batch (``BatchRun``), the runners' base class (``PeerRunner``), and the folder helpers
that mirror a model folder with edited copies of some files, never touching the original."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.driver import decode_rate


@dataclass
class PeerRun:
    """Result of one generation by a peer engine."""

    token_ids: list[int]
    text: str
    ttft_s: float
    total_s: float
    decode_tok_s: float | None
    new_tokens: int
    finish_reason: str = ""
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "token_ids": list(self.token_ids),
            "text": self.text,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "decode_tok_s": self.decode_tok_s,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "extra": dict(self.extra),
        }


@dataclass
class BatchRun:
    """One static batch of a peer: every row's new token ids (``rows[i]`` for prompt ``i``), the wall seconds from
    the padded prompts in hand to the last token, and the peer's generation steps."""

    rows: list[list[int]]
    seconds: float
    steps: int


class PeerRunner:
    """Common interface. Subclasses implement :meth:`run`."""

    name: str = "peer"
    version: str = ""
    tokenizer: Tokenizer  # the folder's tokenizer, set by each subclass

    def run(self, prompt: str | Sequence[int], max_new_tokens: int, seed: int | None = None) -> PeerRun:
        raise NotImplementedError  # pragma: no cover

    def warmup(self, prompt: str | Sequence[int] = "Hello", max_new_tokens: int = 8) -> None:
        """One short generation so that first-call costs are not measured."""
        self.run(prompt, max_new_tokens)

    def describe(self) -> dict:
        return {"name": self.name, "version": self.version}

    def close(self) -> None:
        pass

    def _result(self, new: list[int], ttft: float, total: float, finish: str, prompt_tokens: int,
                extra: dict) -> PeerRun:  # fmt: skip
        """A ``PeerRun`` for ``new`` tokens (text through the folder's Tokenizer, decode rate after the first)."""
        return PeerRun(
            token_ids=new,
            text=self.tokenizer.decode(new),
            ttft_s=ttft,
            total_s=total,
            decode_tok_s=decode_rate(len(new), ttft, total),
            new_tokens=len(new),
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            extra=extra,
        )


# --------------------------------------------------------------------------
# Folder helpers (never touch the original folder)
# --------------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> str:
    """Hard link ``src`` at ``dst`` (copy across file systems); returns the mode.

    Weights and graphs cannot be symlinked: ONNX Runtime resolves the links of
    external data files and rejects data that lies outside the model's folder.
    """
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:
        shutil.copy2(src, dst)
        return "copy"


def _overlay_folder(src: Path, dst: Path, edits: dict[str, Callable[[bytes], bytes]]) -> Path:
    """Mirror ``src`` into ``dst``: files in ``edits`` (file name -> function of
    the original bytes) are written as edited copies, every other file is hard
    linked (copied when hard links are impossible)."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        if not entry.is_file():
            continue
        target = dst / entry.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if entry.name in edits:
            target.write_bytes(edits[entry.name](entry.read_bytes()))
        else:
            _link_or_copy(entry.resolve(), target)
    return dst
