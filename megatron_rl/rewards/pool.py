"""Rule rewards scored in worker processes while generation runs, each call under a timeout.

`RewardPool(reward, workers, timeout)` scores `get_reward(reward)(text, answer)` in `workers`
processes. `submit(key, text, answer)` only queues (cheap enough for an asyncio callback as each
response arrives); a dispatcher thread hands one call at a time to each idle worker, so scoring
overlaps generation. `collect(keys)` waits for those keys and returns their scores.

Timeouts: a call's clock starts when a ready worker receives it (time queued behind other calls
does not count). A call still running after `timeout` seconds has its worker killed (SIGKILL) and
replaced by a fresh process; the call scores 0.0 and its key is reported in `timed_out`, so a
pathological answer costs one timeout, never the step. math-verify's own limits (SIGALRM, 5 s per
parse and per verify, main thread only — the workers call it on theirs) end most such answers
(measured: `\\boxed{2^{2^{40}}}` scores 0 after ~6 s), but a call stuck inside one C operation
does not see the signal, and a rule reward need not have any limit: the kill is the bound that
always holds. Workers are processes for exactly that reason: a hung thread cannot be stopped.

Errors: an exception in the reward function (or a result that is not a finite number, or a worker
process that dies mid-call) is a bug or a crash, not a property of the answer, so `collect` raises
`RewardError` naming every failing key with its traceback — after all the keys are in, so the pool
stays usable. Unknown reward names fail in the constructor with the valid ones.

Workers are started with `spawn` (safe with torch and CUDA in the parent, unlike fork), resolve the
reward by name themselves (they import the module that registered it), ignore SIGINT, SIGTERM,
SIGUSR1 and SIGUSR2 (a launcher signals every process of the job; the trainer decides shutdown
and finishes its step first) and die with the pool's dispatcher thread (Linux PR_SET_PDEATHSIG), so a hung
call never outlives a killed trainer. As with any spawn start, a worker re-imports the parent's
main module: a script that makes a pool must guard its entry point (`if __name__ == "__main__"`).
There is no in-process mode: an inline call cannot be killed, so it could not honour the timeout.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import logging
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Hashable, Iterable, Optional

from megatron_rl.rewards import get_reward

log = logging.getLogger(__name__)

_OK, _ERROR, _TIMEOUT = "ok", "error", "timeout"


class _PoolStopped(RuntimeError):
    """The dispatcher cannot go on (a worker could not start); collect() raises the message."""


class RewardError(RuntimeError):
    """The reward function raised (or returned a non-number) for these keys: [(key, message)]."""

    def __init__(self, reward: str, errors: list[tuple[Any, str]]):
        self.errors = errors
        shown = "\n\n".join(f"key {k!r}:\n{msg}" for k, msg in errors[:3])
        more = f"\n\n... and {len(errors) - 3} more" if len(errors) > 3 else ""
        super().__init__(f"reward {reward!r} failed on {len(errors)} response(s): "
                         f"{[k for k, _ in errors]}\n\n{shown}{more}")


@dataclass
class Collected:
    """What `collect(keys)` returns: a score for every key (0.0 for a timed-out call), the keys
    whose call was killed at the timeout, and the seconds `collect` spent waiting."""

    scores: dict[Any, float]
    timed_out: list[Any]
    wait_s: float

    def metrics(self) -> dict[str, float]:
        return {"reward/timeouts": float(len(self.timed_out)), "time/reward_wait": self.wait_s}


# ------------------------------------------------------------------------------------------------
# Worker process


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this worker when the thread that started it (the pool's dispatcher) ends, e.g. the
    trainer is killed with -9 while this worker is stuck in a pathological call."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Signals a launcher sends to every process of a job (Ctrl-C; Slurm's preemption SIGTERM and
`--signal` USR1/USR2 reach the whole step): the trainer catches them, finishes its step — whose
rewards these workers score — and checkpoints; the workers die with it (PR_SET_PDEATHSIG)."""


def _worker_main(conn: Connection, reward: str, module: Optional[str], parent_pid: int) -> None:
    for sig in _IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    try:
        # The module that registered the reward (a user's or a test's); the built-ins load by name.
        # A spawned child has already re-imported the parent's __main__ (as __mp_main__).
        if module and module != "__main__":
            importlib.import_module(module)
        fn = get_reward(reward)
    except BaseException:  # noqa: BLE001 — reported to the parent, which stops the pool
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the pool is gone
            return
        task_id, text, answer = task
        try:
            value = float(fn(text, answer))
            if not math.isfinite(value):
                raise ValueError(f"reward {reward!r} returned {value}, not a finite number")
            conn.send((task_id, _OK, value))
        except Exception:  # noqa: BLE001 — reported with the key by collect()
            conn.send((task_id, _ERROR, traceback.format_exc().strip()))


# ------------------------------------------------------------------------------------------------
# Parent side


class _Worker:
    def __init__(self, ctx, reward: str, module: Optional[str]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, reward, module, os.getpid()),
                                name="reward-worker", daemon=True)
        self.proc.start()
        # Only the child may hold its end: a dead worker then reads as EOF / a broken pipe here.
        child.close()
        self.ready = False
        self.task: Optional[tuple[int, str, Any]] = None
        self.started = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardPool:
    """Score `get_reward(reward)` in `workers` processes; a call past `timeout` s scores 0.0 and
    is reported. Keys are any hashable values (they never leave this process)."""

    def __init__(self, reward: str, workers: int, timeout: float):
        fn = get_reward(reward)  # unknown names fail here, with the valid ones
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward_workers={workers!r}: need an integer >= 1 (rewards run in worker "
                             f"processes so that a hung call can be killed)")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"reward_timeout={timeout!r}: need a positive number of seconds")
        self.reward, self.workers, self.timeout = reward, workers, float(timeout)
        self._module = getattr(fn, "__module__", None)
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._inbox: deque[tuple[int, str, Any]] = deque()
        self._ids: dict[Hashable, int] = {}
        self._keys: dict[int, Hashable] = {}
        self._results: dict[int, tuple[str, Any]] = {}
        self._counter = itertools.count()
        self._fatal: Optional[str] = None
        self._closed = False
        self.replaced = 0  # workers killed at a timeout (or found dead) and started afresh
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._dispatch, name="reward-pool", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------------
    def submit(self, key: Hashable, text: str, answer: Any) -> None:
        """Queue one response for scoring; returns at once."""
        if not isinstance(text, str):
            raise TypeError(f"key {key!r}: the response text must be a str, got {type(text).__name__}")
        with self._cond:
            if self._closed:
                raise RuntimeError("RewardPool.submit after close()")
            if self._fatal is not None:
                raise RuntimeError(f"reward pool stopped: {self._fatal}")
            if key in self._ids:
                raise ValueError(f"key {key!r} was submitted already and not yet collected")
            i = next(self._counter)
            self._ids[key], self._keys[i] = i, key
            self._inbox.append((i, text, answer))
        self._wake()

    def collect(self, keys: Iterable[Hashable]) -> Collected:
        """Wait for these keys' scores (each key once; every key must have been submitted).
        Raises RewardError, naming the keys, if the reward function failed on any of them."""
        start = time.perf_counter()
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("collect: duplicate keys")
        with self._cond:
            missing = [k for k in keys if k not in self._ids]
            if missing:
                raise KeyError(f"collect: keys never submitted (or already collected): {missing[:10]}")
            ids = [self._ids[k] for k in keys]
            while not all(i in self._results for i in ids):
                if self._fatal is not None:
                    raise RuntimeError(f"reward pool stopped: {self._fatal}")
                if self._closed:
                    raise RuntimeError("RewardPool closed while collect() was waiting")
                self._cond.wait()
            results = [self._results.pop(i) for i in ids]
            for k, i in zip(keys, ids):
                del self._ids[k], self._keys[i]
        wait_s = time.perf_counter() - start
        scores, timed_out, errors = {}, [], []
        for k, (status, value) in zip(keys, results):
            if status == _OK:
                scores[k] = value
            elif status == _TIMEOUT:
                scores[k] = 0.0
                timed_out.append(k)
            else:
                errors.append((k, value))
        if errors:
            raise RewardError(self.reward, errors)
        return Collected(scores, timed_out, wait_s)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake()
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # already awake (buffer full) or closing
            pass

    # -- dispatcher thread ------------------------------------------------------------------------
    def _dispatch(self) -> None:
        workers: list[_Worker] = []
        pending: deque[tuple[int, str, Any]] = deque()
        try:
            workers = [_Worker(self._ctx, self.reward, self._module) for _ in range(self.workers)]
            while True:
                with self._cond:
                    if self._closed:
                        break
                    pending.extend(self._inbox)
                    self._inbox.clear()
                for n, w in enumerate(workers):
                    if w.ready and w.task is None and pending:
                        task = pending.popleft()
                        try:
                            w.conn.send(task)
                        except OSError:  # died while idle: the call was not started
                            pending.appendleft(task)
                            workers[n] = self._replace(w, "found dead while idle")
                            continue
                        w.task, w.started = task, time.monotonic()
                busy = [w.started + self.timeout for w in workers if w.task is not None]
                wait_s = max(0.0, min(busy) - time.monotonic()) if busy else None
                readable = wait([w.conn for w in workers] + [self._wake_r], timeout=wait_s)
                if self._wake_r in readable:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                for n, w in enumerate(workers):
                    if w.conn in readable:
                        workers[n] = self._receive(w)
                now = time.monotonic()
                for n, w in enumerate(workers):
                    if w.task is not None and now - w.started >= self.timeout:
                        task_id, text, _ = w.task
                        log.warning("reward %r: call for key %r ran past %.1f s; worker killed and "
                                    "replaced, scored 0.0 (response starts: %r)", self.reward,
                                    self._keys.get(task_id), self.timeout, text[:200])
                        self._finish(task_id, _TIMEOUT, 0.0)
                        w.task = None
                        workers[n] = self._replace(w, None)
        except BaseException as e:  # noqa: BLE001 — a dispatcher bug must not leave collect() waiting
            with self._cond:
                self._fatal = str(e) if isinstance(e, _PoolStopped) else traceback.format_exc()
                self._cond.notify_all()
        finally:
            # Workers hold nothing to flush (results travel only on their own pipe): killing is
            # immediate, where a clean exit spends ~0.5 s tearing down sympy, and a worker inside
            # a call would not read a stop message anyway.
            for w in workers:
                w.kill()

    def _receive(self, w: _Worker) -> _Worker:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(timeout=10)
            if not w.ready:
                raise _PoolStopped(f"reward worker for {self.reward!r} exited (code {w.proc.exitcode}) "
                                   f"before it was ready") from None
            if w.task is not None:
                self._finish(w.task[0], _ERROR, f"the reward worker process died (exit code "
                                                f"{w.proc.exitcode}) during this call")
                w.task = None
            return self._replace(w, "died")
        if msg[0] == "fatal":
            raise _PoolStopped(f"reward worker for {self.reward!r} could not start (workers import the "
                               f"module that registered the reward, {self._module!r}, and look the name "
                               f"up; register it at that module's import time):\n{msg[1]}")
        if msg[0] == "ready":
            w.ready = True
            return w
        task_id, status, value = msg
        w.task = None
        self._finish(task_id, status, value)
        return w

    def _replace(self, w: _Worker, why: Optional[str]) -> _Worker:
        if why:
            log.warning("reward %r: worker pid %s %s (exit code %s); starting a new one",
                        self.reward, w.proc.pid, why, w.proc.exitcode)
        w.kill()
        self.replaced += 1
        return _Worker(self._ctx, self.reward, self._module)

    def _finish(self, task_id: int, status: str, value: Any) -> None:
        with self._cond:
            self._results[task_id] = (status, value)
            self._cond.notify_all()
