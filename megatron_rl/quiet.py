"""A quiet start: known upstream notices collapse into one line.

Importing megatron-core without Transformer Engine or Apex (every CPU run, and GPU runs on the
`local` spec) prints a dozen "not installed, falling back" warnings from as many modules; torch
warns about collectives without an autograd kernel on every first backward; transformers draws a
progress bar for a one-file checkpoint. None of it is actionable for a user of this project, and
together they push the run's own first lines off the screen. `install()` hides exactly the notices
listed in `KNOWN` (by category and message) and prints one line, once per process and on rank 0
only, naming what was hidden and how to see it. Every other warning shows as usual.

`MRL_VERBOSE=1` (or `megatron-rl --verbose ...`, which sets it for every process it starts: ranks,
servers, reward workers) shows everything.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Optional

KNOWN: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed",
     "Transformer Engine / Apex not installed (megatron-core's torch fallbacks)"),
    (UserWarning, r"c10d::\w+: an autograd kernel was not registered",
     "autograd fallback notices of c10d collectives"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope",
     "megatron-core's cuda_graph_scope deprecation"),
    # torch deprecations inside megatron-core's dist_checkpointing (its torch_dist strategy)
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed",
     "torch.distributed.checkpoint deprecations in dist_checkpointing"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     "torch ShardedTensor deprecation in dist_checkpointing"),
    # mbridge saving a single-file checkpoint (no model.safetensors.index.json to copy)
    (UserWarning, r"No index file found, saving index file failed", "mbridge's single-file save notice"),
)
"""(category, message regex, what the summary line calls it)."""

_seen: set[str] = set()
_announced = False
_installed = False
_show_original = warnings.showwarning


def verbose() -> bool:
    return os.environ.get("MRL_VERBOSE", "0").lower() not in ("", "0", "false", "no")


def known(message: str, category: type[Warning]) -> Optional[str]:
    """The summary name of a known upstream notice, or None."""
    for cat, pattern, name in KNOWN:
        if issubclass(category, cat) and re.search(pattern, message):
            return name
    return None


def _lead_rank() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _showwarning(message, category, filename, lineno, file=None, line=None):
    global _announced
    name = known(str(message), category)
    if name is None:
        return _show_original(message, category, filename, lineno, file, line)
    _seen.add(name)
    if not _announced and _lead_rank():
        _announced = True
        print("[megatron-rl] known upstream notices hidden (Transformer Engine / Apex fallbacks, autograd "
              "fallback of collectives, ...); MRL_VERBOSE=1 or --verbose shows them", file=sys.stderr, flush=True)


def install() -> None:
    """Hide the known notices in this process (and progress bars of HF downloads/saves in it and its
    children), unless MRL_VERBOSE is set. Idempotent."""
    global _installed
    if _installed or verbose():
        return
    _installed = True
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.showwarning = _showwarning


def set_verbose() -> None:
    """`--verbose`: show everything here and in every process started from here."""
    global _installed
    os.environ["MRL_VERBOSE"] = "1"
    if _installed:
        warnings.showwarning = _show_original
        _installed = False


def hidden() -> list[str]:
    """What this process has hidden so far (summary names)."""
    return sorted(_seen)
