"""Import paths that moved in the restructuring of 2026-11-27 (docs/architecture.md): the old path
still imports, for one release, as the new module itself, with a DeprecationWarning naming the new
path. A user's plugin or script that imported the old path keeps working unchanged."""

from __future__ import annotations

import importlib
import sys
import warnings

REMOVED_IN = "0.2.0"


def alias(old: str, new: str) -> None:
    """Make `old` (the module being imported) the module `new`: every name, private ones included,
    and one object for both paths (a monkeypatch of either is seen by both)."""
    warnings.warn(f"{old} moved to {new}; the old import path is removed in megatron-rl {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)


MOVED = {
    "megatron_rl.trainer.batch": "megatron_rl.batch",
    "megatron_rl.trainer.prompts": "megatron_rl.data.prompts",
    "megatron_rl.trainer.rollouts": "megatron_rl.rollout.fleet",
    "megatron_rl.trainer.checkpoint": "megatron_rl.run.checkpoint",
    "megatron_rl.trainer.run_dir": "megatron_rl.run.run_dir",
    "megatron_rl.trainer.operations": "megatron_rl.run.operations",
    "megatron_rl.trainer.signals": "megatron_rl.run.signals",
    "megatron_rl.trainer.metrics": "megatron_rl.run.metrics",
    "megatron_rl.trainer.compare": "megatron_rl.tools.compare",
    "megatron_rl.trainer.plot": "megatron_rl.tools.plot",
    "megatron_rl.export": "megatron_rl.tools.export",
    "megatron_rl.evaluate": "megatron_rl.tools.evaluate",
    "megatron_rl.lm_demo": "megatron_rl.tools.lm_demo",
}
"""Old import path -> new (each old path is a two-line module calling `alias`)."""
