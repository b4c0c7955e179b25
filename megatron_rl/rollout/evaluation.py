"""Evaluation on held-out prompts: its metrics, and an evaluation beside training.

`Fleet.evaluate` samples eval.k responses per prompt with the evaluation's own admission budget
(never training's slots); `eval_metrics` turns their rewards into mean@k (the mean reward) and
pass@k (the share of prompts with a correct sample: rewards/__init__.py `is_correct`). With
eval.servers > 0, `BesideTraining` runs it on a thread on the last eval.servers servers of the
push just made, which keep those weights (no push reaches them, no producer samples there) until it
ends; its metrics join the row of the step it ends in.

Why whole servers, and what sizes the evaluation (issue 41). Every sample of an evaluation must
come from the weights it evaluates, and a server holds one version: a push replaces it for every
request there, and the old weights are gone (SGLang records the version of every token, so a
sample cut by a push is detected, but it cannot be generated at the old weights again). So an
evaluation that shares servers with training can only run between two pushes, or hold the pushes
back. Holding whole servers keeps training's pushes on time, at the cost of those servers' share
of the fleet while it runs. What bounds that cost here: the evaluation's own budget follows the
lengths of its samples (rollout/admission.py: slots fill each held server's KV pool, not the
first estimate's ~40 %), so it ends sooner and training has the whole fleet back sooner.
`benchmarks/bench_fleet.py` measures, on two servers, a step beside an evaluation that holds one
(1.50x a step without) and beside one that would take a fifth of every server's KV pool instead
(1.15x), the design that needs the pushes held while it runs (docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from megatron_rl.data.prompts import Prompt
from megatron_rl.rewards import CORRECT_THRESHOLD, is_correct


def eval_metrics(rewards: list[list[float]], k: int, missing: int = 0,
                 threshold: float = CORRECT_THRESHOLD) -> dict[str, float]:
    """mean@k (the mean reward over the samples) and pass@k (a prompt passes when one of its k
    samples is correct: the reward function's verdict where it gave one (a `Scored`), else a reward
    >= `threshold`, data.correct_threshold; a positive reward alone is not a pass). With samples
    `missing` (eval.timeout), mean@k is over the samples that finished and pass@k over the prompts
    whose k samples all did (fewer samples would understate it); a metric with nothing to average
    over is left out, and eval/missing_samples counts the rest."""
    finished = [r for row in rewards for r in row]
    whole = [row for row in rewards if len(row) == k]
    out = {}
    if finished:
        out[f"eval/mean@{k}"] = sum(map(float, finished)) / len(finished)
    if whole:
        out[f"eval/pass@{k}"] = sum(any(is_correct(r, threshold) for r in row) for row in whole) / len(whole)
    if missing:
        out["eval/missing_samples"] = float(missing)
    return out



class BesideTraining:
    """Rank 0: the evaluation running beside training (at most one) and the servers it holds."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.hold: list[str] = []  # servers at the evaluated step's weights: no push, no producer
        self._thread: Optional[threading.Thread] = None
        self._out: Optional[tuple] = None  # (step, metrics or None, error or None)
        self._started = 0.0

    def start(self, prompts: list[Prompt], step: int) -> Optional[str]:
        """Rank 0, right after the push of `step`'s weights: evaluate them on a thread, on the last
        eval.servers servers of this push, which keep these weights (no push reaches them, no
        producer samples there once the next push tells every rank) until it ends. None when
        started; else why not (nothing started)."""
        fleet = self.fleet
        k = fleet.cfg.eval.servers
        pushed_to = fleet.pushes.pushed_to or []
        if self._thread is not None:  # (one that ended was collected by result first)
            return "the previous evaluation is still running"
        if len(pushed_to) <= k:
            why = (" (the previous evaluation's servers hold older weights until the next push)"
                   if self.hold else "")
            return (f"{len(pushed_to)} server(s) hold these weights{why}; eval.servers={k} would "
                    "leave none to training")
        hold = list(pushed_to[-k:])
        self.hold, self._out, self._started = hold, None, time.monotonic()
        fleet.exclude(hold)  # rank 0's own producer leaves them at once

        def run() -> None:
            fleet.use_servers(hold)
            try:
                self._out = (step, fleet.evaluate(prompts, step, versions=True), None)
            except BaseException as e:  # noqa: BLE001 - reported by result, never ends the run
                self._out = (step, None, e)
            finally:
                fleet.close_lane()

        self._thread = threading.Thread(target=run, name=f"eval-step{step}", daemon=True)
        self._thread.start()
        return None

    def result(self, wait: bool = False) -> Optional[tuple[int, dict, Optional[BaseException]]]:
        """Rank 0: (step, metrics or None, error or None) of a finished evaluation, once; None while
        it runs (or waits for it with `wait`) and when there is none. Its servers rejoin at the
        next push."""
        t = self._thread
        if t is None or (t.is_alive() and not wait):
            return None
        t.join()
        self._thread = None
        step, metrics, error = self._out
        if metrics is not None:
            metrics["time/eval"] = time.monotonic() - self._started
        return step, metrics, error

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self) -> None:
        """Rank 0: cut a running evaluation (the run stops): its requests are aborted."""
        if self.running():
            self.fleet.abort_pinned()
            self._thread.join(60)

    def release_hold(self) -> None:
        """Rank 0, before a push: servers held by an evaluation that has ended get this push."""
        if self.hold and not self.running():
            self.hold = []
