"""Moved to `megatron_rl.run.metrics` (docs/architecture.md); this path works until megatron-rl 0.2.0."""

from megatron_rl._moved import alias

alias(__name__, "megatron_rl.run.metrics")
