"""The built-in synthetic task: two-operand integer addition, answer checked exactly.

Small enough that a 2-layer model learns it on a laptop CPU in minutes, structured enough that
accuracy (not just loss) shows learning. A prompt is "a+b=", the answer the decimal sum followed
by the end-of-turn token. `operand_digits` sets the difficulty.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "12+7="
    answer: str  # e.g. "19"


def make_problems(n: int, seed: int, operand_digits: int = 2) -> list[Problem]:
    """`n` problems drawn with a seeded RNG (same seed -> same list, on every rank)."""
    rng = random.Random(seed)
    hi = 10 ** operand_digits - 1
    out = []
    for _ in range(n):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        out.append(Problem(f"{a}+{b}=", str(a + b)))
    return out


def is_correct(problem: Problem, completion: str) -> bool:
    """Exact match of the completion (up to the end-of-turn token, whitespace-stripped)."""
    return completion.split("<|im_end|>")[0].strip() == problem.answer
