"""The package's layout (docs/architecture.md): imports point down, rooms stay small, moved import
paths keep working for one release.

Read from the source (every `import`, lazy ones inside functions included), not from a running
process, so a layering break fails here whichever code path would have taken it.
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"

# Rooms from the bottom up. A module may import its own room, rooms of its own level and rooms below.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"config", "distributed", "quiet", "plugins", "_moved", "__init__"}),
    ("math, models and data", {"algorithms", "vocab_parallel", "models", "data"}),
    ("rollout side", {"rollout", "weights", "rewards"}),
    ("the batch", {"batch"}),
    ("learner", {"learner"}),
    ("run lifecycle", {"run"}),
    ("trainer", {"trainer"}),
    ("tools and CLI", {"tools", "cli"}),
]
LEVEL = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}
MAX_MODULE_LINES, MAX_CLASS_LINES = 800, 450


def _is_shim(tree: ast.AST) -> bool:
    """A moved path's two-line module (megatron_rl/_moved.py), which imports its new place."""
    return any(isinstance(n, ast.ImportFrom) and n.module == "megatron_rl._moved" for n in ast.walk(tree))


def _modules(shims: bool = False):
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        tree = ast.parse(path.read_text(), filename=str(path))
        if shims or not _is_shim(tree):
            yield rel, tree


def _room(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imported_rooms(rel: Path, tree: ast.AST):
    """(room, line) of every megatron_rl module this one imports."""
    package = ["megatron_rl", *rel.parts[:-1]]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            parts = t.split(".")
            if parts[0] == "megatron_rl" and len(parts) > 1:
                yield parts[1], node.lineno


def test_every_room_has_a_level():
    rooms = {_room(rel) for rel, _ in _modules()}
    assert rooms <= set(LEVEL), f"rooms without a level in LAYERS: {sorted(rooms - set(LEVEL))}"


def test_imports_point_down():
    """No module imports a room above its own (the shims of moved paths, which import their new
    place, aside)."""
    up = []
    for rel, tree in _modules():
        src = _room(rel)
        for dst, line in _imported_rooms(rel, tree):
            if dst not in LEVEL:
                up.append(f"megatron_rl/{rel}:{line} imports megatron_rl.{dst}, a moved path (megatron_rl/_moved.py)")
            elif LEVEL[dst] > LEVEL[src]:
                up.append(f"megatron_rl/{rel}:{line} ({LAYERS[LEVEL[src]][0]}) imports {dst} "
                          f"({LAYERS[LEVEL[dst]][0]})")
    assert not up, "imports that climb to a higher room:\n" + "\n".join(up)


def test_nothing_below_the_trainer_imports_it():
    below = [f"megatron_rl/{rel}:{line}" for rel, tree in _modules() if LEVEL[_room(rel)] < LEVEL["trainer"]
             for dst, line in _imported_rooms(rel, tree) if dst == "trainer"]
    assert not below, below


def test_modules_and_classes_stay_small():
    big = []
    for rel, tree in _modules(shims=True):
        lines = (PACKAGE / rel).read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"megatron_rl/{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"megatron_rl/{rel}: class {node.name} {node.end_lineno - node.lineno + 1} lines "
                           f"(at most {MAX_CLASS_LINES})")
    assert not big, "\n".join(big)


def test_layers_check_finds_an_upward_import():
    """The check itself: a learner module importing the trainer is found (lazy import included)."""
    tree = ast.parse("def f():\n    from megatron_rl.trainer.loop import Trainer\n    from ..run import metrics\n")
    found = list(_imported_rooms(Path("learner/x.py"), tree))
    assert found == [("trainer", 2), ("run", 3)]


@pytest.mark.parametrize("old", sorted(importlib.import_module("megatron_rl._moved").MOVED))
def test_moved_import_paths_still_work(old):
    """Each old path is the new module itself (private names and monkeypatches included) and says
    where it went, once, as a DeprecationWarning."""
    from megatron_rl._moved import MOVED

    new = importlib.import_module(MOVED[old])
    saved = sys.modules.pop(old, None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is new
        said = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(said) == 1 and MOVED[old] in str(said[0].message), [str(w.message) for w in caught]
    finally:
        if saved is not None:
            sys.modules[old] = saved


def test_the_project_uses_the_new_paths():
    """The package, tests and benchmarks import the moved modules from their new places (the old
    paths are for users' code only)."""
    from megatron_rl._moved import MOVED

    root = PACKAGE.parent
    old = []
    for folder in ("megatron_rl", "tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name == "test_architecture.py" or path.read_text().startswith('"""Moved to'):
                continue  # this test, and the shims of the old paths
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([node.module] + [f"{node.module}.{a.name}" for a in node.names]
                         if isinstance(node, ast.ImportFrom) and node.module and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                hit = [n for n in names if n in MOVED]
                if hit:
                    old.append(f"{path.relative_to(root)}:{node.lineno} imports {hit[0]} (now {MOVED[hit[0]]})")
    assert not old, "\n".join(old)
