"""Async HTTP client for SGLang servers: generation with log-probs / top-K / routed experts,
retries across servers, and thin wrappers for SGLang's control endpoints.

`RolloutClient.generate(prompts, sampling, n=...)` sends one `/generate` request per sample,
keyed by (prompt index, sample index). Each key is owned by exactly one asyncio task that
retries until it holds one finished sample, so every prompt ends with exactly n records and no
key is ever produced twice — whatever happens to the servers:
- connection errors, 5xx answers and timeouts mark the server down and retry the sample on
  another server (least loaded first) after exponential backoff (`backoff_initial` doubling up
  to `backoff_max`); a down server is probed (at most every DOWN_PROBE_S) and comes back into
  rotation once it answers (an `EngineManager`, or the sbatch script's supervisor, restarts dead
  servers on the same port) and, once the trainer has pushed weights (`expected_version`), holds
  the version of the last push: a restarted server holds its initial checkpoint until the next
  push. An answer under a version no push gave (a server restarted before this client saw it go)
  is retried elsewhere and marks the server down the same way. Both only while another server is
  up: with none, a server with other weights serves, and its records carry their versions (the
  trainer then pushes and generates the step again);
- a sample that the server aborted without us asking (e.g. `/pause_generation` in abort mode
  around a weight update) is retried the same way, without marking the server down — unless the
  client continues aborted samples (`continue_aborted`, partial rollouts): then the tokens the
  aborted request produced are kept, and the sample goes on as a new request of prompt + those
  tokens, with the remaining budget and the same `sampling_seed` (rid `…-s{k}a{attempt}` for
  segment k ≥ 1), until a segment ends on its own ("stop" / "length"). An aborted segment whose
  last token is an EOS (`eos_token_ids`) or a stop id ends the sample as "stop" (SGLang takes the
  abort before its stop checks, so such a token comes back as "abort"); one that used up the
  budget ends it as "length"; one with no token (aborted while queued), or without the routes
  asked for (queued after a retraction: the tokenizer answers it), is re-sent unchanged, as a
  retry. Each segment is retried on its own (a dead server costs only the segment in flight);
  the segments become ONE record (`records.merge_segments`: μ, top-K and versions per token from
  the segment that produced it, routes from the newest weight version), delivered once;
- the attempt on a server that timed out but is still alive is aborted there (`/abort_request`
  with its rid), so a late answer cannot come back as a second sample;
- 4xx answers (a bad request) are not retried: they raise at once with the server's message;
- a 200 answer that is malformed (a missing field, a string where a number belongs, a top-K row
  of the wrong width, routed experts of the wrong size or naming an expert ≥ num_experts, an
  unknown finish_reason: see wire.py) is a server bug, not retried: `RolloutError` names the
  sample (prompt and sample index), the request id and server, and the field's path in the
  response (e.g. `meta_info.output_token_logprobs[37][1]`).
After `max_attempts` failed attempts on one key the whole call raises `RolloutError` naming the
key, the servers tried and the errors. Every retry is logged and kept in `retry_events`.
`generate(..., on_record=f)` calls `f(record)` in the event loop as soon as each sample's record
is built, exactly once per (prompt, sample), so the caller can start on finished samples (e.g.
score rewards) while others are still generating.

Concurrency and time limits: a request takes a slot of its server before it is sent
(`rollout/admission.py`'s `FleetBudget`: each server's slots, shared by every client of the job when
the trainer passes one budget to all, else this client's own `max_inflight_per_server`). It goes
to the least loaded server with a free slot; with every slot taken it waits in this client, first
in first out, for the next slot anywhere, rather than in one server's queue.
What a request may take is measured by its server's progress, not by a clock that also counts
queueing: while this client has requests in flight on a server, a watchdog asks the server's
scheduler for its load (`/v1/loads`, answered between two forward batches) every
`stall_timeout / 4` s (at most 10 s). A server that gives no answer for `stall_timeout` seconds
(hung or dead: its HTTP front or its scheduler stuck) is marked down, its requests are aborted
there (best effort) and retried elsewhere; a request that waits in a busy server's queue, however
long, is never retried for it and never marks the server down. A scheduler loading weights answers
nothing until it is done, so `stall_timeout` must exceed the longest weight push (600 s by default,
against 2348 s of total timeout for a 16k-token request before). With the watchdog on, generation
requests have no total timeout unless `request_timeout` sets one (then a request not answered
within it, queueing included, is aborted and retried). With `stall_timeout=None` (no watchdog)
`request_timeout=None` derives the total timeout from each call's budget:
`generation_timeout_s(max_new_tokens)` = 300 s + max_new_tokens / 8 tokens per second (16384
tokens → 2348 s); `request_timeout_s` reads the same from a `RolloutConfig`. Control endpoints use
CONTROL_TIMEOUT_S unless told.

Where the pieces live: one server's HTTP surface and the parse of its answers in http.py
(`ServerAPI`), the admission budget and the line of waiting requests in admission.py, the stall
watchdog in watchdog.py; this module keeps each sample's retries and segments.

`RolloutClient.classify(sequences)` scores token-id sequences on servers of a reward model
(sequence classification, SGLang `--is-embedding`, route `/classify`), in chunks that are retried
on another server in the same way; scores come back in input order, one per sequence.

Seeds: with `SamplingParams.seed = s`, sample (i, j) is sent with SGLang's `sampling_seed =
s + i·n + j`, whichever server serves it (SGLang honours it only when the server runs with
`--enable-deterministic-inference`).

Control endpoints (routes and payloads of sglang 0.5.23's http_server.py) are methods of
`ServerAPI` (http.py), one per server; `RolloutClient.servers()` gives one for each current URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import aiohttp

from . import auth
from .admission import FleetBudget, RequestLine
from .http import (  # noqa: F401 (the errors, _loads and ServerAPI: re-exported)
    _CONNECTION_ERRORS, CONTROL_TIMEOUT_S, NO_TIMEOUT, GenerationAborted, RolloutError, SGLangHTTPError,
    ServerAPI, _loads,
)
from .watchdog import Stalled, StallWatchdog
from .records import UNKNOWN_VERSION, RolloutRecord, merge_segments, record_from_sglang, version_number
from .wire import MalformedResponse, finish_reason

logger = logging.getLogger(__name__)


class _Retryable(Exception):
    """An attempt failed in a way another attempt (maybe on another server) can fix."""

    def __init__(self, reason: str, server_down: bool):
        super().__init__(reason)
        self.server_down = server_down


class ServerPool(Protocol):
    def urls(self) -> list[str]: ...


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters of one generate call (all samples of all prompts)."""

    temperature: float = 1.0
    """Softmax temperature; returned log-probs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0: off)."""
    top_k: int = -1
    """Sample among the k most likely tokens (-1: off)."""
    max_new_tokens: int = 128
    """Generation budget per sample."""
    stop_token_ids: list[int] | None = None
    """Extra token ids that end a sample (the model's EOS always does)."""
    seed: int | None = None
    """Base seed; sample (i, j) uses seed + i·n + j (needs --enable-deterministic-inference)."""

    def to_sglang(self, sample_seed: int | None) -> dict[str, Any]:
        p: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                             "top_k": self.top_k, "max_new_tokens": self.max_new_tokens,
                             "skip_special_tokens": False}
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        if sample_seed is not None:
            p["sampling_seed"] = int(sample_seed)
        return p


@dataclasses.dataclass
class RetryEvent:
    """One failed attempt that was retried."""

    prompt_index: int
    sample_index: int
    attempt: int
    url: str
    reason: str
    time: float


KEEPALIVE_S = 2.0  # client-side idle keep-alive, below the server's
ABORT_WAIT_S = 5.0  # abort(): how long the servers' /abort_request answers are waited for, all together
TIMEOUT_BASE_S = 300.0  # queueing and prefill allowance of every generation request
FLOOR_DECODE_TOKENS_PER_S = 8.0  # slowest decode rate per request still counted as alive
STALL_TIMEOUT_S = 600.0  # default: seconds a busy server may give no sign of life (module docstring)
DOWN_PROBE_S = 1.0  # a down server is probed at most this often (every pick would probe it otherwise)


READ_SLOTS = 1
"""Responses read and parsed at once per client: a body is parsed into a record right after it is
read, so the process holds at most this many raw bodies (a 16k-token response with top-K and routes
is ~45 MB of JSON) however many requests are in flight."""


def generation_timeout_s(max_new_tokens: int) -> float:
    """Seconds a generation request with this budget may take: 300 + max_new_tokens / 8."""
    return TIMEOUT_BASE_S + max_new_tokens / FLOOR_DECODE_TOKENS_PER_S


def request_timeout_s(rollout_cfg) -> float:
    """The generation request timeout of a `RolloutConfig`: `request_timeout` when set, else
    derived from `max_new_tokens` (generation_timeout_s)."""
    if rollout_cfg.request_timeout is not None:
        return float(rollout_cfg.request_timeout)
    return generation_timeout_s(rollout_cfg.max_new_tokens)


class RolloutClient:
    """Generation over a pool of SGLang servers (see the module docstring for the guarantees).

    `servers`: fixed URLs, or a pool with `urls()` (e.g. an EngineManager) read at every pick.
    `request_timeout`: seconds per generation request (and /classify), queueing included; None: no
    total timeout while the stall watchdog runs, else derived from each generate call's
    max_new_tokens (generation_timeout_s); CONTROL_TIMEOUT_S for /classify.
    `stall_timeout`: seconds a server with requests of this client in flight may give no sign of
    life before it is marked down and they go elsewhere (module docstring); None: no watchdog.
    `budget`: the slots of each server this client takes before it sends there (admission.py), shared
    with the job's other clients; None: a budget of its own, `max_inflight_per_server` slots per
    server.
    `moe_topk`, `num_experts`: the router's top-k (num_experts_per_tok) and the experts per MoE
    layer, both needed to decode routed experts (ids are checked against num_experts, and
    num_experts picks the routes' dtype: records.route_dtype).
    `continue_aborted`: continue a sample the server aborted (a pause around a weight push) from
    its tokens so far instead of restarting it (module docstring); needs `eos_token_ids`, the
    model's EOS ids (tokenizer and generation_config), to tell an aborted segment that ended on
    one.
    """

    def __init__(self, servers: Sequence[str] | ServerPool, *, request_timeout: float | None = None,
                 connect_timeout: float = 10.0, max_attempts: int = 6,
                 backoff_initial: float = 0.5, backoff_max: float = 8.0,
                 server_wait_timeout: float = 300.0, max_inflight_per_server: int = 64,
                 budget: FleetBudget | None = None,
                 moe_topk: int | None = None, num_experts: int | None = None,
                 continue_aborted: bool = False, eos_token_ids: Sequence[int] = (),
                 stall_timeout: float | None = STALL_TIMEOUT_S):
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout = {stall_timeout}: seconds > 0, or None for no watchdog")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout = {request_timeout}: seconds > 0, or None to derive it "
                             "from max_new_tokens")
        if max_inflight_per_server < 1:
            raise ValueError(f"max_inflight_per_server = {max_inflight_per_server}: at least 1")
        if continue_aborted and not eos_token_ids:
            raise ValueError("continue_aborted needs eos_token_ids (the model's EOS ids): an aborted "
                             "segment that ended on one is finished, not continued")
        self.continue_aborted = continue_aborted
        self.eos_token_ids = frozenset(int(x) for x in eos_token_ids)
        self._urls: Callable[[], list[str]] = (
            (lambda: list(servers)) if isinstance(servers, (list, tuple)) else servers.urls)
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.server_wait_timeout = server_wait_timeout
        self.budget = budget if budget is not None else FleetBudget.local(max_inflight_per_server)
        self.moe_topk = moe_topk
        self.num_experts = num_experts
        self.retry_events: list[RetryEvent] = []
        self._down: dict[str, float] = {}
        self._next_probe: dict[str, float] = {}  # a down server is probed again from then on
        # The weight version every server in rotation holds (the trainer's last push), or None: a
        # down server returns only holding it (`_back`).
        self.expected_version: str | None = None
        self._stale_said: dict[str, str] = {}
        self._inflight: dict[str, dict[str, tuple[int, int]]] = {}
        self.sent: Counter[str] = Counter()  # attempts sent to each server
        # Requests waiting for a slot, first in first out (rollout/admission.py).
        self._line = RequestLine(self._take, lambda: any(u not in self._down for u in self._urls()),
                                 self._release, self.budget.POLL_S)
        # The stall watchdog (rollout/watchdog.py), None without one.
        self._watchdog = (StallWatchdog(stall_timeout, self._inflight, self._down, self.server)
                          if stall_timeout is not None else None)
        self._session: aiohttp.ClientSession | None = None
        self._aborted = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._read_gate = asyncio.Semaphore(READ_SLOTS)

    # --- session ----------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=auth.headers(),  # the job's key (rollout/auth.py), on every request
                # Idle pooled connections are dropped before the server's keep-alive timeout
                # (uvicorn: 5 s) closes them: reusing one the server has closed fails the
                # request ("Server disconnected") after every pause longer than that, e.g. each
                # training phase between two generation rounds.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                # Every request passes its own total timeout (ServerAPI); this sets the connect one.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                # Never through a user's http_proxy: the servers are the job's own (rollout/direct.py).
                trust_env=False)
        return self._session

    async def close(self) -> None:
        if self._watchdog is not None:
            await self._watchdog.close()
        await self._line.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def server(self, url: str) -> ServerAPI:
        return ServerAPI(url, self.session, CONTROL_TIMEOUT_S)

    def servers(self) -> list[ServerAPI]:
        return [self.server(u) for u in self._urls()]

    async def broadcast(self, method: str, *args, **kwargs) -> list[Any]:
        """Call one ServerAPI method on every server concurrently; results in URL order."""
        return list(await asyncio.gather(*(getattr(s, method)(*args, **kwargs)
                                           for s in self.servers())))

    # --- server choice ----------------------------------------------------------------------
    async def _pick(self, avoid: str | None) -> str:
        """A slot of the least loaded up server with one free (`budget`), other than `avoid` when
        another is up; with every slot taken, waits in line for the next one. The caller gives
        it back with `_release`."""
        deadline = time.monotonic() + self.server_wait_timeout
        delay = self.backoff_initial
        while True:
            if self._aborted.is_set():
                raise GenerationAborted("generation aborted")
            urls = self._urls()
            now = time.monotonic()
            for u in [u for u in urls if u in self._down and now >= self._next_probe.get(u, 0.0)]:
                self._next_probe[u] = now + DOWN_PROBE_S  # one probe per down server at a time
                if await self._back(u):
                    logger.warning("server %s answers again; back in rotation", u)
                    self._down.pop(u, None)  # concurrent picks may both see it recover
                    if self._watchdog is not None:
                        self._watchdog.recovered(u)
            if any(u not in self._down for u in urls):
                # Behind the requests already in line; else a slot now, or into the line.
                url = None if self._line else self._take(avoid)
                if url is None:
                    url = await self._line.wait(avoid)
                if url is not None:
                    self.sent[url] += 1
                    return url
                continue  # every server went down meanwhile
            if time.monotonic() > deadline:
                raise RolloutError(f"no SGLang server reachable for {self.server_wait_timeout:.0f}s "
                                   f"(all down: {sorted(self._down)})")
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.backoff_max)

    def _take(self, avoid: str | None) -> str | None:
        """A slot of an up server (not `avoid` while another is up), or None: all full or down."""
        up = [u for u in self._urls() if u not in self._down]
        return self.budget.take([u for u in up if u != avoid] or up)

    async def _back(self, url: str) -> bool:
        """A down server may serve again: its scheduler answers (the watchdog's probe: a hung
        server's HTTP front may still answer /health; /health without the watchdog) and, when
        `expected_version` is set, it holds those weights. A server restarted under the run holds
        its initial checkpoint until the trainer's next push gives it the current weights."""
        if not await (self._watchdog.alive(url) if self._watchdog is not None else self.server(url).health(timeout=2.0)):
            return False
        expected = self.expected_version
        if expected is None:
            return True
        try:
            version = str((await self.server(url).get_model_info()).get("weight_version"))
        except asyncio.CancelledError:
            raise
        except Exception:
            return False
        if version != expected:
            if not self._others_up(url):
                # No server holds the pushed weights (one server, or all restarted): serving from
                # other weights beats waiting for a push that needs this generation to finish. The
                # records say which weights (versions); the trainer pushes and generates again.
                logger.warning("server %s holds weight version %s, not %s, and no other server is up: back in "
                               "rotation (its records carry their version)", url, version, expected)
                return True
            if self._stale_said.get(url) != version:
                self._stale_said[url] = version
                logger.warning("server %s answers but holds weight version %s, not %s (restarted?): out of "
                               "rotation until the trainer pushes it the current weights", url, version, expected)
            return False
        return True

    def _others_up(self, url: str) -> bool:
        return any(u != url and u not in self._down for u in self._urls())

    def _release(self, url: str) -> None:
        self.budget.give(url)
        self._line.freed()

    # --- generation -------------------------------------------------------------------------
    async def _attempt(self, url: str, payload: dict, timeout: float, route: str = "/generate",
                       keep_partial: bool = False) -> Any:
        """One request. A server-side abort is retryable, or with `keep_partial` an answer when
        it holds tokens (the caller continues from them)."""
        api = self.server(url)
        try:
            request = api.post(route, payload, timeout=timeout, gate=self._read_gate if route == "/generate" else None)
            out = await (self._watchdog.watched(url, request) if self._watchdog is not None else request)
        except Stalled as e:
            if "rid" in payload:  # it may come back to life: the answer must not come back too
                try:
                    await asyncio.wait_for(api.abort_request(payload["rid"]), 2.0)
                except Exception:
                    pass
            raise _Retryable(str(e), server_down=True) from e
        except SGLangHTTPError as e:
            if e.status >= 500:
                raise _Retryable(f"HTTP {e.status}: {e.body[:200]}", server_down=True) from e
            raise
        except asyncio.TimeoutError as e:
            # The server may still be working on it: abort that attempt there, best effort.
            if "rid" in payload:
                try:
                    await asyncio.wait_for(api.abort_request(payload["rid"]), 5.0)
                except Exception:
                    pass
            raise _Retryable(f"no answer within {timeout:.0f}s", server_down=True) from e
        except _CONNECTION_ERRORS as e:
            raise _Retryable(f"{type(e).__name__}: {e}", server_down=True) from e
        if route != "/generate":
            return out
        if isinstance(out, list):  # a batch of one (SGLang answers a list for list inputs)
            if len(out) != 1:
                raise MalformedResponse("(response)", f"a list of {len(out)} answers to one request")
            out = out[0]
        if finish_reason(out) == "abort":
            if self._aborted.is_set():
                raise GenerationAborted("generation aborted")
            # Continued only with its tokens' routes: a request aborted in the waiting queue after
            # a retraction (KV pressure) is answered by the tokenizer, with no routes (the module
            # docstring); it is re-sent from the tokens before it instead.
            routed = not payload.get("return_routed_experts") or out["meta_info"].get("routed_experts") is not None
            if keep_partial and isinstance(out.get("output_ids"), list) and out["output_ids"] and routed:
                return out
            raise _Retryable(f"aborted by the server ({out['meta_info']['finish_reason']})",
                             server_down=False)
        if self.expected_version is not None:
            version = (out.get("meta_info") or {}).get("weight_version")
            if (version is not None and version_number(str(version)) == UNKNOWN_VERSION
                    and self._others_up(url)):
                # Restarted (by the launcher's supervisor) since the trainer's last push, before
                # this client noticed it go: its answer is not from the learner's weights.
                raise _Retryable(f"answered under weight version {version!r}, which no push gave it "
                                 "(restarted with its initial checkpoint)", server_down=True)
        return out

    async def _retrying(self, what: str, i: int, j: int, call: Callable[[str, int], Awaitable[Any]]) -> Any:
        """`call(url, attempt)` on a server picked per attempt until one succeeds; a retryable
        failure marks its server down (if it is) and moves to another. `i`, `j` label the
        RetryEvents."""
        errors: list[str] = []
        url = None
        delay = self.backoff_initial
        for attempt in range(self.max_attempts):
            url = await self._pick(avoid=url if errors else None)
            try:
                try:
                    return await call(url, attempt)
                finally:
                    self._release(url)  # before any back-off: the next pick must not count it
            except _Retryable as e:
                if self._aborted.is_set():  # abort() cut it (connections close under it): no retry, no "down"
                    raise GenerationAborted("generation aborted by RolloutClient.abort()") from e
                errors.append(f"{url}: {e}")
                if e.server_down and url not in self._down:
                    self._down[url] = time.monotonic()
                    logger.error("server %s failed (%s); marking it down", url, e)
                self.retry_events.append(RetryEvent(i, j, attempt, url, str(e), time.time()))
                logger.warning("%s attempt %d on %s failed: %s; retrying", what, attempt, url, e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.backoff_max)
        raise RolloutError(f"{what} failed {self.max_attempts} times; nothing was returned for it. "
                           f"Errors: " + " | ".join(errors))

    async def _sample(self, batch: str, i: int, j: int, prompt: list[int], payload_base: dict,
                      sampling: SamplingParams, n: int, top_k: int, routed: bool,
                      timeout: float,
                      on_record: Callable[[RolloutRecord], Any] | None) -> RolloutRecord:
        seed = None if sampling.seed is None else sampling.seed + i * n + j
        what = f"sample (prompt {i}, sample {j})"
        ids, budget, k = list(prompt), sampling.max_new_tokens, 0

        async def call(url: str, attempt: int) -> RolloutRecord:
            rid = f"{batch}-{i}-{j}-a{attempt}" if k == 0 else f"{batch}-{i}-{j}-s{k}a{attempt}"
            payload = dict(payload_base, input_ids=ids, rid=rid,
                           sampling_params=dataclasses.replace(sampling, max_new_tokens=budget).to_sglang(seed))
            try:
                self._inflight.setdefault(url, {})[rid] = (i, j)
                try:
                    out = await self._attempt(url, payload, timeout, keep_partial=self.continue_aborted)
                finally:
                    self._inflight[url].pop(rid, None)
                return record_from_sglang(out, prompt_ids=ids, prompt_index=i, sample_index=j,
                                          temperature=sampling.temperature, top_k=top_k,
                                          moe_topk=self.moe_topk if routed else None,
                                          num_experts=self.num_experts if routed else None)
            except MalformedResponse as e:
                raise RolloutError(f"{what}: request {rid} to {url}/generate got a malformed "
                                   f"response (a server bug; not retried): {e.field}: {e.detail}") from e

        # Segments: one unless the server aborts the sample and continue_aborted keeps its tokens.
        segments: list[tuple[int, RolloutRecord]] = []
        stops = self.eos_token_ids | set(sampling.stop_token_ids or ())
        while True:
            seg = await self._retrying(what if k == 0 else f"{what} segment {k}", i, j, call)
            segments.append((len(ids) - len(prompt), seg))
            ids += seg.response_ids.tolist()
            budget -= seg.num_response_tokens
            finish = seg.finish_reason
            if finish == "abort":  # wire.py's finish kinds; the fix-ups in the module docstring
                finish = "stop" if ids[-1] in stops else "length" if budget <= 0 else None
            if finish is not None:
                break
            k += 1
        if len(segments) == 1:
            record = seg
            record.finish_reason = finish
        else:
            record = merge_segments(prompt, ids[len(prompt):], segments, prompt_index=i, sample_index=j,
                                    finish_reason=finish)
            record.segments = [s for _, s in segments]
        if on_record is not None:
            on_record(record)
        return record

    async def classify(self, sequences: Sequence[Sequence[int]], chunk: int = 64) -> list[float]:
        """Reward-model scores of token-id sequences from servers of a sequence-classification
        model (SGLang `--is-embedding`, route /classify): the first label's score per sequence, in
        order. Sent in chunks of `chunk` sequences, each retried on another server on failure."""
        async def one(k: int, part: list[list[int]]) -> list[float]:
            async def call(url: str, attempt: int) -> list[float]:
                out = await self._attempt(url, {"input_ids": part}, timeout, route="/classify")
                out = out if isinstance(out, list) else [out]
                if len(out) != len(part) or not all("embedding" in o for o in out):
                    raise RolloutError(f"/classify on {url} answered {len(out)} items for {len(part)} "
                                       f"sequences (is it serving a sequence-classification model "
                                       f"with --is-embedding?)")
                return [float(o["embedding"][0]) for o in out]

            return await self._retrying(f"reward scores (chunk {k})", k, -1, call)

        timeout = CONTROL_TIMEOUT_S if self.request_timeout is None else self.request_timeout
        seqs = [list(map(int, s)) for s in sequences]
        parts = [seqs[a:a + chunk] for a in range(0, len(seqs), chunk)]
        results = await asyncio.gather(*(one(k, p) for k, p in enumerate(parts)))
        return [x for r in results for x in r]

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                       n: int = 1, top_k_logprobs: int = 0, return_routed_experts: bool = False,
                       on_record: Callable[[RolloutRecord], Any] | None = None,
                       ) -> list[list[RolloutRecord]]:
        """n samples for each prompt (token ids): result[i][j] is sample j of prompt i.

        `on_record(record)`: called in the event loop as soon as each record is built, once per
        (prompt, sample), before this call returns. If it raises, the call stops as on any error
        (the other samples are cancelled) and raises that exception. Records already delivered
        when a call fails or is aborted are not delivered again by it.
        """
        if return_routed_experts and (self.moe_topk is None or self.num_experts is None):
            raise ValueError("return_routed_experts needs the client's moe_topk (num_experts_per_tok) "
                             f"and num_experts (experts per MoE layer); got moe_topk={self.moe_topk}, "
                             f"num_experts={self.num_experts}")
        timeout = (self.request_timeout if self.request_timeout is not None
                   else NO_TIMEOUT if self.stall_timeout is not None
                   else generation_timeout_s(sampling.max_new_tokens))
        self._aborted.clear()
        batch = uuid.uuid4().hex[:12]
        payload_base = {"return_logprob": True, "logprob_start_len": -1, "stream": False}
        if top_k_logprobs:
            # SGLang's flat base64 top-K (float32 / int32 arrays, wire.py): 213 B a token at K = 20
            # against ~660 of [logp, id, null] JSON. Non-streamed requests only, as every one here.
            payload_base.update(top_logprobs_num=top_k_logprobs, return_flat_raw_output_top_logprobs=True,
                                return_flat_raw_top_logprobs_b64=True)
        if return_routed_experts:
            payload_base.update(return_routed_experts=True, routed_experts_start_len=0)
        keys = list(itertools.product(range(len(prompts)), range(n)))
        tasks = {(i, j): asyncio.ensure_future(self._sample(
                    batch, i, j, list(map(int, prompts[i])), payload_base, sampling, n,
                    top_k_logprobs, return_routed_experts, timeout, on_record))
                 for i, j in keys}
        self._tasks.update(tasks.values())
        try:
            await asyncio.gather(*tasks.values())
        except BaseException as e:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            if self._aborted.is_set() and not isinstance(e, GenerationAborted):
                raise GenerationAborted("generation aborted by RolloutClient.abort()") from e
            raise
        finally:
            self._tasks.difference_update(tasks.values())
        out = [[tasks[(i, j)].result() for j in range(n)] for i in range(len(prompts))]
        assert all(r.prompt_index == i and r.sample_index == j
                   for i, row in enumerate(out) for j, r in enumerate(row))
        return out

    async def generate_until(self, deadline_s: float, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                             n: int = 1, on_record: Callable[[RolloutRecord], None] | None = None,
                             **kw) -> tuple[list[list[RolloutRecord]], int]:
        """`generate` within `deadline_s` seconds: every sample if they all finish in time; else the
        samples finished by then (each prompt's, by sample index), the number missing, and every
        request still running aborted. After a deadline this client is spent (`abort`): make a new
        one."""
        delivered: list[RolloutRecord] = []

        def keep(rec: RolloutRecord) -> None:
            delivered.append(rec)
            if on_record is not None:
                on_record(rec)

        task = asyncio.ensure_future(self.generate(prompts, sampling, n=n, on_record=keep, **kw))
        try:
            return await asyncio.wait_for(asyncio.shield(task), deadline_s), 0
        except asyncio.TimeoutError:
            await self.abort()
            with contextlib.suppress(GenerationAborted, asyncio.CancelledError):
                await task
        groups: list[list[RolloutRecord]] = [[] for _ in prompts]
        for rec in sorted(delivered, key=lambda r: (r.prompt_index, r.sample_index)):
            groups[rec.prompt_index].append(rec)
        return groups, len(prompts) * n - len(delivered)

    async def abort(self) -> None:
        """Abort every in-flight request of this client; running `generate` calls raise
        GenerationAborted."""
        self._aborted.set()
        calls = [self.server(u).abort_request(rid)
                 for u, rids in self._inflight.items() for rid in list(rids)]
        # Best effort, bounded: a busy server answers hundreds of aborts slowly, and a stop must not
        # wait for them (the requests' connections close with their tasks below in any case).
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), ABORT_WAIT_S)
        for t in list(self._tasks):
            t.cancel()
