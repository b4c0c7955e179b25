"""Asynchronous training throughput: synchronous vs trainer.max_staleness=1 and 2, each with the
push draining the producer ("drain") or cutting generation in flight (rollout.partial_rollouts).

    .venv/bin/python benchmarks/bench_async.py sim [--quick]   # ~10 s (--quick: ~3 s)
    .venv/bin/python benchmarks/bench_async.py cpu [--quick]   # real runs, ~20 min (--quick: ~4)

sim: the REAL `trainer/producer.py` `Producer` (its gate, order and `drain`) between a simulated
    rollout fleet and a simulated learner, in virtual time. The learner thread is
    `Trainer.fit`'s loop reduced to its timing: `get(t)`, train, then the push of `sync_weights`
    (drain, or pause/abort -> push -> continue) and `published(t+1)`. The producer's condition
    variable is swapped for one that tells a virtual clock when a thread waits; the clock moves
    only when every thread waits, so results are exact and do not depend on this machine's load.
    Model (every number a flag; defaults a Qwen3-30B-A3B-like GRPO cluster):
    - batch: prompts x samples responses, each `prompt_len` prompt tokens and a response length
      drawn i.i.d. lognormal (median = max_new_tokens/4, sigma 0.84, so ~5 % reach
      max_new_tokens and are cut there: a right-skewed reasoning-RL length histogram with a
      truncation spike at the cap), seeded by step, so every configuration sees the same batches;
    - fleet: `slots` concurrent sequences (servers x the client's in-flight limit); one decode
      step adds a token to every running sequence and takes tau * (beta + (1-beta) * running/slots)
      (memory-bound decode: a nearly empty batch still costs beta of a full one); queued
      requests take free slots in order; first prefill is not modelled (equal in all modes);
    - partial mode: a pause cuts every running sequence; when anything was in flight it costs
      `abort_pause` (SGLang's abort loop sleeps 1 s while a request holds its lock), then the push;
      on continue the cut sequences are prefilled again (prompt + partial, `prefill_rate` tokens/s
      over the fleet) and decode on under the new version;
    - learner: train time = c * tokens of the batch (prompt + response); push = `push` seconds;
    - calibration: tau and c are set so that the synchronous step has the mean `step` seconds with
      generation `gen_frac` of it (and the push `push` s).
    Reported: steady-state time per step (after `warmup` steps), steps/hour, speedup vs sync, the
    fleet's decoding fraction and slot use, the learner's time split, token staleness.

cpu: real `megatron_rl.cli train tiny_cpu` runs against one SGLang CPU server pinned to core 0
    (`taskset -a -p`, OMP_NUM_THREADS=1), the trainer under `taskset -c 1` (OMP_NUM_THREADS=1),
    responses up to 32 tokens; the five configurations interleaved per repetition; median
    time/step over steps 1 .. steps-3 of each run's metrics.jsonl (step 0 fills the queue, the
    last two have nothing left to generate), ratios vs sync within a repetition.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = [  # name, max_staleness, partial_rollouts, overlap (the trainer's: partial rollouts)
    ("sync", 0, False, False), ("k1", 1, False, False), ("k2", 2, False, False),
    ("k1+partial (one target at a time)", 1, True, False), ("k2+partial (one target at a time)", 2, True, False),
    ("k1+partial", 1, True, True), ("k2+partial", 2, True, True)]
# What the trainer runs (with partial rollouts the producer always overlaps): the cpu mode's runs.
REAL = [(name, k, partial) for name, k, partial, overlap in CONFIGS if overlap == partial]


# ============================================================================ virtual time
class VirtualClock:
    """Time shared by cooperating threads. It moves only when every registered thread waits (in
    `sleep`, or in a `VCondition`), and then jumps to the earliest sleeper's deadline; threads
    that run meanwhile take no virtual time."""

    def __init__(self):
        me = threading.get_ident()
        self.now = 0.0
        self._m = threading.Lock()
        self._running = {me}
        self._wake = {me: threading.Event()}
        self._pending = 0  # threads started but not seen yet: counted as running
        self._timers: list[tuple[float, int, int]] = []  # (deadline, seq, thread)
        self._timer_of: dict[int, int] = {}  # thread -> seq of its live timer
        self._interrupted: set[int] = set()
        self._seq = 0
        self.stalled = False  # every thread waits and none has a deadline: a deadlock

    def expect_thread(self) -> None:
        with self._m:
            self._pending += 1

    def _see(self, me: int) -> None:
        if me not in self._wake:
            self._wake[me] = threading.Event()
            self._pending = max(0, self._pending - 1)
            self._running.add(me)

    def _advance(self) -> None:  # under _m
        while not self._running and not self._pending:
            while self._timers and self._timer_of.get(self._timers[0][2]) != self._timers[0][1]:
                heapq.heappop(self._timers)  # cancelled by an interrupt
            if not self._timers:
                self.stalled = True
                return
            t, _, who = heapq.heappop(self._timers)
            del self._timer_of[who]
            self.now = max(self.now, t)
            self._running.add(who)
            self._wake[who].set()

    def block(self) -> None:
        with self._m:
            me = threading.get_ident()
            self._see(me)
            self._running.discard(me)
            self._advance()

    def unblock(self, who: int | None = None) -> None:
        with self._m:
            who = threading.get_ident() if who is None else who
            self._see(who)
            self._running.add(who)

    def retire(self) -> None:
        """The calling thread leaves (the producer's threads' on_exit). Its ident is forgotten:
        a thread started later may get the same ident and must be seen as new."""
        with self._m:
            me = threading.get_ident()
            self._see(me)
            self._running.discard(me)
            self._wake.pop(me, None)
            self._advance()

    def sleep(self, dt: float, cancel=None) -> bool:
        """Wait dt virtual seconds; True if `interrupt`ed before (or `cancel()` already true)."""
        me = threading.get_ident()
        with self._m:
            self._see(me)
            if cancel is not None and cancel():
                return True
            ev = self._wake[me]
            ev.clear()
            self._seq += 1
            heapq.heappush(self._timers, (self.now + max(dt, 0.0), self._seq, me))
            self._timer_of[me] = self._seq
            self._running.discard(me)
            self._advance()
        ev.wait()
        with self._m:
            if me in self._interrupted:
                self._interrupted.discard(me)
                return True
            return False

    def interrupt(self, who: int) -> None:
        """End `who`'s sleep now (no-op when it is not sleeping)."""
        with self._m:
            if who in self._timer_of:
                del self._timer_of[who]
                self._interrupted.add(who)
                self._running.add(who)
                self._wake[who].set()


class VCondition(threading.Condition):
    """A condition variable whose waiters count as waiting for the virtual clock. Notify marks
    its waiters running before they wake, so the clock cannot move past them."""

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self.clock = clock
        self._vwaiters: set[int] = set()

    def wait(self, timeout=None):
        me = threading.get_ident()
        self._vwaiters.add(me)
        self.clock.block()
        try:
            return super().wait(timeout)
        finally:
            self._vwaiters.discard(me)
            self.clock.unblock(me)
            if self.clock.stalled and threading.current_thread() is threading.main_thread():
                raise RuntimeError("simulation deadlock: every thread waits and none has a deadline")

    def notify(self, n=1):
        # Which of several waiters a partial notify wakes is unknown, so only wake-all is
        # supported (the Producer only uses notify_all, which calls this with every waiter).
        if n < len(self._waiters):
            raise NotImplementedError("VCondition supports notify_all only")
        for w in list(self._vwaiters):
            self.clock.unblock(w)
        super().notify(n)


# ============================================================================ simulated fleet
@dataclass
class Request:
    prompt: int  # prompt tokens
    length: int  # response tokens it will make
    done: float = 0.0  # response tokens made so far
    segments: list = field(default_factory=list)  # [(weight version, tokens)] in order
    cut: bool = False  # continued after a pause


class Fleet:
    """The rollout servers as one pool of `slots` sequences decoding in lock-step (see the module
    docstring), driven by a thread of its own: `generate` (on the producer's threads: two targets
    at once with overlap) queues its requests and waits for them; every caller's requests share the
    same slots. `pause`/`resume`/`set_version` come from the learner."""

    def __init__(self, clock: VirtualClock, slots: int, tau: float, beta: float, prefill_rate: float):
        self.clock, self.slots, self.tau, self.beta, self.prefill_rate = clock, slots, tau, beta, prefill_rate
        self.cv = VCondition(clock)
        self.version = 0
        self.paused = False
        self.stopped = False
        self.queue: deque = deque()
        self.running: list[tuple[float, int, Request]] = []  # heap (finish position, seq, request)
        self.left: dict[int, list[int]] = {}  # id(request) -> its generate call's count of unfinished requests
        self.arrived = False  # new requests while decoding: the next decode step takes them
        self.thread: int | None = None
        self.log: list[tuple[float, float, int, str]] = []  # (t0, t1, running, decode|stall|paused)
        clock.expect_thread()
        self._thread = threading.Thread(target=self._drive, daemon=True, name="fleet")
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def step_time(self, n: int) -> float:
        return self.tau * (self.beta + (1 - self.beta) * n / self.slots)

    def generate(self, reqs: list[Request]) -> None:
        left = [len(reqs)]
        with self.cv:
            for r in reqs:
                self.left[id(r)] = left
            self.queue.extend(reqs)
            self.arrived = True
            self.cv.notify_all()
        if self.thread is not None and len(self.running) < self.slots:
            self.clock.interrupt(self.thread)  # free slots: they start at this decode step
        with self.cv:
            while left[0]:
                self.cv.wait()

    def stop(self) -> None:
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        if self.thread is not None:
            self.clock.interrupt(self.thread)
        self.clock.block()
        self._thread.join()
        self.clock.unblock()

    def _drive(self) -> None:
        clock = self.clock
        self.thread = threading.get_ident()
        start: dict[int, float] = {}  # id(request) -> position when it (re)started
        pos, seq, stall = 0.0, 0, 0.0  # tokens every running sequence has made since the start

        def close(r: Request, upto: float) -> None:
            made = upto - start.pop(id(r))
            if made > 0:
                r.segments.append((self.version, made))
                r.done += made

        try:
            while True:
                with self.cv:
                    while not self.stopped and not self.busy:
                        self.cv.wait()
                    if self.stopped:
                        return
                    self.arrived = False
                    if self.paused:
                        cut = [r for _, _, r in sorted(self.running)]
                        for r in cut:
                            close(r, pos)
                            r.cut = r.cut or r.done > 0
                        self.running.clear()
                        self.queue.extendleft(reversed(cut))  # the clients re-send them first
                        t0 = clock.now
                        while self.paused:
                            self.cv.wait()
                        self.log.append((t0, clock.now, 0, "paused"))
                        stall = sum(r.prompt + r.done for r in cut if r.done > 0) / self.prefill_rate
                    while self.queue and len(self.running) < self.slots:
                        r = self.queue.popleft()
                        start[id(r)] = pos
                        seq += 1
                        heapq.heappush(self.running, (pos + r.length - r.done, seq, r))
                t0 = clock.now
                if stall > 0:
                    interrupted = clock.sleep(stall, cancel=lambda: self.paused or self.stopped)
                    self.log.append((t0, clock.now, 0, "stall"))
                    stall = 0.0 if not interrupted else stall - (clock.now - t0)
                    continue
                n = len(self.running)
                dt_tok = self.step_time(n)
                finish = self.running[0][0]
                interrupted = clock.sleep((finish - pos) * dt_tok,
                                          cancel=lambda: self.paused or self.stopped or self.arrived)
                self.log.append((t0, clock.now, n, "decode"))
                pos = finish if not interrupted else min(finish, pos + (clock.now - t0) / dt_tok)
                with self.cv:
                    woke = False
                    while self.running and self.running[0][0] <= pos + 1e-9:
                        _, _, r = heapq.heappop(self.running)
                        close(r, r.length - r.done + start[id(r)])
                        left = self.left.pop(id(r))
                        left[0] -= 1
                        woke = woke or left[0] == 0
                    if woke:
                        self.cv.notify_all()
        finally:
            clock.retire()

    def pause(self) -> bool:
        """Cut generation in flight; whether anything was in flight."""
        with self.cv:
            self.paused = True
            in_flight = self.busy
        if in_flight and self.thread is not None:
            self.clock.interrupt(self.thread)
        return in_flight

    def resume(self, version: int) -> None:
        with self.cv:
            self.paused, self.version = False, version
            self.cv.notify_all()

    def set_version(self, version: int) -> None:
        with self.cv:
            if self.busy:
                raise RuntimeError("drain mode pushed weights while generation ran: the producer's "
                                   "drain did not wait for every admitted target")
            self.version = version


# ============================================================================ simulated trainer
@dataclass
class SimParams:
    steps: int = 60
    warmup: int = 6
    cooldown: int = 3
    prompts: int = 64
    samples: int = 8
    prompt_len: int = 512
    max_new_tokens: int = 8192
    median_frac: float = 0.25
    sigma: float = 0.84
    slots: int = 256
    beta: float = 0.4
    step: float = 225.0  # the synchronous step (mean), seconds
    gen_frac: float = 0.70
    push: float = 5.0
    abort_pause: float = 1.0
    prefill_rate: float = 500_000.0
    seed: int = 0
    tau: float = 1.0  # set by calibration
    c_tok: float = 0.0  # set by calibration


def batch_lengths(p: SimParams, target: int) -> list[int]:
    rng = random.Random(p.seed * 1_000_003 + target)
    mu = math.log(p.median_frac * p.max_new_tokens)
    return [min(p.max_new_tokens, max(1, round(rng.lognormvariate(mu, p.sigma))))
            for _ in range(p.prompts * p.samples)]


def simulate(p: SimParams, k: int, partial: bool, overlap: bool = False) -> dict:
    """One run: the real Producer, the simulated fleet, the learner loop in virtual time."""
    from megatron_rl.trainer.producer import Producer
    from megatron_rl.data.prompts import Prompt, PromptStream

    clock = VirtualClock()
    fleet = Fleet(clock, p.slots, p.tau, p.beta, p.prefill_rate)
    stream = PromptStream([Prompt(ids=(i,), answer="", uid=f"sim:{i}") for i in range(4096)], seed=p.seed)

    def produce(target: int, s: PromptStream):
        s.take(p.prompts)  # the stream advances as the trainer's does (no effect on lengths)
        reqs = [Request(p.prompt_len, n) for n in batch_lengths(p, target)]
        fleet.generate(reqs)
        return reqs, {}

    producer = Producer(produce, stream, k, last_target=p.steps - 1, on_exit=clock.retire, overlap=overlap)
    producer._cond = VCondition(clock)  # the real gate and drain, waiting in virtual time
    producer.before_worker = clock.expect_thread  # overlap's worker threads join the clock
    clock.expect_thread()
    producer.start(0, published=0)
    rows = []
    for t in range(p.steps):
        t0 = clock.now
        reqs = producer.get(t).batch
        t1 = clock.now
        tokens = sum(r.prompt + r.length for r in reqs)
        clock.sleep(p.c_tok * tokens)
        t2 = clock.now
        abort = drain = 0.0
        if partial:  # Trainer.sync_weights with rollout.partial_rollouts
            if fleet.pause():
                clock.sleep(p.abort_pause)
                abort = p.abort_pause
            clock.sleep(p.push)
            fleet.resume(t + 1)
        else:
            producer.drain()
            drain = clock.now - t2
            fleet.set_version(t + 1)
            clock.sleep(p.push)
        producer.published(t + 1)
        by_age: dict[int, float] = {}
        for r in reqs:
            for v, n in r.segments:
                by_age[t - v] = by_age.get(t - v, 0.0) + n
        if any(d < 0 or d > k for d in by_age):
            raise RuntimeError(f"step {t}: token ages {sorted(by_age)} outside [0, {k}]")
        rows.append(dict(end=clock.now, wait=t1 - t0, train=t2 - t1, drain=drain, abort=abort,
                         push=p.push, by_age=by_age, continued=sum(r.cut for r in reqs), tokens=tokens,
                         response_tokens=sum(r.length for r in reqs)))
    clock.block()
    producer.stop()
    clock.unblock()
    fleet.stop()
    return summarize(p, rows, fleet.log)


def summarize(p: SimParams, rows: list[dict], log: list) -> dict:
    # Steady state: without the first `warmup` steps (the producer filling its queue) and the last
    # `cooldown` ones (no targets after the run's last step: the learner drains the queue).
    w, end = p.warmup, len(rows) - p.cooldown
    if not 0 <= w < end:
        raise ValueError(f"{len(rows)} steps leave no window after warmup {p.warmup} and cooldown {p.cooldown}")
    a, b = rows[w - 1]["end"] if w else 0.0, rows[end - 1]["end"]
    window = rows[w:end]
    wall = b - a

    def clipped(kind):
        tot = slots = 0.0
        for t0, t1, n, k in log:
            d = max(0.0, min(t1, b) - max(t0, a))
            if k == kind and d > 0:
                tot += d
                slots += d * n
        return tot, slots

    decode, slot_s = clipped("decode")
    ages: dict[int, float] = {}
    for r in window:
        for d, n in r["by_age"].items():
            ages[d] = ages.get(d, 0.0) + n
    ntok = sum(ages.values())
    return dict(step_s=wall / len(window), decode=decode / wall, slots=slot_s / (p.slots * wall),
                train=sum(r["train"] for r in window) / wall, wait=sum(r["wait"] for r in window) / wall,
                drain=sum(r["drain"] for r in window) / wall,
                push=sum(r["push"] + r["abort"] for r in window) / wall,
                stale_mean=sum(d * n for d, n in ages.items()) / ntok,
                old_frac=sum(n for d, n in ages.items() if d > 0) / ntok,
                continued=statistics.mean(r["continued"] for r in window) / (p.prompts * p.samples),
                response_tokens=statistics.mean(r["response_tokens"] for r in window),
                tokens=statistics.mean(r["tokens"] for r in window))


def calibrate(p: SimParams) -> SimParams:
    """tau, c: the synchronous run's mean generation = gen_frac * step, train = the rest - push."""
    probe = SimParams(**{**vars(p), "tau": 1.0, "c_tok": 0.0, "push": 0.0, "warmup": 0,
                                 "cooldown": 0})
    s = simulate(probe, 0, False)
    gen_unit = s["step_s"]  # train and push are 0: the step is generation
    train = p.step * (1 - p.gen_frac) - p.push
    if train <= 0:
        raise ValueError(f"--step {p.step} x (1 - --gen-frac {p.gen_frac}) leaves no time to train after "
                         f"--push {p.push}")
    return SimParams(**{**vars(p), "tau": p.step * p.gen_frac / gen_unit, "c_tok": train / s["tokens"]})


def run_sim(args) -> None:
    base = SimParams(steps=args.steps or (14 if args.quick else 60), warmup=4 if args.quick else 6,
                     slots=args.slots, beta=args.beta, step=args.step, push=args.push,
                     max_new_tokens=args.max_new_tokens, median_frac=args.median_frac, sigma=args.sigma,
                     prompts=args.prompts, samples=args.samples, abort_pause=args.abort_pause,
                     prefill_rate=args.prefill_rate, prompt_len=args.prompt_len)
    fracs = [0.7] if args.quick else args.gen_fracs
    t_start = time.perf_counter()
    print(f"# sim: {base.prompts}x{base.samples} responses/step, max_new_tokens {base.max_new_tokens}, "
          f"lognormal median {base.median_frac:g}*max sigma {base.sigma}, {base.slots} slots, beta {base.beta}, "
          f"sync step {base.step:g} s, push {base.push:g} s, abort pause {base.abort_pause:g} s, "
          f"prefill {base.prefill_rate:g} tok/s; steps {base.steps} (first {base.warmup} "
          f"and last {base.cooldown} excluded)")
    lengths = [n for t in range(base.steps) for n in batch_lengths(base, t)]
    lengths.sort()
    print(f"# response lengths: median {lengths[len(lengths) // 2]}, mean {statistics.mean(lengths):.0f}, "
          f"p90 {lengths[int(0.9 * len(lengths))]}, "
          f"at max {sum(n == base.max_new_tokens for n in lengths) / len(lengths):.1%}")
    for frac in fracs:
        p = calibrate(SimParams(**{**vars(base), "gen_frac": frac}))
        ideal = statistics.mean(sum(batch_lengths(p, t)) for t in range(p.steps)) * p.tau / p.slots
        print(f"\n## generation {frac:.0%} of the synchronous step: tau {p.tau * 1000:.1f} ms/decode step at full "
              f"occupancy; a tail-free generation of the mean batch would take {ideal:.1f} s")
        print("| config | s/step | steps/h | speedup | fleet decoding | slot use | learner trains | waits for "
              "data | waits in drain | push (+abort) | staleness mean | old-token frac | continued |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        sync = None
        for name, k, partial, overlap in CONFIGS:
            s = simulate(p, k, partial, overlap)
            sync = sync or s["step_s"]
            print(f"| {name} | {s['step_s']:.1f} | {3600 / s['step_s']:.1f} | {sync / s['step_s']:.3f} | "
                  f"{s['decode']:.1%} | {s['slots']:.1%} | {s['train']:.1%} | {s['wait']:.1%} | {s['drain']:.1%} | "
                  f"{s['push']:.1%} | {s['stale_mean']:.3f} | {s['old_frac']:.3f} | {s['continued']:.1%} |")
    print(f"\n# sim wall time {time.perf_counter() - t_start:.1f} s")


# ============================================================================ CPU demo
def pin_tree(pid: int, core: int) -> list[int]:
    """taskset every thread of the process tree of `pid` to `core`; the pids pinned."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for q in procs:
        subprocess.run(["taskset", "-a", "-p", f"{1 << core:x}", str(q.pid)], check=True, capture_output=True)
    return [q.pid for q in procs]


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_cpu(args) -> None:
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.run.metrics import read_metrics

    if (os.cpu_count() or 1) < 2:
        raise SystemExit("cpu mode pins the server to core 0 and the learner to core 1: needs 2 cores")
    reps = args.reps or (1 if args.quick else 3)
    steps = args.cpu_steps or (5 if args.quick else 10)
    if steps < 4:
        raise SystemExit(f"--cpu-steps {steps}: at least 4 (steps 1 .. steps-3 are measured)")
    common = ["rollout.max_new_tokens=32", f"rollout.prompts_per_step={args.cpu_prompts}",
              f"rollout.n_samples={args.cpu_samples}", "algorithm.mini_batches=2",
              f"learner.micro_batch_size={args.cpu_prompts * args.cpu_samples // 2}", "eval.num_prompts=0",
              f"trainer.steps={steps}", "trainer.save_every=0", "trainer.progress=false", "trainer.plot=false"]
    root = Path(tempfile.mkdtemp(prefix="bench_async_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    print(f"# cpu: load before {load()}; runs under {root}")
    tiny = to_object(load_config("tiny_cpu")).model.tiny
    ckpt = make_tiny_checkpoint(root / "model", **vars(tiny))
    config = ServerConfig(model_path=str(ckpt), max_total_tokens=8192,
                          extra_args=("--enable-deterministic-inference",), env={"OMP_NUM_THREADS": "1"})
    results: dict[str, list[dict]] = {name: [] for name, _, _ in REAL}
    with EngineManager(config, 1, log_dir=root / "logs") as mgr:
        url = mgr.urls()[0]
        for rep in range(reps):
            for name, k, partial in REAL:
                pinned = pin_tree(mgr.servers[0].pid, 0)  # again each run: the watchdog may restart it
                out = root / f"{name}.{rep}"
                cmd = ["taskset", "-c", "1", sys.executable, "-m", "megatron_rl.cli", "train", "tiny_cpu",
                       f"trainer.out_dir={out}", f"rollout.server_urls=[{url}]", *common,
                       f"trainer.max_staleness={k}", f"rollout.partial_rollouts={str(partial).lower()}"]
                t, before = time.perf_counter(), load()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
                wall = time.perf_counter() - t
                if proc.returncode:
                    raise SystemExit(f"{name} rep {rep} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
                # Steps 1 .. steps-3: step 0 starts with an empty queue; in the last two the
                # producer has no targets left to make (k=2 made the last one during steps-3).
                rows = [r for r in read_metrics(out) if 1 <= r["step"] <= steps - 3]
                med = {key: statistics.median(r.get(key, 0.0) for r in rows) for key in (
                    "time/step", "time/generate", "time/generate_only", "time/queue_wait", "time/train",
                    "time/weight_sync",
                    "async/staleness_mean", "async/old_token_frac", "async/continued_samples",
                    "rollout/response_len_mean")}
                results[name].append(med | {"wall": wall})
                print(f"rep {rep} {name:11s} wall {wall:6.1f} s  median step {med['time/step']:.3f} s  "
                      f"(generate {med['time/generate']:.3f}, of which queue wait {med['time/queue_wait']:.3f}; "
                      f"producer's generation per share {med['time/generate_only']:.3f}; "
                      f"train {med['time/train']:.3f}; weight sync {med['time/weight_sync']:.3f}); "
                      f"staleness {med['async/staleness_mean']:.2f}, continued {med['async/continued_samples']:.0f}, "
                      f"response length {med['rollout/response_len_mean']:.1f}; load {before} -> {load()}; "
                      f"server pids pinned {pinned}", flush=True)
    print(f"# load after {load()}")
    json.dump(results, open(root / "results.json", "w"), indent=1)
    print(f"# per-run medians: {root / 'results.json'} (print the table again: --table FILE)")
    cpu_table(results)


def cpu_table(results: dict[str, list[dict]]) -> None:
    """Medians over the repetitions of each run's median; speedups are per-repetition ratios
    sync / config (each repetition's five runs ran back to back)."""
    print("\n| config | median s/step | speedup vs sync: median (per repetition) | generate (of it queue wait) "
          "| producer's generation per share | train | weight sync | staleness mean | old-token frac "
          "| continued samples/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sync = results["sync"]
    for name, _, _ in REAL:
        rs = results[name]
        ratios = [s["time/step"] / r["time/step"] for r, s in zip(rs, sync)]

        def m(key):
            return statistics.median(r[key] for r in rs)

        print(f"| {name} | {m('time/step'):.3f} | {statistics.median(ratios):.2f} "
              f"({', '.join(f'{x:.2f}' for x in ratios)}) | {m('time/generate'):.3f} ({m('time/queue_wait'):.3f}) | "
              f"{m('time/generate_only'):.3f} | {m('time/train'):.3f} | {m('time/weight_sync'):.3f} | "
              f"{m('async/staleness_mean'):.2f} | {m('async/old_token_frac'):.2f} | "
              f"{m('async/continued_samples'):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["sim", "cpu"])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions (a smoke run)")
    sim = ap.add_argument_group("sim")
    sim.add_argument("--steps", type=int, default=0, help="steps per configuration (default 60; quick 14)")
    sim.add_argument("--gen-fracs", type=float, nargs="+", default=[0.5, 0.7, 0.85],
                     help="generation's share of the synchronous step (one table each)")
    sim.add_argument("--step", type=float, default=225.0, help="synchronous step, seconds (mean)")
    sim.add_argument("--push", type=float, default=5.0, help="weight push, seconds")
    sim.add_argument("--abort-pause", type=float, default=1.0,
                     help="partial: seconds a pause with requests in flight costs (SGLang's abort loop)")
    sim.add_argument("--prefill-rate", type=float, default=500_000.0,
                     help="partial: fleet prefill tokens/s for re-prefilling cut sequences")
    sim.add_argument("--prompt-len", type=int, default=512)
    sim.add_argument("--slots", type=int, default=256, help="concurrent sequences over the fleet")
    sim.add_argument("--beta", type=float, default=0.4, help="cost of a nearly empty decode step / a full one")
    sim.add_argument("--max-new-tokens", type=int, default=8192)
    sim.add_argument("--median-frac", type=float, default=0.25, help="median response length / max_new_tokens")
    sim.add_argument("--sigma", type=float, default=0.84, help="lognormal sigma of the response lengths")
    sim.add_argument("--prompts", type=int, default=64)
    sim.add_argument("--samples", type=int, default=8)
    cpu = ap.add_argument_group("cpu")
    cpu.add_argument("--reps", type=int, default=0, help="repetitions of the five runs (default 3; quick 1)")
    cpu.add_argument("--cpu-steps", type=int, default=0, help="steps per run (default 10; quick 5)")
    cpu.add_argument("--cpu-prompts", type=int, default=16)
    cpu.add_argument("--cpu-samples", type=int, default=8)
    cpu.add_argument("--table", type=Path, help="only print the table of a finished run's results.json")
    args = ap.parse_args()
    if args.part == "sim":
        run_sim(args)
    elif args.table:
        cpu_table(json.load(open(args.table)))
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
