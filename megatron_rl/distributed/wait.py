"""A leader rank's long job and the ranks that wait for it, outside any collective.

One data-parallel "leader" rank per model-parallel group generates that group's rollouts against
the SGLang servers (minutes to an hour at 16k-token responses) while the other ranks of the group
have nothing to do. Waiting inside a collective (`broadcast_object_list`) is killed by the NCCL
watchdog (or gloo's timeout) after the process group's timeout, 10-30 minutes. Here the waiters
instead poll keys on the default process group's c10d store (the TCPStore every rank already
reaches) with a short sleep, and only enter the collective that hands out the rollouts once the
leader has said it is done:

    leader:   sig.post_progress(key, "1234/4096 samples") ... sig.post_done(key)   then broadcast
    waiters:  sig.wait(key)                                                       then broadcast

Per key the leader writes two store entries, `<prefix>/<key>/progress` (the latest text) and
`<prefix>/<key>/status` ("done", or "error" and the leader's message). Waiters only `check` for
keys and `get` keys already present, so the store's own default timeout (the process group's
timeout, e.g. 1800 s) never fires however long the leader works. Every `log_every_s` a waiter logs
the key, the time waited and the leader's last progress; after `timeout_s` it raises TimeoutError
naming them; when the leader posts an error, waiters raise `LeaderFailed` with its message at the
next poll instead of waiting out the timeout.

Store memory stays bounded: when the leader first posts on a new key it deletes the entries of its
previous key, so one key's entries are live per LeaderSignal. This needs every waiter to have
returned from `wait` on the previous key before the leader posts on the next one; in the trainer
the collectives that hand out each step's rollouts guarantee that. A key must be fresh for each
wait (a step number and, when a step is regenerated, the attempt): posting on a key this leader
already finished raises, since waiters would take the old "done" for the new one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional

import torch.distributed as dist

_DONE = "done"
_ERROR = "error\n"


class LeaderFailed(RuntimeError):
    """The leader posted an error for the key a rank was waiting on."""


class Interrupted(Exception):
    """A stop was requested while this rank waited (run/operations.py `Operations.interrupt`):
    the step in progress is given up. Raised by a wait given an `interrupt` check, and by a waiter
    whose leader was interrupted."""


_INTERRUPTED = "interrupted"


def _print(text: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[megatron-rl] rank {rank}: {text}", flush=True)


def _checked_store(who: str, store: Optional[dist.Store], **seconds: float) -> dist.Store:
    """Refuse non-positive durations (naming `who` and the argument); the store to use: `store`, or a
    clone of the default process group's (a connection of its own, so posting from another thread
    cannot interleave with torch's own use of the store)."""
    for name, value in seconds.items():
        if not value > 0:
            raise ValueError(f"{who} {name}={value!r}: must be a positive number of seconds")
    if store is not None:
        return store
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed initialised (it uses the default process group's "
                           "store); a single process has no one to wait for")
    return dist.distributed_c10d._get_default_store().clone()


class LeaderSignal:
    """Progress, completion and failure of a leader's job, posted on the c10d store, awaited by polling.

    `prefix` namespaces the store keys (e.g. "rollouts"); the per-wait `key` passed to each call
    (e.g. f"step{step}/mp{mp_index}") names the job in every log line and error. `timeout_s`: how
    long `wait` waits before raising TimeoutError; `log_every_s`: how often it logs while waiting;
    `poll_s`: the sleep between two looks at the store (the latency a waiter adds after "done").
    `timeout_name` is how the timeout is called in the TimeoutError (the config key that sets it).
    `store` defaults to a clone of the default process group's store (a connection of its own, so
    posting from another thread cannot interleave with torch's own use of the store).
    """

    def __init__(self, prefix: str, *, timeout_s: float, log_every_s: float, poll_s: float = 0.5,
                 log: Callable[[str], None] = _print, timeout_name: str = "timeout_s",
                 store: Optional[dist.Store] = None):
        store = _checked_store("LeaderSignal", store, timeout_s=timeout_s, log_every_s=log_every_s, poll_s=poll_s)
        self.prefix = prefix.strip("/")
        self.timeout_s, self.log_every_s, self.poll_s = float(timeout_s), float(log_every_s), float(poll_s)
        self.timeout_name = timeout_name
        self.log = log
        self._store = store
        self._lock = threading.Lock()  # posts may come from a worker thread
        self._current: Optional[str] = None  # the key this leader posts on; its entries are live
        self._current_finished = False

    # ------------------------------------------------------------------------------------------
    def _keys(self, key: str) -> tuple[str, str]:
        base = f"{self.prefix}/{key}"
        return f"{base}/progress", f"{base}/status"

    def _begin(self, key: str) -> None:
        """Called under the lock by every post: switch to `key`, deleting the previous key's entries."""
        if key == self._current:
            if self._current_finished:
                raise ValueError(f"{self.prefix}/{key}: already posted done/error; use a fresh key per wait "
                                 "(include the step and the attempt), or waiters take the old result "
                                 "for the new one")
            return
        if self._current is not None:
            for k in self._keys(self._current):
                self._store.delete_key(k)
        self._current, self._current_finished = key, False

    def post_progress(self, key: str, text: str) -> None:
        """Leader: publish `text` (e.g. "1234/4096 samples") as the latest progress on `key`.

        One store round trip: call it per finished group or every few seconds, not per token.
        """
        with self._lock:
            self._begin(key)
            self._store.set(self._keys(key)[0], text)

    def _post_status(self, key: str, status: str) -> None:
        with self._lock:
            self._begin(key)
            self._store.set(self._keys(key)[1], status)
            self._current_finished = True

    def post_done(self, key: str) -> None:
        """Leader: the job behind `key` finished; waiters return from `wait`."""
        self._post_status(key, _DONE)

    def post_error(self, key: str, message: str) -> None:
        """Leader: the job behind `key` failed; waiters raise LeaderFailed with `message`."""
        self._post_status(key, _ERROR + message)

    @contextlib.contextmanager
    def leading(self, key: str) -> Iterator[None]:
        """Leader: post done when the block ends, or post the exception and re-raise it (an
        Interrupted as such: its waiters raise Interrupted too)."""
        try:
            yield
        except Interrupted:
            self._post_status(key, _INTERRUPTED)
            raise
        except BaseException as e:
            self.post_error(key, f"{type(e).__name__}: {e}")
            raise
        self.post_done(key)

    # ------------------------------------------------------------------------------------------
    def wait(self, key: str) -> float:
        """Waiter: block until the leader posts done on `key`; return the seconds waited.

        Raises LeaderFailed with the leader's message if it posts an error, and TimeoutError after
        `timeout_s` with the key, the time waited and the leader's last progress.
        """
        progress_key, status_key = self._keys(key)
        start = time.monotonic()
        next_log = start + self.log_every_s
        progress: Optional[str] = None
        # When this rank first saw the current progress text: local time, no clocks compared across hosts.
        progress_at = start
        while True:
            try:
                finished = self._store.check([status_key])
                if self._store.check([progress_key]):
                    text = self._store.get(progress_key).decode()
                    if text != progress:
                        progress, progress_at = text, time.monotonic()
                status = self._store.get(status_key).decode() if finished else None
            except dist.DistError as e:
                raise RuntimeError(f"{self.prefix}/{key}: the c10d store became unreachable while "
                                   f"waiting for the leader (it lives on global rank 0; did that exit?): "
                                   f"{e}") from e
            now = time.monotonic()
            if status == _DONE:
                return now - start
            if status == _INTERRUPTED:
                raise Interrupted(f"{self.prefix}/{key}: the leader gave the step up (a stop was requested)")
            if status is not None:
                message = status[len(_ERROR):] if status.startswith(_ERROR) else status
                raise LeaderFailed(f"{self.prefix}/{key}: the leader failed after {now - start:.0f}s of "
                                   f"waiting: {message}")
            if now - start >= self.timeout_s:
                raise TimeoutError(f"{self.prefix}/{key}: no result from the leader after {now - start:.0f}s "
                                   f"({self.timeout_name}={self.timeout_s:g}); "
                                   f"{self._describe(progress, progress_at, now)}")
            if now >= next_log:
                self.log(f"waiting for {self.prefix}/{key}: {now - start:.0f}s; "
                         f"{self._describe(progress, progress_at, now)}")
                next_log = now + self.log_every_s  # after a stall, one line, not a burst
            time.sleep(min(self.poll_s, max(0.0, start + self.timeout_s - now)))

    @staticmethod
    def _describe(progress: Optional[str], progress_at: float, now: float) -> str:
        if progress is None:
            return "the leader has posted no progress"
        return f"the leader's last progress: {progress!r} (first seen {now - progress_at:.0f}s ago)"


class StoreMeeting:
    """Peers that meet outside any collective: each posts under `<prefix>/<key>/<rank>` and polls the
    store until all `size` have posted (the waiting part of a barrier, without its timeout), and
    `gather` hands everyone every member's bytes.

    The trainer's data-parallel producers agree on each generation round (`StoreSum`, from their
    threads) and meet again before the step's collectives. A producer later than the process groups'
    timeout (a slow server, a retried 16k-token sample, a slow reward) would make the others fail
    inside a collective (the NCCL watchdog; gloo's timeout); on the store the wait is bounded by
    `timeout_s` (trainer.rollout_wait_timeout), with a line every `log_every_s` naming the members
    not there yet.

    A member that fails says so once (`fail`, or `arrive` around its work); whoever waits for it
    raises LeaderFailed with its message at the next poll instead of waiting out the timeout. Store
    memory stays bounded: a member deletes its entry of two meetings back when it posts (everyone has
    left that meeting: they all reached the previous one). Keys must be fresh for each meeting.
    """

    def __init__(self, prefix: str, rank: int, size: int, *, timeout_s: float, log_every_s: float,
                 poll_s: float = 0.5, log: Callable[[str], None] = _print, timeout_name: str = "timeout_s",
                 store: Optional[dist.Store] = None, what: str = "rank"):
        store = _checked_store("StoreMeeting", store, timeout_s=timeout_s, log_every_s=log_every_s, poll_s=poll_s)
        self.prefix, self.rank, self.size, self.what = prefix.strip("/"), rank, size, what
        self.timeout_s, self.log_every_s, self.poll_s = float(timeout_s), float(log_every_s), float(poll_s)
        self.timeout_name, self.log = timeout_name, log
        self._store = store
        self._mine: list[str] = []

    def fail(self, message: str) -> None:
        """This member failed: every member waiting for it, at any meeting, raises with `message`."""
        self._store.set(f"{self.prefix}/failed/{self.rank}", message)

    @contextlib.contextmanager
    def arrive(self, key: str) -> Iterator[None]:
        """Do this member's work in the block, then meet: on an exception the others learn of it."""
        try:
            yield
        except BaseException as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        self.meet(key)

    def meet(self, key: str, interrupt: Optional[Callable[[], bool]] = None) -> float:
        """Post this member's arrival on `key` and wait for all; return the seconds waited."""
        return self.gather(key, b"", interrupt)[1]

    def gather(self, key: str, value: bytes,
               interrupt: Optional[Callable[[], bool]] = None) -> tuple[list[bytes], float]:
        """Post `value` on `key`, wait for every member's; return (their values by rank, seconds waited).

        `interrupt()` true while some member has not arrived raises Interrupted. Once all have
        arrived every member returns, whatever `interrupt` says: so all of them leave the meeting
        the same way (a stop then waits for the step's end)."""
        mine = f"{self.prefix}/{key}/{self.rank}"
        self._store.set(mine, value)
        self._mine.append(mine)
        if len(self._mine) > 2:
            self._store.delete_key(self._mine.pop(0))
        keys = [f"{self.prefix}/{key}/{r}" for r in range(self.size)]
        start = time.monotonic()
        next_log = start + self.log_every_s
        values: dict[int, bytes] = {}
        while True:
            try:
                for r in range(self.size):
                    if r in values:
                        continue
                    if self._store.check([keys[r]]):
                        values[r] = self._store.get(keys[r])
                    elif self._store.check([f"{self.prefix}/failed/{r}"]):
                        message = self._store.get(f"{self.prefix}/failed/{r}").decode()
                        raise LeaderFailed(f"{self.prefix}/{key}: {self.what} {r} failed: {message}")
            except dist.DistError as e:
                raise RuntimeError(f"{self.prefix}/{key}: the c10d store became unreachable while waiting "
                                   f"for the other {self.what}s (it lives on global rank 0; did that exit?): "
                                   f"{e}") from e
            now = time.monotonic()
            if len(values) == self.size:
                return [values[r] for r in range(self.size)], now - start
            missing = [r for r in range(self.size) if r not in values]
            if interrupt is not None and interrupt():
                raise Interrupted(f"{self.prefix}/{key}: a stop was requested while {self.what}s {missing} "
                                  "had not arrived")
            if now - start >= self.timeout_s:
                raise TimeoutError(f"{self.prefix}/{key}: {self.what}s {missing} not there after {now - start:.0f}s "
                                   f"({self.timeout_name}={self.timeout_s:g})")
            if now >= next_log:
                self.log(f"waiting for {self.prefix}/{key}: {self.what}s {missing} not there yet after "
                         f"{now - start:.0f}s")
                next_log = now + self.log_every_s
            time.sleep(min(self.poll_s, max(0.0, start + self.timeout_s - now)))
