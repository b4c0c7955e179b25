"""Name → function registries for the algorithm library.

Every policy loss, advantage estimator, KL estimator, aggregation mode, mismatch correction,
sampled-token divergence and value loss is registered under a `kind` and a `name`; configs select
them by name. An unknown name is an error that lists the valid names of that kind.

    @register("policy_loss", "dppo")
    def dppo_loss(...): ...

    get("policy_loss", "dppo")   # -> dppo_loss
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

KINDS = ("policy_loss", "advantage", "kl", "aggregation", "correction", "divergence", "value_loss")

_REGISTRY: dict[str, dict[str, Callable]] = {kind: {} for kind in KINDS}

# Modules whose import populates the registry; `get` imports them so a caller that imports only
# this module still sees every name.
_MODULES = (
    "advantages",
    "aggregation",
    "corrections",
    "cppo",
    "divergence",
    "kl",
    "policy_losses",
    "value_loss",
)


class UnknownNameError(ValueError):
    """A kind or name that is not registered; the message lists the valid choices."""


def _check_kind(kind: str) -> dict[str, Callable]:
    if kind not in _REGISTRY:
        raise UnknownNameError(f"unknown registry kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    return _REGISTRY[kind]


def register(kind: str, name: str) -> Callable[[F], F]:
    """Decorator registering `fn` as `name` of `kind`. Registering another function under a taken
    name is an error (re-importing the same module is not)."""
    table = _check_kind(kind)

    def deco(fn: F) -> F:
        old = table.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"{kind} {name!r} is already registered to {old.__module__}.{old.__qualname__}")
        table[name] = fn
        return fn

    return deco


def _load_all() -> None:
    for mod in _MODULES:
        importlib.import_module(f"{__package__}.{mod}")


def get(kind: str, name: str) -> Callable:
    """The function registered as `name` of `kind`; raises UnknownNameError listing valid names."""
    table = _check_kind(kind)
    _load_all()
    try:
        return table[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}"
        ) from None


def names(kind: str) -> tuple[str, ...]:
    """Sorted registered names of `kind`."""
    table = _check_kind(kind)
    _load_all()
    return tuple(sorted(table))
