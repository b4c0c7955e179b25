"""The rollout producer: a thread that generates whole steps' shares ahead of the learner.

Each producer rank (the model-parallel leader of a data-parallel rank, rollout/fleet.py) runs
one `Producer`. Its thread draws prompts from its own `PromptStream` and produces the share of
step t's groups for every *target step* t in order, each as soon as the gate admits it:

    admit t  ⇔  published weight version ≥ t − max_staleness

so no token of step t's batch comes from weights older than t − k (k = `trainer.max_staleness`):
staleness is bounded at admission and no sample is ever dropped for being too old (dropping
would bias towards short responses — the oldest samples are the longest — and lose prompts).
k = 0 admits t only once the learner has pushed the weights of step t: today's synchronous loop,
with the same seeds, prompts and servers. The consumer (`get(t)`) takes the shares in order.

Weight pushes (`Trainer.publish`) either drain the producer first (`drain`: everything admitted
finishes under the weights that admitted it — exactly k-off-policy, deterministic) or, with
`rollout.partial_rollouts`, pause the servers mid-generation; the client then continues each cut
response under the new weights, recording the version of every token (rollout/client.py).

The thread never calls torch.distributed: producers of several data-parallel ranks agree on
dynamic sampling's informative groups through the c10d store (`StoreSum`), so generation may run
while the learner's collectives do.

Checkpoints save the complete queued shares (`snapshot`), each with the prompt-stream position
after it; a resumed run queues them again and generates from the next target, so no prompt is
lost or duplicated (`Trainer.save`).

`overlap` (partial rollouts without dynamic sampling): the next admitted target starts, on a
worker thread of its own, as soon as the target being made has drawn its prompts, so its requests
fill the slots the other's tail frees (at most two targets in the making). Each target draws all
its prompts at once, in target order, and its share records the stream position right after its
own draws; the gate, the versions and the order in which `get` hands shares out are unchanged.
Without it (drain mode, dynamic sampling) targets are made one after the other: a drain-mode push
waits for every admitted target, so there is nothing to overlap with, and dynamic sampling draws
again mid-target.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

import torch

from megatron_rl.data.prompts import PromptStream


@dataclasses.dataclass
class StepShare:
    """One producer's groups of one target step, before any rebalancing."""

    target: int
    batch: object  # RolloutBatch (or records, for tests)
    metrics: dict
    position: dict  # the prompt stream's state after this target's draws
    epoch: int = 0  # restarts before it was made (a restart discards older epochs' shares)


class ProducerStopped(RuntimeError):
    pass


class Producer:
    """`produce(target, stream) -> (batch, metrics)` runs on the thread, one target at a time, in
    order; `get(target)` hands the shares out in order. See the module docstring."""

    def __init__(self, produce: Callable[[int, PromptStream], tuple[object, dict]], stream: PromptStream,
                 max_staleness: int, last_target: Optional[int] = None, name: str = "rollout-producer",
                 on_exit: Optional[Callable[[], None]] = None, overlap: bool = False):
        if max_staleness < 0:
            raise ValueError(f"trainer.max_staleness={max_staleness}: must be >= 0 (weight versions a "
                             "sample may lag the learner)")
        self._produce, self.stream, self.k = produce, stream, int(max_staleness)
        self._name, self._on_exit = name, on_exit
        self.before_worker: Optional[Callable[[], None]] = None  # called before a worker starts (a virtual clock)
        self.last_target = last_target  # no target after it is made (the run's last step)
        self._cond = threading.Condition()
        self._queue: dict[int, StepShare] = {}
        self._next = 0  # the next target the thread makes
        self._published = -1
        self._busy: set[int] = set()  # the targets being made
        self._overlap = bool(overlap)
        self._drawn: set[int] = set()  # targets being made that have drawn their prompts
        self._workers: list[threading.Thread] = []
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._epoch = 0
        self._thread: Optional[threading.Thread] = None
        self.waited_s = 0.0  # time `get` spent waiting (the consumer starved), since the last read

    # -- consumer side --------------------------------------------------------------------------
    def start(self, first_target: int, published: int, saved: list[StepShare] = ()) -> "Producer":
        """Start making shares from `first_target` (after the `saved` ones, which are queued
        again: a resumed run's complete shares; the stream must be at the last one's position)."""
        for s in saved:
            self._queue[s.target] = s
        self._next = max([first_target] + [s.target + 1 for s in saved])
        self._published = published
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def published(self, version: int) -> None:
        """The learner's weights of step `version` are on every server: open the gate."""
        with self._cond:
            self._published = version
            self._cond.notify_all()

    def get(self, target: int, interrupt: Optional[Callable[[], bool]] = None) -> StepShare:
        """The share of `target` (blocks until it is made); re-raises the thread's error. Raises
        Interrupted when `interrupt()` turns true while it waits (checked every half second)."""
        from megatron_rl.distributed.wait import Interrupted

        start = time.perf_counter()
        with self._cond:
            while target not in self._queue:
                self._raise_if_failed()
                if self._next > target and target not in self._busy:
                    raise RuntimeError(f"producer: share of step {target} was taken already or never made "
                                       f"(next target {self._next})")
                if interrupt is not None and interrupt():
                    raise Interrupted(f"a stop was requested while step {target}'s share was being made")
                self._cond.wait(0.5 if interrupt is not None else 1.0)
            share = self._queue.pop(target)
            self._cond.notify_all()
        self.waited_s = time.perf_counter() - start
        return share

    def drain(self) -> None:
        """Wait until every admitted target is made (the thread waits at the gate)."""
        with self._cond:
            while not self._idle():
                self._raise_if_failed()
                self._cond.wait(1.0)
            self._raise_if_failed()

    def restart(self, target: int, position: dict) -> None:
        """Throw away every share from `target` on and make them again from the stream position
        `position` (the state before target's draws): a server served other weights."""
        self.drain()
        with self._cond:
            self._queue = {t: s for t, s in self._queue.items() if t < target}
            self.stream.load_state_dict(position)
            self._next, self._epoch = target, self._epoch + 1
            self._cond.notify_all()

    def snapshot(self) -> list[StepShare]:
        """The complete shares queued now, in target order (for a checkpoint)."""
        with self._cond:
            self._raise_if_failed()
            return [self._queue[t] for t in sorted(self._queue)]

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, abort: Optional[Callable[[], None]] = None, timeout: float = 120.0) -> None:
        """Start no new target; `abort()` (if given) cuts the target being made (a run that stops
        early, e.g. on SIGTERM, need not wait for generation it will not train on). Waits at most
        `timeout` in all for the thread and its workers (a thread held in something no abort
        reaches, a reward function's, is left to end with the process: they are daemons)."""
        with self._cond:
            self._stopping = True
            busy = bool(self._busy)
            self._cond.notify_all()
        if busy and abort is not None:
            abort()
        deadline = time.monotonic() + timeout
        for t in [self._thread, *self._workers]:
            if t is not None and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    # -- thread ---------------------------------------------------------------------------------
    def _admitted(self) -> bool:
        """Whether the gate admits the next target (under the lock)."""
        return (self._next - self.k <= self._published
                and (self.last_target is None or self._next <= self.last_target))

    def _idle(self) -> bool:
        return not self._busy and (self._stopping or not self._admitted() or self._error is not None)

    def _may_start(self) -> bool:
        """Whether the next target may start now (under the lock): admitted, and nothing in the
        making, or (overlap) one target in the making that has drawn its prompts."""
        if not self._admitted():
            return False
        if not self._busy:
            return True
        return self._overlap and len(self._busy) == 1 and self._busy <= self._drawn

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            # The first line only: the whole error (a reward's samples, a traceback) is the cause
            # chained below, printed once.
            first = (str(self._error).splitlines() or [""])[0]
            raise ProducerStopped(f"rollout producer failed: {type(self._error).__name__}: {first} "
                                  "(the producer thread's error, above)") from self._error

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and self._error is None and not self._may_start():
                        self._cond.wait()
                    if self._stopping or self._error is not None:
                        return
                    t, epoch = self._next, self._epoch
                    self._busy.add(t)
                    self._next = t + 1
                if self._overlap:
                    w = threading.Thread(target=self._make, args=(t, epoch, True), name=f"{self._name}-t{t}",
                                         daemon=True)
                    self._workers = [x for x in self._workers if x.is_alive()] + [w]
                    if self.before_worker is not None:
                        self.before_worker()
                    w.start()
                else:
                    self._make(t, epoch, False)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _make(self, t: int, epoch: int, worker: bool) -> None:
        """Make target t's share (on the producer thread, or a worker of its own with overlap)."""
        try:
            with self._cond:
                beside = len(self._busy) > 1  # started in another target's tail
            stream = _DrawOnce(self.stream, t, self._on_drawn) if worker else self.stream
            batch, metrics = self._produce(t, stream)
            if worker:
                metrics = {**metrics, "async/started_beside": float(beside)}
            share = StepShare(t, batch, metrics, stream.state_dict(), epoch)
            with self._cond:
                if epoch == self._epoch:  # a restart during the target discards it
                    self._queue[t] = share
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by get()/drain()
            with self._cond:
                if not self._stopping and epoch == self._epoch:  # a stopped target is no error
                    self._error = e
        finally:
            with self._cond:
                self._busy.discard(t)
                self._drawn.discard(t)
                self._cond.notify_all()
            if worker and self._on_exit is not None:
                self._on_exit()  # each worker thread closes what it opened (its client lane)

    def _on_drawn(self, t: int) -> None:
        with self._cond:
            self._drawn.add(t)
            self._cond.notify_all()


class _DrawOnce:
    """A target's view of the prompt stream with overlap: it draws once (the next target draws
    after it), and its position is the stream's right after those draws."""

    def __init__(self, stream: PromptStream, target: int, on_drawn: Callable[[int], None]):
        self._stream, self._target, self._on_drawn = stream, target, on_drawn
        self._position: Optional[dict] = None

    def take(self, n: int):
        if self._position is not None:
            raise RuntimeError(f"producer: target {self._target} drew prompts twice; overlapping targets "
                               "need one draw per target (no dynamic sampling)")
        out = self._stream.take(n)
        self._position = self._stream.state_dict()
        self._on_drawn(self._target)
        return out

    def state_dict(self) -> dict:
        if self._position is None:
            raise RuntimeError(f"producer: target {self._target} drew no prompts")
        return self._position


class StoreSum:
    """A sum over the producers of the data-parallel ranks through the c10d store, for the
    producer threads (which must not enter a collective: the learner's may be running).

    Each rank posts its int64 vector under `<prefix>/<name>/<rank>` and reads everyone's
    (distributed/wait.py `StoreMeeting.gather`: a late producer is waited for under `timeout_s`,
    trainer.rollout_wait_timeout, with a line every `log_every_s` naming it; one that failed
    (`fail`) ends the others' wait at once; each rank keeps its last two keys)."""

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float = 7200.0,
                 log_every_s: float = 300.0, log=None):
        from megatron_rl.distributed.wait import StoreMeeting

        self.size = size
        kw = {"log": log} if log is not None else {}
        self.meeting = StoreMeeting(prefix, rank, size, timeout_s=timeout_s, log_every_s=log_every_s, store=store,
                                    what="data-parallel producer", timeout_name="trainer.rollout_wait_timeout", **kw)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        values, _ = self.meeting.gather(name, x.to(torch.int64).numpy().tobytes())
        total = torch.zeros_like(x, dtype=torch.int64)
        for v in values:
            total += torch.frombuffer(bytearray(v), dtype=torch.int64)
        return total.to(x.dtype)

    def fail(self, message: str) -> None:
        """This producer's thread failed: the others stop waiting for it."""
        self.meeting.fail(message)
