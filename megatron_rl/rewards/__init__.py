"""Reward functions by name or import path: `get_reward(spec)(response_text, ground_truth) -> float`.

Rules are pure functions of the decoded response and the ground truth. A spec is a built-in name
(registered below; unknown names raise with the list of valid ones) or a user's function by
import path, `my_pkg.my_module:my_fn` or `path/to/file.py:my_fn` (megatron_rl/plugins.py).
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.plugins import is_import_path, load_object

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_reward(name: str, key: str = "data.reward") -> RewardFn:
    if is_import_path(name):
        return load_object(name, key)
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"{key}: unknown reward {name!r}; valid: {', '.join(sorted(_REGISTRY))}, or a "
                         "function by import path (my_pkg.my_module:my_fn or path/to/file.py:my_fn)") from None


def reward_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    from megatron_rl.rewards import math, synthetic  # noqa: F401  (registration side effect)
