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

`op="add_steps"`: column addition with a written scratchpad, the multi-token task of the testbed
(recipes/testbed_cpu.yaml). Operands are zero-padded to `operand_digits`; the solution works the
columns right to left, one `x+y+carry=ss` step each, then `>` and the sum:

    prompt "864+394="   solution "4+4+0=08,6+9+0=15,8+3+1=12>1258"   answer "1258"

(8 + 9·(digits−1) + 1 + answer characters: 31 for three digits, 20 for two). The supervised base
stage trains on the solution; the rule reward (`scratchpad`, rewards/synthetic.py) checks only the
answer after the last `>`, as math rewards check only the final answer.
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
    solution: str = ""  # the supervised target when it differs from the answer (add_steps' scratchpad)

    @property
    def target(self) -> str:
        """What the supervised base stage trains on: the solution, else the answer."""
        return self.solution or self.answer


OPS = ("add", "max", "add_steps")


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
    if op != "add" and modulo:
        raise ValueError("modulo applies to op='add' only")
    if op == "add_steps" and num_operands != 2:
        raise ValueError("op='add_steps' adds two operands (num_operands=2)")
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
        elif op == "add_steps":
            problem = column_addition(xs[0], xs[1], operand_digits)
        elif modulo:
            problem = Problem(f"{'+'.join(map(str, xs))}%{modulo}=", str(sum(xs) % modulo))
        else:
            problem = Problem(f"{'+'.join(map(str, xs))}=", str(sum(xs)))
        answer = int(problem.answer)
        if answer <= top and (target is None or answer == target):
            out.append(problem)
            target = rng.randint(0, top) if balance_answers else None
    return out


def task_kwargs(task) -> dict:
    """`make_problems` arguments of a SyntheticTaskConfig (data.synthetic), without n and seed."""
    return dict(operand_digits=task.operand_digits, num_operands=task.num_operands, modulo=task.modulo,
                op=task.op, max_answer=task.max_answer, balance_answers=task.balance_answers)


def column_addition(a: int, b: int, digits: int) -> Problem:
    """`a+b` with the column-by-column scratchpad of op="add_steps" (see the module docstring)."""
    sa, sb = str(a).zfill(digits), str(b).zfill(digits)
    steps, carry = [], 0
    for x, y in zip(map(int, reversed(sa)), map(int, reversed(sb))):
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return Problem(f"{sa}+{sb}=", str(a + b), ",".join(steps) + f">{a + b}")


def final_answer(completion: str) -> str | None:
    """The answer after the last `>` of a scratchpad completion (up to the end of turn); None
    when there is no `>`."""
    text = completion.split("<|im_end|>")[0]
    return text.rsplit(">", 1)[1].strip() if ">" in text else None


def as_prompt_examples(problems: list[Problem]) -> list[PromptExample]:
    """The problems as chat prompts (one user message each) for the rollout path."""
    return [PromptExample(({"role": "user", "content": p.prompt},), p.answer, "synthetic", f"synthetic:{i + 1}")
            for i, p in enumerate(problems)]


def is_correct(problem: Problem, completion: str) -> bool:
    """Exact match of the completion (up to the end-of-turn token, whitespace-stripped); for a
    scratchpad problem, of its final answer."""
    if problem.solution:
        return final_answer(completion) == problem.answer
    return completion.split("<|im_end|>")[0].strip() == problem.answer
