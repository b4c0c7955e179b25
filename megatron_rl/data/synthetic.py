"""The built-in synthetic verifiable task: integer arithmetic with tunable difficulty.

Small enough that a tiny model trained from random weights learns it on a laptop CPU in minutes,
structured enough that accuracy (not only loss) shows learning. `op="add"`: the prompt is "a+b="
(or "a+b+c=" with more operands) and the answer the decimal sum (its last digit with `modulo=10`,
prompt "a+b%10="); `op="max"`: the prompt is "max(a,b)=" and the answer the largest operand.
`max_answer=9` keeps only problems with one-digit answers, i.e. one-token answers for the
character tokenizer — the setting a policy learns from random weights by RL alone (a random
policy is right ~1% of the time; modular addition is far harder for a tiny model to learn than
max or small sums, so the demo uses max, with `balance_answers` so that small maxima are not
rare). Difficulty knobs: `op`, `operand_digits`, `num_operands`, `modulo`, `max_answer`,
`balance_answers`.
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


OPS = ("add", "max")


def make_problems(n: int, seed: int, operand_digits: int = 1, num_operands: int = 2,
                  modulo: Optional[int] = None, op: str = "add",
                  max_answer: Optional[int] = None, balance_answers: bool = False) -> list[Problem]:
    """`n` problems drawn with a seeded RNG (same arguments -> same list, on every rank).

    `balance_answers`: every possible answer is equally likely (the answer is drawn first, then a
    problem with that answer, uniformly, by rejection). Without it the answer distribution of `max` is
    skewed ((2k+1)/100 for one-digit pairs: answer 0 is 19x rarer than 9), and a policy trained
    by RL from random weights lumps the rare small answers onto a common one and never samples
    the right ones again (zero reward variance in their groups, hence no gradient).
    """
    if operand_digits < 1 or num_operands < 2:
        raise ValueError("operand_digits must be >= 1 and num_operands >= 2")
    if op not in OPS:
        raise ValueError(f"unknown synthetic op {op!r}; valid: {', '.join(OPS)}")
    if op == "max" and modulo:
        raise ValueError("modulo applies to op='add' only")
    if max_answer is not None and max_answer < 0:
        raise ValueError(f"max_answer must be >= 0, got {max_answer}")
    rng = random.Random(seed)
    hi = 10 ** operand_digits - 1
    top = hi if op == "max" else (modulo - 1 if modulo else hi * num_operands)
    top = top if max_answer is None else min(top, max_answer)
    out: list[Problem] = []
    target = rng.randint(0, top) if balance_answers else None
    while len(out) < n:
        # With a target maximum, operands are drawn from [0, target]: still uniform over the
        # problems whose answer is the target, at a fraction of the rejections.
        xs = [rng.randint(0, target if op == "max" and target is not None else hi) for _ in range(num_operands)]
        if op == "max":
            problem = Problem(f"max({','.join(map(str, xs))})=", str(max(xs)))
        elif modulo:
            problem = Problem(f"{'+'.join(map(str, xs))}%{modulo}=", str(sum(xs) % modulo))
        else:
            problem = Problem(f"{'+'.join(map(str, xs))}=", str(sum(xs)))
        answer = int(problem.answer)
        if answer <= top and (target is None or answer == target):
            out.append(problem)
            target = rng.randint(0, top) if balance_answers else None
    return out


def as_prompt_examples(problems: list[Problem]) -> list[PromptExample]:
    """The problems as chat prompts (one user message each) for the rollout path."""
    return [PromptExample(({"role": "user", "content": p.prompt},), p.answer, "synthetic", f"synthetic:{i + 1}")
            for i, p in enumerate(problems)]


def is_correct(problem: Problem, completion: str) -> bool:
    """Exact match of the completion (up to the end-of-turn token, whitespace-stripped)."""
    return completion.split("<|im_end|>")[0].strip() == problem.answer
