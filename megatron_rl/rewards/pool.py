"""Rewards scored in worker processes while generation runs, each call under a timeout.

`RewardPool(reward, workers, timeout, on_error)` scores the reward `reward` (a built-in name or a
user's function by import path, `my_pkg.my_module:my_fn` or `path/to/file.py:my_fn`; see
rewards/__init__.py) in `workers` processes. `submit(key, text, answer)` only queues (cheap enough
for an asyncio callback as each response arrives); a dispatcher thread hands the queued calls to
idle workers, so scoring overlaps generation. `collect(keys)` waits for those keys and returns
their scores. `wait_ready(timeout)` waits for every worker to have loaded the reward (calls
submitted before just queue; tests use it to know where the next call goes).

Function kinds (`reward_kind`): a sync per-sample function `fn(response, answer) -> float` gets
one call at a time per worker. A batched function (`@batched` / `fn.batched = True`)
`fn(responses, answers) -> list[float]` gets the calls queued when a worker falls idle — split
evenly over the idle workers, at most `max_batch_size` (default 64) per call — so batches form by
themselves while generation runs: small while responses trickle in, larger when they queue up. An
`async def` per-sample function gets such a group too and awaits its calls concurrently
(`asyncio.gather`); an `async def` batched function is awaited. Each worker keeps one event loop
for all its calls, so a client a user's module caches stays bound to a live loop.

Timeouts: `timeout` bounds each call of the function — for a batch or an async group, the whole
call. Its clock starts when a ready worker receives the call (time queued behind other calls does
not count). A call still running past `timeout` seconds has its worker killed (SIGKILL) and
replaced by a fresh process. A single sample's call then scores 0.0 and its key is reported in
`timed_out`; a batch or group is queued again one sample per call, so only the sample that hangs
times out and the others keep their real scores (they are scored twice: a reward function must be
safe to call again). So a pathological answer costs at most two timeouts, never the step; a batch
that was merely slow costs one timeout and is logged — size `timeout` for `max_batch_size`
responses. math-verify's own limits (SIGALRM, 5 s per parse and per verify, main thread only —
the workers call it on theirs) end most such answers (measured: `\\boxed{2^{2^{40}}}` scores 0
after ~6 s), but a call stuck inside one C operation does not see the signal, and a reward need
not have any limit: the kill is the bound that always holds. Workers are processes for exactly
that reason: a hung thread cannot be stopped.

Results: a number, or one that says whether the answer is right (`Scored`, or a dict
{"reward": r, "correct": bool}; rewards/__init__.py), which reaches `collect` as a `Scored`.

Errors: an exception in the reward function, a result that is not a finite number (a str, None,
NaN; a dict without "reward", with other keys or a "correct" that is not a bool), a batched result
of the wrong length (an error for every sample of that call, naming the
function), or a worker process that dies mid-call. A batched call that raises, or a worker that
dies mid-batch, is retried one sample per call like a timeout, so the error names the sample that
caused it. With `on_error="fail"` (data.reward_on_error) `collect` raises `RewardError` naming
every failing sample — key, response (truncated), answer and traceback — after all the keys are
in, so the pool stays usable. With `on_error="zero"` those samples score 0.0 and are reported in
`errors` (the step's `reward/errors` metric); the first few are logged with the sample.

Workers are started with `spawn` (safe with torch and CUDA in the parent, unlike fork) and resolve
the reward themselves: a built-in or registered name by importing the module that registered it,
an import path by loading it as the parent did (a spawned worker gets the parent's sys.path and
working directory; a relative file path is made absolute in the parent, so a worker started after
the parent changed directory, e.g. a replacement, loads the same file). They ignore SIGINT,
SIGTERM, SIGUSR1 and SIGUSR2 (a launcher signals every process of the job; the trainer decides
shutdown and finishes its step first) and die with the pool's dispatcher thread (Linux
PR_SET_PDEATHSIG), so a hung call never outlives a killed trainer. As with any spawn start, a
worker re-imports the parent's main module: a script that makes a pool must guard its entry point
(`if __name__ == "__main__"`). There is no in-process mode: an inline call cannot be killed, so it
could not honour the timeout.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import inspect
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
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from megatron_rl.distributed.parent import die_with_parent
from typing import Any, Callable, Hashable, Iterable, Optional

from megatron_rl.plugins import absolute, is_import_path
from megatron_rl.rewards import RewardKind, Scored, get_reward, reward_kind

log = logging.getLogger(__name__)

_OK, _ERROR, _TIMEOUT = "ok", "error", "timeout"
ON_ERROR = ("fail", "zero")
_LOGGED_ERRORS = 5  # on_error=zero: samples logged in full per pool; later ones only counted
_SHOWN = 300  # characters of a response or answer in an error


class _PoolStopped(RuntimeError):
    """The dispatcher cannot go on (a worker could not start); collect() raises the message."""


def _clip(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= _SHOWN else f"{s[:_SHOWN]}... ({len(s)} characters)"


@dataclass
class FailedSample:
    """A sample the reward function failed on: its key, response, answer and the error (a
    traceback, or what was wrong with the result)."""

    key: Any
    response: str
    answer: Any
    error: str

    def __str__(self) -> str:
        return (f"key {self.key!r}\n  response: {_clip(self.response)}\n  answer: {_clip(self.answer)}\n"
                f"{self.error}")


class RewardError(RuntimeError):
    """The reward function failed on these samples (data.reward_on_error=fail): `errors`, a list
    of FailedSample."""

    def __init__(self, reward: str, errors: list[FailedSample]):
        self.errors = errors
        shown = "\n\n".join(str(e) for e in errors[:3])
        more = f"\n\n... and {len(errors) - 3} more" if len(errors) > 3 else ""
        keys = [e.key for e in errors]
        keys_shown = f"{keys[:8]}" if len(keys) <= 8 else f"{str(keys[:8])[:-1]}, ... ({len(keys)} keys)]"
        super().__init__(f"reward {reward!r} failed on {len(errors)} response(s), keys "
                         f"{keys_shown} (data.reward_on_error=zero scores them 0 and counts "
                         f"them in reward/errors instead):\n\n{shown}{more}")


@dataclass
class Collected:
    """What `collect(keys)` returns: a score for every key (0.0 for a timed-out call, and with
    on_error=zero for a failed one — both wrong answers), the keys whose call was killed at the
    timeout, the samples the function failed on (on_error=zero) and the seconds `collect` spent
    waiting. A score is a float; a `Scored` (rewards/__init__.py) where the function said whether
    the answer is right (`is_correct` reads it)."""

    scores: dict[Any, float]
    timed_out: list[Any]
    wait_s: float
    errors: list[FailedSample] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"reward/timeouts": float(len(self.timed_out)), "reward/errors": float(len(self.errors)),
                "time/reward_wait": self.wait_s}


# ------------------------------------------------------------------------------------------------
# Worker process


_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Signals a launcher sends to every process of a job (Ctrl-C; Slurm's preemption SIGTERM and
`--signal` USR1/USR2 reach the whole step): the trainer catches them, finishes its step — whose
rewards these workers score — and checkpoints; the workers die with it (PR_SET_PDEATHSIG)."""


_RESULT_KEYS = ("reward", "correct")


def _checked(reward: str, value: Any) -> tuple[str, Any]:
    """(status, score or error) for one result: a finite number — a `Scored` when the function said
    whether the answer is right (a Scored, or a dict {"reward": r, "correct": bool}) — or an error
    saying what it was."""
    correct = value.correct if isinstance(value, Scored) else None
    if isinstance(value, dict):
        extra = sorted(map(str, set(value) - set(_RESULT_KEYS)))
        if "reward" not in value or extra:
            return _ERROR, (f"reward {reward!r} returned the dict {_clip(value)}; a dict needs the key 'reward' "
                            f"and may have 'correct' (a bool){f', not {extra}' if extra else ''}")
        value, correct = value["reward"], value.get("correct")
        # A bool (numpy's too), or None: the threshold decides (data.correct_threshold).
        if correct is not None and not (isinstance(correct, bool) or type(correct).__name__ in ("bool_", "bool")):
            return _ERROR, (f"reward {reward!r} returned 'correct': {type(correct).__name__} {_clip(correct)}; "
                            "need True, False or None")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__float__"):
        return _ERROR, f"reward {reward!r} returned {type(value).__name__} {_clip(value)}, not a number"
    try:
        score = float(value)
    except (TypeError, ValueError) as e:  # e.g. an array of several numbers
        return _ERROR, f"reward {reward!r} returned {type(value).__name__} {_clip(value)}, not a number ({e})"
    if not math.isfinite(score):
        return _ERROR, f"reward {reward!r} returned {score}, not a finite number"
    return _OK, (score if correct is None else Scored(score, correct=bool(correct)))


def _traceback(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).strip()


async def _gather(awaitables: list) -> list:
    return await asyncio.gather(*awaitables, return_exceptions=True)


class _Caller:
    """Calls the reward function on one batch of (task_id, text, answer) in a worker; returns
    ([(task_id, status, value)], whole) — `whole`: a batched call raised, so no sample is known
    to be at fault (the parent retries them one per call)."""

    def __init__(self, fn: Callable, kind: RewardKind, reward: str):
        self.fn, self.kind, self.reward = fn, kind, reward
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def _await(self, awaitable):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def __call__(self, batch: list[tuple[int, str, Any]]) -> tuple[list[tuple[int, str, Any]], bool]:
        ids = [t for t, _, _ in batch]
        if self.kind.batched:
            try:
                out = self.fn([x for _, x, _ in batch], [a for _, _, a in batch])
                if inspect.isawaitable(out):
                    out = self._await(out)
            except Exception as e:  # noqa: BLE001 — reported with the samples
                return [(i, _ERROR, _traceback(e)) for i in ids], True
            if isinstance(out, (str, bytes)) or not hasattr(out, "__len__") or len(out) != len(batch):
                what = f"{len(out)} scores" if hasattr(out, "__len__") else f"a {type(out).__name__}"
                msg = (f"batched reward {self.reward!r} returned {what} for a batch of {len(batch)} responses; "
                       "it must return one score per response, in order")
                return [(i, _ERROR, msg) for i in ids], False
            return [(i, *_checked(self.reward, v)) for i, v in zip(ids, list(out))], False
        results, pending = [], []
        for i, text, answer in batch:
            try:
                value = self.fn(text, answer)
            except Exception as e:  # noqa: BLE001
                results.append((i, _ERROR, _traceback(e)))
                continue
            if inspect.isawaitable(value):
                pending.append((i, value))
            else:
                results.append((i, *_checked(self.reward, value)))
        if pending:
            # An async function's calls run concurrently (an LLM judge, a sandbox: mostly waiting).
            for (i, _), value in zip(pending, self._await(_gather([c for _, c in pending]))):
                results.append((i, _ERROR, _traceback(value)) if isinstance(value, BaseException)
                               else (i, *_checked(self.reward, value)))
        return results, False


def _worker_main(conn: Connection, reward: str, module: Optional[str], parent_pid: int) -> None:
    for sig in _IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)  # e.g. the trainer killed with -9 while this worker is stuck in a pathological call
    try:
        # A registered name: the module that registered it (a user's or a test's); the built-ins
        # load by name. An import path loads itself. A spawned child has already re-imported the
        # parent's __main__ (as __mp_main__).
        if module and module != "__main__":
            importlib.import_module(module)
        fn = get_reward(reward)
        call = _Caller(fn, reward_kind(fn, reward), reward)
    except BaseException:  # noqa: BLE001 — reported to the parent, which stops the pool
        conn.send(("fatal", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the pool is gone
            return
        conn.send(("result", *call(batch)))


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
        self.batch: Optional[list[tuple[int, str, Any]]] = None
        self.started = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class RewardPool:
    """Score the reward `reward` in `workers` processes; a call past `timeout` s scores 0.0 and
    is reported; a failed sample raises RewardError (on_error="fail") or scores 0.0 and is
    reported (on_error="zero"). Keys are any hashable values (they never leave this process)."""

    def __init__(self, reward: str, workers: int, timeout: float, on_error: str = "fail"):
        fn = get_reward(reward)  # unknown names and unloadable import paths fail here, clearly
        self.kind = reward_kind(fn, reward)
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward_workers={workers!r}: need an integer >= 1 (rewards run in worker "
                             f"processes so that a hung call can be killed)")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"reward_timeout={timeout!r}: need a positive number of seconds")
        if on_error not in ON_ERROR:
            raise ValueError(f"reward_on_error={on_error!r}; valid: {', '.join(ON_ERROR)}")
        self.reward, self.workers, self.timeout, self.on_error = reward, workers, float(timeout), on_error
        self._spec = absolute(reward)
        # A name: the workers import the module that registered it. An import path resolves itself.
        self._module = None if is_import_path(reward) else getattr(fn, "__module__", None)
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._inbox: deque[tuple[int, str, Any]] = deque()
        self._ids: dict[Hashable, int] = {}
        self._keys: dict[int, Hashable] = {}
        self._samples: dict[int, tuple[str, Any]] = {}  # (response, answer) until collected, for errors
        self._results: dict[int, tuple[str, Any]] = {}
        self._counter = itertools.count()
        self._fatal: Optional[str] = None
        self._closed = False
        self._logged = 0  # failed samples logged in full (on_error=zero)
        self.replaced = 0  # workers killed at a timeout (or found dead) and started afresh
        self._ready = 0  # workers that have loaded the reward and take calls
        # Dispatcher-thread state: calls not yet handed out, and those to run one per call.
        self._pending: deque[tuple[int, str, Any]] = deque()
        self._solo: set[int] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._dispatch, name="reward-pool", daemon=True)
        self._thread.start()
        # An owner that leaves on an exception may not close the pool; at interpreter exit
        # multiprocessing SIGTERMs its daemonic children and joins them — these ignore SIGTERM,
        # so exit would wait forever. Closing first (atexit runs this before multiprocessing's
        # handler, registered at its import) kills them.
        atexit.register(self.close)

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
            self._ids[key], self._keys[i], self._samples[i] = i, key, (text, answer)
            self._inbox.append((i, text, answer))
        self._wake()

    def collect(self, keys: Iterable[Hashable]) -> Collected:
        """Wait for these keys' scores (each key once; every key must have been submitted).
        on_error="fail": raises RewardError, naming the samples, if the reward function failed on
        any of them; "zero": those score 0.0 and are listed in `errors`."""
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
            samples = [self._samples.pop(i) for i in ids]
            for k, i in zip(keys, ids):
                del self._ids[k], self._keys[i]
        wait_s = time.perf_counter() - start
        scores, timed_out, errors = {}, [], []
        for k, (status, value), (text, answer) in zip(keys, results, samples):
            if status == _OK:
                scores[k] = value
            elif status == _TIMEOUT:
                scores[k] = Scored(0.0, correct=False)
                timed_out.append(k)
            else:
                scores[k] = Scored(0.0, correct=False)
                errors.append(FailedSample(k, text, answer, value))
        if errors and self.on_error == "fail":
            raise RewardError(self.reward, errors)
        if errors:
            show = errors[:max(0, _LOGGED_ERRORS - self._logged)]
            self._logged += len(show)
            log.warning("reward %r failed on %d of %d response(s), scored 0.0 (data.reward_on_error=zero, "
                        "counted in reward/errors)%s%s", self.reward, len(errors), len(keys),
                        "".join(f"\n\n{e}" for e in show),
                        "" if len(show) == len(errors) else
                        f"\n\n(samples are logged in full for the first {_LOGGED_ERRORS} errors of the run)")
        return Collected(scores, timed_out, wait_s, errors)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every worker has loaded the reward (calls submitted before simply queue);
        False if that takes longer than `timeout` s. Raises if the workers cannot start."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._ready < self.workers:
                if self._fatal is not None:
                    raise RuntimeError(f"reward pool stopped: {self._fatal}")
                if self._closed or time.monotonic() >= deadline:
                    return False
                self._cond.wait(deadline - time.monotonic())
            return True

    def close(self) -> None:
        atexit.unregister(self.close)
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
        pending = self._pending
        try:
            workers = [_Worker(self._ctx, self._spec, self._module) for _ in range(self.workers)]
            while True:
                with self._cond:
                    if self._closed:
                        break
                    pending.extend(self._inbox)
                    self._inbox.clear()
                idle = [n for n, w in enumerate(workers) if w.ready and w.batch is None]
                for left, n in zip(range(len(idle), 0, -1), idle):
                    if not pending:
                        break
                    # The queue split evenly over the idle workers, each share at most max_batch.
                    batch = self._take(-(-len(pending) // left))
                    w = workers[n]
                    try:
                        w.conn.send(batch)
                    except OSError:  # died while idle: the call was not started
                        pending.extendleft(reversed(batch))
                        workers[n] = self._replace(w, "found dead while idle")
                        continue
                    w.batch, w.started = batch, time.monotonic()
                busy = [w.started + self.timeout for w in workers if w.batch is not None]
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
                    if w.batch is not None and now - w.started >= self.timeout:
                        batch, w.batch = w.batch, None
                        # Replaced before the result is out: a caller that sees it sees `replaced`.
                        workers[n] = self._replace(w, None)
                        if len(batch) > 1:
                            log.warning("reward %r: a call on %d responses ran past %.1f s; worker killed "
                                        "and replaced, the responses are scored again one per call (if "
                                        "the call was only slow, raise data.reward_timeout or lower the "
                                        "function's max_batch_size)", self.reward, len(batch), self.timeout)
                            self._retry_alone(batch)
                        else:
                            task_id, text, answer = batch[0]
                            log.warning("reward %r: call for key %r ran past %.1f s; worker killed and "
                                        "replaced, scored 0.0 (response starts: %r; answer: %s)", self.reward,
                                        self._keys.get(task_id), self.timeout, text[:200], _clip(answer))
                            self._finish([(task_id, _TIMEOUT, 0.0)])
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

    def _take(self, share: int) -> list[tuple[int, str, Any]]:
        """The next call for one worker: a call queued to run alone, or up to `share` (at most
        max_batch) of the others."""
        pending = self._pending
        batch = [pending.popleft()]
        if batch[0][0] in self._solo:
            return batch
        while len(batch) < min(share, self.kind.max_batch) and pending and pending[0][0] not in self._solo:
            batch.append(pending.popleft())
        return batch

    def _retry_alone(self, batch: list[tuple[int, str, Any]]) -> None:
        """Queue a failed batch's calls again, first, one per call: only a sample at fault fails."""
        self._solo.update(t for t, _, _ in batch)
        self._pending.extendleft(reversed(batch))

    def _receive(self, w: _Worker) -> _Worker:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(timeout=10)
            if not w.ready:
                raise _PoolStopped(f"reward worker for {self.reward!r} exited (code {w.proc.exitcode}) "
                                   f"before it was ready") from None
            batch, w.batch = w.batch, None
            new = self._replace(w, "died")
            if batch is not None and len(batch) > 1:
                self._retry_alone(batch)
            elif batch is not None:
                self._finish([(batch[0][0], _ERROR, f"the reward worker process died (exit code "
                                                    f"{w.proc.exitcode}) during this call")])
            return new
        if msg[0] == "fatal":
            how = ("loads it by import path as the trainer did" if self._module is None else
                   f"imports the module that registered the name, {self._module!r}, and looks it up; "
                   "register it at that module's import time")
            raise _PoolStopped(f"reward worker for {self.reward!r} could not start (a worker {how}):\n{msg[1]}")
        if msg[0] == "ready":
            w.ready = True
            with self._cond:
                self._ready += 1
                self._cond.notify_all()
            return w
        _, results, whole = msg
        batch, w.batch = w.batch, None
        if whole and len(batch) > 1:
            self._retry_alone(batch)
        else:
            self._finish(results)
        return w

    def _replace(self, w: _Worker, why: Optional[str]) -> _Worker:
        if why:
            log.warning("reward %r: worker pid %s %s (exit code %s); starting a new one",
                        self.reward, w.proc.pid, why, w.proc.exitcode)
        w.kill()
        if w.ready:
            with self._cond:
                self._ready -= 1
        self.replaced += 1
        return _Worker(self._ctx, self._spec, self._module)

    def _finish(self, results: list[tuple[int, str, Any]]) -> None:
        with self._cond:
            for task_id, status, value in results:
                self._solo.discard(task_id)
                self._results[task_id] = (status, value)
            self._cond.notify_all()
