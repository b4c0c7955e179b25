"""The rollout producer: a thread that generates whole steps' shares ahead of the learner.

Each producer rank (the model-parallel leader of a data-parallel rank, trainer/rollouts.py) runs
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
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

import torch

from megatron_rl.trainer.prompts import PromptStream


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
                 on_exit: Optional[Callable[[], None]] = None):
        if max_staleness < 0:
            raise ValueError(f"trainer.max_staleness={max_staleness}: must be >= 0 (weight versions a "
                             "sample may lag the learner)")
        self._produce, self.stream, self.k = produce, stream, int(max_staleness)
        self._name, self._on_exit = name, on_exit
        self.last_target = last_target  # no target after it is made (the run's last step)
        self._cond = threading.Condition()
        self._queue: dict[int, StepShare] = {}
        self._next = 0  # the next target the thread makes
        self._published = -1
        self._busy: Optional[int] = None  # the target being made
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
                if self._next > target and self._busy != target:
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
        early, e.g. on SIGTERM, need not wait for generation it will not train on)."""
        with self._cond:
            self._stopping = True
            busy = self._busy is not None
            self._cond.notify_all()
        if busy and abort is not None:
            abort()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- thread ---------------------------------------------------------------------------------
    def _admitted(self) -> bool:
        """Whether the gate admits the next target (under the lock)."""
        return (self._next - self.k <= self._published
                and (self.last_target is None or self._next <= self.last_target))

    def _idle(self) -> bool:
        return self._busy is None and (self._stopping or not self._admitted() or self._error is not None)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ProducerStopped(f"rollout producer failed: {type(self._error).__name__}: "
                                  f"{self._error}") from self._error

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._admitted():
                        self._cond.wait()
                    if self._stopping:
                        return
                    t, epoch = self._next, self._epoch
                    self._busy = t
                try:
                    batch, metrics = self._produce(t, self.stream)
                    share = StepShare(t, batch, metrics, self.stream.state_dict(), epoch)
                finally:
                    with self._cond:
                        self._busy = None
                        self._cond.notify_all()
                with self._cond:
                    if epoch == self._epoch:  # a restart during the target discards it
                        self._queue[t] = share
                        self._next = t + 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer by get()/drain()
            with self._cond:
                if not self._stopping:  # an aborted target of a stopping producer is no error
                    self._error = e
                self._cond.notify_all()
        finally:
            if self._on_exit is not None:
                self._on_exit()


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
