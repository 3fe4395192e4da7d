"""Make the shipped form of a trained drafter folder (adapters/engine/shipped.py): every file but the target's
input-embedding table, which ``drafter.json`` then names by shape and hash, to be materialised from the model folder
on first use.

    python scripts/ship_drafter.py TRAINED_DIR [DEST]   # DEST: ortspec/drafters/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ortspec.adapters.engine.shipped import package_drafter

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", type=Path, help="a drafter folder written by ortspec train-drafter")
    parser.add_argument("dest", type=Path, nargs="?", default=ROOT / "ortspec" / "drafters" / "SmolLM2-135M-Instruct")
    args = parser.parse_args()
    out = package_drafter(args.trained, args.dest)
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size:>12,}  {path}")


if __name__ == "__main__":
    main()
