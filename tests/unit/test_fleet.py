"""The fleet's admission (rollout/admission.py): one budget of slots per server for every client of a
job, counted in a real c10d TCPStore, against stand-in SGLang servers (test_records.FakeSGLang)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch.distributed as dist
from test_records import PROMPTS, FakeSGLang

from megatron_rl.rollout.client import RolloutClient, SamplingParams
from megatron_rl.rollout.admission import FleetBudget, LocalCounts, derived_capacity


def test_derived_capacity_from_the_servers_kv_pool():
    info = {"max_total_num_tokens": 1_000_000, "internal_states": [{"effective_max_running_requests_per_dp": 512}]}
    assert derived_capacity(info, 16384) == 1_000_000 // 11469 == 87  # 0.7 x 16384 reserved per request
    assert derived_capacity(info, 512) == 512  # capped by max_running_requests
    assert derived_capacity({"max_total_num_tokens": 1000}, 16384) == 1  # at least one
    assert derived_capacity({"max_running_requests": 48}, 16384) == 48
    assert derived_capacity({}, 16384) == 64


def test_take_is_least_loaded_rotates_ties_and_never_passes_capacity():
    b = FleetBudget(LocalCounts(), "t", {"a": 2, "b": 4})
    taken = [b.take(["a", "b"]) for _ in range(7)]
    assert taken[-1] is None and sorted(taken[:-1]) == ["a", "a", "b", "b", "b", "b"]
    assert b.loads(["a", "b"]) == [2, 4]
    b.give("b")
    assert b.take(["a", "b"]) == "b" and b.take(["a"]) is None
    firsts = {FleetBudget(LocalCounts(), "t", 1, seed=s).take(["a", "b", "c", "d"]) for s in range(40)}
    assert firsts == {"a", "b", "c", "d"}  # no first-URL bias on an empty fleet
    with pytest.raises(ValueError, match="at least 1 slot"):
        FleetBudget(LocalCounts(), "t", 0)


def test_one_budget_holds_across_clients_in_threads_over_a_tcp_store():
    """4 producers (each its own thread, event loop and client, as the trainer's producers are),
    one budget of 3 slots per server over a TCPStore, 4 stand-in servers taking 0.2 s a request:
    no server ever has more than 3 requests in flight from all of them together (each client's
    own cap of 3 let 12 in), the 48 samples spread evenly, every slot comes back."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    budget = FleetBudget(store, "fleet/test", 3)
    servers = [FakeSGLang(delay=0.2) for _ in range(4)]
    ready, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    def serve():
        nonlocal stop
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()

        async def up():
            for s in servers:
                await s.__aenter__()
            ready.set()
            await stop.wait()
            for s in servers:
                await s.__aexit__(None, None, None)
        loop.run_until_complete(up())

    host = threading.Thread(target=serve, daemon=True)
    host.start()
    assert ready.wait(10)
    results, errors = {}, []

    def producer(k):
        async def go():
            async with RolloutClient([s.url for s in servers], budget=budget.clone(),
                                     backoff_initial=0.05) as client:
                out = await client.generate(PROMPTS, SamplingParams(max_new_tokens=7), n=6)
                return out, client.sent
        try:
            results[k] = asyncio.run(go())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    start = time.monotonic()
    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.monotonic() - start
    loop.call_soon_threadsafe(stop.set)
    host.join(10)
    assert not errors, errors
    assert all(sum(len(row) for row in out) == 12 for out, _ in results.values())
    assert max(s.max_inflight for s in servers) == 3  # the fleet's cap, all producers together
    per_server = [len(s.requests) for s in servers]
    assert sum(per_server) == 48 and max(per_server) - min(per_server) <= 2, per_server
    assert budget.loads([s.url for s in servers]) == [0, 0, 0, 0]
    assert wall < 3.5, wall  # 48 requests / 12 slots x 0.2 s = 0.8 s at best
    print(f"4 producers, 48 samples, 4 servers x 3 slots: {per_server}, {wall:.2f} s")
