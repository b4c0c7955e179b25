"""The rollout producer thread (trainer/producer.py): the staleness gate, order, drain, restart,
errors, snapshots; and the store-based sum the producer threads agree with (a real c10d
HashStore shared by two threads)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.trainer.producer import Producer, ProducerStopped, StepShare, StoreSum
from megatron_rl.data.prompts import Prompt, PromptStream


def stream() -> PromptStream:
    return PromptStream([Prompt(ids=(i,), answer=str(i), uid=f"t:{i}") for i in range(10)], seed=0)


class Recorder:
    """produce(): records (target, published version when it started, prompts drawn)."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.calls: list[tuple[int, int, list[int]]] = []
        self.delay, self.fail_at = delay, fail_at
        self.producer: Producer | None = None

    def __call__(self, target, s):
        if target == self.fail_at:
            raise ValueError(f"boom at {target}")
        drawn = [p.ids[0] for p in s.take(3)]
        self.calls.append((target, self.producer._published, drawn))
        time.sleep(self.delay)
        return drawn, {"target": target}


def make(k: int, last: int | None = None, **kw) -> tuple[Producer, Recorder]:
    rec = Recorder(**kw)
    p = Producer(rec, stream(), k, last_target=last)
    rec.producer = p
    return p, rec


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_gate_bounds_staleness_and_queue(k):
    """Target t starts only once version t−k is published: at most k+1 shares ahead."""
    p, rec = make(k, last=5)
    p.start(0, published=0)
    wait_until(lambda: p.depth() == k + 1)
    time.sleep(0.1)
    assert p.depth() == k + 1  # nothing more until the next version
    for step in range(6):
        share = p.get(step)
        assert share.target == step and share.batch == rec.calls[step][2]
        p.published(step + 1)
    p.stop()
    for target, version, _ in rec.calls:
        assert target - k <= version <= target  # never older than t−k, never ahead of t
    assert [c[0] for c in rec.calls] == list(range(6))  # the last target bounds it


def test_prompts_in_order_and_position_recorded():
    p, rec = make(1, last=3)
    p.start(0, published=0)
    shares = []
    for step in range(4):
        shares.append(p.get(step))
        p.published(step + 1)
    p.stop()
    drawn = [x for s in shares for x in s.batch]
    ref = stream()
    assert drawn == [q.ids[0] for q in ref.take(12)]  # one stream, no prompt twice
    ref = stream()
    for s in shares:
        ref.take(3)
        assert s.position == ref.state_dict()


def test_drain_waits_for_admitted_targets():
    p, rec = make(1, last=3, delay=0.3)
    p.start(0, published=0)
    p.drain()  # targets 0 and 1 admitted at version 0
    assert p.depth() == 2 and len(rec.calls) == 2
    p.stop()


def test_restart_regenerates_from_a_position():
    p, rec = make(1, last=4)
    p.start(0, published=0)
    first = p.get(0)
    wait_until(lambda: p.depth() == 1)  # target 1 done
    p.restart(1, first.position)  # a server served other weights: step 1 again, same prompts
    p.published(1)
    again = p.get(1)
    assert again.batch == rec.calls[1][2]  # the same prompts as the discarded share
    assert again.epoch == 1
    p.stop()


def test_error_reaches_the_consumer():
    p, _ = make(0, fail_at=1)
    p.start(0, published=0)
    p.get(0)
    p.published(1)
    with pytest.raises(ProducerStopped, match="boom at 1") as e:
        p.get(1)
    assert "boom at 1" in str(e.value.__cause__)  # the whole error once, as the cause
    with pytest.raises(ProducerStopped):
        p.drain()


def test_saved_shares_come_first_and_generation_continues_after_them():
    s = stream()
    s.take(6)
    saved = [StepShare(3, ["a"], {}, {"epoch": 0, "index": 3}), StepShare(4, ["b"], {}, s.state_dict())]
    rec = Recorder()
    p = Producer(rec, s, 2, last_target=5)
    rec.producer = p
    p.start(3, published=3, saved=saved)
    assert p.get(3).batch == ["a"] and p.get(4).batch == ["b"]
    assert p.get(5).batch == [q.ids[0] for q in stream().take(9)[6:]]
    p.stop()


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        Producer(lambda t, s: None, stream(), -1)


def test_store_sum_across_threads():
    """Two producers' threads agree through a real c10d store, many rounds, keys cleaned up."""
    store = dist.HashStore()
    out: dict[int, list] = {0: [], 1: []}

    def producer(rank):
        agree = StoreSum(store, "agree/x", rank, 2, timeout_s=30)
        for i in range(20):
            x = torch.tensor([rank + i, 1, 0, rank * i], dtype=torch.int64)
            out[rank].append(agree(f"{i}/0", x))

    threads = [threading.Thread(target=producer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(20):
        want = torch.tensor([1 + 2 * i, 2, 0, i])
        assert torch.equal(out[0][i], want) and torch.equal(out[1][i], want)
    assert store.num_keys() <= 4  # each rank keeps its last two keys


def test_store_sum_waits_for_a_late_producer_saying_so_and_stops_for_a_failed_one():
    from megatron_rl.distributed.wait import LeaderFailed

    store = dist.HashStore()
    logs: list[str] = []
    a = StoreSum(store, "agree/x", 0, 2, timeout_s=30, log_every_s=0.3, log=logs.append)
    b = StoreSum(store, "agree/x", 1, 2, timeout_s=30, log_every_s=0.3, log=logs.append)
    late = threading.Timer(1.0, lambda: b("0/0", torch.tensor([5])))
    late.start()
    assert int(a("0/0", torch.tensor([2]))) == 7
    late.join()
    assert logs and all("agree/x/0/0: data-parallel producers [1] not there yet" in line for line in logs), logs
    # producer 1's thread dies before round 1: producer 0 stops waiting at its next poll, not after 30 s
    threading.Timer(0.5, lambda: b.fail("step 0: RuntimeError: reward pool broken")).start()
    start = time.monotonic()
    with pytest.raises(LeaderFailed, match="agree/x/0/1: data-parallel producer 1 failed: step 0: RuntimeError"):
        a("0/1", torch.tensor([1]))
    assert time.monotonic() - start < 5


def test_stop_aborts_the_target_being_made():
    """A stopping run cuts generation it will not train on; the cut is no error."""
    cut = threading.Event()

    def produce(target, s):
        if target == 1:
            assert cut.wait(30), "never aborted"
            raise RuntimeError("generation aborted")
        return [target], {}

    p = Producer(produce, stream(), 1).start(0, published=0)
    p.get(0)
    wait_until(lambda: 1 in p._busy)
    start = time.monotonic()
    p.stop(abort=cut.set)
    assert time.monotonic() - start < 5 and not p._thread.is_alive()
    assert p.snapshot() == []  # no error raised, nothing queued


def test_overlap_starts_the_next_target_once_the_current_one_has_drawn():
    """overlap (partial rollouts): with k = 1 targets 0 and 1 are both admitted at version 0; target
    1 starts as soon as target 0 has drawn its prompts and runs beside it (never more than two;
    target 2 waits for version 1). Draws stay in target order, each share's position is the
    stream's right after its own draws (as made one after the other), shares come out in order
    whichever finishes first. Without overlap, target 1 waits for target 0 to finish."""
    release = {t: threading.Event() for t in range(4)}
    seen, both = [], threading.Event()
    p = Producer(lambda target, s: produce(target, s), stream(), 1, last_target=3, overlap=True)

    def produce(target, s):
        drawn = [q.ids[0] for q in s.take(3)]
        seen.append(target)
        if len(p._busy) == 2:
            both.set()
        assert release[target].wait(10)
        return drawn, {}

    p.start(0, published=0)
    assert both.wait(5) and sorted(p._busy) == [0, 1]
    time.sleep(0.1)
    assert seen == [0, 1]  # target 2 is not admitted before version 1
    release[1].set()  # the later target finishes first
    wait_until(lambda: p._busy == {0})
    release[0].set()
    s0, s1 = p.get(0), p.get(1)
    ref = stream()
    first, after_first = [q.ids[0] for q in ref.take(3)], ref.state_dict()
    second, after_second = [q.ids[0] for q in ref.take(3)], ref.state_dict()
    assert (s0.batch, s1.batch) == (first, second)
    assert (s0.position, s1.position) == (after_first, after_second)
    assert (s0.metrics["async/started_beside"], s1.metrics["async/started_beside"]) == (0.0, 1.0)
    release[2].set(), release[3].set()
    p.published(1)
    assert p.get(2).batch == [q.ids[0] for q in ref.take(3)]
    p.stop()

    # Without overlap: one target at a time.
    started = []

    def one_at_a_time(target, s):
        started.append((target, sorted(q._busy)))
        s.take(3)
        time.sleep(0.05)
        return target, {}

    q = Producer(lambda target, s: one_at_a_time(target, s), stream(), 1, last_target=1)
    q.start(0, published=0)
    assert [q.get(t).batch for t in (0, 1)] == [0, 1]
    assert started == [(0, [0]), (1, [1])]
    q.stop()


def test_overlap_refuses_a_second_draw():
    """A target that draws twice (dynamic sampling) cannot overlap: its share fails, naming why."""
    def produce(target, s):
        s.take(2)
        s.take(2)
        return target, {}

    p = Producer(produce, stream(), 1, last_target=0, overlap=True).start(0, published=0)
    with pytest.raises(ProducerStopped, match="drew prompts twice"):
        p.get(0)
    p.stop()


def test_stop_waits_its_timeout_in_all_not_per_thread():
    """A stop's `timeout` bounds its whole wait: two overlapping targets held where no abort
    reaches (a reward function's sleep) cost one timeout, not one per thread, and the run goes on
    without them (daemon threads)."""
    hold = threading.Event()
    both = threading.Event()
    p = Producer(lambda target, s: produce(target, s), stream(), 1, last_target=1, overlap=True)

    def produce(target, s):
        s.take(3)
        if len(p._busy) == 2:
            both.set()
        hold.wait(30)
        return target, {}

    p.start(0, published=0)
    assert both.wait(5) and len([w for w in p._workers if w.is_alive()]) == 2
    start = time.monotonic()
    p.stop(timeout=0.5)
    waited = time.monotonic() - start
    assert 0.45 <= waited < 0.95, waited  # one timeout (0.5 s) under load; two would be >= 1.0 s
    assert all(w.daemon for w in p._workers)
    hold.set()
