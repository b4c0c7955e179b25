"""Built-in rule rewards: exact match for the synthetic task, the final answer of a scratchpad
(`scratchpad`), and `none` (a learned reward model alone)."""

from __future__ import annotations

from megatron_rl.rewards import register_reward

END_OF_TURN = "<|im_end|>"


@register_reward("synthetic")
def exact_match(response: str, ground_truth: str) -> float:
    return float(response.split(END_OF_TURN)[0].strip() == ground_truth.strip())


@register_reward("scratchpad")
def final_answer_match(response: str, ground_truth: str) -> float:
    """The answer after the scratchpad's last `>` (data/synthetic.py op="add_steps"); 0 without one."""
    from megatron_rl.data.synthetic import final_answer

    return float(final_answer(response) == ground_truth.strip())


@register_reward("none")
def no_rule_reward(response: str, ground_truth: str) -> float:
    """No rule: the learned reward model (reward_model.*) scores every response alone."""
    return 0.0
