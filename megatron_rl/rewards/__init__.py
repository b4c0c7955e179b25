"""Reward functions by name or import path: `get_reward(spec)(response_text, ground_truth) -> float`.

Rules are pure functions of the decoded response and the ground truth. A spec is a built-in name
(registered below; unknown names raise with the list of valid ones) or a user's function by
import path, `my_pkg.my_module:my_fn` or `path/to/file.py:my_fn` (megatron_rl/plugins.py).

A function is per-sample, `fn(response, answer) -> float`, or batched, `fn(responses, answers) ->
list[float]` (marked with `@batched`, or `fn.batched = True` in a module that does not import
this package); either may be `async def`. `reward_kind` reads the marks; rewards/pool.py calls
the function accordingly in its worker processes.

Correct vs rewarded: a score may also say whether the answer is right, so that a reward that pays
for more than right answers (0.1 for a well-formed answer, 1.0 for a right one) does not read as
accuracy. A function returns either a number, or `{"reward": r, "correct": bool}` (no import
needed), or `Scored(r, correct=...)` (a float that carries the verdict). The built-in rule rewards
(`synthetic`, `scratchpad`, `math`) return `Scored`: correct = the answer matched. `is_correct`
decides a sample: its verdict where the function gave one, else `reward >= data.correct_threshold`
(default 1.0, the built-in rewards' score for a right answer; an episode's own `episode.reward` is
a plain number too). rollout/accuracy and eval/pass@k count correct samples; rollout/reward_mean
and eval/mean@k stay the mean reward. `correct_rule` says in words which applies (the train
summary line, eval's report), with a function's `correct_means` text where it sets one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.plugins import is_import_path, load_object

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, RewardFn] = {}

DEFAULT_MAX_BATCH = 64
"""Calls one worker takes at once for a batched or async function without its own max_batch_size."""

CORRECT_THRESHOLD = 1.0
"""data.correct_threshold's default: a plain-number reward counts as correct when >= this."""


class Scored(float):
    """A reward that also says whether the answer is right: `Scored(0.1, correct=False)`. It is
    the float `reward` everywhere a number is used (sums, comparisons, tensors); `correct` is read
    by `is_correct` (rollout/accuracy, eval/pass@k). A function may return
    `{"reward": r, "correct": b}` instead; the reward pool turns that into a Scored."""

    __slots__ = ("correct",)

    def __new__(cls, reward: float, correct: bool) -> "Scored":
        self = super().__new__(cls, reward)
        self.correct = bool(correct)
        return self

    def __reduce__(self):  # pickles (the pool's pipe) as a Scored, not a bare float
        return (Scored, (float(self), self.correct))

    def __repr__(self) -> str:
        return f"Scored({float(self)!r}, correct={self.correct})"


def is_correct(score: Any, threshold: float = CORRECT_THRESHOLD) -> bool:
    """Whether a sample's answer counts as right: the reward function's own verdict (a `Scored`),
    else its reward >= `threshold` (data.correct_threshold)."""
    verdict = getattr(score, "correct", None)
    return bool(verdict) if verdict is not None else float(score) >= threshold


def correct_rule(spec: str, threshold: float = CORRECT_THRESHOLD) -> str:
    """What counts as correct under the reward `spec`, in words (summary lines, eval reports)."""
    fn = get_reward(spec)
    own = getattr(fn, "correct_means", None)
    if own:
        return f"correct = {own} (data.reward={spec})"
    return (f"correct = the reward function's verdict where it returns one ({{'reward': r, 'correct': "
            f"bool}}), else reward >= {threshold:g} (data.correct_threshold; data.reward={spec})")


def register_reward(name: str):
    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def batched(fn: Optional[Callable] = None, *, max_size: Optional[int] = None):
    """Mark a reward function as batched: `fn(responses: list[str], answers: list) -> list[float]`
    (one score per response, in order). `@batched` or `@batched(max_size=16)` (the most responses
    one call receives; default DEFAULT_MAX_BATCH). Sets `fn.batched = True` (and
    `fn.max_batch_size`), which a user's module may also set by hand."""

    def mark(f: Callable) -> Callable:
        f.batched = True
        if max_size is not None:
            f.max_batch_size = max_size
        return f

    return mark(fn) if fn is not None else mark


@dataclass(frozen=True)
class RewardKind:
    """How the pool calls a reward function. `max_batch`: the calls one worker takes at once —
    1 for a sync per-sample function; a batched function's batch, or the calls an async
    per-sample function awaits concurrently."""

    batched: bool
    is_async: bool
    max_batch: int


def reward_kind(fn: Callable, spec: str, key: str = "data.reward") -> RewardKind:
    """The marks on a reward function, checked (a bad mark names the spec and the attribute)."""
    mark = getattr(fn, "batched", False)
    if mark not in (True, False):
        raise ValueError(f"{key}={spec!r}: {getattr(fn, '__name__', fn)}.batched={mark!r}; set it to True "
                         "(the function takes lists of responses and answers) or leave it unset")
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    cap = getattr(fn, "max_batch_size", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{key}={spec!r}: max_batch_size={cap!r}; need an integer >= 1")
    if not (mark or is_async):
        return RewardKind(False, False, 1)  # a sync call blocks its worker: one at a time
    return RewardKind(bool(mark), is_async, cap or DEFAULT_MAX_BATCH)


def get_reward(name: str, key: str = "data.reward") -> RewardFn:
    if is_import_path(name):
        return load_object(name, key)
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"{key}: unknown reward {name!r}; valid: {', '.join(sorted(_REGISTRY))}, or a "
                         "function by import path (my_pkg.my_module:my_fn or path/to/file.py:my_fn)") from None


def reward_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    from megatron_rl.rewards import math, synthetic  # noqa: F401  (registration side effect)
