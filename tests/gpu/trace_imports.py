"""Run `python -m MODULE ARGS...` and record who imports what: `trace_imports.py OUT.json -m MODULE ARGS...`.

Every successful absolute import statement (and importlib.import_module call) adds an edge
(importing top-level package -> imported top-level package); OUT.json gets the edges and the
top-level packages in sys.modules when the process exits. prepare.py reads it to check that every
package the project's code path needs, directly or through a package that travels as a wheel,
resolves on the GPU machine (tests/gpu/wheels.txt + tests/gpu/image-packages.txt).
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import runpy
import sys

_edges: set[tuple[str, str]] = set()
_orig_import = builtins.__import__
_orig_import_module = importlib.import_module


def _top(name: str | None) -> str:
    return (name or "").partition(".")[0]


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _orig_import(name, globals, locals, fromlist, level)
    if level == 0 and globals:
        _edges.add((_top(globals.get("__name__")), _top(name)))
    return module


def _import_module(name, package=None):
    module = _orig_import_module(name, package)
    if not name.startswith("."):
        _edges.add((_top(sys._getframe(1).f_globals.get("__name__")), _top(name)))
    return module


def _dump(path: str) -> None:
    loaded = sorted({_top(m) for m in list(sys.modules)})
    with open(path, "w") as f:
        json.dump({"edges": sorted(_edges), "loaded": loaded}, f)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit(__doc__)
    out, module, args = sys.argv[1], sys.argv[3], sys.argv[4:]
    atexit.register(_dump, out)
    builtins.__import__ = _import
    importlib.import_module = _import_module
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
