"""Correct vs rewarded (issue 44): rollout/accuracy and eval/pass@k count samples whose answer is
right — the reward function's own verdict where it gives one, else a reward >=
data.correct_threshold — never merely a positive reward; rollout/reward_mean and eval/mean@k stay
the mean reward.

The task below: a reward that pays 0.1 for a well-formed answer (digits only) and 1.0 for the right
one, the shape of the run that showed "accuracy 0.95" while solving ~25 %. The reward functions run
through the reward workers' own caller (`_Caller`, in this process: the unit tier starts none) and
the fleet's own `generate` / `evaluate` around a stub of its sampling.
"""

from __future__ import annotations

import pickle
import re
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config.load import load_config, to_object
from megatron_rl.rewards import Scored, correct_rule, get_reward, is_correct, reward_kind
from megatron_rl.rewards.pool import _Caller, _checked
from megatron_rl.rollout.evaluation import eval_metrics
from megatron_rl.rollout.fleet import Fleet

FORMAT_OR_RIGHT = '''
def score(response, answer):
    """0.1 for a well-formed answer (digits only), 1.0 for the right one."""
    text = response.removesuffix("<|im_end|>").strip()
    return 1.0 if text == answer else (0.1 if text.isdigit() else 0.0)


def verdict(response, answer):
    """The same reward, saying which answers are right."""
    r = score(response, answer)
    return {"reward": r, "correct": r == 1.0}


def partial(response, answer):
    """Partial credit that never reaches 1.0: only the threshold can call it correct."""
    return 0.6 if response.removesuffix("<|im_end|>").strip() == answer else 0.2


def broken(response, answer):
    raise ValueError("no verdict here")
'''

# 4 prompts x 4 samples, the answer is "7": right (R), well-formed but wrong (W), malformed (M).
R, W, M = "7<|im_end|>", "3<|im_end|>", "seven<|im_end|>"
RESPONSES = [[R, W, W, W], [W, W, W, W], [R, R, W, M], [W, W, W, M]]
RIGHT = 3 / 16  # the share of right answers
POSITIVE = 14 / 16  # the share of positive rewards: what "accuracy" used to read
PASSED = 2 / 4  # prompts with a right answer among their 4
MEAN = (3 * 1.0 + 11 * 0.1) / 16


@pytest.fixture
def user_reward(tmp_path):
    path = tmp_path / "format_reward.py"
    path.write_text(FORMAT_OR_RIGHT)
    return lambda name: f"{path}:{name}"


def scores(spec: str) -> list[list[float]]:
    """The workers' results for RESPONSES, as `RewardPool.collect` hands them on."""
    fn = get_reward(spec)
    call = _Caller(fn, reward_kind(fn, spec), spec)
    flat = [(i * 4 + j, text, "7") for i, row in enumerate(RESPONSES) for j, text in enumerate(row)]
    out, whole = call(flat)
    assert not whole and all(status == "ok" for _, status, _ in out), out
    values = [v for _, _, v in sorted(out)]
    return [values[i * 4:(i + 1) * 4] for i in range(len(RESPONSES))]


def fleet(overrides: list[str], rewards: list[list[float]]) -> Fleet:
    """A Fleet whose sampling is a stub returning `rewards` (one producer, no servers): its own
    `generate`, `finish_metrics` and `evaluate` do the counting."""
    cfg = to_object(load_config("tiny_cpu", [f"rollout.prompts_per_step={len(rewards)}",
                                             f"rollout.n_samples={len(rewards[0])}", f"eval.k={len(rewards[0])}",
                                             *overrides]))
    f = Fleet.__new__(Fleet)
    f.cfg, f.ctx, f.episode_fn, f.producer = cfg, SimpleNamespace(dp=1, dp_rank=0, dp_group=None), None, True
    f._lanes = threading.local()
    f._lanes.lane = (SimpleNamespace(retry_events=[], budget=None), None)
    f._eval_budget = SimpleNamespace(clone=lambda: None)

    def sample(prompts, n, sampling, **_):
        groups = [[SimpleNamespace(prompt_index=i, sample_index=j, num_response_tokens=2, finish_reason="stop",
                                   versions=None) for j in range(n)] for i in range(len(prompts))]
        return groups, [list(rewards[i]) for i in range(len(prompts))], {
            "reward/timeouts": 0.0, "reward/errors": 0.0, "time/reward_wait": 0.0}

    f.sample = sample
    return f


def train_metrics(f: Fleet) -> dict[str, float]:
    take = lambda n: [SimpleNamespace(uid=f"p{i}", ids=(1, 2), answer="7") for i in range(n)]  # noqa: E731
    _, rewards, _, metrics = f.generate(take, step=0)
    assert all(type(r) is float for r in rewards)  # the trainer gets plain numbers
    return Fleet.finish_metrics(metrics["_sums"])


def test_scored_is_its_reward_and_carries_the_verdict():
    s = Scored(0.1, correct=False)
    assert s == 0.1 and s + 1 == pytest.approx(1.1) and torch.tensor([s]).item() == pytest.approx(0.1)
    assert {s, 0.1} == {0.1} and repr(s) == "Scored(0.1, correct=False)"
    back = pickle.loads(pickle.dumps(s))  # the reward workers' pipe
    assert type(back) is Scored and back == 0.1 and back.correct is False
    assert is_correct(Scored(0.0, correct=True)) and not is_correct(Scored(1.0, correct=False))
    assert is_correct(1.0) and not is_correct(0.1) and is_correct(0.1, threshold=0.1)


def test_builtin_rules_report_the_answer_matched():
    for name, right, wrong, answer in (("synthetic", "7<|im_end|>", "3<|im_end|>", "7"),
                                       ("scratchpad", "1+6=7>7<|im_end|>", "1+6=7>8<|im_end|>", "7"),
                                       ("math", "so \\boxed{7}", "so \\boxed{8}", "7")):
        fn = get_reward(name)
        assert fn(right, answer) == 1.0 and fn(right, answer).correct is True, name
        assert fn(wrong, answer) == 0.0 and fn(wrong, answer).correct is False, name
        assert "correct = " in correct_rule(name) and "threshold" not in correct_rule(name)
    assert get_reward("none")("anything", "7").correct is False  # the reward model alone: nothing is checked


def test_a_positive_but_wrong_reward_is_not_accuracy(user_reward):
    """A plain-float user reward (0.1 formatted, 1.0 right): accuracy and pass@k count the right
    answers (the threshold, 1.0 by default), the mean reward still counts the 0.1s."""
    rewards = scores(user_reward("score"))
    assert all(type(v) is float for row in rewards for v in row)  # no verdict: the threshold decides
    assert sum(v > 0 for row in rewards for v in row) / 16 == POSITIVE
    m = train_metrics(fleet([], rewards))
    assert m["rollout/accuracy"] == pytest.approx(RIGHT) and m["rollout/accuracy"] != pytest.approx(POSITIVE)
    assert m["rollout/reward_mean"] == pytest.approx(MEAN)
    assert eval_metrics(rewards, 4) == pytest.approx({"eval/mean@4": MEAN, "eval/pass@4": PASSED})
    assert fleet([], rewards).evaluate([None] * 4, step=0) == pytest.approx({"eval/mean@4": MEAN,
                                                                             "eval/pass@4": PASSED})
    assert "reward >= 1 (data.correct_threshold" in correct_rule(user_reward("score"))


def test_a_verdict_from_the_reward_function_is_used(user_reward):
    """{"reward": r, "correct": bool}: the function's verdict counts, whatever the threshold."""
    rewards = scores(user_reward("verdict"))
    assert all(isinstance(v, Scored) for row in rewards for v in row)
    for threshold in ("1.0", "0.05"):  # a threshold that would count the 0.1s changes nothing
        f = fleet([f"data.correct_threshold={threshold}"], rewards)
        assert train_metrics(f)["rollout/accuracy"] == pytest.approx(RIGHT)
        assert f.evaluate([None] * 4, step=0)["eval/pass@4"] == pytest.approx(PASSED)


def test_a_plain_float_reward_uses_the_configured_threshold(user_reward):
    """Partial credit (0.6 right, 0.2 otherwise) never reaches the default 1.0; the threshold says
    what is right."""
    rewards = scores(user_reward("partial"))
    assert train_metrics(fleet([], rewards))["rollout/accuracy"] == 0.0
    f = fleet(["data.correct_threshold=0.6"], rewards)
    assert train_metrics(f)["rollout/accuracy"] == pytest.approx(RIGHT)
    assert f.evaluate([None] * 4, step=0) == pytest.approx({"eval/mean@4": (3 * 0.6 + 13 * 0.2) / 16,
                                                            "eval/pass@4": PASSED})
    assert to_object(load_config("tiny_cpu")).data.correct_threshold == 1.0


def test_the_dynamic_sampling_filter_still_judges_by_reward(user_reward):
    """A group of well-formed wrong answers only (all 0.1) is uninformative, one mixing 0.1 and
    0.0 is not (the filter reads rewards, not verdicts)."""
    rewards = scores(user_reward("verdict"))
    m = train_metrics(fleet([], rewards))
    assert m["rollout/informative_groups"] == pytest.approx(3 / 4)  # prompt 1: four 0.1s


@pytest.mark.parametrize("value, message", [
    ({"reward": 1.0, "corect": True}, r"a dict needs the key 'reward' and may have 'correct' \(a bool\), not \['corect'\]"),
    ({"correct": True}, "a dict needs the key 'reward'"),
    ({"reward": 1.0, "correct": "yes"}, "returned 'correct': str 'yes'; need True, False or None"),
    ({"reward": float("nan"), "correct": True}, "returned nan, not a finite number"),
    ({"reward": "1", "correct": True}, "returned str '1', not a number"),
])
def test_bad_verdicts_are_errors_naming_what_was_wrong(value, message):
    status, error = _checked("r", value)
    assert status == "error"
    assert re.search(message, error), error


def test_results_keep_or_gain_their_verdict():
    assert _checked("r", {"reward": 0.1, "correct": False}) == ("ok", 0.1)
    assert _checked("r", {"reward": 1, "correct": True})[1].correct is True
    assert type(_checked("r", {"reward": 0.5})[1]) is float  # no verdict: the threshold decides
    assert type(_checked("r", {"reward": 0.5, "correct": None})[1]) is float
    assert _checked("r", Scored(1.0, correct=False))[1].correct is False
    assert type(_checked("r", 1)[1]) is float


@pytest.mark.slow
def test_verdicts_cross_the_reward_workers(user_reward):
    """Through real worker processes: a dict result and a built-in's Scored reach `collect` as a
    Scored; a timed-out or failed sample is a wrong answer."""
    from megatron_rl.rewards.pool import RewardPool

    for spec, want in ((user_reward("verdict"), Scored), ("synthetic", Scored), (user_reward("score"), float)):
        with RewardPool(spec, workers=1, timeout=60) as pool:
            for i, text in enumerate(RESPONSES[2]):
                pool.submit(i, text, "7")
            got = pool.collect(range(4)).scores
        assert [type(got[i]) for i in range(4)] == [want] * 4, spec
        assert [is_correct(got[i]) for i in range(4)] == [True, True, False, False], spec
    with RewardPool(user_reward("broken"), workers=1, timeout=60, on_error="zero") as pool:
        pool.submit(0, R, "7")
        got = pool.collect([0])
    assert got.errors and got.scores[0] == 0.0 and got.scores[0].correct is False
