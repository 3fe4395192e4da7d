"""The rooms of ``adapters/`` stand in layers (docs/architecture.md): a room imports only from the rooms below it,
and the pure core imports nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each room and the rooms it may import from (itself included).
LAYERS = {
    "hosts": {"hosts"},
    "engine": {"engine", "hosts"},
    "ray_support": {"ray_support", "engine", "hosts"},
    "tools": {"tools", "engine", "hosts"},
    "serve": {"serve", "engine", "hosts", "ray_support", "tools"},
    "batch": {"batch", "engine", "hosts", "ray_support", "tools"},
    "cli": {"cli", "serve", "batch", "tools", "engine", "hosts", "ray_support"},
}


def _room(path: Path) -> str:
    part = path.relative_to(ROOT / "adapters").parts[0]
    return part.removesuffix(".py")


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_every_room_imports_only_from_the_rooms_below_it() -> None:
    wrong = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        if path.parent == ROOT / "adapters" and path.name == "__init__.py":
            continue
        room = _room(path)
        assert room in LAYERS, f"{path}: a room the layers do not name"
        for module in _imported_modules(path):
            if module.startswith("ortspec.adapters."):
                other = module.split(".")[2]
                if other not in LAYERS[room]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_nothing_but_itself_and_its_libraries() -> None:
    wrong = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for module in _imported_modules(path):
            if module.startswith("ortspec") and not module.startswith("ortspec.core"):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)
