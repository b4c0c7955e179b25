"""A user's own code by import path: `data.reward: my_pkg.rewards:score`, `rollout.generate: ...`.

A spec is `module.path:attribute` (a module importable from sys.path, e.g. a package the user
installed or one on PYTHONPATH) or `path/to/file.py:attribute` (a file, relative to the working
directory or absolute; loaded as a module of its own, so it needs no package). The attribute may
be dotted (`my_module:Class.method`). Every failure names the config key, the spec and what was
wrong with it — a missing module, a missing attribute (with the module's public callables), or an
object that is not callable.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable


def is_import_path(spec: str) -> bool:
    """A `module:attr` or `file.py:attr` spec (built-in names have no colon)."""
    return ":" in spec


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def absolute(spec: str) -> str:
    """The spec with a file path made absolute against this process's working directory (for
    processes that may start elsewhere, e.g. spawned workers); anything else unchanged."""
    where, sep, attr = spec.rpartition(":")
    return f"{Path(where).resolve()}:{attr}" if sep and _is_file(where) else spec


def _load_file(path: Path, key: str, spec: str):
    if not path.is_file():
        raise ValueError(f"{key}={spec!r}: no such file {path} (a file path is relative to the working "
                         f"directory {Path.cwd()})")
    # One module per file, named after its absolute path: spawned workers and every rank import
    # the same file under the same name, and two files called rewards.py do not collide.
    name = "mrl_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_object(spec: str, key: str) -> Callable[..., Any]:
    """The callable a spec names; `key` is the config key it came from (for the error)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"{key}={spec!r}: expected 'module.path:function' or 'path/to/file.py:function'")
    if _is_file(where):
        module = _load_file(Path(where), key, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):  # the module itself, not one it imports
                raise ValueError(f"{key}={spec!r}: no module named {e.name!r} on sys.path (install the "
                                 f"package, add its folder to PYTHONPATH, or give a file: "
                                 f"path/to/file.py:{attr})") from None
            raise
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
            raise ValueError(f"{key}={spec!r}: {module.__name__} has no attribute {attr!r}; its functions: "
                             f"{', '.join(names) or '(none)'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}={spec!r}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def describe(fn: Callable[..., Any]) -> str:
    """`module.qualname` of a loaded callable, for logs."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}" + (
        " (async)" if inspect.iscoroutinefunction(fn) else "")
