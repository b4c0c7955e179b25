"""The stall watchdog of one client: a server's progress, not a clock, decides when a request is
given up.

While a client has requests in flight on a server, the watchdog asks the server's scheduler for its
load (`/v1/loads`, answered between two forward batches) every `stall_timeout / 4` s (at most
10 s). A server that gives no answer for `stall_timeout` seconds (hung or dead: its HTTP front or
its scheduler stuck) is marked down and its requests are given up (`Stalled`: the client aborts
them there, best effort, and retries them elsewhere). A request that waits in a busy server's
queue, however long, is never given up for it and never marks the server down. A scheduler loading
weights answers nothing until it is done, so `stall_timeout` must exceed the longest weight push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)


class Stalled(Exception):
    """The watchdog found the request's server hung."""


class StallWatchdog:
    """`inflight`: the client's {server: {rid: ...}} of requests in flight; `down`: its {server:
    since} of servers out of rotation (the watchdog adds the hung ones); `server(url)`: the
    server's `ServerAPI`."""

    def __init__(self, stall_timeout: float, inflight: dict, down: dict, server: Callable[[str], Any]):
        self.stall_timeout = stall_timeout
        self.poll_s = min(10.0, stall_timeout / 4)
        self._inflight, self._down, self._server = inflight, down, server
        self._stalled: dict[str, asyncio.Event] = {}  # set by the watchdog: that server is hung
        self._task: asyncio.Task | None = None

    async def watched(self, url: str, request: Awaitable[Any]) -> Any:
        """`request` to `url`, given up (`Stalled`) as soon as the watchdog finds `url` hung."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._watch())  # one per client, on its event loop
        stalled = self._stalled.setdefault(url, asyncio.Event())
        task = asyncio.ensure_future(request)
        waiter = asyncio.ensure_future(stalled.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stalled(f"no sign of life for {self.stall_timeout:.0f}s (stall_timeout)")

    def recovered(self, url: str) -> None:
        """`url` is back in rotation: its requests are watched afresh."""
        self._stalled.pop(url, None)

    async def alive(self, url: str) -> bool:
        """The server's scheduler answers (between two forward batches): /v1/loads, core section."""
        try:
            await self._server(url).get("/v1/loads?include=core", timeout=self.poll_s)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _watch(self) -> None:
        """Probe every server this client has requests in flight on; one silent for stall_timeout
        seconds since it last answered (or since it got them) is declared hung."""
        heard: dict[str, float] = {}  # server -> when it last answered (or became busy)
        while True:
            await asyncio.sleep(self.poll_s)
            busy = [u for u, reqs in self._inflight.items() if reqs and u not in self._down]
            now = time.monotonic()
            heard = {u: heard.get(u, now) for u in busy}
            answers = await asyncio.gather(*(self.alive(u) for u in busy))
            now = time.monotonic()
            for u, ok in zip(busy, answers):
                if ok:
                    heard[u] = now
                elif now - heard[u] >= self.stall_timeout:
                    n = len(self._inflight.get(u, ()))
                    logger.error("server %s gave no sign of life for %.0fs with %d requests of this client in "
                                 "flight; marking it down and sending them elsewhere", u, now - heard[u], n)
                    self._down[u] = now
                    self._stalled.setdefault(u, asyncio.Event()).set()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                await asyncio.gather(task, return_exceptions=True)
