"""Policy losses, advantages, KL estimators, aggregation, DAPO filters and trust-region
diagnostics — pure tensor functions registered by name (see registry.py and docs/algorithms.md).

Importing the package registers every name.
"""

from . import advantages, aggregation, corrections, dapo, diagnostics, divergence, kl, policy_losses
from .registry import get, names, register

__all__ = [
    "advantages", "aggregation", "corrections", "dapo", "diagnostics", "divergence", "kl",
    "policy_losses", "get", "names", "register",
]
