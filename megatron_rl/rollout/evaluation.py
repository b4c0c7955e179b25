"""Evaluation on held-out prompts: its metrics, and an evaluation beside training.

`Fleet.evaluate` samples eval.k responses per prompt with the evaluation's own admission budget
(never training's slots); `eval_metrics` turns their rewards into mean@k (the mean reward) and
pass@k (the share of prompts with a correct sample: rewards/__init__.py `is_correct`). With
eval.servers > 0, `BesideTraining` runs it on a thread beside training, on the weights of the push
just made; its metrics join the row of the step it ends in. Two ways (issue 41):

- Whole servers (`eval.share=0`, or unset on a fleet big enough): the last eval.servers servers of
  the push keep those weights (no push reaches them, no producer samples there) until it ends.
  Training's pushes stay on time; it loses those servers while the evaluation runs, and the
  weight-update group is formed again twice (without them, and with them back).
- A share of every server (`eval.share=f`, or unset where the held servers would be more than
  MAX_HELD of the fleet: then f = DEFAULT_SHARE): the evaluation samples on every server with a
  budget of f of each server's room, and training's budget keeps 1 - f (rollout/admission.py
  `set_share`), so neither queues in SGLang behind the other. Every push goes to every server, so
  the update group is never formed anew.

Why a share can share servers at all. Every sample of an evaluation must come from the weights it
evaluates, and a server holds one version: a push replaces it for every request there. But the
evaluation of the weights pushed after step s runs while step s+1 generates on those same weights,
so the two share the servers for free until the next push. So in share mode the next push waits
for the evaluation (`before_push`, in Fleet.sync_weights before anything is sent, and before a
partial-rollout pause; eval.timeout bounds it: what did not finish is aborted and counted). An
evaluation that ends within the step costs training f of the room for that long and no wait; a
longer one makes that push wait. To fit it in the step, with synchronous training
(trainer.max_staleness=0) the evaluation takes the room training leaves (`Follower`): once the
step's requests are all admitted training's slots only fall, and nothing of training's reaches a
server before the push, so the tail of the step (a cache emptying as its last responses finish),
the learner's time (log-probs, the update) and any wait at the push are the evaluation's. That
room is empty as the evaluation takes it, so its slots there follow a step's ramp
(`FleetBudget.grow`), not the steady state's count. Asynchronously the producer may send at any
time, so the evaluation keeps f throughout. Fleet.sync_weights reports `time/eval_wait` (what the
push waited) and `weight_sync/groups_formed` with eval.servers > 0.

Why the automatic choice: holding N of S servers makes a step beside the evaluation take about
S / (S - N) of one without. N <= MAX_HELD x S keeps that within 1.25x, and whole servers keep the
pushes on time whatever the evaluation's length, so big fleets hold. Below that a share is
cheaper. `benchmarks/bench_fleet.py --two` (30B shape, one rollout node: two servers, the AIME
evaluation of about one step's generation of work) measures a whole step beside the evaluation
against one without, at the 2 + 1 layout's learner time (docs/cluster.md) and others: a fifth of
every server costs less than holding one of the two wherever the learner's time is more than a small
part of the generation's, which is every layout docs/cluster.md lists; with no learner time at all
holding wins (the evaluation must end before the next push, and only the learner's time is free).
The figures, and the bound they meet (the evaluation's own length), are in docs/benchmarks.md.
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



MAX_HELD = 0.2  # whole servers an evaluation may hold unasked, as a share of the fleet (a step <= 1.25x)
DEFAULT_SHARE = 0.2  # of every server's room, for an evaluation beside training on a smaller fleet
WATCH_S = 0.2  # how often a share-mode evaluation looks at training's slots (`follow_training`)
# Average slots' KV a training request still running in its step's tail holds: the last to finish
# are its longest, far through their responses (a slot's average is E[c], rollout/admission.py).
TAIL_KV = 2.0


def beside_share(servers: int, fleet: int, share: Optional[float]) -> float:
    """How an evaluation beside training runs on a fleet of `fleet` servers: 0.0 on `servers`
    whole servers (eval.servers), else the share of every server's room it takes (eval.share; unset:
    whole servers when they are at most MAX_HELD of the fleet, else DEFAULT_SHARE)."""
    if share is not None:
        if not 0 <= share < 1:
            raise ValueError(f"eval.share={share}: the share of every server's room an evaluation beside "
                             "training takes, 0 < share < 1, or 0 to hold eval.servers whole servers")
        return float(share)
    return 0.0 if servers <= MAX_HELD * fleet else DEFAULT_SHARE


def follow_training(evaluation, training, servers: list[str], share: float, running, generated,
                    every_s: float = WATCH_S, tail_kv: float = TAIL_KV) -> None:
    """Synchronous training, share mode, while `running()`: every `every_s`, the evaluation's
    budget takes the share of every server `Follower` gives."""
    look = Follower(evaluation, training, servers, share, generated, tail_kv)
    while running():
        look()
        time.sleep(every_s)


class Follower:
    """One look each call: the evaluation's budget takes `share` of every server while training's
    requests fill its own (1 - share), and what training leaves once its step's requests are all
    admitted: 1 - the largest share of a server training's slots take, each counted `tail_kv`
    times (the tail's requests are its longest), at least `share`. Training's slots only fall from
    then on, as its step's last responses finish (synchronously nothing of training's is sent
    until the next push, which waits for the evaluation), so the room given to the evaluation is
    room training has no use for: the tail of its step, the learner's time, the wait at the push.
    That room is empty as it is given, so the evaluation takes it with `FleetBudget.grow`: its
    slots there follow a ramp, as a step's requests fill an empty cache (rollout/admission.py), not the
    steady state's count, which would leave it part empty while its first requests are young.
    Until training has filled its room on a server (its step's requests still arriving: a ramp,
    not a tail) or its generation is over (`generated()`), the evaluation keeps `share`. DAPO's
    dynamic sampling is the exception: a further round's requests find the room the evaluation
    took and may queue in SGLang behind its requests, at most one response long."""

    def __init__(self, evaluation, training, servers: list[str], share: float, generated,
                 tail_kv: float = TAIL_KV):
        self.evaluation, self.training, self.servers = evaluation, training, servers
        self.share, self.generated, self.tail_kv = share, generated, tail_kv
        self.seen, self.current = False, share

    def __call__(self) -> float:
        """Look at training's slots; the evaluation's share now."""
        training, servers = self.training, self.servers
        loads = training.loads(servers)
        self.seen = self.seen or any(n >= training.cap(u) for n, u in zip(loads, servers)) or self.generated()
        if self.seen:
            held = max(n / training.cap(u) for n, u in zip(loads, servers)) * training.share
            held = held if held >= training.share else min(training.share, self.tail_kv * held)
            want = min(1.0, max(self.share, 1.0 - held))
            if abs(want - self.current) >= 0.01 or (want == 1.0 and self.current < 1.0):
                self.evaluation.grow(want, servers)
                self.current = want
        return self.current


class BesideTraining:
    """Rank 0: the evaluation running beside training (at most one), the servers it holds (whole
    servers) or the share of every server it takes."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.hold: list[str] = []  # servers at the evaluated step's weights: no push, no producer
        self.share = 0.0  # of every server's room, for the running evaluation (0: whole servers)
        self.groups_formed = 0  # weight-update groups (transports) rank 0 formed
        self._thread: Optional[threading.Thread] = None
        self._servers: list[str] = []  # where the running evaluation samples
        self._out: Optional[tuple] = None  # (step, metrics or None, error or None)
        self._started = self._ended = 0.0
        self._pushes = 0  # pushes made (every rank): the key of a push's wait for an evaluation
        self._waited_at_pause = 0.0  # rank 0: what the pause before this push waited for one
        self._signal = None
        e = fleet.cfg.eval
        if e.share is not None and not e.servers:
            raise ValueError(f"eval.share={e.share} applies to an evaluation beside training: set "
                             "eval.servers > 0 (with eval.servers=0 it runs on every server between steps)")

    def describe(self, servers: int) -> None:
        """Rank 0, at the start: say how an evaluation beside training will run (a bad eval.share
        fails here)."""
        e = self.fleet.cfg.eval
        if e.servers:
            share = beside_share(e.servers, servers, e.share)
            print("[megatron-rl] evaluation beside training: " + (
                f"{share:.0%} of every server's room, the next push waiting for it (eval.share)" if share
                else f"on {e.servers} whole server(s) held at its weights (eval.servers)"), flush=True)

    def start(self, prompts: list[Prompt], step: int) -> Optional[str]:
        """Rank 0, right after the push of `step`'s weights: evaluate them on a thread, on the last
        eval.servers servers of this push, which keep these weights (no push reaches them, no
        producer samples there once the next push tells every rank) until it ends; or on every
        server with a share of each (module docstring), the next push waiting for it. None when
        started; else why not (nothing started)."""
        fleet = self.fleet
        e = fleet.cfg.eval
        k = e.servers
        pushed_to = fleet.pushes.pushed_to or []
        if self._thread is not None:  # (one that ended was collected by result first)
            return "the previous evaluation is still running"
        share = beside_share(k, len(fleet.urls()), e.share)
        if share:
            if not pushed_to:
                return "no server holds these weights"
            servers, hold = list(pushed_to), []
        else:
            if len(pushed_to) <= k:
                why = (" (the previous evaluation's servers hold older weights until the next push)"
                       if self.hold else "")
                return (f"{len(pushed_to)} server(s) hold these weights{why}; eval.servers={k} would "
                        "leave none to training")
            servers = hold = list(pushed_to[-k:])
        self.hold, self.share, self._out, self._servers = hold, share, None, servers
        self._started = self._ended = time.monotonic()
        fleet._eval_budget.set_share(share or 1.0)
        training = None
        if share:
            # Training's budget (every producer's, in the job's store) keeps the rest of each server.
            training = fleet._budget.clone()
            training.set_share(1.0 - share)
        else:
            # Out of rank 0's own producer's rotation at once (the other ranks: with the next push).
            fleet._excluded = fleet._excluded | frozenset(hold)

        done, follower = threading.Event(), None
        if share and fleet.cfg.trainer.max_staleness == 0:
            generations = fleet.generations
            follower = threading.Thread(
                target=follow_training, name=f"eval-step{step}-share", daemon=True,
                args=(fleet._eval_budget.clone(), fleet._budget.clone(), servers, share,
                      lambda: not done.is_set(), lambda: fleet.generations > generations))
            follower.start()

        def run() -> None:
            # This thread's client samples on `servers` only, with the evaluation's budget, and
            # keeps the version it starts with (Fleet.client).
            fleet._lanes.urls = servers
            try:
                self._out = (step, fleet.evaluate(prompts, step, versions=True), None)
            except BaseException as e:  # noqa: BLE001 - reported by result, never ends the run
                self._out = (step, None, e)
            finally:
                self._ended = time.monotonic()  # time/eval: its own length, not when it is collected
                done.set()
                if follower is not None:
                    follower.join()
                if training is not None:
                    training.set_share(1.0)  # the whole of every server is training's again
                fleet._eval_budget.set_share(1.0)  # an evaluation between steps takes every server whole
                fleet.close_lane()

        self._thread = threading.Thread(target=run, name=f"eval-step{step}", daemon=True)
        self._thread.start()
        return None

    def before_pause(self) -> None:
        """Rank 0, before a partial-rollout pause (which precedes a push): a share-mode evaluation
        ends first, or the pause would stop it and the push wait for it forever."""
        self._waited_at_pause += self.before_push()

    def wait_before_push(self) -> float:
        """Every rank, before a push: an evaluation sharing the servers ends first (rank 0 waits
        for it, `before_push`; the other ranks wait on the store, not in the push's collectives,
        which would time out at trainer.collective_timeout). Rank 0's seconds waited."""
        self._pushes += 1
        paused, self._waited_at_pause = self._waited_at_pause, 0.0
        fleet = self.fleet
        if not fleet.cfg.eval.servers:
            return 0.0
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return paused + (self.before_push() if fleet.driver else 0.0)
        if self._signal is None:
            from megatron_rl.distributed.wait import LeaderSignal

            t = fleet.cfg.trainer
            self._signal = LeaderSignal("evalpush", timeout_s=t.rollout_wait_timeout, poll_s=0.05,
                                        log_every_s=t.rollout_wait_log_every,
                                        timeout_name="trainer.rollout_wait_timeout")
        key = f"push{self._pushes}"
        if fleet.driver:
            with self._signal.leading(key):
                return paused + self.before_push()
        self._signal.wait(key)
        return 0.0

    def before_push(self) -> float:
        """Rank 0, before a push: an evaluation that shares the servers ends first (the push would
        replace the weights it evaluates; eval.timeout bounds it). With synchronous training it
        takes the whole room meanwhile. The seconds waited."""
        if not self.share or not self.running():
            return 0.0
        if self.fleet.cfg.trainer.max_staleness == 0:  # (room training's step has left: `Follower`)
            self.fleet._eval_budget.grow(1.0, self._servers)
        t0 = time.monotonic()
        self._thread.join()
        return time.monotonic() - t0

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
            metrics["time/eval"] = self._ended - self._started
        return step, metrics, error

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self) -> None:
        """Rank 0: cut a running evaluation (the run stops): its requests are aborted."""
        if self.running():
            self.fleet.abort_other_lanes_of(self.fleet._pinned)  # the evaluation's clients
            self._thread.join(60)

    def release_hold(self) -> None:
        """Rank 0, before a push: servers held by an evaluation that has ended get this push."""
        if self.hold and not self.running():
            self.hold = []
