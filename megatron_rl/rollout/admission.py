"""Admission to the rollout fleet: each server's concurrency, one budget for every producer.

A job has many producers (one per data-parallel rank, and a thread per target in the making), each
with its own `RolloutClient`. Each client takes a slot of a server before it sends a request there
and gives it back once the answer is in. The counts live in one c10d store: the job's TCPStore on
rank 0 (every producer of the job), or `LocalCounts` in one process. So the fleet as
a whole keeps each server at its capacity, whichever producers send:
- a request goes to the server with the lowest load (slots taken / capacity) that has a free slot,
  ties broken by a per-budget rotation (no first-URL bias);
- with every slot taken, requests wait in their client (first in, first out), not in a server's
  queue, so the next free slot anywhere takes the next request; a server never holds work another
  could start now.
Per request that is three store operations (read the loads, take, give back), against a request
that decodes for seconds to minutes. A client whose requests wait polls the store every
`FleetBudget.POLL_S` for slots other producers gave back (its own are seen at once).

Why a store and not a router process in front of the servers (sglang-router, as slime and Miles
run): the client has to know which server answers a request. It aborts a request there by its rid,
watches that server for stalls (client.py), takes a restarted server back only with the pushed
weights, and holds servers out of rotation for an evaluation beside training. A router hides all of
that behind one URL. It would also be one more process to supervise, and it counts requests per
router, not per job, so sixteen producers would still need one view. The store is already there
(every rank's process group has it), and a slot count is what SGLang itself cannot give us: its
scheduler admits whatever arrives.

Capacity: `rollout.max_inflight_per_server` when set (slots per server for the whole job), else
derived from what the server reports (/server_info): as many sequences as its KV pool holds at
SGLang's own first admission estimate (`KV_NEW_TOKEN_RATIO` of max_new_tokens each), at most its
`max_running_requests`. An evaluation has a budget of its own
(`Fleet.evaluate`), so it never takes training's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence

# SGLang's SGLANG_INIT_NEW_TOKEN_RATIO: the share of max_new_tokens its scheduler reserves for a
# request it admits, before it has learnt how long responses run.
KV_NEW_TOKEN_RATIO = 0.7
DEFAULT_CAPACITY = 64  # a server that does not report its KV pool


def derived_capacity(info: Mapping, max_new_tokens: int) -> int:
    """Sequences a server runs at once, from its /server_info: KV pool tokens over what SGLang
    reserves per request (KV_NEW_TOKEN_RATIO x max_new_tokens), at most its max_running_requests;
    DEFAULT_CAPACITY when it reports neither."""
    states = info.get("internal_states") or [{}]
    running = states[0].get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
    pool = info.get("max_total_num_tokens")
    if not pool:
        return int(running) if running else DEFAULT_CAPACITY
    per_request = max(1, math.ceil(KV_NEW_TOKEN_RATIO * max_new_tokens))
    fits = max(1, int(pool) // per_request)
    return min(fits, int(running)) if running else fits


class FleetBudget:
    """Slots of each server, counted in `store` under `prefix` (shared by every FleetBudget made
    with the same store and prefix, across threads and processes). `capacity`: slots per server,
    one number for all or a URL -> slots mapping (a URL it lacks gets the smallest)."""

    POLL_S = 0.05  # a waiting client looks for slots given back by other producers this often

    def __init__(self, store, prefix: str, capacity: int | Mapping[str, int], seed: int = 0):
        if isinstance(capacity, Mapping):
            if not capacity or min(capacity.values()) < 1:
                raise ValueError(f"capacity {dict(capacity)}: at least 1 slot per server")
        elif capacity < 1:
            raise ValueError(f"capacity = {capacity}: at least 1 slot per server")
        self.store, self.prefix, self.capacity = store, prefix, capacity
        self._known: set[str] = set()
        self._order = random.Random(seed).random()  # this budget's place in the tie rotation
        self._turn = itertools.count()

    @classmethod
    def local(cls, capacity: int | Mapping[str, int]) -> "FleetBudget":
        """A budget of its own, counted in this process (its clones share it)."""
        return cls(LocalCounts(), "fleet", capacity)

    def cap(self, url: str) -> int:
        c = self.capacity
        return c if isinstance(c, int) else c.get(url, min(c.values()))

    def _key(self, url: str) -> str:
        return f"{self.prefix}/{url}"

    def loads(self, urls: Sequence[str]) -> list[int]:
        """Slots taken on each server, by every client of this budget."""
        fresh = [u for u in urls if u not in self._known]
        for u in fresh:  # multi_get needs every key to exist
            self.store.add(self._key(u), 0)
        self._known.update(fresh)
        return [int(v) for v in self.store.multi_get([self._key(u) for u in urls])] if urls else []

    def take(self, urls: Sequence[str]) -> str | None:
        """A slot of the least loaded of `urls` with one free (counted from now on), or None when
        all are full."""
        urls = list(dict.fromkeys(urls))
        if not urls:
            return None
        turn = next(self._turn)
        n = len(urls)
        loads = self.loads(urls)
        ranked = sorted(range(n), key=lambda i: (loads[i] / self.cap(urls[i]),
                                                 (i - turn - int(self._order * n)) % n))
        for i in ranked:
            if loads[i] >= self.cap(urls[i]):
                break  # sorted by load: the rest are full too
            if self.store.add(self._key(urls[i]), 1) <= self.cap(urls[i]):
                return urls[i]
            self.store.add(self._key(urls[i]), -1)  # another producer took the last one meanwhile
        return None

    def give(self, url: str) -> None:
        self.store.add(self._key(url), -1)

    def clone(self) -> "FleetBudget":
        """The same counts over a connection of its own (a TCPStore client is one socket: one per
        thread)."""
        store = self.store if isinstance(self.store, LocalCounts) else self.store.clone()
        return FleetBudget(store, self.prefix, self.capacity, seed=random.getrandbits(32))


class LocalCounts:
    """The two store operations a budget uses, in this process (thread-safe)."""

    def __init__(self):
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, key: str, value: int) -> int:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + value
            return self._counts[key]

    def multi_get(self, keys: Sequence[str]) -> list[int]:
        with self._lock:
            return [self._counts[k] for k in keys]


class RequestLine:
    """One client's requests waiting for a slot, first in first out: each waits for the server whose
    slot the pump took for it. Slots this client gives back (`freed`) are granted at once, those of
    other clients every `FleetBudget.POLL_S`.

    `take(avoid)`: a slot of an up server (not `avoid` while another is up), or None; `any_up()`:
    whether any server is up (with none, waiting requests go back to the client's wait for one,
    given None); `release(url)`: gives a slot back."""

    def __init__(self, take, any_up, release, poll_s: float):
        self._take, self._any_up, self._release, self._poll_s = take, any_up, release, poll_s
        self._line: deque = deque()  # (server to avoid, the future the pump sets)
        self._pump_task = None
        self._freed = asyncio.Event()  # the client gave a slot back

    def __bool__(self) -> bool:
        return bool(self._line)

    def freed(self) -> None:
        self._freed.set()

    async def wait(self, avoid):
        """The server whose slot the pump took for this request, in arrival order; None when no
        server is up any more."""
        fut = asyncio.get_running_loop().create_future()
        entry = (avoid, fut)
        self._line.append(entry)
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                self._release(fut.result())  # granted as this request was cancelled: give it back
            with contextlib.suppress(ValueError):
                self._line.remove(entry)
            raise

    async def _pump(self) -> None:
        while self._line:
            while self._line:
                avoid, fut = self._line[0]
                if fut.done():  # its request was cancelled
                    self._line.popleft()
                    continue
                if not self._any_up():
                    url = None  # back to the client: probes and the wait for a server
                else:
                    url = self._take(avoid)
                    if url is None:
                        break
                self._line.popleft()
                fut.set_result(url)
            if not self._line:
                break
            self._freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), self._poll_s)

    async def close(self) -> None:
        task, self._pump_task = self._pump_task, None
        if task is not None:
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                await asyncio.gather(task, return_exceptions=True)
