"""The loop's operations (run/operations.py): the job's end, and the decision between two steps.

Independent reference: the arithmetic written out here (end − now against the longest recent step
+ the measured parts of the recent saves, with their safety margin, + the margin); the Slurm end
time as squeue prints it, parsed by the standard library. The Slurm job itself (a time limit
lowered mid-run, the requeue, the resume with no step lost or repeated) is tests/slurm/test_sbatch.py's.
"""

from __future__ import annotations

import datetime
import signal
import types

import pytest

from megatron_rl.config.schema import TrainerConfig
from megatron_rl.run.operations import JobClock, Operations, parse_end_time


def test_parse_end_time():
    assert parse_end_time("2026-11-26T21:34:40") == datetime.datetime(2026, 11, 26, 21, 34, 40).timestamp()
    assert parse_end_time("1800000000") == 1.8e9
    for none in ("NONE", "Unknown", "N/A", "UNLIMITED", ""):
        assert parse_end_time(none) is None


def test_job_clock_sources():
    t = [1000.0]
    now = lambda: t[0]  # noqa: E731
    assert JobClock(3600, env={"SLURM_JOB_ID": "7"}, now=now).end() == 4600.0  # explicit wins over Slurm
    assert JobClock(0, env={"SLURM_JOB_ID": "7"}, now=now).end() is None
    assert JobClock(None, env={}, now=now).end() is None  # not in a Slurm job
    with pytest.raises(ValueError, match="trainer.time_limit=-5"):
        JobClock(-5, env={})

    # Slurm: re-read every refresh_s (an administrator may change the limit mid-run)
    ends, reads = [5000.0, 3000.0], []

    def squeue(job_id):
        reads.append(job_id)
        return ends[min(len(reads), len(ends)) - 1]

    clock = JobClock(None, env={"SLURM_JOB_ID": "7"}, now=now, read_slurm=squeue, refresh_s=10)
    assert clock.end() == 5000.0 and reads == ["7"]
    t[0] += 5
    assert clock.end() == 5000.0 and len(reads) == 1  # cached
    t[0] += 6
    assert clock.end() == 3000.0 and len(reads) == 2  # lowered: seen

    # no squeue (a container): the end time the sbatch exported, said once
    lines = []

    def missing(job_id):
        raise OSError("squeue: [Errno 2] No such file or directory")

    clock = JobClock(None, env={"SLURM_JOB_ID": "7", "MRL_JOB_END_TIME": "4242"}, now=now, read_slurm=missing,
                     log=lines.append)
    assert clock.end() == 4242.0 and clock.end() == 4242.0
    assert len(lines) == 1 and "using MRL_JOB_END_TIME" in lines[0]


def _ops(tmp_path, end, margin=10.0, save_every=0):
    t = TrainerConfig(time_limit_margin=margin, save_every=save_every)
    ctx = types.SimpleNamespace(device="cpu", rank=0)
    clock = JobClock(None, env={})
    clock.end = lambda: end  # a fixed end, in epoch seconds
    clock.source = "test"
    return Operations(t, ctx, tmp_path, log=print, clock=clock)


def test_between_steps_stops_before_a_step_that_would_not_fit(tmp_path):
    import time

    ops = _ops(tmp_path, end=time.time() + 100, margin=10)
    try:
        ops._steps.extend([30.0, 50.0])  # the longest recent step counts
        d = ops.between_steps(step=3, last_step=10, save_every=0)
        assert (d.save, d.stop, d.requeue) == (False, "", False)  # 100 s left >= 50 + 0 + 10
        # a synchronous save blocked 36 s: 36 + 9 safety; 50 + 45 + 10 > 100
        ops.checkpointer.recent.append({"blocked_s": 36.0, "waited_s": 0.0, "writer_s": 0.0, "total_s": 36.0})
        d = ops.between_steps(step=4, last_step=10, save_every=0)
        assert (d.save, d.stop, d.requeue) == (True, "time limit", True)
        assert "a step takes up to 50s, a save 45s (blocking 36s + writer 0s + 9s safety)" in ops.why, ops.why
        assert "time_limit_margin=10s" in ops.why
        d = ops.between_steps(step=10, last_step=10, save_every=0)  # the last step: done, not requeued
        assert (d.save, d.stop, d.requeue) == (True, "", False)
    finally:
        ops.finish()


def test_save_reserve_from_measured_parts():
    from megatron_rl.run.operations import SAVE_SAFETY_MAX_S, save_reserve

    # An asynchronous save: 3 s blocking (2 s more waited for the save before: not its own), its
    # writer 40 s after; the most of the recent saves counts, plus a quarter as safety.
    recent = [{"blocked_s": 5.0, "waited_s": 2.0, "writer_s": 40.0},
              {"blocked_s": 2.0, "waited_s": 0.0, "writer_s": 30.0}]
    r = save_reserve(recent, step_s=600.0, saving_now=False, in_flight_for_s=None)
    assert (r.blocked_s, r.writer_s, r.in_flight_s, r.safety_s) == (3.0, 40.0, 0.0, 0.25 * 43.0)
    assert r.total_s == 43.0 * 1.25
    # A periodic save asked for now: its blocking part comes before the next step, its writer
    # (40 s) runs beside it (600 s); one whose writer outlasts the step is waited for.
    assert save_reserve(recent, 600.0, True, None).in_flight_s == 3.0
    assert save_reserve(recent, 30.0, True, None).in_flight_s == 3.0 + 10.0
    # A save in flight for 10 s: its writer needs 30 s more, less the next step's 25 s.
    assert save_reserve(recent, 25.0, False, 10.0).in_flight_s == 5.0
    assert save_reserve(recent, 600.0, False, 10.0).in_flight_s == 0.0
    # The safety margin is bounded; nothing measured yet: nothing reserved (the margin covers it).
    assert save_reserve([{"blocked_s": 4000.0, "writer_s": 0.0}], 10.0, False, None).safety_s == SAVE_SAFETY_MAX_S
    none = save_reserve([], 600.0, True, None)
    assert none.total_s == 0.0 and none.describe() == "no save measured yet"


def test_an_asynchronous_save_does_not_reserve_a_whole_step(tmp_path):
    """A 600 s step, an asynchronous save of 5 s blocking + 40 s writing, seen complete only at the
    next boundary (total 650 s). 700 s left: the next step and the final save fit (600 + 56 + 10);
    the old estimate (the request-to-complete 650 s) stopped here, a step early."""
    import time

    ops = _ops(tmp_path, end=time.time() + 700, margin=10)
    try:
        ops._steps.extend([600.0])
        ops.checkpointer.recent.append({"blocked_s": 5.0, "waited_s": 0.0, "writer_s": 40.0, "written_s": 600.0,
                                        "total_s": 650.0})
        d = ops.between_steps(step=3, last_step=10, save_every=0)
        assert (d.save, d.stop) == (False, "")
    finally:
        ops.finish()


def test_a_periodic_save_now_is_waited_for_before_the_final_one(tmp_path):
    """Blocking 30 s, writer 200 s, a 100 s step, 500 s left. Without a save at this boundary the
    next step and the final save fit (100 + 230 + 57.5 + 10); with a periodic one (save_every=4)
    the final save first waits for its writer (30 s before the step, 100 s after it): 100 + 360 + 90
    + 10 > 500, so the run stops at step 4, saving once."""
    import time

    ops = _ops(tmp_path, end=time.time() + 500, margin=10)
    try:
        ops._steps.extend([100.0])
        ops.checkpointer.recent.append({"blocked_s": 30.0, "waited_s": 0.0, "writer_s": 200.0})
        assert ops.between_steps(step=3, last_step=10, save_every=4).stop == ""
        d = ops.between_steps(step=4, last_step=10, save_every=4)
        assert (d.save, d.stop, d.requeue) == (True, "time limit", True)
        assert "+ 130s for the save in flight" in ops.why, ops.why
    finally:
        ops.finish()


def test_between_steps_periodic_final_and_signals(tmp_path):
    ops = _ops(tmp_path, end=None, save_every=4)
    try:
        assert ops.between_steps(3, 10, 4).save is False
        assert ops.between_steps(4, 10, 4).save is True
        assert ops.between_steps(10, 10, 4).save is True  # the last step
        signal.raise_signal(signal.SIGUSR1)
        d = ops.between_steps(5, 10, 4)
        assert (d.save, d.stop, d.requeue) == (True, "SIGUSR1", False)  # a signal is not a requeue by the loop
    finally:
        ops.finish()
    assert signal.getsignal(signal.SIGUSR1) is not ops.stop._handle  # handlers given back


def test_step_time_excludes_saves(tmp_path):
    import time

    ops = _ops(tmp_path, end=None)
    try:
        ops.step_started()
        time.sleep(0.2)
        ops.checkpointer.blocked_total_s += 0.15  # of those 0.2 s, a save held the step up for 0.15
        ops.between_steps(1, 10, 0)
        assert 0.04 < ops._steps[-1] < 0.12
    finally:
        ops.finish()


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_count_matches_transformers(tmp_path, moe):
    import transformers

    from megatron_rl.models.layout import parameter_count
    from megatron_rl.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", moe=moe, num_layers=3)
    config = transformers.AutoConfig.from_pretrained(path)
    import torch

    with torch.device("meta"):  # shapes only
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    assert parameter_count(types.SimpleNamespace(hf_path=str(path))) == expected


def test_storage_check_refuses_what_does_not_fit(tmp_path):
    import json

    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.run.checkpoint import storage_check

    (tmp_path / "q3").mkdir()
    (tmp_path / "q3" / "config.json").write_text(json.dumps(dict(  # Qwen3-30B-A3B's shape
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, vocab_size=151936,
        tie_word_embeddings=False)))
    job = to_object(load_config("tiny_cpu", [f"model.hf_path={tmp_path / 'q3'}", f"trainer.out_dir={tmp_path / 'run'}",
                                             "hardware=4 nodes x 8 H100"]))
    tb = 1e12
    line, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home="/nonexistent-home")
    assert "427.4 GB each (30,532.1M params x 14 bytes)" in line and "1,282.3 GB" in line and not problems
    line, problems = storage_check(job, free_bytes=lambda p: int(1 * tb), home="/nonexistent-home")
    assert len(problems) == 1 and "need 1,282.3 GB (keep_checkpoints=2 + 1 being written)" in problems[0]
    _, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home=str(tmp_path))
    assert len(problems) == 1 and "is under $HOME" in problems[0] and "427 GB" in problems[0]
    job.hardware = "cpu: 2 cores"  # a CPU run: fp32 (12 bytes), and $HOME is fine
    line, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home=str(tmp_path))
    assert "x 12 bytes" in line and not problems
