"""The DPPO paper's two motivating cases, run through every policy loss of the library.

A rare token whose probability rises 1e-4 → 1e-2 (r = 100, but only 0.0099 of probability mass
moved) and a dominant token that falls 0.99 → 0.80 (r ≈ 0.81, but 0.19 of mass moved), each with
the advantage sign that pushes it further (the update the trust region is for) and the opposite
sign (a move back toward μ, which DPPO never masks).

`python -m megatron_rl.algorithms.worked_examples` prints the markdown tables that
docs/algorithms.md embeds; tests/unit/test_algorithms_docs.py checks the document still matches.
"""

from __future__ import annotations

import torch

from .divergence import binary_kl, binary_tv
from .registry import get

# (label, μ(a_t), π(a_t), A)
CASES = (
    ("rare ↑, A>0", 1e-4, 1e-2, 1.0),
    ("rare ↑, A<0", 1e-4, 1e-2, -1.0),
    ("dominant ↓, A<0", 0.99, 0.80, -1.0),
    ("dominant ↓, A>0", 0.99, 0.80, 1.0),
)

# (label, registered loss, keyword arguments)
RULES = (
    ("PG-IS", "pg_is", {}),
    ("PPO clip ε=0.2", "ppo", {"eps_low": 0.2, "eps_high": 0.2}),
    ("clip-higher ε=0.2/0.28", "ppo", {"eps_low": 0.2, "eps_high": 0.28}),
    ("dual-clip ε=0.2, c=3", "ppo", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}),
    ("ATR δ=0.0231", "atr", {"delta": 0.0231}),
    ("ASPO ε=0.2, c=3", "aspo", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0}),
    ("CISPO ε_high=0.2", "cispo", {"eps_high": 0.2}),
    ("DPPO binary TV δ=0.15", "dppo", {"divergence_type": "binary_tv", "delta": 0.15}),
    ("DPPO binary KL δ=0.05", "dppo", {"divergence_type": "binary_kl", "delta": 0.05}),
    ("DPPO binary TV δ=0.15, C=5", "dppo", {"divergence_type": "binary_tv", "delta": 0.15, "truncation": 5.0}),
)


def _tensors():
    mu = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    pi = torch.tensor([c[2] for c in CASES], dtype=torch.float64)
    adv = torch.tensor([c[3] for c in CASES], dtype=torch.float64)
    return torch.log(pi), torch.log(mu), adv


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def cases_table() -> str:
    logp, rollout_logp, _ = _tensors()
    tv = binary_tv(rollout_logp, logp)
    kl = binary_kl(rollout_logp, logp)
    lines = ["| case | μ(a_t) | π(a_t) | r = π/μ | binary TV | binary KL(μ‖π) |",
             "|---|---|---|---|---|---|"]
    for i, (label, mu, pi, _) in enumerate(CASES):
        lines.append(f"| {label} | {_fmt(mu)} | {_fmt(pi)} | {_fmt(pi / mu)} | "
                     f"{_fmt(float(tv[i]))} | {_fmt(float(kl[i]))} |")
    return "\n".join(lines)


def rules_table() -> str:
    """Per rule and case: **masked** (gradient stopped), `clipped w=…` (weight capped, gradient
    kept) or `w=…` (kept); w is the coefficient of −A·∇log π in the gradient."""
    logp, rollout_logp, adv = _tensors()
    header = "| rule | " + " | ".join(c[0] for c in CASES) + " |"
    lines = [header, "|---" * (len(CASES) + 1) + "|"]
    for label, name, kwargs in RULES:
        _, m = get("policy_loss", name)(logp, rollout_logp, adv, **kwargs)
        cells = []
        for i in range(len(CASES)):
            if bool(m["masked"][i]):
                cells.append("**masked**")
            elif bool(m["clipped"][i]):
                cells.append(f"clipped w={_fmt(float(m['weight'][i]))}")
            else:
                cells.append(f"w={_fmt(float(m['weight'][i]))}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown() -> str:
    return cases_table() + "\n\n" + rules_table() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
