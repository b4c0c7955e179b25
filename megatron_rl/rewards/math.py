"""Math answers checked with math-verify: 1.0 iff the response's final answer equals the truth
(a `Scored`: correct = the answer matched).

The ground truth (DAPO-Math style: "34", "\\frac{1}{2}", "x^2+1") is parsed as a boxed LaTeX
answer; the response is parsed with math-verify's default extraction (last \\boxed{...} first,
then LaTeX / plain expressions). Parsing or verification errors and time-outs score 0 — a
response that cannot be read is wrong, never a crash of the rollout loop.
"""

from __future__ import annotations

from megatron_rl.rewards import Scored, register_reward


@register_reward("math")
def math_verify_reward(response: str, ground_truth: str) -> Scored:
    from math_verify import parse, verify

    # math-verify's signal-based time-outs only work on the main thread; rollouts may score
    # from worker threads, where they are disabled (None).
    import threading

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)
        pred = parse(response, parsing_timeout=timeout)
        right = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 — unreadable answers are wrong answers
        right = False
    return Scored(float(right), correct=right)


math_verify_reward.correct_means = "math-verify found the response's final answer equal to the truth"
