"""RewardPool (rewards/pool.py) with real worker processes: scores equal the serial reward, a hung
call is killed at the timeout and reported while the rest come back, the killed workers' successors
score the next calls, an exception names its key, scoring overlaps the caller's own work.

One pool (2 spawned workers) serves the module. Its reward, `test_pool`, is registered here at
import time — the workers import this module to find it — and is math-verify's `math` reward
except for a few marker texts that hang, raise, return NaN, sleep or report the worker's pid.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import math_verify  # noqa: F401  (imported by the workers before they report ready: no first-call import under the timeout)
import pytest

from megatron_rl.rewards import _REGISTRY, get_reward, register_reward
from megatron_rl.rewards.pool import RewardError, RewardPool

TIMEOUT = 4.0
SLACK = 10.0  # killing a worker, starting its successor and scoring the rest, on a loaded 2-core machine


@register_reward("test_pool")
def _test_reward(text: str, answer: str) -> float:
    if text == "HANG":
        time.sleep(3600)
    if text == "RAISE":
        raise ZeroDivisionError("boom")
    if text == "NAN":
        return float("nan")
    if text.startswith("SLEEP"):
        time.sleep(float(text[5:]))
        return 1.0
    if text == "PID":
        return float(os.getpid())
    return get_reward("math")(text, answer)


# (response, ground truth): right and wrong boxed answers, equivalent forms, unparseable text.
MATH = [
    ("The answer is \\boxed{34}.", "34"),
    ("So we get \\boxed{35}.", "34"),
    ("Hence $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("Hence $\\boxed{0.5}$", "\\frac{1}{2}"),
    ("\\boxed{x^2+1}", "1+x^2"),
    ("\\boxed{x^2-1}", "x^2+1"),
    ("I think it is 7, so \\boxed{7}", "7"),
    ("no answer here", "12"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{2\\pi}", "6.28"),
]
QUICK = [MATH[i] for i in (0, 1, 6, 7)]  # numbers and no answer: milliseconds each

if multiprocessing.parent_process() is not None:
    # In a pool worker: sympy's first symbolic comparison (~0.3 s idle, seconds on a loaded machine)
    # happens here, before the worker reports ready, not inside a test's timed call.
    get_reward("math")("\\boxed{x^2-1}", "x^2+1")


def within(limit: float, fn, *args):
    """fn(*args) in a thread: its result, or its exception; a failure (not a hung suite) if it
    is still running after `limit` seconds."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 — re-raised in the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {limit} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def collect(pool: RewardPool, keys, limit: float = 20.0):
    return within(limit, pool.collect, keys)


@pytest.fixture(scope="module")
def pool():
    with RewardPool("test_pool", workers=2, timeout=TIMEOUT) as p:
        yield p
    _REGISTRY.pop("test_pool", None)


def test_scores_equal_serial_math_reward(pool):
    serial = [get_reward("math")(t, a) for t, a in MATH]
    assert 0.0 in serial and 1.0 in serial  # both outcomes exercised
    for i, (t, a) in enumerate(MATH):
        pool.submit(("math", i), t, a)
    got = collect(pool, [("math", i) for i in range(len(MATH))])
    assert [got.scores[("math", i)] for i in range(len(MATH))] == serial
    assert got.timed_out == []
    assert got.metrics()["reward/timeouts"] == 0.0 and got.metrics()["time/reward_wait"] >= 0.0


def test_hung_calls_are_killed_and_the_pool_goes_on(pool):
    pool.submit("pid", "PID", "")
    before = {collect(pool, ["pid"]).scores["pid"]}
    replaced = pool.replaced
    # Two hangs occupy both workers: every call after them runs on a replacement.
    pool.submit("hang-a", "HANG", "")
    pool.submit("hang-b", "HANG", "")
    for i, (t, a) in enumerate(QUICK):
        pool.submit(i, t, a)
    keys = ["hang-a", "hang-b", *range(len(QUICK))]
    start = time.perf_counter()
    got = collect(pool, keys, TIMEOUT + SLACK)
    elapsed = time.perf_counter() - start
    assert elapsed >= TIMEOUT, elapsed
    assert sorted(got.timed_out) == ["hang-a", "hang-b"]
    assert got.scores["hang-a"] == got.scores["hang-b"] == 0.0
    assert [got.scores[i] for i in range(len(QUICK))] == [get_reward("math")(t, a) for t, a in QUICK]
    assert got.metrics() == {"reward/timeouts": 2.0, "time/reward_wait": got.wait_s}
    assert pool.replaced == replaced + 2
    # The replacements (new pids) score what comes next.
    for i in range(4):
        pool.submit(("pid", i), "PID", "")
    after = set(collect(pool, [("pid", i) for i in range(4)]).scores.values())
    assert after and not (after & before)
    pool.submit("after", *MATH[0])
    assert collect(pool, ["after"]).scores == {"after": 1.0}


def test_reward_exception_names_the_key(pool):
    pool.submit(("prompt", 3, "sample", 1), "RAISE", "")
    pool.submit(("prompt", 3, "sample", 2), "NAN", "")
    pool.submit(("prompt", 3, "sample", 0), *MATH[0])
    with pytest.raises(RewardError) as e:
        collect(pool, [("prompt", 3, "sample", i) for i in range(3)])
    assert [k for k, _ in e.value.errors] == [("prompt", 3, "sample", 1), ("prompt", 3, "sample", 2)]
    text = str(e.value)
    assert "('prompt', 3, 'sample', 1)" in text and "ZeroDivisionError: boom" in text
    assert "returned nan, not a finite number" in text
    # The failing keys were collected with the error; the pool keeps scoring.
    pool.submit(("prompt", 3, "sample", 1), *MATH[1])
    assert collect(pool, [("prompt", 3, "sample", 1)]).scores == {("prompt", 3, "sample", 1): 0.0}


def test_scoring_overlaps_the_callers_work(pool):
    """Submitted from an asyncio callback as 'responses' arrive; by the time generation ends the
    scores are in, so collect hardly waits."""

    submit_s = []

    def on_record(i):  # what the client's per-record callback does
        t = time.perf_counter()
        pool.submit(("overlap", i), "SLEEP0.4", "")
        submit_s.append(time.perf_counter() - t)

    async def generation():
        loop = asyncio.get_running_loop()
        for i in range(4):  # four responses, each scored for 0.4 s: 0.8 s of work on 2 workers
            loop.call_later(0.05 * i, on_record, i)
        await asyncio.sleep(1.5)  # the rest of generation

    asyncio.run(generation())
    assert max(submit_s) < 0.2, submit_s  # never held up by scoring (a call takes 0.4 s)
    got = collect(pool, [("overlap", i) for i in range(4)])
    assert set(got.scores.values()) == {1.0}
    assert got.wait_s < 0.4, got.wait_s  # scored after generation: >= 0.8 s


def test_bad_input_is_refused(pool):
    with pytest.raises(ValueError, match="unknown reward .nope.; valid: .*math"):
        RewardPool("nope", workers=1, timeout=1.0)
    with pytest.raises(ValueError, match="reward_workers=0: need an integer >= 1"):
        RewardPool("math", workers=0, timeout=1.0)
    with pytest.raises(ValueError, match="reward_timeout=0: need a positive"):
        RewardPool("math", workers=1, timeout=0)
    pool.submit("dup", *MATH[0])
    with pytest.raises(ValueError, match="key 'dup' was submitted already"):
        pool.submit("dup", *MATH[0])
    with pytest.raises(TypeError, match="key 'x': the response text must be a str"):
        pool.submit("x", b"bytes", "1")
    assert collect(pool, ["dup"]).scores == {"dup": 1.0}
    with pytest.raises(KeyError, match="never submitted"):
        collect(pool, ["dup"])


def test_reward_the_workers_cannot_find_stops_the_pool_clearly():
    # Registered after import: the workers import this module and do not find it.
    register_reward("test_pool_late")(lambda text, answer: 1.0)
    try:
        with RewardPool("test_pool_late", workers=1, timeout=TIMEOUT) as p:
            p.submit(0, "x", "x")
            with pytest.raises(RuntimeError, match=r"could not start(.|\n)*unknown reward 'test_pool_late'"):
                collect(p, [0])
    finally:
        _REGISTRY.pop("test_pool_late", None)


def test_close_kills_a_worker_stuck_in_a_call():
    p = RewardPool("test_pool", workers=1, timeout=60.0)
    p.submit("pid", "PID", "")
    pid = int(collect(p, ["pid"]).scores["pid"])
    p.submit("hang", "HANG", "")
    time.sleep(0.3)
    within(5.0, p.close)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie left to a non-reaping pid 1
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_worker_stuck_in_a_call_dies_with_a_killed_trainer():
    here = os.path.dirname(os.path.abspath(__file__))
    script = ("import time, test_reward_pool\n"
              "from megatron_rl.rewards.pool import RewardPool\n"
              "p = RewardPool('test_pool', workers=1, timeout=600.0)\n"
              "p.submit(0, 'PID', ''); print(int(p.collect([0]).scores[0]), flush=True)\n"
              "p.submit(1, 'HANG', ''); time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(within(60.0, trainer.stdout.readline))
        time.sleep(0.5)  # the HANG call is in the worker
        assert not _gone(worker)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5.0
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), f"reward worker {worker} outlived its killed parent"
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()


def test_workers_survive_the_signals_a_launcher_sends_the_whole_job(pool):
    """Slurm signals every process of a step (USR1 before the time limit, TERM on preemption) and
    a terminal sends INT to the foreground group: the trainer finishes its step on them, so the
    workers scoring that step's rewards must live on."""
    import signal as sig

    for i in range(4):
        pool.submit(("who", i), "PID", "")
    pids = {int(v) for v in collect(pool, [("who", i) for i in range(4)]).scores.values()}
    replaced = pool.replaced
    pool.submit("slow", "SLEEP1.5", "")
    time.sleep(0.3)  # the call is running in a worker
    for pid in pids:
        for s in (sig.SIGUSR1, sig.SIGTERM, sig.SIGINT, sig.SIGUSR2):
            os.kill(pid, s)
    got = collect(pool, ["slow"])
    assert got.scores["slow"] == 1.0 and got.timed_out == [] and pool.replaced == replaced
