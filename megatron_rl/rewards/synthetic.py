"""Built-in rule rewards: exact match for the synthetic task, the final answer of a scratchpad
(`scratchpad`), and `none` (a learned reward model alone). The rules score 1.0 for a right answer
and 0.0 otherwise, with the verdict attached (`Scored`: correct = the answer matched)."""

from __future__ import annotations

from megatron_rl.rewards import Scored, register_reward

END_OF_TURN = "<|im_end|>"


@register_reward("synthetic")
def exact_match(response: str, ground_truth: str) -> Scored:
    right = response.split(END_OF_TURN)[0].strip() == ground_truth.strip()
    return Scored(float(right), correct=right)


exact_match.correct_means = "the response (up to the end of turn) is the answer exactly"


@register_reward("scratchpad")
def final_answer_match(response: str, ground_truth: str) -> Scored:
    """The answer after the scratchpad's last `>` (data/synthetic.py op="add_steps"); 0 without one."""
    from megatron_rl.data.synthetic import final_answer

    right = final_answer(response) == ground_truth.strip()
    return Scored(float(right), correct=right)


final_answer_match.correct_means = "the final answer (after the scratchpad's last '>') matched"


@register_reward("none")
def no_rule_reward(response: str, ground_truth: str) -> Scored:
    """No rule: the learned reward model (reward_model.*) scores every response alone; no answer is
    checked, so none counts as correct (rollout/accuracy and eval/pass@k read 0)."""
    return Scored(0.0, correct=False)


no_rule_reward.correct_means = "never: no rule checks the answer (rollout/accuracy and eval/pass@k read 0)"
