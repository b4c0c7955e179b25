"""Exact-match reward for the synthetic task: 1.0 iff the answer before the end-of-turn matches."""

from __future__ import annotations

from megatron_rl.rewards import register_reward

END_OF_TURN = "<|im_end|>"


@register_reward("synthetic")
def exact_match(response: str, ground_truth: str) -> float:
    return float(response.split(END_OF_TURN)[0].strip() == ground_truth.strip())
