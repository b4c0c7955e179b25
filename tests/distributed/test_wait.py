"""megatron_rl.distributed.wait with 2 real gloo processes: rank 0 leads, rank 1 waits.

(a) A leader that works longer than the process group's timeout: a plain barrier under that
    timeout fails (the control, measured in the same run), LeaderSignal.wait returns and the
    broadcast after it succeeds; over later steps the store holds one key's entries, not more.
(b) A leader that never finishes: the waiter raises TimeoutError after timeout_s naming the key
    and the leader's last progress, having logged while it waited.
(c) A leader that fails: post_error (and `leading` around a raising block) reach the waiter at
    its next poll, long before its timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.distributed.wait import LeaderFailed, LeaderSignal

GROUP_TIMEOUT_S = 3.0
LEADER_WORK_S = 6.0  # twice the group's timeout


def _outlasts_group_timeout(rank, world_size):
    out = {}
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    # The default group is set up by run_distributed with the usual 30 min; the groups here get
    # 3 s, and so does the store's default timeout, which a store.get-based wait would hit.
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    sig = LeaderSignal("rollouts", timeout_s=60, log_every_s=1.0, poll_s=0.05, log=lambda s: None)
    key = "step0/mp0"
    t0 = time.monotonic()
    if rank == 0:
        # The leader's work. Meanwhile, show the store's default timeout is the short one.
        try:
            store.get("never-set")
        except dist.DistStoreError:
            out["store_get_failed_after"] = time.monotonic() - t0
        time.sleep(max(0.0, LEADER_WORK_S - (time.monotonic() - t0)))
        base_keys = store.num_keys()
        sig.post_progress(key, "8/8 samples")
        out["done_at"] = time.time()  # wall clock: both ranks run on this host
        sig.post_done(key)
        value = torch.tensor([42.0])
    else:
        # Control, over the same wait: a thread sits in a barrier as a collective would.
        def control_barrier():
            try:
                dist.barrier(group=control)
                out["control"] = "barrier returned"
            except RuntimeError as e:
                out["control"] = f"{type(e).__name__}: {e}"
                out["control_failed_after"] = time.monotonic() - t0

        thread = threading.Thread(target=control_barrier)
        thread.start()
        out["waited"] = sig.wait(key)
        out["returned_at"] = time.time()
        thread.join()
        value = torch.zeros(1)
    out["leader_done_after"] = time.monotonic() - t0
    dist.broadcast(value, src=0, group=group)
    out["broadcast"] = value.item()

    # Later steps: each posts and waits on a fresh key; the previous key's entries are deleted.
    # Counted by the leader after its own posts (a waiter's count could race the next step's).
    keys_live = []
    for step in range(1, 5):
        key = f"step{step}/mp0"
        if rank == 0:
            sig.post_progress(key, "1/8 samples")
            sig.post_done(key)
            keys_live.append(store.num_keys() - base_keys)
        else:
            sig.wait(key)
        dist.broadcast(torch.zeros(1), src=0, group=group)  # the rollouts' hand-out
    out["keys_live"] = keys_live
    out["old_keys_present"] = [s for s in range(3) if store.check([f"rollouts/step{s}/mp0/status"])
                               or store.check([f"rollouts/step{s}/mp0/progress"])]
    out["key_reuse"] = None
    if rank == 0:
        try:
            sig.post_progress(key, "again")
        except ValueError as e:
            out["key_reuse"] = str(e)
    return out


@pytest.mark.slow
def test_wait_outlasts_the_group_timeout_where_a_barrier_fails():
    leader, waiter = run_distributed(_outlasts_group_timeout, 2, timeout=120)
    # The controls: under the same 3 s timeout and the same leader delay, a barrier and a
    # store.get fail.
    assert "Timed out" in waiter["control"], waiter["control"]
    assert GROUP_TIMEOUT_S - 0.5 < waiter["control_failed_after"] < LEADER_WORK_S
    assert GROUP_TIMEOUT_S - 0.5 < leader["store_get_failed_after"] < LEADER_WORK_S
    # LeaderSignal.wait outlasts both, returns soon after the leader is done, and the collective
    # after it succeeds.
    assert leader["leader_done_after"] >= LEADER_WORK_S
    assert waiter["waited"] > LEADER_WORK_S - 0.5
    assert 0 <= waiter["returned_at"] - leader["done_at"] < 1.0
    assert leader["broadcast"] == waiter["broadcast"] == 42.0
    # One key's two entries (progress, status) stay live whatever the number of steps.
    assert leader["keys_live"] == [2, 2, 2, 2], leader["keys_live"]
    assert leader["old_keys_present"] == waiter["old_keys_present"] == []
    assert "already posted done/error" in leader["key_reuse"]


def _never_posts(rank, world_size):
    logs = []
    sig = LeaderSignal("rollouts", timeout_s=2.0, log_every_s=0.5, poll_s=0.05, log=logs.append,
                       timeout_name="trainer.rollout_wait_timeout")
    key = "step7/mp1"
    if rank == 0:
        sig.post_progress(key, "1/8 samples")
        time.sleep(0.5)
        sig.post_progress(key, "3/8 samples")
        return None  # and never posts done
    t0 = time.monotonic()
    try:
        sig.wait(key)
        return {"error": None}
    except TimeoutError as e:
        return {"error": str(e), "after": time.monotonic() - t0, "logs": logs}


@pytest.mark.slow
def test_wait_times_out_naming_the_key_and_last_progress():
    _, waiter = run_distributed(_never_posts, 2, timeout=120)
    err = waiter["error"]
    assert err is not None, "wait returned although the leader never posted done"
    assert 2.0 <= waiter["after"] < 4.0
    assert "rollouts/step7/mp1" in err and "'3/8 samples'" in err, err
    assert "trainer.rollout_wait_timeout=2" in err and "after 2s" in err, err
    # Logged every 0.5 s: at 0.5, 1.0, 1.5 (and perhaps at 2.0; one fewer if a poll stalled).
    assert 2 <= len(waiter["logs"]) <= 4, waiter["logs"]
    assert all("rollouts/step7/mp1" in line for line in waiter["logs"])
    assert "'3/8 samples'" in waiter["logs"][-1], waiter["logs"]


def _leader_fails(rank, world_size):
    sig = LeaderSignal("rollouts", timeout_s=60, log_every_s=30, poll_s=0.05, log=lambda s: None)
    out = {}
    if rank == 0:
        sig.post_progress("step3/mp0", "5/8 samples")
        time.sleep(0.3)
        sig.post_error("step3/mp0", "server http://node3:30000 refused the connection")
    else:
        t0 = time.monotonic()
        with pytest.raises(LeaderFailed) as e:
            sig.wait("step3/mp0")
        out["error"], out["after"] = str(e.value), time.monotonic() - t0
    dist.barrier()  # the waiter has seen step 3 before the leader moves on (and deletes it)
    if rank == 0:
        try:
            with sig.leading("step4/mp0"):
                raise ValueError("math-verify worker pool is broken")
        except ValueError:
            pass
    else:
        t0 = time.monotonic()
        with pytest.raises(LeaderFailed) as e:
            sig.wait("step4/mp0")
        out["leading_error"], out["leading_after"] = str(e.value), time.monotonic() - t0
    return out


@pytest.mark.slow
def test_leader_error_reaches_the_waiter_promptly():
    _, waiter = run_distributed(_leader_fails, 2, timeout=120)
    assert "rollouts/step3/mp0" in waiter["error"], waiter["error"]
    assert "server http://node3:30000 refused the connection" in waiter["error"]
    assert waiter["after"] < 5.0  # not the 60 s timeout
    assert "rollouts/step4/mp0" in waiter["leading_error"]
    assert "ValueError: math-verify worker pool is broken" in waiter["leading_error"]
    assert waiter["leading_after"] < 5.0


def test_bad_timeouts_are_refused():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="timeout_s=0"):
        LeaderSignal("x", timeout_s=0, log_every_s=1, store=store)
    with pytest.raises(ValueError, match="log_every_s=-1"):
        LeaderSignal("x", timeout_s=1, log_every_s=-1, store=store)
