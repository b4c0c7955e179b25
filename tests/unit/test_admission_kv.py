"""Slots that follow the responses seen (rollout/admission.py): the capacity rule against
arithmetic, a simulated server whose pool the rule fills without overflowing, and the statistics
shared by every producer through a real c10d TCPStore."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch.distributed as dist

from megatron_rl.rollout.admission import (
    MIN_SAMPLES, FleetBudget, LengthStats, LocalCounts, ServerKV, derived_capacity, kv_capacity, ramp,
)


def test_kv_per_request_and_capacity_against_arithmetic():
    # Every response 1,000 tokens after a 200-token prompt: a running request holds 200 + U x 1000,
    # mean 700, standard deviation 1000 / sqrt(12).
    stats = LengthStats.of([200] * 10, [1000] * 10)
    mean, std = stats.kv_per_request()
    assert mean == pytest.approx(700.0) and std == pytest.approx(1000 / math.sqrt(12))
    # n x 700 + 2 sqrt(n) x 288.675 <= 100,000: 133 fits (93,100 + 6,658 = 99,758), 134 does not
    # (93,800 + 6,683 = 100,483).
    n = kv_capacity(ServerKV(pool=100_000, max_running=0), stats)
    used = lambda k: k * mean + 2 * math.sqrt(k) * std  # noqa: E731
    assert used(n) <= 100_000 < used(n + 1), (n, used(n), used(n + 1))
    assert n == 133
    assert kv_capacity(ServerKV(100_000, 100), stats) == 100  # max_running_requests caps it
    assert kv_capacity(ServerKV(100, 0), stats) == 1  # at least one
    assert kv_capacity(ServerKV(100_000, 0), stats, z=0.0) == 100_000 // 700
    # Spread lengths weigh the long ones: 1 of 100 and 1 of 10,000 (no prompt): the time a slot
    # spends is 99 % on the long one, mean (100^2 + 10,000^2) / 2 / 10,100 = 4,950.5.
    mean2, _ = LengthStats.of([0, 0], [100, 10_000]).kv_per_request()
    assert mean2 == pytest.approx((100 ** 2 + 10_000 ** 2) / 2 / 10_100)


def test_statistics_weigh_the_last_window_of_samples():
    old = LengthStats.of([0] * 6000, [1000] * 6000)
    new = LengthStats.of([0] * 4000, [3000] * 4000)
    both = old.plus(new, window=8000)
    assert both.n == pytest.approx(8000)  # 4,000 new + 6,000 old scaled to 4,000
    assert both.l1 == pytest.approx(4000 * 1000 + 4000 * 3000)
    assert LengthStats().plus(new, window=8000) == new
    assert LengthStats.from_json(both.to_json()) == both


def test_the_rule_fills_a_simulated_pool_and_rarely_overflows():
    """A server whose n slots are refilled the moment a request ends (requests waiting in the
    producers), lognormal responses (median 4,096, sigma 0.84, cut at 16,384: bench_fleet's) after
    512-token prompts, pool 2 M tokens: with n from the rule, the KV in use averages >= 85 % of
    the pool and passes it in < 5 % of the time; today's first estimate fills < 50 %."""
    rng = np.random.default_rng(0)
    draw = lambda k: np.clip(np.rint(np.exp(np.log(4096) + 0.84 * rng.standard_normal(k))), 1, 16384)  # noqa: E731
    seen = draw(4096)
    stats = LengthStats.of([512] * len(seen), seen.tolist())
    kv = ServerKV(pool=2_000_000, max_running=1024)
    n = kv_capacity(kv, stats)
    first = derived_capacity({"max_total_num_tokens": kv.pool, "max_running_requests": 1024}, 16384)
    assert first == 2_000_000 // math.ceil(0.7 * 16384) == 174 and n > 2 * first

    def simulate(slots: int, ticks: int = 6000, step: int = 64) -> tuple[float, float]:
        length = draw(slots)
        done = np.floor(rng.random(slots) * length)  # start anywhere: the steady state
        used = np.empty(ticks)
        for t in range(ticks):
            done += step
            over = done >= length
            length[over], done[over] = draw(int(over.sum())), 0.0
            used[t] = (512 + done).sum()
        return float(used.mean() / kv.pool), float((used > kv.pool).mean())

    fill, overflow = simulate(n)
    assert fill >= 0.85 and overflow < 0.05, (n, fill, overflow)
    assert simulate(first)[0] < 0.5


def test_budget_follows_the_lengths_every_producer_reports_through_a_tcp_store():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kv = {"a": ServerKV(100_000, 0), "b": ServerKV(50_000, 0)}
    first = {"a": 4, "b": 2}
    one = FleetBudget(store, "fleet/t", first, kv=kv)
    two = FleetBudget(store.clone(), "fleet/t", first, kv=kv)  # another producer
    assert [one.take(["a", "b"]) for _ in range(7)].count(None) == 1  # 4 + 2 slots before any length
    # Too few samples: the first estimate holds.
    two.observe([200] * (MIN_SAMPLES - 1), [1000] * (MIN_SAMPLES - 1))
    assert one.take(["a", "b"]) is None and one.cap("a") == 4
    # Enough: both producers' caps follow the statistics, the same for both.
    sizes, errors = [5] * 8, []

    def report(k):
        try:
            FleetBudget(store.clone(), "fleet/t", first, kv=kv).observe([200] * sizes[k], [1000] * sizes[k])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=report, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert one.stats().n == pytest.approx(MIN_SAMPLES - 1 + 40)  # no update lost to a race
    stats = two.stats()
    assert one.take(["a", "b"]) is not None
    # Nothing has ended on either server since its first request: each at its ramp's first slots,
    # a first wave of 1,000-token responses whose KV at their last tick of the ramp's grid (256
    # ticks to the longest) fills 0.9 of the pool.
    assert one.cap("a") == two.cap("a") == ramp(kv["a"], stats).cap(0) == int(0.9 * 100_000 / (200 + 255 * 1000 / 256))
    assert one.cap("b") == ramp(kv["b"], stats).cap(0) and 2 < one.cap("b") < one.cap("a")
    first = one.cap("a")
    taken = [u for u in (one.take(["a"]) for _ in range(200)) if u]
    assert len(taken) == first - 5  # 5 taken before on a
    # Lengths that grow shrink the caps: a server above its new cap takes nothing until enough
    # come back. Those that end move its clock past the ramp: the steady state's slots.
    two.observe([200] * 8000, [16_000] * 8000)
    cap = ramp(kv["a"], two.stats()).cap(0)
    assert cap < 10 and one.take(["a"]) is None and one.cap("a") == cap
    steady = kv_capacity(kv["a"], two.stats())
    for _ in range(first - steady + 1):  # one under the steady cap
        one.give("a")
    assert one.take(["a"]) == "a" and one.cap("a") == steady and one.take(["a"]) is None


def test_fixed_budget_ignores_lengths():
    b = FleetBudget(LocalCounts(), "t", 3)
    b.observe([10] * 100, [50] * 100)
    assert [b.take(["a"]) for _ in range(4)] == ["a", "a", "a", None]
    local = FleetBudget.local({"a": 1}, kv={"a": ServerKV(10_000, 0)})
    local.clone().observe([0] * 100, [100] * 100)  # a clone shares the counts and the statistics
    assert local.take(["a"]) == "a" and local.cap("a") == ramp(ServerKV(10_000, 0), local.stats()).cap(0)


def test_a_fleets_finished_samples_reach_the_statistics_its_slots_follow():
    """The fleet's glue (rollout/fleet.py `observe_lengths`): the real client's records of a
    finished call, from a stand-in SGLang server (7 tokens a sample), become the shared
    statistics: their count and tokens, and the caps those give; a fixed budget takes nothing."""
    import asyncio

    from test_records import PROMPTS, FakeSGLang

    from megatron_rl.rollout.client import RolloutClient, SamplingParams
    from megatron_rl.rollout.fleet import observe_lengths

    async def sample(budget):
        async with FakeSGLang() as server, RolloutClient([server.url], budget=budget) as client:
            return await client.generate(PROMPTS, SamplingParams(max_new_tokens=7), n=40), server.url

    groups, url = asyncio.run(sample(FleetBudget.local(2)))
    kv = ServerKV(pool=100_000, max_running=0)
    budget = FleetBudget.local(2, kv={url: kv})
    observe_lengths(budget, groups)
    stats = budget.stats()
    assert stats.n == 80 and stats.l1 == 80 * 7  # every sample, each 7 tokens
    assert stats.pl == 40 * 7 * (len(PROMPTS[0]) + len(PROMPTS[1]))  # prompt x response, summed
    # Its first request starts the server's ramp (clock 0): the slots of a first wave of 7-token
    # responses, 0.9 of the pool over their KV at the end (below the steady state's, where ages
    # spread), the steady state's once they end (one has: the first wave is ending).
    assert budget.take([url]) == url and budget.cap(url) == ramp(kv, stats).cap(0) > 2
    assert ramp(kv, stats).cap(0) == int(0.9 * kv.pool / (stats.pl / stats.l1 + 6))  # its KV at its last tick
    assert budget.take([url]) == url
    budget.give(url)
    budget.loads([url])
    assert budget.cap(url) == kv_capacity(kv, stats)
    fixed = FleetBudget.local(2)
    observe_lengths(fixed, groups)
    assert fixed.stats() == LengthStats() and fixed.cap(url) == 2


def test_a_step_from_empty_fills_the_pool_and_ends_sooner():
    """One server through one synchronous step at the 30B shape (benchmarks/sim_kv_ramp.py): pool
    2 M tokens, max_running_requests 1,024, 1,024 requests, 512-token prompts, lognormal responses
    (median 4,096, sigma 0.84, cut at 16,384), each running sequence decoding 64 tokens a tick. The
    slots come from a FleetBudget that saw a previous step's lengths: a take when a slot is free, a
    give when a response ends. Its ramp (slots by the requests ended since the server was empty)
    keeps the pool >= 0.85 full on average while requests wait (past the first median response)
    and ends every step >= 5 % sooner than the steady state's fixed slots (kv_capacity: the rule
    before the ramp, < 0.85). It passes the pool only where a step's responses run longer than
    those seen and the fixed slots pass it too, and not further."""
    rng = np.random.default_rng(7)
    draw = lambda k: np.clip(np.rint(np.exp(np.log(4096) + 0.84 * rng.standard_normal(k))), 1, 16384)  # noqa: E731
    seen = draw(8192)
    kv = ServerKV(pool=2_000_000, max_running=1024)
    budget = FleetBudget.local(174, kv={"a": kv})
    budget.observe([512] * len(seen), seen.astype(int).tolist())
    steady = kv_capacity(kv, budget.stats())

    def step(lengths, take, give):
        ages, ends, nxt, kv_used, waiting = np.zeros(0), np.zeros(0), 0, [], []
        while nxt < len(lengths) or len(ages):
            while nxt < len(lengths) and take():
                ages, ends, nxt = np.append(ages, 0), np.append(ends, lengths[nxt]), nxt + 1
            kv_used.append((512 + ages).sum() / kv.pool)
            waiting.append(nxt < len(lengths))
            ages = ages + 64
            for _ in range(int((ages >= ends).sum())):
                give()
            ages, ends = ages[ages < ends], ends[ages < ends]
        kv_used, waiting = np.array(kv_used), np.array(waiting)
        waiting[: 4096 // 64] = False  # past the first median response time
        return len(kv_used), float(kv_used[waiting].mean()), float(kv_used.max())

    ramped, fixed = [], []
    for _ in range(3):
        lengths = draw(1024)
        ramped.append(step(lengths, lambda: budget.take(["a"]) == "a", lambda: budget.give("a")))
        assert budget.loads(["a"]) == [0]
        running = [0]

        def take():
            if running[0] >= steady:
                return False
            running[0] += 1
            return True

        def give():
            running[0] -= 1

        fixed.append(step(lengths, take, give))
    for (ticks, full, peak), (fixed_ticks, fixed_full, fixed_peak) in zip(ramped, fixed):
        # Every step shorter; over the pool only where the fixed slots are too (a step whose
        # responses run longer than those seen: then both rely on SGLang's retraction), less so.
        assert ticks <= 0.95 * fixed_ticks and peak <= max(1.0, fixed_peak), (ramped, fixed)
    assert np.mean([r[1] for r in ramped]) >= 0.85 > np.mean([f[1] for f in fixed]), (ramped, fixed)
