"""Reward functions by name: `get_reward(name)(response_text, ground_truth) -> float`.

Rules are pure functions of the decoded response and the ground truth; unknown names raise with
the list of valid ones. `reward_for_source` picks the function from a row's `data_source`.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid rewards: {', '.join(sorted(_REGISTRY))}") from None


def reward_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    from megatron_rl.rewards import math, synthetic  # noqa: F401  (registration side effect)
