"""Operations: what the training loop asks between two steps — save now? stop now, and why?

`Operations.between_steps(step)` (collective, after every step) answers with a `Decision`:
- **stop signals** (SIGTERM / SIGUSR1 from a scheduler, Ctrl-C; run/signals.py): checkpoint and stop.
  One that arrives while the step is still generating does not wait for the generation (tens of
  minutes at 16k tokens, longer than a preemption's grace time): `interrupt()` turns true, the
  waits for the step's rollouts raise Interrupted, generation in flight is aborted, and the loop
  checkpoints the state after the last completed step (with max_staleness 0 exactly that: the
  weights after step t-1 and the prompt position before step t; with k >= 1 the complete queued
  shares too) and stops;
- **the time limit**: the job's end is known (the Slurm job's end time, re-read as an administrator
  may change it, or `trainer.time_limit` seconds after the start). The loop measures its own steps
  (the longest of the last five, without the time it was held up by saves) and its saves, in two
  parts (`save_reserve`): the part that holds the loop up (`blocked`: planning, staging to host
  memory; the whole write for a synchronous save) and the forked writer's own time to get its shards
  on disk (`writer`, the slowest rank's, timed by the writer itself), each the most of the last three
  saves, plus a quarter of their sum as a safety margin (at most SAVE_SAFETY_MAX_S). The final save
  has to be complete before the job ends, after waiting for a save still in flight (or a periodic
  one asked for now, whose writer runs beside the next step). Not the time from the request until the loop
  saw the checkpoint complete: an asynchronous save is seen complete at the next step boundary at
  the earliest, so that reserved a whole step and stopped each 24-hour job about two 30B steps
  early. When the next step plus that reserve plus `trainer.time_limit_margin` would run past the
  end, it checkpoints now and stops with `requeue` set: rank 0 writes `<out_dir>/requeue`, the CLI
  exits with REQUEUE_EXIT (75, "try again"), and the sbatch requeues the job, which resumes from that
  checkpoint. A 30B step takes tens of minutes, so waiting for Slurm's USR1 (300 s before the end)
  would lose the step in progress and every step since the last periodic checkpoint. Before the
  job's first save there is no measurement: the reserve is 0 and `trainer.time_limit_margin` alone
  covers the final save;
- **periodic and final checkpoints** (`trainer.save_every`, the last step).
The flags are max-reduced in one all-reduce, so every rank takes the same decision after the same
step. Checkpoints are written by `Checkpointer` (run/checkpoint.py); with `trainer.async_save`
each `between_steps` finishes a save whose writers are done, and `finish()` waits for one in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.run.checkpoint import Checkpointer
from megatron_rl.run.signals import StopRequest

STOP_KEY = "stop/requested"  # c10d store key: a stop signal arrived on some rank mid-step
REQUEUE_EXIT = 75  # EX_TEMPFAIL: stopped before the time limit with a checkpoint; run it again to go on
# Written by rank 0 into the run folder beside that exit: srun's --kill-on-bad-exit turns the other
# ranks' exit codes into "terminated" when one rank leaves first, so the sbatch reads this file instead.
REQUEUE_MARKER = "requeue"
SAVE_SAFETY = 0.25  # the reserve for a save: its measured parts plus this fraction of them ...
SAVE_SAFETY_MAX_S = 300.0  # ... but never more than this many seconds on top


@dataclasses.dataclass
class SaveReserve:
    """The seconds from a step boundary until the final checkpoint is complete (`save_reserve`)."""

    blocked_s: float  # a save's blocking part, measured (the most of the recent saves)
    writer_s: float  # its forked writer's time after that, measured (0 for synchronous saves)
    in_flight_s: float  # waiting for the save before it (one in flight, or one asked for now)
    safety_s: float

    @property
    def total_s(self) -> float:
        return self.blocked_s + self.writer_s + self.in_flight_s + self.safety_s

    def describe(self) -> str:
        if not self.blocked_s and not self.writer_s:
            return "no save measured yet"
        parts = f"blocking {self.blocked_s:.0f}s + writer {self.writer_s:.0f}s"
        if self.in_flight_s:
            parts += f" + {self.in_flight_s:.0f}s for the save in flight"
        return f"{parts} + {self.safety_s:.0f}s safety"


def save_reserve(recent: list[dict], step_s: float, saving_now: bool,
                 in_flight_for_s: Optional[float]) -> SaveReserve:
    """What to keep free after the next step (of up to `step_s`) for the final save, from the
    measured saves `recent` (Checkpointer.recent: blocked_s, waited_s, writer_s). `saving_now`: a
    periodic save starts at this boundary (its blocking part comes before the next step, its writer
    runs beside it); `in_flight_for_s`: an asynchronous save in flight for that many seconds (None:
    none). The final save waits for either's writer to finish, then blocks and writes."""
    blocked = max((r.get("blocked_s", 0.0) - r.get("waited_s", 0.0) for r in recent), default=0.0)
    writer = max((r.get("writer_s", 0.0) for r in recent), default=0.0)
    if saving_now:
        in_flight = blocked + max(0.0, writer - step_s)
    elif in_flight_for_s is not None:
        in_flight = max(0.0, writer - in_flight_for_s - step_s)
    else:
        in_flight = 0.0
    safety = min(SAVE_SAFETY * (blocked + writer + in_flight), SAVE_SAFETY_MAX_S)
    return SaveReserve(max(0.0, blocked), writer, in_flight, safety)


@dataclasses.dataclass
class Decision:
    save: bool  # checkpoint after this step
    stop: str = ""  # why the run stops after it ("" = it goes on): a signal's name, or "time limit"
    requeue: bool = False  # stopped for the time limit: exit REQUEUE_EXIT so that the launcher requeues


def slurm_end_time(job_id: str, timeout_s: float = 20.0) -> Optional[float]:
    """The Slurm job's end time (epoch seconds), from squeue; None when it has no time limit.
    Raises OSError when squeue is missing or fails (a container without the Slurm client)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%e"], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise OSError(f"squeue: {e}") from e
    text = out.stdout.strip()
    if out.returncode != 0 or not text:
        raise OSError(f"squeue -j {job_id} exited {out.returncode}: {out.stderr.strip()[:200]}")
    return parse_end_time(text)


def parse_end_time(text: str) -> Optional[float]:
    """squeue's %e (local time, `2026-11-26T21:34:40`) or epoch seconds -> epoch seconds; None for
    no end (NONE, Unknown, N/A, UNLIMITED)."""
    text = text.strip()
    if text.upper() in ("NONE", "UNKNOWN", "N/A", "UNLIMITED", ""):
        return None
    try:
        return float(text)
    except ValueError:
        return datetime.datetime.fromisoformat(text).timestamp()  # naive: local time, as squeue prints it


class JobClock:
    """When the run must be done (epoch seconds), or None.

    `time_limit`: seconds from `start`; 0 = no limit; None = the Slurm job's end time when this runs
    in a Slurm job: squeue (re-read every `refresh_s`, since `scontrol update TimeLimit=` changes it),
    else `MRL_JOB_END_TIME` (epoch seconds; the sbatch exports it for containers without squeue).
    """

    def __init__(self, time_limit: Optional[float], env=os.environ, now: Callable[[], float] = time.time,
                 read_slurm: Callable[[str], Optional[float]] = slurm_end_time, refresh_s: float = 10.0,
                 log: Callable[[str], None] = print):
        self._now, self._read, self.refresh_s, self.log = now, read_slurm, refresh_s, log
        self.job_id = env.get("SLURM_JOB_ID") if time_limit is None else None
        self._fixed: Optional[float] = None
        if time_limit is not None and time_limit < 0:
            raise ValueError(f"trainer.time_limit={time_limit}: seconds (> 0), 0 for none, or null for the Slurm job's")
        if time_limit:
            self._fixed = now() + float(time_limit)
            self.source = f"trainer.time_limit={time_limit:g}s"
        elif self.job_id:
            exported = env.get("MRL_JOB_END_TIME")
            self._fixed = parse_end_time(exported) if exported else None
            self.source = f"Slurm job {self.job_id}'s end time"
        else:
            self.source = "none"
        self._read_at = -float("inf")
        self._slurm: Optional[float] = None
        self._squeue_ok = True

    def end(self) -> Optional[float]:
        if self.job_id and self._squeue_ok and self._now() - self._read_at >= self.refresh_s:
            self._read_at = self._now()
            try:
                self._slurm = self._read(self.job_id)
                self._fixed = None
            except OSError as e:
                self._squeue_ok = False  # once: then MRL_JOB_END_TIME, or no limit
                self.log(f"[megatron-rl] cannot read the Slurm job's end time ({e}); "
                         f"{'using MRL_JOB_END_TIME' if self._fixed else 'no time limit is kept'}")
        return self._slurm if self.job_id and self._squeue_ok else self._fixed


class Operations:
    """The loop's one place for checkpoint timing, time limits and stop requests (module docstring).
    Collective: every learner rank makes the same calls."""

    def __init__(self, trainer_cfg, ctx, out_dir: str | Path, log: Callable[[str], None], clock: Optional[JobClock] = None):
        t = trainer_cfg
        self.ctx, self.log = ctx, log
        self.stop = StopRequest(ctx.device, announce=ctx.rank == 0)
        self.checkpointer = Checkpointer(out_dir, keep=t.keep_checkpoints, async_save=t.async_save,
                                         device=ctx.device, log=log)
        self.margin = float(t.time_limit_margin)
        self.clock = clock if clock is not None else JobClock(t.time_limit, log=log) if ctx.rank == 0 else None
        self._steps: collections.deque[float] = collections.deque(maxlen=5)  # recent step seconds, saves excluded
        self._mark = time.monotonic()
        self._blocked_at_mark = 0.0
        self.why = ""  # rank 0: the time-limit arithmetic behind the last stop
        self._store = None  # where a stop requested mid-step is posted for the other ranks
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._store = dist.distributed_c10d._get_default_store().clone()
        self._posted, self._remote, self._checked = False, False, -float("inf")

    def _out_of_time(self, saving_now: bool) -> bool:
        if self.clock is None:
            return False
        end = self.clock.end()
        if end is None or not self._steps:
            return False
        left = end - time.time()
        step_s = max(self._steps)
        job = self.checkpointer.pending
        in_flight = time.monotonic() - job.forked_at if job is not None and job.process is not None else None
        reserve = save_reserve(list(self.checkpointer.recent), step_s, saving_now, in_flight)
        if left >= step_s + reserve.total_s + self.margin:
            return False
        self.why = (f"{left:.0f}s left before {datetime.datetime.fromtimestamp(end):%Y-%m-%d %H:%M:%S} "
                    f"({self.clock.source}); a step takes up to {step_s:.0f}s, a save {reserve.total_s:.0f}s "
                    f"({reserve.describe()}), and trainer.time_limit_margin={self.margin:g}s stays free")
        return True

    def between_steps(self, step: int, last_step: int, save_every: int) -> Decision:
        """Collective, after step `step` (1-based count of finished steps)."""
        now = time.monotonic()
        self._steps.append(max(0.0, now - self._mark - (self.checkpointer.blocked_total_s - self._blocked_at_mark)))
        self.checkpointer.poll()  # finish an asynchronous save whose writers are all done
        periodic = bool(save_every and step % save_every == 0)
        out_of_time = step < last_step and self._out_of_time(periodic)  # the last step needs no requeue
        flags = torch.tensor([self.stop.signum, int(out_of_time)], dtype=torch.int64, device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, out_of_time = int(flags[0]), bool(flags[1])
        self.stop.signum = signum
        stop = self.stop.name() if signum else "time limit" if out_of_time else ""
        save = bool(stop) or step == last_step or periodic
        return Decision(save=save, stop=stop, requeue=out_of_time and not signum)

    def interrupt(self) -> bool:
        """Whether the step in progress is to be given up now: a stop signal arrived here, or another
        rank posted one on the c10d store (`stop/requested`; checked at most every half second).
        Polled by producer ranks while they wait for their generation (trainer/producer.py `get`,
        distributed/wait.py `StoreMeeting`); their model-parallel peers follow their leader."""
        if self.stop.signum:
            if self._store is not None and not self._posted:
                self._store.set(STOP_KEY, self.stop.name())
                self._posted = True
            return True
        if self._store is None:
            return False
        now = time.monotonic()
        if now - self._checked >= 0.5:
            self._checked = now
            self._remote = self._store.check([STOP_KEY])
        return self._remote

    def step_started(self) -> None:
        """The next step's clock starts here (after the save the last decision asked for)."""
        self._mark = time.monotonic()
        self._blocked_at_mark = self.checkpointer.blocked_total_s

    def finish(self) -> None:
        """Collective: complete a save in flight; give the signal handlers back."""
        try:
            self.checkpointer.wait()
        finally:
            self.stop.restore()
