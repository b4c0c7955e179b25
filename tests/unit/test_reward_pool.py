"""RewardPool (rewards/pool.py) with real worker processes: scores equal the serial reward, a hung
call is killed at the timeout and reported while the rest come back, the killed workers' successors
score the next calls, an exception names its key, scoring overlaps the caller's own work.

One pool (2 spawned workers) serves the module. Its reward, `test_pool`, is registered here at
import time — the workers import this module to find it — and is math-verify's `math` reward
except for a few marker texts that hang, raise, return NaN, sleep or report the worker's pid.

The second half loads a user's functions by import path from a module written outside the package
(`module:fn` on PYTHONPATH, `file.py:fn`): per-sample and batched, sync and async, scored as the
function called directly here; batches up to the function's cap; data.reward_on_error fail (the
error names the sample) and zero (scored 0, counted); a timeout inside a batch; config validation.
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
    # `test_pool` stays registered afterwards: it is this module's import-time registration, and tests
    # that do not share this fixture (and may run after its teardown) start pools of it too.
    with RewardPool("test_pool", workers=2, timeout=TIMEOUT) as p:
        yield p


@pytest.mark.slow
def test_scores_equal_serial_math_reward(pool):
    serial = [get_reward("math")(t, a) for t, a in MATH]
    assert 0.0 in serial and 1.0 in serial  # both outcomes exercised
    for i, (t, a) in enumerate(MATH):
        pool.submit(("math", i), t, a)
    got = collect(pool, [("math", i) for i in range(len(MATH))])
    assert [got.scores[("math", i)] for i in range(len(MATH))] == serial
    assert got.timed_out == []
    assert got.metrics()["reward/timeouts"] == 0.0 and got.metrics()["time/reward_wait"] >= 0.0


@pytest.mark.slow
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
    assert got.metrics() == {"reward/timeouts": 2.0, "reward/errors": 0.0, "time/reward_wait": got.wait_s}
    assert pool.replaced == replaced + 2
    # The replacements (new pids) score what comes next.
    for i in range(4):
        pool.submit(("pid", i), "PID", "")
    after = set(collect(pool, [("pid", i) for i in range(4)]).scores.values())
    assert after and not (after & before)
    pool.submit("after", *MATH[0])
    assert collect(pool, ["after"]).scores == {"after": 1.0}


@pytest.mark.slow
def test_reward_exception_names_the_key(pool):
    pool.submit(("prompt", 3, "sample", 1), "RAISE", "")
    pool.submit(("prompt", 3, "sample", 2), "NAN", "")
    pool.submit(("prompt", 3, "sample", 0), *MATH[0])
    with pytest.raises(RewardError) as e:
        collect(pool, [("prompt", 3, "sample", i) for i in range(3)])
    assert [x.key for x in e.value.errors] == [("prompt", 3, "sample", 1), ("prompt", 3, "sample", 2)]
    text = str(e.value)
    assert "('prompt', 3, 'sample', 1)" in text and "ZeroDivisionError: boom" in text
    assert "returned nan, not a finite number" in text
    # The failing keys were collected with the error; the pool keeps scoring.
    pool.submit(("prompt", 3, "sample", 1), *MATH[1])
    assert collect(pool, [("prompt", 3, "sample", 1)]).scores == {("prompt", 3, "sample", 1): 0.0}


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_trainer_that_leaves_on_an_error_without_close_exits():
    """multiprocessing SIGTERMs and joins daemonic children at exit; the workers ignore SIGTERM, so
    an unclosed pool (a trainer leaving on RewardError) must be closed before that or exit hangs."""
    script = ("from megatron_rl.rewards.pool import RewardPool\n"
              "if __name__ == '__main__':\n"
              "    p = RewardPool('synthetic', workers=2, timeout=5.0)\n"
              "    p.submit(0, 'PID', ''); p.collect([0]); assert p.wait_ready(60)\n"
              "    raise SystemExit('left without close()')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "left without close()" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------
# A user's reward functions by import path, from a module outside the package (written to a tmp
# folder; it does not import megatron_rl): per-sample / batched, sync / async. Each test checks
# the pool's scores against the same function called directly in this process.

USER_MODULE = '''
import asyncio, difflib, os, time


def _score(response, answer):
    if response == "HANG":
        time.sleep(3600)
    if response == "RAISE":
        raise KeyError("no verifier for " + answer)
    if response == "NAN":
        return float("nan")
    if response == "STR":
        return "1.0"
    if response == "PID":
        return float(os.getpid())
    if response.startswith("SLEEP"):
        time.sleep(float(response[5:]))
        return 1.0
    return difflib.SequenceMatcher(None, response, answer).ratio()


def similarity(response, answer):
    return _score(response, answer)


async def similarity_async(response, answer):
    if response.startswith("ASLEEP"):
        await asyncio.sleep(float(response[6:]))
        return 1.0
    await asyncio.sleep(0)
    return _score(response, answer)


def similarity_batch(responses, answers):
    if "SHORT" in responses:
        return [0.0] * (len(responses) - 1)
    return [float(len(responses)) if r == "SIZE" else _score(r, a) for r, a in zip(responses, answers)]


similarity_batch.batched = True  # marked by hand: this module does not import megatron_rl
similarity_batch.max_batch_size = 4


async def similarity_batch_async(responses, answers):
    await asyncio.sleep(0)
    return similarity_batch(responses, answers)


similarity_batch_async.batched = True
similarity_batch_async.max_batch_size = 4
'''

USER_TIMEOUT = 2.5
# (response, answer) pairs whose similarity differs pair to pair.
PAIRS = [("The answer is 42", "42"), ("forty-two", "42"), ("42", "42"), ("", "7"), ("x = 3/4", "3/4"),
         ("so the result is 1/2", "0.5"), ("abc", "abd"), ("The final answer: 17", "17")]


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's module (imported here, the reference) and four pools over it: `module:fn` with
    its folder on PYTHONPATH (per-sample sync, batched sync; on_error=fail) and `file.py:fn`
    relative to the working directory at construction (async per-sample, async batched;
    on_error=zero), the directory changed right after: workers load the same file."""
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / "mrl_test_user_rewards.py").write_text(USER_MODULE)
    old_env, old_cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder)] + ([old_env] if old_env else []))
    sys.path.insert(0, str(folder))  # what PYTHONPATH does for this (already running) process
    import mrl_test_user_rewards as mod

    try:
        os.chdir(folder)
        pools = {"sync": RewardPool("mrl_test_user_rewards:similarity", 2, USER_TIMEOUT),
                 "batch": RewardPool("mrl_test_user_rewards:similarity_batch", 2, USER_TIMEOUT),
                 "async": RewardPool("mrl_test_user_rewards.py:similarity_async", 2, USER_TIMEOUT, on_error="zero"),
                 "batch_async": RewardPool("./mrl_test_user_rewards.py:similarity_batch_async", 2, USER_TIMEOUT,
                                           on_error="zero")}
    finally:
        os.chdir(old_cwd)
    try:
        yield mod, pools
    finally:
        for p in pools.values():
            p.close()
        sys.path.remove(str(folder))
        sys.modules.pop("mrl_test_user_rewards", None)
        if old_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_env


def _score_all(pool, pairs, tag, limit=20.0):
    for i, (t, a) in enumerate(pairs):
        pool.submit((tag, i), t, a)
    got = collect(pool, [(tag, i) for i in range(len(pairs))], limit)
    return [got.scores[(tag, i)] for i in range(len(pairs))], got


def _occupy_both_workers(pool, tag):
    """One 1 s SLEEP call on each of the two ready workers (the queue is split evenly over idle
    workers): what is submitted in the next second queues and is handed out in batches."""
    assert pool.wait_ready(30.0)
    for w in range(2):
        pool.submit((tag, "sleep", w), "SLEEP1.0", "")
    time.sleep(0.2)  # both calls handed out
    return [(tag, "sleep", w) for w in range(2)]


@pytest.mark.slow
def test_user_functions_score_as_called_directly(user):
    mod, pools = user
    texts, answers = [t for t, _ in PAIRS], [a for _, a in PAIRS]
    reference = {
        "sync": [mod.similarity(t, a) for t, a in PAIRS],
        "async": [asyncio.run(mod.similarity_async(t, a)) for t, a in PAIRS],
        "batch": mod.similarity_batch(texts, answers),
        "batch_async": asyncio.run(mod.similarity_batch_async(texts, answers)),
    }
    assert len(set(reference["sync"])) >= 6  # the pairs score differently: a mix-up would show
    for kind, pool in pools.items():
        scores, got = _score_all(pool, PAIRS, kind)
        assert scores == reference[kind], kind
        assert got.timed_out == [] and got.errors == [] and got.metrics()["reward/errors"] == 0.0


@pytest.mark.slow
def test_batches_form_while_workers_are_busy_up_to_the_cap(user):
    _, pools = user
    pool = pools["batch"]
    sleeps = _occupy_both_workers(pool, "cap")
    for i in range(12):
        pool.submit(("size", i), "SIZE", "")
    got = collect(pool, sleeps + [("size", i) for i in range(12)])
    sizes = [got.scores[("size", i)] for i in range(12)]  # each call's batch size
    assert max(sizes) == 4 and min(sizes) >= 1, sizes  # batched, at most max_batch_size = 4


@pytest.mark.slow
def test_async_per_sample_calls_run_concurrently(user):
    _, pools = user
    pool = pools["async"]
    start = time.perf_counter()
    scores, _ = _score_all(pool, [("ASLEEP0.5", "")] * 12, "concurrent")
    elapsed = time.perf_counter() - start
    assert scores == [1.0] * 12
    assert elapsed < 2.5, elapsed  # one at a time on 2 workers: >= 3 s


@pytest.mark.slow
def test_on_error_fail_names_each_failing_sample(user):
    _, pools = user
    pool = pools["sync"]
    bad = {"raise": ("RAISE", "x^2"), "str": ("STR", "1"), "nan": ("NAN", "2"), "good": PAIRS[0]}
    for k, (t, a) in bad.items():
        pool.submit(k, t, a)
    with pytest.raises(RewardError) as e:
        collect(pool, list(bad))
    assert [x.key for x in e.value.errors] == ["raise", "str", "nan"]
    assert [(x.response, x.answer) for x in e.value.errors] == [bad["raise"], bad["str"], bad["nan"]]
    text = str(e.value)
    assert "reward 'mrl_test_user_rewards:similarity' failed on 3 response(s)" in text
    assert "key 'raise'\n  response: 'RAISE'\n  answer: 'x^2'\nTraceback" in text
    assert "KeyError: 'no verifier for x^2'" in text and "in _score" in text  # the user's traceback
    assert "returned str '1.0', not a number" in text and "returned nan, not a finite number" in text
    # A long response is shown truncated (the function fails on a missing answer).
    pool.submit("long", "y" * 5000, None)
    with pytest.raises(RewardError) as e:
        collect(pool, ["long"])
    assert "response: '" + "y" * 299 + "... (5002 characters)\n  answer: None\nTraceback" in str(e.value)
    assert "y" * 400 not in str(e.value)
    # The failing keys were collected with the error; the pool keeps scoring.
    pool.submit("raise", *PAIRS[2])
    assert collect(pool, ["raise"]).scores == {"raise": 1.0}


@pytest.mark.slow
def test_batched_errors_name_the_sample_or_the_function(user):
    """A batched call that raises is retried one sample per call, so the error names the sample
    that raised, not its batch-mates; a result of the wrong length names the function."""
    _, pools = user
    pool = pools["batch"]
    sleeps = _occupy_both_workers(pool, "mixed")  # the next four form one batch
    for i, (t, a) in enumerate([("RAISE", "y"), *PAIRS[:3]]):
        pool.submit(("mixed", i), t, a)
    with pytest.raises(RewardError) as e:
        collect(pool, sleeps + [("mixed", i) for i in range(4)])
    assert [x.key for x in e.value.errors] == [("mixed", 0)]
    assert "KeyError: 'no verifier for y'" in str(e.value)
    pool.submit("short", "SHORT", "1")
    with pytest.raises(RewardError, match=r"batched reward 'mrl_test_user_rewards:similarity_batch' returned "
                                          r"0 scores for a batch of 1 responses"):
        collect(pool, ["short"])


@pytest.mark.slow
def test_on_error_zero_scores_zero_counts_and_logs(user, caplog):
    mod, pools = user
    pool = pools["async"]
    samples = {"raise": ("RAISE", "x^2"), "nan": ("NAN", "2"), "str": ("STR", "3"), "good": PAIRS[0]}
    for k, (t, a) in samples.items():
        pool.submit(k, t, a)
    with caplog.at_level("WARNING", logger="megatron_rl.rewards.pool"):
        got = collect(pool, list(samples))
    assert got.scores == {"raise": 0.0, "nan": 0.0, "str": 0.0, "good": mod.similarity(*PAIRS[0])}
    assert [(x.key, x.response, x.answer) for x in got.errors] == [
        ("raise", "RAISE", "x^2"), ("nan", "NAN", "2"), ("str", "STR", "3")]
    assert got.metrics()["reward/errors"] == 3.0 and got.timed_out == []
    logged = caplog.text
    assert "failed on 3 of 4 response(s), scored 0.0" in logged
    assert "key 'raise'\n  response: 'RAISE'\n  answer: 'x^2'" in logged and "KeyError: 'no verifier for x^2'" in logged


@pytest.mark.slow
def test_a_timeout_in_a_batch_costs_only_its_sample(user):
    """A batch holding a hanging sample is killed at the timeout and its samples scored again one
    per call: the hang times out (0.0, reward/timeouts), a sample that raises is an error
    (on_error=zero: 0.0, reward/errors) and the rest keep their real scores. The replacement
    workers, started after the fixture changed directory, load the same file."""
    mod, pools = user
    pool = pools["batch_async"]
    replaced = pool.replaced
    sleeps = _occupy_both_workers(pool, "timeout")
    batch = {"hang": ("HANG", ""), "raise": ("RAISE", "z"), "a": PAIRS[0], "b": PAIRS[4]}  # one batch of 4
    for k, (t, a) in batch.items():
        pool.submit(k, t, a)
    got = collect(pool, sleeps + list(batch), limit=1.0 + 2 * USER_TIMEOUT + SLACK)
    assert got.timed_out == ["hang"] and [x.key for x in got.errors] == ["raise"]
    assert got.metrics()["reward/timeouts"] == 1.0 and got.metrics()["reward/errors"] == 1.0
    assert [got.scores[k] for k in ("hang", "raise", "a", "b")] == [
        0.0, 0.0, *asyncio.run(mod.similarity_batch_async([PAIRS[0][0], PAIRS[4][0]], [PAIRS[0][1], PAIRS[4][1]]))]
    assert pool.replaced == replaced + 2  # the batch's worker, then the hanging sample's alone
    scores, _ = _score_all(pool, PAIRS, "after")
    assert scores == mod.similarity_batch([t for t, _ in PAIRS], [a for _, a in PAIRS])


def test_relative_file_spec_is_made_absolute(tmp_path, monkeypatch):
    from megatron_rl.plugins import absolute as _absolute

    monkeypatch.chdir(tmp_path)
    assert _absolute("sub/r.py:fn") == f"{tmp_path}/sub/r.py:fn"
    assert _absolute("./r.py:fn") == f"{tmp_path}/r.py:fn"
    assert _absolute("pkg.mod:fn") == "pkg.mod:fn" and _absolute("math") == "math"


def test_batched_marker_and_bad_marks(tmp_path):
    from megatron_rl.rewards import DEFAULT_MAX_BATCH, batched, reward_kind

    @batched
    def plain(responses, answers):
        return [0.0] * len(responses)

    @batched(max_size=8)
    async def capped(responses, answers):
        return [0.0] * len(responses)

    async def per_sample(response, answer):
        return 0.0

    k = reward_kind(plain, "m:plain")
    assert (k.batched, k.is_async, k.max_batch) == (True, False, DEFAULT_MAX_BATCH)
    k = reward_kind(capped, "m:capped")
    assert (k.batched, k.is_async, k.max_batch) == (True, True, 8)
    k = reward_kind(per_sample, "m:per_sample")
    assert (k.batched, k.is_async, k.max_batch) == (False, True, DEFAULT_MAX_BATCH)
    k = reward_kind(lambda r, a: 0.0, "m:f")
    assert (k.batched, k.is_async, k.max_batch) == (False, False, 1)
    (tmp_path / "marks.py").write_text("def f(r, a):\n    return 0.0\nf.batched = 'yes'\n"
                                       "def g(r, a):\n    return [0.0]\ng.batched = True\ng.max_batch_size = 0\n")
    with pytest.raises(ValueError, match=r"data.reward='.*marks.py:f': f.batched='yes'; set it to True"):
        RewardPool(f"{tmp_path}/marks.py:f", 1, 1.0)
    with pytest.raises(ValueError, match=r"marks.py:g': max_batch_size=0; need an integer >= 1"):
        RewardPool(f"{tmp_path}/marks.py:g", 1, 1.0)
    with pytest.raises(ValueError, match="reward_on_error='skip'; valid: fail, zero"):
        RewardPool("math", 1, 1.0, on_error="skip")


@pytest.mark.parametrize("override,message", [
    ("data.reward_on_error=skip", "data.reward_on_error='skip'; valid: fail, zero"),
    ("data.reward=mrl_no_such_module:fn", "data.reward='mrl_no_such_module:fn': no module named 'mrl_no_such_module'"),
    ("data.reward=megatron_rl.rewards.math:no_such_fn", "has no attribute 'no_such_fn'; its functions: "),
    ("data.reward=no/such/file.py:fn", "data.reward='no/such/file.py:fn': no such file"),
])
def test_validate_resolves_the_reward_before_workers_start(override, message):
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.trainer.preflight import validate

    with pytest.raises(ValueError, match=message):
        validate(to_object(load_config("tiny_cpu", [override])))


def test_a_reward_error_for_many_samples_stays_readable():
    """A reward that fails on a whole batch: the message names 8 keys and the count, and shows 3
    samples, not one line per failing key (11,980 characters at 256 samples before)."""
    from megatron_rl.rewards.pool import FailedSample, RewardError

    text = str(RewardError("mine", [FailedSample((i, 0), "x" * 50, "1", "Traceback\nValueError: no")
                                    for i in range(256)]))
    assert "(7, 0), ... (256 keys)]" in text and "(8, 0)" not in text.splitlines()[0]
    assert max(map(len, text.splitlines())) < 300 and text.count("ValueError: no") == 3
