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
    MIN_SAMPLES, FleetBudget, LengthStats, LocalCounts, ServerKV, derived_capacity, kv_capacity,
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
    assert one.cap("a") == two.cap("a") == kv_capacity(kv["a"], stats) == 133
    assert one.cap("b") == kv_capacity(kv["b"], stats) and 2 < one.cap("b") < one.cap("a")
    # Lengths that grow shrink the caps: a server above its new cap takes nothing until enough
    # come back.
    taken = [u for u in (one.take(["a"]) for _ in range(200)) if u]
    assert len(taken) == 133 - 5  # 5 taken before on a
    two.observe([200] * 8000, [16_000] * 8000)
    cap = kv_capacity(kv["a"], two.stats())
    assert cap < 20 and one.take(["a"]) is None and one.cap("a") == cap
    for _ in range(133 - cap + 1):  # one under the new cap
        one.give("a")
    assert one.take(["a"]) == "a"


def test_fixed_budget_ignores_lengths():
    b = FleetBudget(LocalCounts(), "t", 3)
    b.observe([10] * 100, [50] * 100)
    assert [b.take(["a"]) for _ in range(4)] == ["a", "a", "a", None]
    local = FleetBudget.local({"a": 1}, kv={"a": ServerKV(10_000, 0)})
    local.clone().observe([0] * 100, [100] * 100)  # a clone shares the counts and the statistics
    assert local.take(["a"]) == "a" and local.cap("a") == kv_capacity(ServerKV(10_000, 0), local.stats())


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
    assert budget.take([url]) == url and budget.cap(url) == kv_capacity(kv, stats) > 2
    fixed = FleetBudget.local(2)
    observe_lengths(fixed, groups)
    assert fixed.stats() == LengthStats() and fixed.cap(url) == 2
