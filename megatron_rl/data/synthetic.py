"""The built-in synthetic verifiable task: integer addition with tunable difficulty.

Small enough that a tiny model trained from random weights learns it on a laptop CPU in minutes,
structured enough that accuracy (not only loss) shows learning. A prompt is "a+b=" (or
"a+b+c=" with more operands); the answer is the decimal sum, or its last digit with
`modulo=10` (prompt "a+b%10="), which makes every answer one token — the easiest setting, and
the one a policy learns from random weights by RL alone. Difficulty knobs: `operand_digits`,
`num_operands`, `modulo`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from megatron_rl.data.datasets import PromptExample


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "12+7="
    answer: str  # e.g. "19"


def make_problems(n: int, seed: int, operand_digits: int = 1, num_operands: int = 2,
                  modulo: Optional[int] = None) -> list[Problem]:
    """`n` problems drawn with a seeded RNG (same arguments -> same list, on every rank)."""
    if operand_digits < 1 or num_operands < 2:
        raise ValueError("operand_digits must be >= 1 and num_operands >= 2")
    rng = random.Random(seed)
    hi = 10 ** operand_digits - 1
    out = []
    for _ in range(n):
        xs = [rng.randint(0, hi) for _ in range(num_operands)]
        total = sum(xs)
        expr = "+".join(map(str, xs))
        if modulo:
            out.append(Problem(f"{expr}%{modulo}=", str(total % modulo)))
        else:
            out.append(Problem(f"{expr}=", str(total)))
    return out


def as_prompt_examples(problems: list[Problem]) -> list[PromptExample]:
    """The problems as chat prompts (one user message each) for the rollout path."""
    return [PromptExample(({"role": "user", "content": p.prompt},), p.answer, "synthetic", f"synthetic:{i + 1}")
            for i, p in enumerate(problems)]


def is_correct(problem: Problem, completion: str) -> bool:
    """Exact match of the completion (up to the end-of-turn token, whitespace-stripped)."""
    return completion.split("<|im_end|>")[0].strip() == problem.answer
