"""Does the shared-KV head draft better when its first step reads several target layers (EAGLE-3's fused
features) instead of the final hidden state alone? Two heads trained the same way on the same data, measured on the
same held-out sequences, acceptance per draft position.

    python scripts/fused_features.py [--model DIR] [--sequences 384] [--heldout 32] [--updates 480]
                                     [--layers 8 15 22] [--seed 0] [--threads 2]
                                     [--out docs/bench/fused-features.md]

* **Data**: ``ortspec train-drafter``'s own (``drafter_data.collect``: the target's greedy continuations of the
  recipe's prompts, ``--sequences`` of them, seed ``--seed``), its hidden rows carrying, after the final hidden
  state, the residual stream entering each of ``--layers`` (``BackendConfig.hidden_features``' rewrite).
* **Baseline**: the recipe's head (``train_drafter``: ridge-initialised ``fc``, the target's last layer copied,
  the draft vocabulary ranked on the training sequences), trained by ``drafter_training.train_head`` with
  ``TrainConfig`` at these counts.
* **Fused**: the same head, initialised the same, whose first step reads ``fuse(rms(h), rms(r_l) for l in layers)``
  (``drafter_head.fused_torch_head``: a trained ``[(1 + L) H, H]`` matrix and bias, initialised to pass ``rms(h)``
  through, so the two heads start identical) in place of the final hidden state ``h``; later steps read the head's
  own state, as before. ``ortspec train-drafter --feature-layers`` trains and exports the same head.
* Both train in parallel, one process and one torch thread each; the held-out acceptance (``evaluate``: drafts
  chained on the head's own picks, accepted up to the first pick that differs from the target's greedy token) is
  measured every ``eval_every`` updates.

Training (not the measurement) is the slow part: about 32 minutes for the defaults on 2 cores. The heads are not
exported (``ortspec train-drafter --feature-layers 8 15 22`` makes a drafter folder that the runtime reads).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import pickle
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ortspec.adapters.tools.drafter_data import collect  # noqa: E402
from ortspec.adapters.tools.drafter_recipe import TrainConfig  # noqa: E402
from ortspec.backends.onnx import ModelFolder  # noqa: E402

DEFAULT_MODEL = Path("~/.cache/ortspec/models/SmolLM2-135M-Instruct-fp32").expanduser()
ARMS = ("baseline", "fused")


def train_arm(arm: str, data_path: str, cfg: TrainConfig, model: str, layers: Sequence[int], queue) -> None:
    """Train one arm on the data pickled at ``data_path``; put ``(arm, TrainingRun, ridge fit, seconds)`` on
    ``queue``."""
    import attrs
    import torch

    from ortspec.adapters.tools.drafter_head import fused_torch_head, torch_head
    from ortspec.adapters.tools.drafter_training import TrainingSet, train_head
    from ortspec.adapters.tools.target_tables import TargetTables
    from ortspec.adapters.tools.train_drafter import initial_weights, rank_vocabulary, ridge_fc

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    with open(data_path, "rb") as f:
        train, hold = pickle.load(f)  # hidden rows: the final hidden state, then the feature layers' streams
    target = ModelFolder.load(model)
    tables = TargetTables(target)
    embedding = tables.embedding()
    hidden = embedding.shape[1]
    draft_ids = rank_vocabulary(train, target.vocab_size, cfg.draft_vocab)
    to_draft = np.full(target.vocab_size, -1, np.int64)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    fc, fc_bias, fit = ridge_fc(train, embedding, tables.eps, cfg.ridge)
    head = torch_head(initial_weights(tables, target.num_layers - 1, draft_ids, fc, fc_bias), target.num_kv_heads)
    if arm == "fused":
        head = fused_torch_head(head, tuple(layers), tables.eps)
    else:
        train, hold = ([attrs.evolve(s, hidden=s.hidden[:, :hidden]) for s in seqs] for seqs in (train, hold))
    data = TrainingSet(
        embedding=torch.from_numpy(np.ascontiguousarray(embedding)),
        to_draft=to_draft,
        to_target=torch.from_numpy(draft_ids),
        train=train,
        hold=hold,
    )
    t0 = time.perf_counter()
    run = train_head(head, data, cfg, None, lambda m: print(f"{arm}: {m}", flush=True) if "held out" in m else None)
    queue.put((arm, run, fit, time.perf_counter() - t0))


def run(args: argparse.Namespace) -> str:
    target = ModelFolder.load(args.model)
    cfg = TrainConfig(
        sequences=args.sequences, heldout=args.heldout, updates=args.updates, eval_every=args.eval_every,
        seed=args.seed, threads=1,
    )  # fmt: skip
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    sequences = collect(target, target.num_layers - 1, count=cfg.sequences, batch=cfg.batch, max_new=cfg.max_new,
                        seed=cfg.seed, threads=args.threads, progress=print, features=args.layers)  # fmt: skip
    data_seconds = time.perf_counter() - t0
    order = np.random.default_rng(cfg.seed).permutation(len(sequences))  # the split train_drafter makes
    hold_i, train_i = np.sort(order[: cfg.heldout]), np.sort(order[cfg.heldout :])
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        data_path = os.path.join(tmp, "data.pkl")
        with open(data_path, "wb") as f:
            pickle.dump(([sequences[i] for i in train_i], [sequences[i] for i in hold_i]), f)
        del sequences
        jobs = [(arm, data_path, cfg, args.model, args.layers, queue) for arm in ARMS]
        workers = [context.Process(target=train_arm, args=job) for job in jobs]
        for w in workers:
            w.start()
        results = dict((arm, (run_, fit, seconds)) for arm, run_, fit, seconds in (queue.get() for _ in ARMS))
        for w in workers:
            w.join()
    return report(args, cfg, results, data_seconds, load_start, os.getloadavg())


def report(args, cfg: TrainConfig, results, data_seconds: float, load_start, load_end) -> str:
    width = cfg.num_speculative_tokens
    loads = " ".join(f"{x:.2f}" for x in load_start), " ".join(f"{x:.2f}" for x in load_end)
    lines = [
        "# Fused features for the shared-KV head (scripts/fused_features.py)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load average at the start "
        f"{loads[0]}, at the end {loads[1]}",
        f"- command: `python scripts/fused_features.py --sequences {cfg.sequences} --heldout {cfg.heldout} --updates "
        f"{cfg.updates} --layers {' '.join(map(str, args.layers))} --seed {cfg.seed}`",
        f"- target: {Path(args.model).name}; data: {cfg.sequences} sequences ({cfg.heldout} held out), "
        f"{data_seconds:.0f} s; training: {cfg.updates} updates of {cfg.train_batch}, the recipe's other settings, "
        "one torch thread per arm, both arms at once",
        f"- fused: the head's first step reads the final hidden state and the residual stream entering layers "
        f"{', '.join(map(str, args.layers))}, through a trained fuse initialised to the final hidden state alone",
        "",
        "Held-out tokens accepted per draft, drafts of width 1 .. "
        f"{width} chained on the head's own picks (greedy), every {cfg.eval_every} updates:",
        "",
        "| updates | " + " | ".join(f"{arm}: width 1 .. {width}" for arm in ARMS) + " | fused ÷ baseline, width "
        f"{width} |",
        "| ---: | " + " | ".join("---" for _ in ARMS) + " | ---: |",
    ]
    curves = {arm: results[arm][0].heldout for arm in ARMS}
    for base, fused in zip(curves["baseline"], curves["fused"], strict=True):
        cells = [" / ".join(f"{a:.2f}" for a in point["accepted_by_width"]) for point in (base, fused)]
        ratio = fused["accepted_by_width"][-1] / max(base["accepted_by_width"][-1], 1e-9)
        lines.append(f"| {base['updates']} | {cells[0]} | {cells[1]} | {ratio:.3f} |")
    lines += ["", "Per draft position at the end (the chance that position k of a draft is accepted):", ""]
    lines += ["| arm | " + " | ".join(f"position {k + 1}" for k in range(width)) + " | top-1 | train seconds |"]
    lines += ["| --- | " + " | ".join("---:" for _ in range(width)) + " | ---: | ---: |"]
    for arm in ARMS:
        run_, _, seconds = results[arm]
        by_width = run_.heldout[-1]["accepted_by_width"]
        per_position = [by_width[0]] + [b - a for a, b in zip(by_width, by_width[1:], strict=False)]
        lines.append(
            f"| {arm} | " + " | ".join(f"{x:.3f}" for x in per_position)
            + f" | {run_.heldout[-1]['top1']:.3f} | {seconds:.0f} |"
        )  # fmt: skip
    lines += ["", f"Ridge initialisation (both arms): R^2 {results['baseline'][1]['r2']:.3f} over "
              f"{results['baseline'][1]['positions']:.0f} positions.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--sequences", type=int, default=384)
    parser.add_argument("--heldout", type=int, default=32)
    parser.add_argument("--updates", type=int, default=480)
    parser.add_argument("--eval-every", type=int, default=120)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 15, 22])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime's threads for the data")
    parser.add_argument("--out", default=None, help="write the report (markdown) here too")
    args = parser.parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
