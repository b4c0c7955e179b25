"""megatron_rl.distributed.wait with 2 real gloo processes: rank 0 leads, rank 1 waits.

(a) A leader that works longer than the process group's timeout: a plain barrier under that
    timeout fails (the control, measured in the same run), LeaderSignal.wait returns and the
    broadcast after it succeeds; over later steps the store holds one key's entries, not more.
(b) A leader that never finishes: the waiter raises TimeoutError after timeout_s naming the key
    and the leader's last progress, having logged while it waited.
(c) A leader that fails: post_error (and `leading` around a raising block) reach the waiter at
    its next poll, long before its timeout.
(d) StoreMeeting (3 ranks: the trainer's data-parallel producers before their first collective;
    StoreSum, their threads' per-round sum, is a gather on it): one member late by twice the
    group's timeout; the others wait, log the late rank, and the all-reduce after the meeting
    succeeds under the 3 s timeout; a member that fails reaches the others promptly; a member that
    never comes times out naming it; the store holds at most two meetings' entries per member.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.distributed.wait import LeaderFailed, LeaderSignal, StoreMeeting

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


def _meeting(rank, world_size):
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    dist.distributed_c10d._get_default_store().set_timeout(timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    logs, out = [], {}
    meeting = StoreMeeting("producers", rank, world_size, timeout_s=30, log_every_s=1.0, poll_s=0.05,
                           log=logs.append, timeout_name="trainer.rollout_wait_timeout", what="producer")
    store = dist.distributed_c10d._get_default_store()
    base = store.num_keys()
    live = []
    for step in range(4):
        if rank == 2 and step == 1:
            time.sleep(LEADER_WORK_S)  # twice the group's timeout
        out.setdefault("waited", []).append(meeting.meet(f"step{step}/try1"))
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)  # under the 3 s timeout: fine, everyone arrived together
        out.setdefault("sums", []).append(float(x))
        dist.barrier(group=group)
        live.append(store.num_keys() - base)
    out["live"], out["logs"] = live, list(logs)
    # A failing member: the others raise with its message at once.
    t0 = time.monotonic()
    try:
        with meeting.arrive("step4/try1"):
            if rank == 1:
                raise RuntimeError("reward worker pool is broken")
        out["failed"] = None
    except (LeaderFailed, RuntimeError) as e:
        out["failed"], out["failed_after"] = f"{type(e).__name__}: {e}", time.monotonic() - t0
    dist.barrier(group=group)
    # A member that never comes: the others time out naming it.
    short = StoreMeeting("late", rank, world_size, timeout_s=1.0, log_every_s=10, poll_s=0.05, log=lambda s: None,
                         timeout_name="trainer.rollout_wait_timeout", what="producer")
    if rank != 0:
        try:
            short.meet("step5/try1")
        except TimeoutError as e:
            out["timeout"] = str(e)
    dist.barrier(group=group)
    return out


@pytest.mark.slow
def test_meeting_outlasts_the_group_timeout_and_reports_who_is_late():
    outs = run_distributed(_meeting, 3, timeout=120)
    for rank, out in enumerate(outs):
        assert out["sums"] == [3.0] * 4  # 0 + 1 + 2: every all-reduce after a meeting went through
        # Bounded: two meetings' entries per member (the rest are torch's own barrier keys), not one per step.
        assert max(out["live"]) <= 2 * 3 + 2, out["live"]
        if rank != 2:
            assert out["waited"][1] > LEADER_WORK_S - 0.5  # waited out the late producer on the store
            assert any("producers/step1/try1: producers [2] not there yet" in line for line in out["logs"]), out["logs"]
        else:
            assert out["waited"][1] < 1.0 and not out["logs"]
        if rank == 1:
            assert out["failed"].startswith("RuntimeError: reward worker pool is broken")
        else:
            assert "producers/step4/try1: producer 1 failed: RuntimeError: reward worker pool is broken" in out["failed"]
            assert out["failed_after"] < 5.0
        if rank != 0:
            assert "late/step5/try1: producers [0] not there after 1s (trainer.rollout_wait_timeout=1)" \
                in out["timeout"], out["timeout"]


def test_meeting_refuses_bad_timeouts():
    with pytest.raises(ValueError, match="timeout_s=0"):
        StoreMeeting("x", 0, 2, timeout_s=0, log_every_s=1, store=dist.HashStore())
