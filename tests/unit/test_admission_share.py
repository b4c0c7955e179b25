"""Shares of a server (rollout/admission.py `set_share`, rollout/evaluation.py): an evaluation beside
training takes a share f of every server's room and training keeps 1 - f, each budget's caps
computed on its share of the KV pool and max_running_requests, the two never passing the server;
the share reaches every producer's budget through a real c10d TCPStore; the automatic choice
between whole servers and a share."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_rl.rollout.admission import (
    MIN_SAMPLES, FleetBudget, LengthStats, LocalCounts, ServerKV, kv_capacity, ramp,
)
from megatron_rl.rollout.evaluation import DEFAULT_SHARE, beside_share


def test_server_kv_scaled_is_the_share_of_pool_and_running_requests():
    kv = ServerKV(2_000_000, 1024)
    assert kv.scaled(1.0) is kv
    assert kv.scaled(0.2) == ServerKV(400_000, 204) and kv.scaled(0.8) == ServerKV(1_600_000, 819)
    assert ServerKV(0, 0).scaled(0.5) == ServerKV(0, 0)  # reports neither: nothing to share
    assert ServerKV(3, 1).scaled(0.1) == ServerKV(1, 1)  # at least one of each


def test_training_and_evaluation_shares_together_fit_the_pool():
    """At the 30B shape's lengths (lognormal, median 4k, cut at 16k; 512-token prompts), training
    at 0.8 and the evaluation at 0.2: caps on their shares, whose KV (mean + KV_Z std each) sums
    within the pool, and within max_running_requests."""
    import math
    import random

    g = random.Random(0)
    lengths = [max(1, min(16384, int(math.exp(math.log(4096) + 0.84 * g.gauss(0, 1))))) for _ in range(4000)]
    kv = {"a": ServerKV(2_000_000, 1024)}
    train = FleetBudget(LocalCounts(), "train", 170, kv=kv)
    evaluation = FleetBudget(LocalCounts(), "eval", 170, kv=kv)
    for b in (train, evaluation):
        b.observe([512] * len(lengths), lengths)
    whole = train.stats()
    full = kv_capacity(kv["a"], whole)
    train.set_share(0.8)
    evaluation.set_share(0.2)
    # The steady state's slots of each share (past a step's ramp).
    t, e = kv_capacity(ServerKV(1_600_000, 819), whole), kv_capacity(ServerKV(400_000, 204), whole)
    mean, std = whole.kv_per_request()
    fits = lambda n, pool: n * mean + 2 * math.sqrt(n) * std <= pool  # noqa: E731
    assert fits(t, 1_600_000) and fits(e, 400_000) and t + e <= full <= 1024
    assert e >= 0.15 * full and t >= 0.75 * full  # a share's cap is about its share of the whole's
    # A step's ramp (nothing ended yet): each budget's caps are its share's, together within the
    # whole server's.
    tr, er = train.cap("a"), evaluation.cap("a")
    assert tr == ramp(ServerKV(1_600_000, 819), whole).cap(0) and er == ramp(ServerKV(400_000, 204), whole).cap(0)
    assert tr + er <= ramp(kv["a"], whole).cap(0) <= 1024 and tr > t and er > e
    assert [ramp(ServerKV(1_600_000, 819), whole).cap(c) for c in (10**9,)] == [t]  # past the ramp: steady
    train.set_share(1.0)  # the evaluation ended: training's whole room again
    assert train.cap("a") == ramp(kv["a"], whole).cap(0)


def test_fixed_slots_are_shared_by_their_floor_at_least_one():
    b = FleetBudget(LocalCounts(), "t", {"a": 10, "b": 3})
    b.set_share(0.8)
    assert (b.cap("a"), b.cap("b")) == (8, 2)
    b.set_share(0.2)
    assert (b.cap("a"), b.cap("b")) == (2, 1)
    with pytest.raises(ValueError, match="more than 0 and at most 1"):
        b.set_share(0.0)
    with pytest.raises(ValueError, match="more than 0 and at most 1"):
        b.set_share(1.5)


def test_a_share_reaches_every_producer_at_its_next_take_and_cancels_nothing():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kv = {"a": ServerKV(100_000, 0)}
    one = FleetBudget(store, "fleet/t", 4, kv=kv)
    two = FleetBudget(store.clone(), "fleet/t", 4, kv=kv)  # another producer
    two.observe([200] * MIN_SAMPLES, [1000] * MIN_SAMPLES)
    stats = LengthStats.of([200] * MIN_SAMPLES, [1000] * MIN_SAMPLES)
    first = ramp(kv["a"], stats).cap(0)  # the server's ramp: nothing has ended on it yet
    assert [one.take(["a"]) for _ in range(133)].count("a") == first == 75  # 0.9 x 100,000 / 1,196
    one.clone().set_share(0.5)  # rank 0, as an evaluation starts (a connection of its own)
    cap = ramp(ServerKV(50_000, 0), stats).cap(0)
    assert two.take(["a"]) is None and two.cap("a") == cap == 37  # the 75 taken stay; none new
    for _ in range(first - cap + 1):  # requests end: past the ramp, the share's steady state
        one.give("a")
    steady = kv_capacity(ServerKV(50_000, 0), stats)
    assert [two.take(["a"]) for _ in range(100)].count("a") == steady - (cap - 1) and two.cap("a") == steady == 64
    one.set_share(1.0)
    assert two.take(["a"]) == "a" and two.cap("a") == kv_capacity(kv["a"], stats) == 133


def test_whole_servers_on_a_big_fleet_a_share_on_a_small_one():
    assert beside_share(1, 2, None) == DEFAULT_SHARE  # one rollout node: holding one halves the fleet
    assert beside_share(1, 4, None) == DEFAULT_SHARE  # a quarter: a step 1.33x
    assert beside_share(1, 5, None) == 0.0 and beside_share(2, 16, None) == 0.0  # a fifth or less: held
    assert beside_share(1, 2, 0.0) == 0.0 and beside_share(1, 16, 0.3) == 0.3  # eval.share decides when set
    with pytest.raises(ValueError, match="eval.share=1.0"):
        beside_share(1, 2, 1.0)


def test_the_evaluation_takes_the_room_training_leaves_never_training_s_share():
    """`follow_training` (synchronous training): the evaluation keeps its share before training's
    step starts, while its requests arrive and while they fill its own share; as training's last
    requests finish (its slots only fall), the evaluation's share grows to what they leave, up to
    every server whole once the step's generation is over."""
    import threading
    import time

    from megatron_rl.rollout.evaluation import follow_training

    store = LocalCounts()
    training = FleetBudget(store, "train", 10)
    evaluation = FleetBudget.local(10)
    training.clone().set_share(0.8)
    evaluation.set_share(0.2)
    stop, generated = threading.Event(), threading.Event()
    follower = threading.Thread(target=follow_training, daemon=True,
                                args=(evaluation.clone(), training.clone(), ["a", "b"], 0.2,
                                      lambda: not stop.is_set(), generated.is_set, 0.01))

    def settled(share: float) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            evaluation.loads(["a"])
            if evaluation.share == pytest.approx(share):
                return True
            time.sleep(0.01)
        return False

    follower.start()
    try:
        time.sleep(0.1)  # training's step not started (no slot taken): the evaluation keeps its share
        assert settled(0.2) and evaluation.cap("a") == 2
        for _ in range(8):  # training's step starting: a ramp, not a tail
            assert training.take(["a", "b"]) is not None
        time.sleep(0.1)
        assert settled(0.2)
        for _ in range(8):  # training's step fills its 8 slots of each server
            assert training.take(["a", "b"]) is not None
        time.sleep(0.1)  # (the follower looks every 0.01 s)
        assert training.take(["a", "b"]) is None and settled(0.2)
        for url, n in (("a", 6), ("b", 7)):  # its last responses finish: 2 and 1 still run
            for _ in range(n):
                training.give(url)
        # The busiest server decides, its tail counted twice (TAIL_KV): 1 - 0.8 x 2 x 2 / 8.
        assert settled(0.6) and evaluation.cap("a") == 6
        for url, n in (("a", 2), ("b", 1)):
            for _ in range(n):
                training.give(url)
        generated.set()
        assert settled(1.0) and evaluation.cap("a") == 10  # the learner's time: every server whole
    finally:
        stop.set()
        follower.join(10)


def test_room_given_anew_fills_by_a_ramp_of_its_own():
    """`grow` (an evaluation taking the room training's step leaves): a server's caps follow the
    ramp of the whole new share with the held share's steady-state requests running as its clock
    restarts, so the empty room takes more than the steady state of the whole share at first;
    later calls keep the held share and the clock; past the ramp, the whole share's steady state;
    `set_share` ends it. Every producer's budget sees it through a real c10d TCPStore."""
    import math
    import random

    g = random.Random(1)
    lengths = [max(1, min(16384, int(math.exp(math.log(4096) + 0.84 * g.gauss(0, 1))))) for _ in range(4000)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kv = ServerKV(2_000_000, 1024)
    mine = FleetBudget(store, "fleet/e", 170, kv={"a": kv, "b": kv})
    other = FleetBudget(store.clone(), "fleet/e", 170, kv={"a": kv, "b": kv})  # the evaluation's client
    mine.observe([512] * len(lengths), lengths)
    stats = mine.stats()
    mine.set_share(0.2)
    steady = {s: kv_capacity(kv.scaled(s), stats) for s in (0.2, 0.5, 0.9, 1.0)}
    for u in ("a", "b"):  # the evaluation's requests run and end: its clocks far past its ramp
        assert other.take([u]) == u  # (one runs throughout: an empty server restarts its ramp)
        for _ in range(3000):
            assert other.take([u]) == u
            other.give(u)
    taken = [other.take(["a", "b"]) for _ in range(1000)]
    assert taken.count("a") == taken.count("b") == other.cap("a") - 1 == steady[0.2] - 1
    mine.grow(0.5, ["a", "b"])  # training's tail left 0.3 of each server
    other.loads(["a", "b"])
    assert other.share == 0.5 and other.held == 0.2
    after = {s: ramp(kv.scaled(s), stats, held=steady[0.2]) for s in (0.5, 0.9)}
    first = after[0.5].cap(0)
    assert other.cap("a") == other.cap("b") == first
    # Between the steady state of the new share and the ramp of an empty server of that share.
    assert steady[0.5] < first < ramp(kv.scaled(0.5), stats).cap(0)
    assert [other.take(["a"]) for _ in range(1000)].count("a") == first - steady[0.2]
    for _ in range(40):  # requests end: the ramp moves on
        other.give("a")
    mine.grow(0.9, ["a", "b"])  # more of it: the held share and the clock stay
    other.loads(["a", "b"])
    assert other.held == 0.2 and (other.cap("a"), other.cap("b")) == (after[0.9].cap(40), after[0.9].cap(0))
    for _ in range(3000):  # past the ramp: the steady state of the whole share
        other.give("a")
        other.take(["a"])
    other.loads(["a"])
    assert other.cap("a") == steady[0.9]
    mine.grow(0.2, ["a", "b"])  # back to what it held: no room is empty, the steady state's slots
    other.loads(["a", "b"])
    assert other.held == 0.2 and other.cap("a") == other.cap("b") == steady[0.2]
    mine.set_share(1.0)  # the evaluation is over: a plain share again
    other.loads(["a"])
    assert other.held is None and other.cap("a") == steady[1.0]
    # Growing to no more than it holds adds nothing: a plain share, no clock restarted.
    mine.set_share(0.5)
    mine.grow(0.4, ["a", "b"])
    other.loads(["b"])
    assert other.held is None and other.share == 0.4


def test_requests_held_at_the_steady_state_against_a_monte_carlo():
    """`steady_requests_later` (what `grow`'s ramp takes the requests already running to hold
    later) against a Monte Carlo draw: requests size-biased by their length, uniformly far
    through it, followed t tokens on: the share still running and the KV they hold."""
    import numpy as np

    from megatron_rl.rollout.admission import steady_requests_later

    rng = np.random.default_rng(3)
    lengths = np.clip(np.rint(np.exp(np.log(4096) + 0.84 * rng.standard_normal(20_000))), 1, 16384)
    stats = LengthStats.of([512] * len(lengths), lengths.astype(int).tolist())
    dt = stats.longest() / 256
    ages = np.arange(256) * dt
    R, H = steady_requests_later(stats.survival(ages), ages, 512.0)
    assert H[0] == pytest.approx(stats.kv_per_request()[0], rel=0.01)
    # The draw: 400,000 requests running at a random moment of refilled slots.
    l = rng.choice(lengths, size=400_000, p=lengths / lengths.sum())
    a = rng.uniform(0, 1, size=l.size) * l
    for t in (0, 1000, 4000, 8000, 12000):
        i = int(round(t / dt))
        alive = a + ages[i] < l
        assert R[i] == pytest.approx(alive.mean(), abs=0.01), t
        assert H[i] == pytest.approx(np.where(alive, 512 + a + ages[i], 0).mean(), rel=0.02, abs=30), t


def test_the_evaluation_ends_sooner_where_its_added_room_follows_a_ramp():
    """One server through a step beside an evaluation (the 30B shape of benchmarks/bench_fleet.py:
    pool 2 M tokens, max_running_requests 1,024; training's 1,024 requests at 0.8 of it, the
    evaluation's 960 at 0.2; 512-token prompts, lognormal responses, median 4,096, sigma 0.84, cut
    at 16,384; every running sequence decoding 64 tokens a tick), the `Follower` giving the
    evaluation the room training's tail leaves: taken with `grow` (a ramp there), the evaluation
    ends >= 3 % sooner than at the steady state's slots of its share (`set_share`, the rule
    before), training's step the same, and the pool, as the room fills, stays under 0.95 full."""
    import numpy as np

    from megatron_rl.rollout.evaluation import Follower

    def step(seed: int, grow: bool) -> tuple[int, int, float]:
        rng = np.random.default_rng(seed)
        draw = lambda k: np.clip(np.rint(np.exp(np.log(4096) + 0.84 * rng.standard_normal(k))), 1, 16384)  # noqa: E731
        seen = draw(8192).astype(int).tolist()
        kv = ServerKV(2_000_000, 1024)
        train, evaluation = FleetBudget.local(174, kv={"a": kv}), FleetBudget.local(174, kv={"a": kv})
        for b in (train, evaluation):
            b.observe([512] * len(seen), seen)
        train.set_share(0.8)
        evaluation.set_share(0.2)

        class SteadySlots:  # the rule before: the share grows, its slots the steady state's
            def grow(self, share, urls):
                evaluation.set_share(share)

        lengths = {False: draw(1024), True: draw(960)}  # training's, the evaluation's
        budgets, sent = {False: train, True: evaluation}, {False: 0, True: 0}
        generated = [False]
        look = Follower(evaluation if grow else SteadySlots(), train, ["a"], 0.2, lambda: generated[0])
        ages, ends, kind = np.zeros(0), np.zeros(0), np.zeros(0, bool)
        tick, grown, ended, fill = 0, None, {}, []
        while len(ended) < 2:
            if look() > 0.2 and grown is None:
                grown = tick
            for k in (False, True):
                while sent[k] < len(lengths[k]) and budgets[k].take(["a"]) == "a":
                    ages, ends, kind = np.append(ages, 0), np.append(ends, lengths[k][sent[k]]), np.append(kind, k)
                    sent[k] += 1
            fill.append((512 + ages).sum() / kv.pool)
            ages, tick = ages + 64, tick + 1
            over = ages >= ends
            for k in kind[over]:
                budgets[bool(k)].give("a")
            ages, ends, kind = ages[~over], ends[~over], kind[~over]
            for k in (False, True):
                if k not in ended and sent[k] == len(lengths[k]) and not (kind == k).any():
                    ended[k] = tick
                    generated[0] = generated[0] or not k
        assert grown is not None
        return ended[False], ended[True], max(fill[grown:])

    for seed in range(3):
        (t0, e0, _), (t1, e1, peak) = step(seed, False), step(seed, True)
        assert t1 == t0 and e1 <= 0.97 * e0 and peak <= 0.95, (seed, (t0, e0), (t1, e1, peak))
