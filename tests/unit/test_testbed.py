"""The testbed's pieces without servers: the scratchpad task and its reward, the base stage's cache
key, compare's method specs and collapse events, and the report's two stopping rules."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from megatron_rl.config.load import load_config, to_object
from megatron_rl.data.synthetic import column_addition, final_answer, is_correct, make_problems
from megatron_rl.models.base import base_dir, base_spec
from megatron_rl.rewards import get_reward
from megatron_rl.tools.compare import collapse_events, parse_methods, smoothed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_scratchpad_solutions_are_correct_column_additions():
    """Every step of every solution re-derived from the digits (an independent check: Python's
    integer sum of the columns and the carry), and the final answer is a + b."""
    problems = make_problems(500, seed=3, operand_digits=3, op="add_steps")
    lengths = set()
    for p in problems:
        a, b = map(int, p.prompt.rstrip("=").split("+"))
        steps, answer = p.solution.split(">")
        assert int(answer) == a + b == int(p.answer)
        carry = 0
        for i, step in enumerate(steps.split(",")):
            x, y, c, s = map(int, re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d\d)", step).groups())
            assert (x, y) == (a // 10 ** i % 10, b // 10 ** i % 10) and c == carry and s == x + y + c
            carry = s // 10
        assert i == 2 and carry == (a + b) // 1000
        lengths.add(len(p.solution))
    assert min(lengths) >= 8 and max(lengths) <= 32  # the 8-32 token answers (1 char = 1 token)
    assert column_addition(999, 999, 3).solution == "9+9+0=18,9+9+1=19,9+9+1=19>1998"
    assert column_addition(5, 7, 2).prompt == "05+07="


def test_scratchpad_reward_checks_the_final_answer_only():
    reward = get_reward("scratchpad")
    p = column_addition(123, 456, 3)
    assert reward(p.solution + "<|im_end|>", p.answer) == 1.0
    assert reward("garbage>579<|im_end|>", "579") == 1.0  # the scratchpad is not graded
    assert reward("3+6+0=09>578<|im_end|>", "579") == 0.0
    assert reward("579", "579") == 0.0  # no `>`: no final answer
    assert reward("1>2>579<|im_end|>junk", "579") == 1.0  # the last `>`, up to the end of turn
    assert final_answer("abc") is None
    assert is_correct(p, "x>579") and not is_correct(p, "579")
    with pytest.raises(ValueError, match="two operands"):
        make_problems(1, seed=0, op="add_steps", num_operands=3)


def test_base_cache_key_covers_what_determines_the_weights():
    job = to_object(load_config("testbed_cpu"))
    key = base_dir(job)
    same = to_object(load_config("testbed_cpu", ["model.base.cache_dir=/elsewhere", "data.synthetic.num_train=5",
                                                 "optim.lr=1.0", "algorithm=pg_is", "trainer.seed=7",
                                                 "data.synthetic.seed=3"]))
    assert base_dir(same).name == key.name and str(base_dir(same)).startswith("/elsewhere")
    for change in ("model.tiny.hidden=64", "data.synthetic.operand_digits=2", "model.base.target_accuracy=0.3",
                   "model.base.sft_steps=10", "model.base.seed=1", "model.tiny.seed=1"):
        assert base_dir(to_object(load_config("testbed_cpu", [change]))).name != key.name, change
    spec = base_spec(job)
    assert spec["task"]["op"] == "add_steps" and not {"num_train", "seed"} & set(spec["task"]) and "cache_dir" not in spec["stage"]


def test_testbed_recipes_share_everything_but_the_method():
    """The recipe's Dr.GRPO, 8 mini-batches and bf16 rollouts hold whatever algorithm= picks."""
    for recipe in ("testbed_cpu", "testbed_moe_cpu"):
        for algo in ("dppo_binary_tv", "grpo_clip_higher", "cispo", "pg_is"):
            job = to_object(load_config(recipe, [f"algorithm={algo}"]))
            assert job.algorithm.advantage == "dr_grpo" and job.algorithm.mini_batches == 8
            assert job.rollout.dtype == "bfloat16" and job.model.dtype in ("auto", "float32")
            assert job.data.reward == "scratchpad" and job.model.base.sft_steps > 0
    assert to_object(load_config("testbed_moe_cpu")).model.tiny.moe


def test_compare_method_specs():
    m = parse_methods("cispo", ["tv2=dppo_binary_tv +algorithm.loss_kwargs.delta=0.2",
                                "old=dppo_binary_tv '+algorithm.loss_kwargs.anchor=old' algorithm.recompute_old_logp=true"])
    assert m == {"cispo": ["algorithm=cispo"],
                 "tv2": ["algorithm=dppo_binary_tv", "+algorithm.loss_kwargs.delta=0.2"],
                 "old": ["algorithm=dppo_binary_tv", "+algorithm.loss_kwargs.anchor=old",
                         "algorithm.recompute_old_logp=true"]}
    for bad in (["noequals"], ["x="], ["cispo=cispo"]):
        with pytest.raises(ValueError):
            parse_methods("cispo", bad)


def test_collapse_events_and_smoothing():
    assert collapse_events([0.5, 0.6, 0.7, 0.7]) == 0
    assert collapse_events([0.8] + [0.3] * 5) == 1  # 5 steps below half the best
    assert collapse_events([0.8] + [0.3] * 4 + [0.8]) == 0  # 4 steps: a dip, not a collapse
    assert collapse_events([0.8] + [0.3] * 9) == 1  # one stretch counts once
    assert collapse_events([0.26] + [0.05] * 5) == 1  # relative: a low base collapses too
    assert collapse_events([0.8] + [0.3] * 5 + [0.8] + [0.1] * 6) == 2
    assert smoothed([1.0, 0.0, 0.5, 0.5, 0.0, 1.0], window=3) == [1.0, 0.5, 0.5, 1 / 3, 1 / 3, 0.5]


def test_report_rules_are_the_two_trust_regions():
    """PPO clip (0.2 / 0.28) and binary TV (0.15) on the paper's two cases, in float64 by hand."""
    import torch
    from testbed_report import rules

    mu = torch.tensor([0.01, 0.95, 0.50, 0.50, 0.02, 0.95], dtype=torch.float64)
    pi = torch.tensor([0.03, 0.78, 0.70, 0.45, 0.01, 0.99], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    ppo, tv = rules(mu, pi, adv)
    # rare token tripled (mass moved 0.02): only the ratio clip stops it
    # dominant token losing 0.17 (ratio 0.82): only TV stops it
    # 0.5 -> 0.7 with A>0: ratio 1.4 and mass 0.2, both stop it
    # small moves, and a rare token halved under A<0 (ratio 0.5: PPO stops, TV does not)
    assert ppo.tolist() == [True, False, True, False, True, False]
    assert tv.tolist() == [False, True, True, False, False, False]
