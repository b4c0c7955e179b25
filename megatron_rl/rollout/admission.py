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

Capacity: how many requests a server runs at once. `rollout.max_inflight_per_server`, when set,
is a fixed number for the whole job. Otherwise it follows the responses the job has seen, so that
the fleet fills each server's KV pool (`max_total_num_tokens` of its /server_info) without
queueing in it:
- What SGLang does with what it is sent (sglang 0.5.23, schedule_policy.py `PrefillAdder`,
  new_token_ratio_tracker.py): it admits a waiting request while its KV pool holds the running
  requests' tokens plus a reservation for what each may still decode, min(max_new - decoded,
  SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096) x new_token_ratio; the ratio starts at
  SGLANG_INIT_NEW_TOKEN_RATIO = 0.7, falls by (0.7 - 0.7 x 0.14) / 600 per decode step to about 0.1
  and goes back to 0.7 when the server idles; when decoding outgrows the pool it retracts requests
  (their KV is dropped and recomputed later) and raises the ratio. So SGLang fills its pool on its
  own, but what it does not admit waits in its queue, where another server's free room cannot
  take it: the fleet decides how many requests each server gets, and should give it what its
  pool holds, no more (queued there, or retracted) and no less (an empty cache decodes in smaller
  batches).
- Before any response is seen (the job's first step): the rule before issue 41, KV pool /
  (KV_NEW_TOKEN_RATIO x max_new_tokens) (`derived_capacity`: SGLang's first ratio over the whole
  budget, unclipped) - safe, and about 40 % of the pool at 16k tokens with a 6k mean response.
- Then: the KV a running request holds at a random moment, from the lengths of finished requests
  (`LengthStats`). A slot that is refilled at once (the fleet's slots are, while requests wait)
  spends time on a request in proportion to its length l (decode time), so the request in it at a
  random moment is drawn size-biased, l f(l) / E[l], and is uniformly far through its response:
  it holds c = p + U l tokens (prompt p, U uniform on [0, 1]), E[c] = E[p l] / E[l] + E[l^2] /
  (2 E[l]) and E[c^2] = (E[p^2 l] + E[p l^2] + E[l^3] / 3) / E[l]. n slots hold a sum of n such
  draws; `kv_capacity` takes the largest n whose mean plus KV_Z standard deviations fits the pool
  (n E[c] + KV_Z sqrt(n Var c) <= pool), at most the server's max_running_requests. At 16k
  tokens with lognormal lengths (median 4k, sigma 0.84, cut at 16k: a 5.5k mean) and 512-token
  prompts E[c] is 4.9k: 376-386 slots of a 2 M-token pool against the first estimate's 174, the
  pool 91 % full in the steady state (tests/unit/test_admission_kv.py). Lengths that grow or
  shrink over training move the caps: the statistics weigh the last LENGTH_WINDOW samples (older
  ones fade out proportionally).
- A step whose cache starts empty (synchronous training: every server drains before the push) is
  not that steady state: its first wave's requests are all young and hold little KV, then its
  long survivors peak together. Fixed at the steady state's number, slots keep such a step's
  pool about 0.77 full while requests wait (benchmarks/sim_kv_ramp.py; 0.68 in bench_fleet). So
  each server's slots follow its step's ramp (`ramp`): a fluid model of the first wave admits,
  tick by tick over one longest response, the most requests whose expected KV - every admitted
  request of age x holding p + x tokens with the survival S(x) of the lengths seen, from a
  histogram in `LengthStats` - stays under RAMP_TARGET (0.9) of the pool at every future tick.
  That gives about twice the steady slots while the cache is empty and fewer while the first
  wave's long survivors peak; the step's clock is the count of requests that ended on the server
  since it was last empty (counted in the store beside the slots: no decode speed needed), and
  past the ramp the steady state's `kv_capacity` holds. Simulated at the 30B shape, a step's pool
  is 0.90 full instead of 0.77 and the step 6 % shorter, never over the pool where the lengths
  are those seen (tests/unit/test_admission_kv.py, benchmarks/sim_kv_ramp.py). Responses longer
  than those seen pass the pool under either rule, and SGLang retracts: both rely on statistics
  that keep up with the lengths.
- Which lengths: only complete sets of samples - a producer's share of a step (`Fleet.generate`),
  an evaluation that finished - never a step's first finishers alone, which are its short ones
  (counting those while the long ones still run would overfill the pool).
- One capacity for every producer: the statistics are one value in the store (a JSON of the
  weighted sums), replaced by compare-and-set (`observe`: read, add, compare_set, again if another
  producer replaced it meanwhile), read with the loads at every take. Every producer computes the
  caps from the same value with the same function, so after an update every take anywhere uses
  the new caps; a take checks the count it made against the caps read in the same store call.
  When caps fall, no server gets a request until its count is under the new cap (nothing is
  cancelled); when they rise, the next take sees it.
The guarantees stay those of the fixed budget: requests wait in their producers, never in a
server's queue while another server has a free slot (SGLang may still hold a few in its queue for
a moment, when its reservation for what the running requests may still decode does not fit beside
them, or when lengths jump beyond the statistics; bench_fleet: none in a plain step at the 30B
shape, at most 81 with an evaluation beside); the least loaded server (count / cap) takes the next
request, so tokens per server stay even (max/min 1.014 there); a request waiting in its producer
has no timeout (client.py times only a server's progress). An evaluation has a budget of its own (`Fleet.evaluate`), with its
own statistics, so it never takes training's slots.

Shares of a server (`FleetBudget.set_share`): an evaluation beside training on the same servers
(rollout/evaluation.py) takes a share f of every server's room and training keeps the rest. The
share is one more value in the store, read with the loads at every take, so every producer's caps
follow it at its next take: a budget at share s computes its caps on s x the KV pool and
s x max_running_requests (fixed slots: s x the slots), at least 1 each. Training at 1 - f and the
evaluation at f together never pass a server's pool (to the floors), so neither makes the other
queue in SGLang; when a share falls, nothing is cancelled: the server takes no new request of that
budget until its count is under the new cap. The evaluation's share also grows into the room
training leaves at the end of its step (rollout/evaluation.py `Follower`), by `FleetBudget.grow`:
that room is empty as it is given, so the server's slots follow a step's `ramp` again, over the
whole new share, with the requests the evaluation already runs there in the model at the steady
state's ages (`steady_requests_later`). At the steady state's count instead, the room stays part
empty while its first requests are young: bench_fleet's evaluation beside training ended 4 % later
that way (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import itertools
import json
import math
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Optional

# SGLang's SGLANG_INIT_NEW_TOKEN_RATIO: the share of max_new_tokens its scheduler reserves for a
# request it admits, before it has learnt how long responses run.
KV_NEW_TOKEN_RATIO = 0.7
DEFAULT_CAPACITY = 64  # a server that does not report its KV pool
KV_Z = 2.0  # standard deviations of the slots' summed KV kept free below the pool
LENGTH_WINDOW = 8192  # samples the length statistics weigh (older ones fade out)
MIN_SAMPLES = 64  # finished samples before the statistics replace the first estimate


def derived_capacity(info: Mapping, max_new_tokens: int) -> int:
    """Sequences a server runs at once, from its /server_info, before any response is seen: KV
    pool tokens over SGLang's first ratio of the whole budget (KV_NEW_TOKEN_RATIO x max_new_tokens;
    SGLang's own reservation is clipped at 4,096 tokens), at most its max_running_requests;
    DEFAULT_CAPACITY when it reports neither."""
    kv = ServerKV.from_info(info)
    if not kv.pool:
        return kv.max_running or DEFAULT_CAPACITY
    per_request = max(1, math.ceil(KV_NEW_TOKEN_RATIO * max_new_tokens))
    fits = max(1, kv.pool // per_request)
    return min(fits, kv.max_running) if kv.max_running else fits


@dataclasses.dataclass(frozen=True)
class ServerKV:
    """A server's room, from its /server_info: KV pool tokens (max_total_num_tokens) and
    max_running_requests (per data-parallel rank); 0 where it reports none."""

    pool: int
    max_running: int

    @classmethod
    def from_info(cls, info: Mapping) -> "ServerKV":
        states = info.get("internal_states") or [{}]
        running = states[0].get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
        return cls(int(info.get("max_total_num_tokens") or 0), int(running or 0))

    def scaled(self, share: float) -> "ServerKV":
        """`share` of this room (an evaluation's share of the server, or training's rest)."""
        if share >= 1:
            return self
        return ServerKV(max(1, int(self.pool * share)) if self.pool else 0,
                        max(1, int(self.max_running * share)) if self.max_running else 0)


HIST_PER_OCTAVE = 4  # response-length histogram: bins of a quarter octave (19 % wide)
HIST_BINS = 80  # up to 2^20 tokens


def _bin(length: float) -> int:
    return min(HIST_BINS - 1, int(HIST_PER_OCTAVE * math.log2(max(1.0, length))))


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Weighted sums over finished samples (prompt p and response l tokens each): n and the sums of
    l, l^2, l^3, p l, p^2 l, p l^2 - what the KV of a running request takes (module docstring) -
    and the responses' histogram (`HIST_BINS` bins of a quarter octave, each its count and its
    lengths' sum: the survival of the lengths, which the step's ramp needs, `ramp`)."""

    n: float = 0.0
    l1: float = 0.0
    l2: float = 0.0
    l3: float = 0.0
    pl: float = 0.0
    p2l: float = 0.0
    pl2: float = 0.0
    hist: tuple[float, ...] = ()
    hist_sum: tuple[float, ...] = ()
    hist_sq: tuple[float, ...] = ()

    @classmethod
    def of(cls, prompts: Sequence[int], responses: Sequence[int]) -> "LengthStats":
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompt lengths for {len(responses)} responses")
        out = [0.0] * 7
        hist, hist_sum, hist_sq = [0.0] * HIST_BINS, [0.0] * HIST_BINS, [0.0] * HIST_BINS
        for p, l in zip(prompts, responses):
            p, l = float(p), float(l)
            for i, v in enumerate((1.0, l, l * l, l ** 3, p * l, p * p * l, p * l * l)):
                out[i] += v
            b = _bin(l)
            hist[b] += 1.0
            hist_sum[b] += l
            hist_sq[b] += l * l
        return cls(*out, hist=tuple(hist), hist_sum=tuple(hist_sum), hist_sq=tuple(hist_sq))

    def _sums(self) -> tuple[float, ...]:
        none = (0.0,) * HIST_BINS
        return (self.n, self.l1, self.l2, self.l3, self.pl, self.p2l, self.pl2,
                *(self.hist or none), *(self.hist_sum or none), *(self.hist_sq or none))

    def plus(self, other: "LengthStats", window: float = LENGTH_WINDOW) -> "LengthStats":
        """`other` added, the old samples scaled down so that at most `window` are weighed."""
        keep = max(0.0, min(1.0, (window - other.n) / self.n)) if self.n else 0.0
        sums = [a * keep + b for a, b in zip(self._sums(), other._sums())]
        B = HIST_BINS
        return LengthStats(*sums[:7], hist=tuple(sums[7:7 + B]), hist_sum=tuple(sums[7 + B:7 + 2 * B]),
                           hist_sq=tuple(sums[7 + 2 * B:]))

    def _bins(self):
        """(count, lower end, width) of the histogram's bins that have samples: each bin's
        lengths spread evenly over the interval of their mean and variance (a bin of one length,
        such as the cut at max_new_tokens, is that length alone)."""
        import numpy as np

        none = (0.0,) * HIST_BINS
        counts = np.asarray(self.hist or none, dtype=np.float64)
        has = counts > 0
        counts = counts[has]
        mean = np.asarray(self.hist_sum or none, dtype=np.float64)[has] / counts
        var = np.maximum(0.0, np.asarray(self.hist_sq or none, dtype=np.float64)[has] / counts - mean ** 2)
        width = np.sqrt(12 * var)
        width = np.where(width < 1e-6 * np.maximum(mean, 1.0), 0.0, width)  # one length (to rounding)
        return counts, mean - width / 2, width

    def survival(self, ages):
        """P(l > age) for each of `ages` (a numpy array), from the histogram (`_bins`)."""
        import numpy as np

        counts, lower, width = self._bins()
        if counts.sum() <= 0:
            raise ValueError("no response lengths in the histogram")
        x = np.asarray(ages, dtype=np.float64)[:, None]
        inside = np.clip((lower + width - x) / np.where(width > 0, width, 1.0), 0.0, 1.0)
        above = np.where(width > 0, inside, (lower > x).astype(np.float64))
        return (counts * above).sum(1) / counts.sum()

    def longest(self) -> float:
        """The longest response the histogram holds (0 with none)."""
        counts, lower, width = self._bins()
        return float(lower[-1] + width[-1]) if len(counts) else 0.0

    def kv_per_request(self) -> tuple[float, float]:
        """(mean, standard deviation) of the KV tokens a running request holds at a random moment
        while its slot is refilled at once: c = p + U l, the request drawn size-biased by l."""
        if self.l1 <= 0:
            raise ValueError("no decoded token among the samples")
        mean = (self.pl + self.l2 / 2) / self.l1
        second = (self.p2l + self.pl2 + self.l3 / 3) / self.l1
        return mean, math.sqrt(max(0.0, second - mean * mean))

    def to_json(self) -> str:
        """The store's value: the sums and a random tag, so that two producers that add the same
        sums to the same value never write the same text (compare_set tells them apart)."""
        return json.dumps([random.getrandbits(63), *self._sums()[:7], list(self.hist), list(self.hist_sum),
                           list(self.hist_sq)])

    @classmethod
    def from_json(cls, text) -> "LengthStats":
        if not text:
            return cls()
        values = json.loads(text)[1:]
        hists = [tuple(v) for v in values[7:10]]
        hists += [()] * (3 - len(hists))  # a value written before the histogram: none
        return cls(*values[:7], hist=hists[0], hist_sum=hists[1], hist_sq=hists[2])


def kv_capacity(kv: ServerKV, stats: LengthStats, z: float = KV_Z) -> int:
    """The most requests whose KV fits the server's pool: the largest n with
    n mean + z sqrt(n) std <= pool (`LengthStats.kv_per_request`), at most max_running_requests,
    at least 1."""
    mean, std = stats.kv_per_request()
    # n mean + z std sqrt(n) - pool = 0 is a quadratic in sqrt(n).
    root = (-z * std + math.sqrt(z * z * std * std + 4 * mean * kv.pool)) / (2 * mean)
    n = max(1, math.floor(root * root + 1e-9))
    return min(n, kv.max_running) if kv.max_running else n


RAMP_TARGET = 0.9  # the share of the pool a step's ramp keeps the expected KV under (sim_kv_ramp.py)
RAMP_TICKS = 256  # the ramp's grid: a longest response in this many ticks


@dataclasses.dataclass(frozen=True)
class Ramp:
    """A server's slots over a step whose cache starts empty: at the ramp's first tick t whose
    expected count of ended requests `ended[t]` reaches the requests that have ended since the
    server was last empty (the step's clock: counted, no decode speed needed), `caps[t]`;
    `steady` (`kv_capacity`) once its first wave is expected gone (module docstring)."""

    caps: tuple[int, ...]
    ended: tuple[float, ...]
    steady: int

    def cap(self, ended: int) -> int:
        t = bisect.bisect_left(self.ended, ended)
        return self.caps[t] if t < len(self.caps) else self.steady


def ramp(kv: ServerKV, stats: LengthStats, target: float = RAMP_TARGET, z: float = KV_Z,
         held: float = 0.0) -> Ramp:
    """The slots of a server whose cache starts empty, by a fluid model of its first wave
    (benchmarks/sim_kv_ramp.py, "schedule by ends"): on a grid of RAMP_TICKS ticks over the longest
    response seen, a request of age x holds g(x) = p + x tokens with probability S(x) (the
    histogram's survival; p the prompt, weighed by the response as in `kv_per_request`); at each
    tick admit the most requests whose expected KV, added to that of all admitted before, stays
    under target x pool at every future tick, at most max_running_requests running. The ramp lasts
    one longest response; `steady` after it.

    `held`: requests already running as the clock starts, at the steady state's ages (a share of
    the server held before `FleetBudget.grow` added room), each still running t later with
    probability R(t) and holding H(t) tokens (`steady_requests_later`): their expected KV is in
    the model from the start, their ends on its clock, and they count against
    max_running_requests and in the caps while they run."""
    import numpy as np

    steady = kv_capacity(kv, stats, z)
    longest = stats.longest()
    if not stats.hist or longest < 1 or not kv.pool:
        return Ramp((), (), steady)
    dt = max(1.0, longest / RAMP_TICKS)
    K = math.ceil(longest / dt)  # ages 0 .. (K - 1) dt, short of the longest
    ages = np.arange(K) * dt
    S = stats.survival(ages)
    prompt = stats.pl / stats.l1 if stats.l1 else 0.0
    g = (prompt + ages) * S
    live = g > 0
    limit = target * kv.pool
    max_running = kv.max_running or float("inf")
    admitted = np.zeros(K)
    future = np.zeros(2 * K)
    R = np.zeros(K)
    if held > 0:
        R, H = steady_requests_later(S, ages, prompt)
        future[:K] += held * H
    caps, ended = [], []
    for t in range(K):
        running = (float(admitted[:t] @ S[t - np.arange(t)]) if t else 0.0) + held * R[t]
        room = float(((limit - future[t:t + K])[live] / g[live]).min()) if live.any() else 0.0
        admitted[t] = max(0.0, min(math.floor(room), max_running - running))
        future[t:t + K] += admitted[t] * g
        ended.append(float(admitted[:t].sum()) + held - running)
        caps.append(max(1, int(running + admitted[t])))
    return Ramp(tuple(caps), tuple(ended), steady)


def steady_requests_later(S, ages, prompt: float):
    """For a request running at a random moment of a slot refilled at once (drawn size-biased by
    its length, uniformly far through it: `kv_per_request`), on the evenly spaced `ages` grid
    (from 0) with the lengths' survival S there: (R, H), the probability that it still runs t
    later and the tokens it is expected to hold then (0 once ended): R(t) = int_t S / E[l],
    H(t) = ((p + t) int_t S + int_t (x - t) S(x) dx) / E[l] (H(0) = E[c]); the integrals by the
    grid's sums from t on."""
    import numpy as np

    dt = float(ages[1] - ages[0]) if len(ages) > 1 else 1.0
    tail = np.cumsum(S[::-1])[::-1] * dt
    tail_x = np.cumsum((ages * S)[::-1])[::-1] * dt
    return tail / tail[0], ((prompt + ages) * tail + tail_x - ages * tail) / tail[0]


class FleetBudget:
    """Slots of each server, counted in `store` under `prefix` (shared by every FleetBudget made
    with the same store and prefix, across threads and processes). `capacity`: slots per server,
    one number for all or a URL -> slots mapping (a URL it lacks gets the smallest): fixed, or,
    with `kv` (URL -> ServerKV), the first estimate until `observe` has seen MIN_SAMPLES finished
    samples, then each server's `ramp` from the shared length statistics: its slots by the
    requests ended since it was last empty (counted here too), `kv_capacity` after a longest
    response. Either at the budget's share of each server (`set_share`, shared like the counts; 1
    until set)."""

    POLL_S = 0.05  # a waiting client looks for slots given back by other producers this often

    def __init__(self, store, prefix: str, capacity: int | Mapping[str, int], seed: int = 0,
                 kv: Optional[Mapping[str, ServerKV]] = None, ramps: bool = True):
        if isinstance(capacity, Mapping):
            if not capacity or min(capacity.values()) < 1:
                raise ValueError(f"capacity {dict(capacity)}: at least 1 slot per server")
        elif capacity < 1:
            raise ValueError(f"capacity = {capacity}: at least 1 slot per server")
        self.store, self.prefix, self.capacity = store, prefix, capacity
        self.kv = dict(kv) if kv else None
        self.ramps = ramps  # False: the steady state's kv_capacity from the first request on (the rule before)
        self._known: set[str] = set()
        self._order = random.Random(seed).random()  # this budget's place in the tie rotation
        self._turn = itertools.count()
        self._seen = (b"", b"1")  # the statistics and the share the caps below were computed from
        self._ramps: dict[str, Ramp] = {}
        self._clock: dict[str, int] = {}  # requests ended on each server since it was last empty
        self.share = 1.0
        self.held: Optional[float] = None  # after `grow`: the share held before it

    @classmethod
    def local(cls, capacity: int | Mapping[str, int], kv: Optional[Mapping[str, ServerKV]] = None) -> "FleetBudget":
        """A budget of its own, counted in this process (its clones share it)."""
        return cls(LocalCounts(), "fleet", capacity, kv=kv)

    def cap(self, url: str) -> int:
        """The server's slots now (by its clock as the last `loads` read it)."""
        if url in self._ramps:
            return self._ramps[url].cap(self._clock.get(url, 0))
        c = self.capacity
        c = c if isinstance(c, int) else c.get(url, min(c.values()))
        return c if self.share >= 1 else max(1, int(c * self.share + 1e-9))

    def ramp_of(self, url: str) -> Optional[Ramp]:
        """The server's ramp, once the statistics give one (None before, or for fixed slots)."""
        return self._ramps.get(url)

    def _key(self, url: str) -> str:
        return f"{self.prefix}/{url}"

    def _ended_key(self, url: str) -> str:  # requests that ended on the server (a count)
        return f"{self.prefix}/{url}//ended"

    def _start_key(self, url: str) -> str:  # its ended count when it was last empty
        return f"{self.prefix}/{url}//start"

    @property
    def _stats_key(self) -> str:
        return f"{self.prefix}//lengths"

    @property
    def _share_key(self) -> str:
        return f"{self.prefix}//share"

    def _follow(self, text: bytes, share: bytes) -> None:
        """The caps of the statistics `text` at the share `share` (recomputed only when either
        changed). The share's value is "s", or "s b" after `grow`: s of each server, of which b was
        held before the rest was added."""
        if (text, share) == self._seen:
            return
        self._seen = (text, share)
        parts = (share.decode() if isinstance(share, bytes) else str(share)).split()
        self.share = float(parts[0])
        self.held = float(parts[1]) if len(parts) > 1 else None
        if self.kv is None:
            return
        stats = LengthStats.from_json(text.decode() if isinstance(text, bytes) else text)
        self._ramps = {}
        if stats.n >= MIN_SAMPLES and stats.l1 > 0:
            each: dict[ServerKV, Ramp] = {}  # servers alike share one (a few ms each)
            for u, k in self.kv.items():
                if k.pool:
                    if k not in each:
                        each[k] = self._ramp(k, stats)
                    self._ramps[u] = each[k]

    def _ramp(self, kv: ServerKV, stats: LengthStats) -> Ramp:
        """A server's slots at this budget's share: its ramp (or, without ramps, the steady
        state's); after `grow`, the ramp of the whole share with the held share's steady-state
        requests running as its clock starts."""
        room = kv.scaled(self.share)
        if not self.ramps:
            return Ramp((), (), kv_capacity(room, stats))
        if self.held is None:
            return ramp(room, stats)
        if self.held >= self.share:  # grown, then back to no more than was held: nothing is empty
            return Ramp((), (), kv_capacity(room, stats))
        return ramp(room, stats, held=kv_capacity(kv.scaled(self.held), stats))

    def set_share(self, share: float) -> None:
        """From now on every client of this budget (any producer's) takes at most `share` of each
        server's room (module docstring); 1: all of it."""
        if not 0 < share <= 1:
            raise ValueError(f"share {share}: a fraction of each server, more than 0 and at most 1")
        self._set_share(repr(float(share)).encode())

    def grow(self, share: float, urls: Sequence[str]) -> None:
        """`share` of each of `urls`, as `set_share`, where the room this budget gains is empty
        now: another budget's requests have left it (an evaluation beside training taking the room
        training's step leaves, rollout/evaluation.py `Follower`). Empty room fills as a
        step's cache does, its first requests young and holding little, so a server's slots follow
        a `ramp` of the whole share again, its clock restarted at the first `grow`, with the
        requests of the share held before it (its steady state's slots) running, at the steady
        state's ages, as the clock starts. Later calls, more or less, keep that held share and the
        clock. `set_share` ends it."""
        if not 0 < share <= 1:
            raise ValueError(f"share {share}: a fraction of each server, more than 0 and at most 1")
        self.loads(list(urls))  # the keys exist, and this budget's caps are the store's
        if self.held is None and share <= self.share:
            return self.set_share(share)  # nothing added
        first, held = self.held is None, self.share if self.held is None else self.held
        self._set_share(f"{float(share)!r} {held!r}".encode())
        if first and self.kv is not None:
            for u in dict.fromkeys(urls):
                self._restart_clock(u)

    def _set_share(self, new: bytes) -> None:
        self.loads([])  # the key exists
        old = self.store.multi_get([self._share_key])[0]
        while old != new:  # compare-and-set: TCPStore's and LocalCounts' one way to replace a value
            old = self.store.compare_set(self._share_key, old, new)
        stats = self.store.multi_get([self._stats_key])[0] if self.kv is not None else b""
        self._follow(stats, new)  # this budget's caps at once; the others' at their next take

    def stats(self) -> LengthStats:
        """The length statistics every producer's caps follow, now (empty for a fixed budget)."""
        if self.kv is None:
            return LengthStats()
        self.loads([])
        text = self.store.multi_get([self._stats_key])[0]
        self._follow(text, self._seen[1])  # and this budget's caps are those of these statistics
        return LengthStats.from_json(text.decode())

    def observe(self, prompts: Sequence[int], responses: Sequence[int]) -> None:
        """Add a complete set of finished samples (prompt and response tokens each) to the
        statistics every producer's caps follow: never a set's first finishers alone (module
        docstring). Nothing for a fixed budget."""
        if self.kv is None or not responses:
            return
        add = LengthStats.of(prompts, responses)
        self.loads([])  # the statistics' key exists
        old = self.store.multi_get([self._stats_key])[0]
        while True:  # compare-and-set: another producer's update in between is kept, not lost
            new = LengthStats.from_json(old.decode()).plus(add).to_json()
            now = self.store.compare_set(self._stats_key, old, new)
            if now in (new, new.encode()):
                return
            old = now

    def loads(self, urls: Sequence[str]) -> list[int]:
        """Slots taken on each server, by every client of this budget (and, for a budget that
        follows the statistics, the caps of their latest value)."""
        if self.kv is not None and self._stats_key not in self._known:
            self.store.compare_set(self._stats_key, "", LengthStats().to_json())  # exists from now on
            self._known.add(self._stats_key)
        if self._share_key not in self._known:
            self.store.compare_set(self._share_key, "", "1.0")
            self._known.add(self._share_key)
        fresh = [u for u in urls if u not in self._known]
        for u in fresh:  # multi_get needs every key to exist
            self.store.add(self._key(u), 0)
            if self.kv is not None:
                self.store.add(self._ended_key(u), 0)
                self.store.add(self._start_key(u), 0)
        self._known.update(fresh)
        if not urls:
            return []
        clocks = [k for u in urls for k in (self._ended_key(u), self._start_key(u))] if self.kv is not None else []
        keys = [self._key(u) for u in urls] + clocks + [self._share_key] + ([self._stats_key] if self.kv is not None else [])
        values = self.store.multi_get(keys)
        stats = values.pop() if self.kv is not None else b""
        self._follow(stats, values.pop())
        n = len(urls)
        if self.kv is not None:  # each server's clock: ended - start
            for i, u in enumerate(urls):
                self._clock[u] = int(values[n + 2 * i]) - int(values[n + 2 * i + 1])
        return [int(v) for v in values[:n]]

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
            taken = self.store.add(self._key(urls[i]), 1)
            if taken <= self.cap(urls[i]):
                if taken == 1 and self.kv is not None:
                    self._restart_clock(urls[i])
                return urls[i]
            self.store.add(self._key(urls[i]), -1)  # another producer took the last one meanwhile
        return None

    def give(self, url: str) -> None:
        if self.kv is not None:
            self.store.add(self._ended_key(url), 1)
        self.store.add(self._key(url), -1)

    def _restart_clock(self, url: str) -> None:
        """The server was empty (this take is its only request): its ramp starts again, the clock
        at 0 from the ended count now."""
        ended = self.store.add(self._ended_key(url), 0)
        start = self.store.add(self._start_key(url), 0)
        self.store.add(self._start_key(url), ended - start)  # only this take moves it now
        self._clock[url] = 0

    def clone(self) -> "FleetBudget":
        """The same counts over a connection of its own (a TCPStore client is one socket: one per
        thread)."""
        store = self.store if isinstance(self.store, LocalCounts) else self.store.clone()
        return FleetBudget(store, self.prefix, self.capacity, seed=random.getrandbits(32), kv=self.kv, ramps=self.ramps)


class LocalCounts:
    """The store operations a budget uses, in this process (thread-safe), with a TCPStore's
    semantics: counts are added, values are bytes, compare_set sets an absent key when
    `expected` is empty and returns the value it leaves."""

    def __init__(self):
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def add(self, key: str, value: int) -> int:
        with self._lock:
            n = int(self._values.get(key, b"0")) + value
            self._values[key] = str(n).encode()
            return n

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = (v.encode() if isinstance(v, str) else v for v in (expected, desired))
        with self._lock:
            if self._values.get(key, b"") == expected or (key not in self._values and not expected):
                self._values[key] = desired
            return self._values[key]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._lock:
            return [self._values[k] for k in keys]


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
