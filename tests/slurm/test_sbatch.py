"""slurm/megatron_rl.sbatch submitted to a real Slurm: slurm/local_cluster.sh's two virtual nodes.

(a) two srun tasks of distinct ranks on two nodes (TP=2 across them) run the supervised command to
    completion; per-rank logs land in the run dir;
(b) a bad recipe name, a misspelt key and a missing dataset fail the job within seconds, the
    dry-run's one-line error in the job log, no learner launched;
(c) preemption, launcher side: `scancel -s USR1 -b` mid-run -> the batch script forwards USR1
    through srun to every rank, waits for them, requeues the job; the requeued job runs in the same
    run dir and completes. The ranks are tests/slurm/contract_rank.py, a stand-in that implements
    only the trainer's preemption contract, so this checks the launcher in seconds;
(d) disaggregated SGLang: the script starts a real SGLang server on the second node, waits for it,
    passes rollout.server_urls to the ranks (the stand-in generates from it), and stops it;
(d') disaggregated SGLang with the RL trainer: two CPU servers on the rollout node (GPUS_PER_NODE=2,
    ROLLOUT_TP=1: one server per replica, distinct ports), tiny_cpu for 3 steps on DP=2, weights
    pushed through the gloo process group; the servers' own request logs show every prompt
    answered exactly n times, both servers serving and both on each step's weight version;
(c') rank failures, launcher side: a stand-in rank that raises in every attempt -> the job requeues
    itself with the reason in logs/JOB.RESTART/failure.txt, as long as each failure comes after a
    newer checkpoint, else FAILURE_REQUEUES times in a row, then fails saying so; a configuration
    error (exit code 2) is not requeued;
(f) the RL trainer as a job (shrunk tiny_cpu), DP=2 over two srun tasks, rank 0 starting SGLang
    beside them (local placement): the uninterrupted run completes and plots its curves; a job
    whose time limit is lowered as it starts checkpoints before the limit and requeues itself, then
    its rollout server is killed during a weight push (the push fails in seconds, the job requeues
    itself), then learner rank 1 is killed mid-step (requeued again); the fourth attempt finishes; every step trained exactly once and every metric
    equal, bit for bit, to the uninterrupted run's.
(The unchanged embedded default as a 60-step job meeting the demo's accuracy bar takes 3-4 minutes
here: benchmarks/bench_demo_slurm.py; (f) asserts the same job shape and
tests/e2e/test_readme_byo.py the learning.)

Slurm holds a requeued batch job for ~2 minutes (its BeginTime); the tests release it after 3 s
with `scontrol update JobId=J StartTime=now`, as an admin would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One cluster: two of these jobs at once would queue behind each other (and past the tests' waits), so
# under pytest-xdist the module runs on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "megatron_rl.sbatch"
HERE = Path(__file__).resolve().parent
HOST = socket.gethostname().split(".")[0]  # srun's %N: the host the task ran on
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def _has_rl_trainer() -> bool:
    """Whether the RL trainer (megatron_rl.trainer, behind `cli train`) and its tiny recipe exist."""
    return (importlib.util.find_spec("megatron_rl.trainer") is not None
            and (REPO / "recipes" / "tiny_cpu.yaml").exists())


def submit(tmp_path: Path, recipe_and_overrides: list[str], env: dict,
           sbatch_opts: tuple[str, ...] = ("--nodes=1", "--ntasks=2")) -> str:
    full_env = {**os.environ, "PYTHON": sys.executable, "GPUS_PER_NODE": "2",
                "RUN_DIR": str(tmp_path / "run"), **env}
    r = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", *sbatch_opts,
                        str(SBATCH), *recipe_and_overrides],
                       cwd=REPO, env=full_env, capture_output=True, text=True, check=True)
    return r.stdout.strip().split(";")[0]


def job(jobid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True, text=True,
                         check=True).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def job_log(tmp_path: Path, jobid: str) -> str:
    p = tmp_path / f"job-{jobid}.out"
    return p.read_text() if p.exists() else "(no job log yet)"


def wait_for(jobid: str, tmp_path: Path, timeout: float, release_requeued: bool = False) -> dict:
    """Poll until the job reaches a final state; release requeued jobs from their hold.

    Not at once: slurmd refuses to launch a job whose credential was revoked (by the requeue) in
    the same second ("Job credential revoked"), so the hold is lifted after 3 s.
    """
    deadline = time.monotonic() + timeout
    held_since = None
    while time.monotonic() < deadline:
        info = job(jobid)
        if info["JobState"] in FINAL:
            return info
        held = (info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime"
                and int(info.get("Restarts", 0)) > 0)
        held_since = (held_since or time.monotonic()) if held else None
        if release_requeued and held and time.monotonic() - held_since >= 3:
            subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], check=True)
            held_since = None
        time.sleep(1)
    subprocess.run(["scancel", jobid])
    pytest.fail(f"job {jobid} not finished after {timeout:.0f}s (state {info['JobState']}); "
                f"job log:\n{job_log(tmp_path, jobid)}")


def wait_until(pred, timeout: float, what: str, jobid: str, tmp_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if job(jobid)["JobState"] in FINAL:
            break
        time.sleep(0.5)
    subprocess.run(["scancel", jobid])
    pytest.fail(f"job {jobid}: {what} did not happen; job log:\n{job_log(tmp_path, jobid)}")


def exited(text: str, task: int, code: int = 1) -> bool:
    """srun said task `task` exited with `code`: alone ("task 0: Exited with exit code 1") or with
    the others that exited with the same code before srun ended them ("tasks 0-1: ...")."""
    for tasks in re.findall(rf"\btasks? ([0-9,-]+): Exited with exit code {code}\b", text):
        for part in tasks.split(","):
            lo, _, hi = part.partition("-")
            if int(lo) <= task <= int(hi or lo):
                return True
    return False


def hostnames(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                          text=True, check=True).stdout.split()


def test_two_ranks_on_two_nodes_tp2_complete(slurm_cluster, tmp_path):
    jobid = submit(tmp_path, ["tiny_lm_cpu", "train.steps=3", "train.log_every=1", "parallel.tp=2"],
                   {"MRL_COMMAND": "train-lm", "GPUS_PER_NODE": "1"},
                   ("--nodes=2", "--ntasks-per-node=1"))
    info = wait_for(jobid, tmp_path, timeout=240)
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    logs = tmp_path / "run" / "logs" / f"{jobid}.0"
    rank_logs = sorted(p.name for p in logs.glob("learner-rank*.log"))
    assert info["NumNodes"] == "2" and len(hostnames(info["NodeList"])) == 2, info
    assert rank_logs == [f"learner-rank0-{HOST}.log", f"learner-rank1-{HOST}.log"], rank_logs
    rank0 = (logs / rank_logs[0]).read_text()
    # rank 0 reports the world it formed: both srun tasks joined one TP=2 group.
    assert "world=2 tp=2" in rank0, rank0
    assert "Traceback" not in (logs / rank_logs[1]).read_text()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(steps) == 3, steps
    assert "layout for world size 2: tp=2" in log and "done; metrics in" in log, log


@pytest.mark.parametrize("command, args, message", [
    ("train-lm", ["no_such_recipe"], "unknown recipe 'no_such_recipe'; available recipes: "),
    ("train-lm", ["tiny_lm_cpu", "parallel.tpp=2"], "unknown config key 'parallel.tpp'"),
    ("train", ["tiny_cpu", "data.source=files", "data.train_files=[/nonexistent/train.parquet]"],
     "dataset /nonexistent/train.parquet does not exist"),
    # a GPU recipe on a Python without CUDA (the submit dir's CPU venv): named, before anything starts
    ("train", ["dppo_binary_tv_qwen3_30b_a3b_base_r3"],
     f"not yet run at scale), and this Python finds none: {sys.executable} (torch "),
], ids=["unknown-recipe", "misspelt-key", "missing-dataset", "gpu-recipe-without-cuda"])
def test_bad_config_fails_fast(slurm_cluster, tmp_path, command, args, message):
    start = time.monotonic()
    jobid = submit(tmp_path, args, {"MRL_COMMAND": command})
    info = wait_for(jobid, tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
    assert message in log and "nothing was launched" in log, log
    assert not list((tmp_path / "run" / "logs").glob("*/learner-*.log")), "learners were launched"
    assert elapsed < 30, f"took {elapsed:.0f}s to fail"


def test_usr1_checkpoints_requeues_resumes_launcher(slurm_cluster, tmp_path):
    """Also the container rule: with a container (CONTAINER_EXEC here, a stand-in runtime whose
    image has its own python3; pyxis's CONTAINER_IMAGE takes the same path) and no PYTHON, the
    dry-run and every rank run the container's python3, never the submit dir's .venv; the learner
    ranks, and only they, get CUDA_DEVICE_MAX_CONNECTIONS=1."""
    run = tmp_path / "run"
    steps = 24
    calls = tmp_path / "container.log"
    jobid = submit(tmp_path, ["tiny_lm_cpu", f"train.steps={steps}"],
                   {"MRL_COMMAND": "train-lm", "PYTHON": "", "CONTAINER_EXEC": str(HERE / "fake_container.sh"),
                    "CONTAINER_LOG": str(calls), "REAL_PYTHON": sys.executable})
    metrics = run / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 60,
               "three steps", jobid, tmp_path)
    subprocess.run(["scancel", "--signal=USR1", "--batch", jobid], check=True)
    info = wait_for(jobid, tmp_path, timeout=120, release_requeued=True)
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "1", log
    # Every rank got USR1 in attempt 0, checkpointed state came back in attempt 1.
    assert (run / "preempted-rank0-attempt0").read_text() == "USR1"
    assert (run / "preempted-rank1-attempt0").read_text() == "USR1"
    assert (run / "finished-rank0").read_text() == str(steps)
    assert (run / "finished-rank1").read_text() == str(steps)
    rows = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows  # no step lost or repeated
    assert {r["attempt"] for r in rows} == {0, 1}, rows
    assert "USR1: asking the learner ranks to checkpoint and exit" in log, log
    assert "requeueing job" in log and "job %s (restart 1)" % jobid in log, log
    assert sorted(p.name for p in (run / "logs").iterdir()) == [f"{jobid}.0", f"{jobid}.1"]
    lines = calls.read_text().splitlines()
    cache = f"TRITON_CACHE_DIR={run / 'cache' / 'triton'}"  # the run's own cache folder, never $HOME's
    assert lines.count(f"python3 megatron_rl.cli dry-run CUDA_DEVICE_MAX_CONNECTIONS=unset NCCL_NVLS_ENABLE=0 {cache}") == 2, lines
    assert lines.count(f"python3 megatron_rl.cli train-lm CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 {cache}") == 4, lines
    assert len(lines) == 6, lines


def test_rank_failure_requeues_with_its_reason_then_gives_up_launcher(slurm_cluster, tmp_path):
    """A learner rank that fails ends the attempt: the job writes why to logs/JOB.RESTART/failure.txt
    and RUN_DIR/failures.tsv and requeues itself from the last checkpoint, FAILURE_REQUEUES (here 1)
    times in a row at most without a newer checkpoint between them:
    - rank 1 fails at the second step of every attempt; srun's SIGTERM makes rank 0 checkpoint each
      time, so every failure is at a newer checkpoint and the job goes on until it finishes;
    - rank 0 fails at the second step of every attempt: no checkpoint is ever written, so the second
      failure gives up, and the job fails saying so;
    - a configuration error (a rank's exit code 2) is not requeued at all."""
    env = {"MRL_COMMAND": "train-lm", "PYTHON": str(HERE / "contract_python.sh"), "REAL_PYTHON": sys.executable,
           "FAILURE_REQUEUES": "1"}
    steps = 6
    progress = tmp_path / "progress"
    progress.mkdir()
    jobid = submit(progress, ["tiny_lm_cpu", f"train.steps={steps}"], env | {"CONTRACT_CRASH": "1:2:1"})
    info = wait_for(jobid, progress, timeout=300, release_requeued=True)
    log = job_log(progress, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    restarts = int(info["Restarts"])
    assert restarts >= 2 and log.count("failure 1 of at most 1 in a row without a newer checkpoint") == restarts, log
    rows = [r.split("\t") for r in (progress / "run" / "failures.tsv").read_text().splitlines()]
    assert [r[0] for r in rows] == [f"{jobid}.{k}" for k in range(restarts)], rows
    assert len({r[1] for r in rows}) == restarts and rows[0][1] != "none", rows  # a newer checkpoint each time
    assert (progress / "run" / "finished-rank1").read_text() == str(steps)
    failure = (progress / "run" / "logs" / f"{jobid}.0" / "failure.txt").read_text()
    assert f"job {jobid}, restart 0, " in failure and exited(failure, 1), failure
    assert f"learner-rank1-{HOST}.log: RuntimeError: injected failure at step 2" in failure, failure

    run = tmp_path / "run"
    jobid = submit(tmp_path, ["tiny_lm_cpu", f"train.steps={steps}"], env | {"CONTRACT_CRASH": "0:2:1"})
    info = wait_for(jobid, tmp_path, timeout=180, release_requeued=True)
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", log
    for attempt in (0, 1):
        failure = (run / "logs" / f"{jobid}.{attempt}" / "failure.txt").read_text()
        assert f"job {jobid}, restart {attempt}, " in failure and "latest checkpoint: none" in failure, failure
        assert f"learner-rank0-{HOST}.log: RuntimeError: injected failure at step 2" in failure, failure
        assert exited(failure, 0), failure
    assert "failure 1 of at most 1 in a row without a newer checkpoint (latest: none)" in log, log
    assert log.count("requeueing job") == 1, log
    assert "given up after 2 failures in a row at checkpoint none (FAILURE_REQUEUES=1" in log, log
    rows = [r.split("\t") for r in (run / "failures.tsv").read_text().splitlines()]
    assert [r[:2] for r in rows] == [[f"{jobid}.0", "none"], [f"{jobid}.1", "none"]], rows
    assert exited(rows[0][2], 0), rows

    config = tmp_path / "config"
    config.mkdir()
    jobid = submit(config, ["tiny_lm_cpu", f"train.steps={steps}"], env | {"CONTRACT_CRASH": "1:1:2"})
    info = wait_for(jobid, config, timeout=120)
    log = job_log(config, jobid)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log
    assert "learner ranks failed with a configuration error, not requeued" in log, log
    assert "megatron-rl: error: injected configuration error" in log and "requeueing" not in log, log


def test_disaggregated_sglang_server(slurm_cluster, tmp_path):
    from megatron_rl.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    calls = tmp_path / "container.log"
    # The servers in a container of their own (ROLLOUT_CONTAINER_EXEC: ROLLOUT_PYTHON defaults to its
    # python3), the learners not; the servers get none of the learners' variables
    # (CUDA_DEVICE_MAX_CONNECTIONS, NCCL_NVLS_ENABLE, ...) but the run's caches.
    jobid = submit(tmp_path, ["tiny_lm_cpu", "train.steps=2"],
                   {"MRL_COMMAND": "train-lm", "PYTHON": str(HERE / "contract_python.sh"),
                    "ROLLOUT_CONTAINER_EXEC": str(HERE / "fake_container.sh"), "CONTAINER_LOG": str(calls),
                    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                    "REAL_PYTHON": sys.executable, "GPUS_PER_NODE": "1", "ROLLOUT_NODES": "1",
                    "ROLLOUT_MODEL": str(ckpt), "ROLLOUT_PORT": "30517",
                    "ROLLOUT_ARGS": "--device cpu --dtype float32 --max-total-tokens 2048"},
                   ("--nodes=2", "--ntasks-per-node=1"))
    info = wait_for(jobid, tmp_path, timeout=400)
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    logs = run / "logs" / f"{jobid}.0"
    assert sorted(p.name for p in logs.glob("*.log")) == [f"learner-rank0-{HOST}.log",
                                                          f"server0-{HOST}.log"]
    server_log = (logs / f"server0-{HOST}.log").read_text()
    # Bound on every interface at the node's port (SGLang's server_args line: uvicorn's own start-up
    # line is at info, which the servers' HTTP log level, warning, leaves out: rollout/placement.py
    # quiet_http), and no access line per request.
    assert "'host': '0.0.0.0', 'port': 30517" in server_log and "fired up and ready to roll" in server_log, server_log
    assert '"POST /generate HTTP/1.1" 200' not in server_log, server_log
    # The server ran on the rollout node, the rank on the learner node, and the rank reached it.
    learner_node, rollout_node = hostnames(info["NodeList"])
    assert f"SGLang {rollout_node};" in log and f"learner ranks on {learner_node}," in log, log
    url = "http://127.0.0.1:30517"  # local_cluster.sh's nodes' NodeAddr
    assert f"SGLang servers up: {url}" in log, log
    replies = json.loads((run / "rollout-rank0.json").read_text())
    assert list(replies) == [url] and len(replies[url]) == 4, replies
    assert log.index("stopping the SGLang servers") < log.index("done; metrics in"), log
    lines = calls.read_text().splitlines()  # only the server (and its supervisor) went through the rollout container
    env = f"CUDA_DEVICE_MAX_CONNECTIONS=unset NCCL_NVLS_ENABLE=unset TRITON_CACHE_DIR={run / 'cache' / 'triton'}"
    assert lines == [f"python3 megatron_rl.rollout.supervise --restarts {env}",
                     f"python3 megatron_rl.rollout.launch_server --slurm-slot {env}"], lines


def served_requests(log: Path) -> list[dict]:
    """Generation requests a server finished, from its `--log-requests --log-requests-format json`
    lines: sampling seed, prompt ids, weight version (warm-up requests carry no seed)."""
    out = []
    for line in log.read_text().splitlines():
        if '"event": "request.finished"' not in line:
            continue
        event = json.loads(line[line.index("{"):])
        seed = event["obj"]["sampling_params"].get("sampling_seed")
        if seed is not None:
            out.append({"seed": seed, "prompt": tuple(event["obj"]["input_ids"]),
                        "version": event["out"]["meta_info"]["weight_version"]})
    return out


def two_servers_env(ckpt: Path, port: int) -> dict[str, str]:
    """The launcher's environment for one rollout node serving two CPU servers (one per replica) of
    `ckpt` from `port`, logging every finished request as JSON (`served_requests`)."""
    # No ROLLOUT_MODEL, no --enable-deterministic-inference: the recipe's model.hf_path and seeded
    # sampling imply them, and the launcher adds them (from the dry-run; asserted in the tests' logs).
    return {"GPUS_PER_NODE": "2", "ROLLOUT_NODES": "1", "ROLLOUT_TP": "1",
            "ROLLOUT_PORT": str(port),
            "ROLLOUT_ARGS": "--device cpu --dtype float32 --max-total-tokens 2048 --sleep-on-idle "
                            "--log-requests --log-requests-level 2 --log-requests-format json"}


def finished(jobid: str, tmp_path: Path) -> tuple[dict, str]:
    """Wait for the job; it must have completed with exit 0. Returns (its info, its log)."""
    info = wait_for(jobid, tmp_path, timeout=900)
    log = job_log(tmp_path, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    return info, log


COLLECTIVE_S, LATE_S = 12, 30
# tiny_cpu's reward, except that one call on rank 1 (SLURM_PROCID; reward workers inherit it) sleeps,
# and rank 0 (which scores SAMPLES samples a step) SIGKILLs the server listening on KILL_PORT twice
# (its supervisor restarts it): at its first call (step 0) and at its first call of step 1, once the
# server answers again; at its first call of step 2 it waits until the server answers again.
LATE_REWARD = """
import os, time, urllib.request
import psutil
from megatron_rl.rewards.synthetic import exact_match

def once(name):
    try:
        os.close(os.open(os.path.join({tmp!r}, name), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False

def wait_up():
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen("http://127.0.0.1:{kill_port}/health", timeout=2)
            return
        except OSError:
            time.sleep(1)

def kill():
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == {kill_port} and c.status == psutil.CONN_LISTEN and c.pid:
            psutil.Process(c.pid).kill()

def score(response, answer):
    if os.environ.get("SLURM_PROCID") == "1" and once("late_once"):
        time.sleep({late_s})
    if os.environ.get("SLURM_PROCID") == "0" and {kill_port}:
        fd = os.open(os.path.join({tmp!r}, "rank0_calls"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
        os.write(fd, b"x")
        os.close(fd)
        calls = os.path.getsize(os.path.join({tmp!r}, "rank0_calls"))
        if once("killed1"):
            kill()
        if calls > {samples} and once("killed2"):
            wait_up()
            kill()
        if calls > 2 * {samples} and once("waited"):
            wait_up()
    return exact_match(response, answer)
"""


def test_disaggregated_two_servers_rl_trainer(slurm_cluster, tmp_path):
    """ROLLOUT_NODES=1 with two servers on the rollout node (one per replica, dp 1 each) and the
    real RL trainer (tiny_cpu, DP=2) for 3 steps, weights through the process group (gloo).

    Rank 1's producer is late once, by LATE_S (its reward scores one sample slowly), past every
    process group's timeout (trainer.collective_timeout=COLLECTIVE_S): rank 0 waits for it on the
    c10d store (the producers' per-round StoreSum), saying so, and the step's all-reduces then run
    together.

    Server 1 is killed (SIGKILL) during the generation of step 0 and again in step 1. Its
    supervisor restarts it on the same port each time. Restarted before the next push (step 0,
    while rank 1 is late), it is found by its version and joins a new update group; still starting
    at the push (step 1), it is left out: the trainer pushes to server 0 alone, and the first push
    after it answers gives it the current weights. No client takes an answer from its initial
    checkpoint (no step is generated again), and it serves step 3 on version 3. Every prompt of
    every step is answered n times, each sample once (server 1's logged answers under its initial
    weights, rejected by the clients, aside; steps 0 and 1 may log a sample on both servers: one
    finished on server 1 as it was killed, its answer lost)."""
    from megatron_rl.models.tiny import make_tiny_checkpoint

    steps, prompts, n = 4, 8, 4
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128)  # tiny_cpu's model, for both sides
    run = tmp_path / "run"
    reward = tmp_path / "late_reward.py"
    reward.write_text(LATE_REWARD.format(tmp=str(tmp_path), late_s=LATE_S, kill_port=30633,
                                         samples=prompts * n // 2))
    jobid = submit(tmp_path, ["tiny_cpu", f"trainer.steps={steps}", f"rollout.prompts_per_step={prompts}",
                              f"rollout.n_samples={n}", "learner.micro_batch_size=16", "algorithm.mini_batches=1",
                              "eval.num_prompts=0", "trainer.plot=false", f"model.hf_path={ckpt}",
                              "rollout.weight_sync=distributed", f"data.reward={reward}:score",
                              f"data.reward_timeout={LATE_S * 10}", f"trainer.collective_timeout={COLLECTIVE_S}",
                              "trainer.rollout_wait_log_every=4"],
                   two_servers_env(ckpt, 30617) | {"SERVER_MIN_UPTIME": "5"}, ("--nodes=2", "--ntasks-per-node=2"))
    info, log = finished(jobid, tmp_path)
    rank0 = (run / "logs" / f"{jobid}.0" / f"learner-rank0-{HOST}.log").read_text()
    assert "data-parallel producers [1] not there yet" in rank0, rank0[-3000:]
    assert all((tmp_path / f).exists() for f in ("late_once", "killed1", "killed2", "waited"))
    learner_node, rollout_node = hostnames(info["NodeList"])
    urls = ["http://127.0.0.1:30617", "http://127.0.0.1:30633"]  # ROLLOUT_PORT + 16k on NodeAddr 127.0.0.1
    # The dry-run printed the layout it checked; the script started exactly that.
    for k, url in enumerate(urls):
        assert f"rollout server {k}: node {rollout_node} (127.0.0.1), CPU, port {url[-5:]} -> {url}" in log, log
    assert f"SGLang servers up: {','.join(urls)}" in log, log
    assert "rollout servers' added args: --enable-deterministic-inference" in log, log
    assert f"rollout servers' model: {ckpt}" in log, log
    logs = run / "logs" / f"{jobid}.0"
    assert_two_ranks(run, jobid, log)
    served, texts = {}, {}
    for k, url in enumerate(urls):
        text = texts[k] = (logs / f"server{k}-{HOST}.log").read_text()
        assert f"server slot {k} of node {rollout_node}: CPU, TP 1, port {url[-5:]}" in text, text[-3000:]
        # Each server joined the update group of learner rank 0 + 2 servers x TP 1 at its own rank.
        assert f"rank_offset={k + 1}, rank={k + 1}, world_size=3" in text, text[-3000:]
        served[url] = served_requests(logs / f"server{k}-{HOST}.log")
    # Server 1 died twice, its supervisor started it again each time, and it rejoined the pushes.
    assert "server exited (signal 9)" in texts[1] and "restart 1 of 3 in 2s" in texts[1], texts[1][-3000:]
    assert "restart 2 of 3 in 4s" in texts[1] and "megatron-rl supervisor" not in texts[0], texts[1][-3000:]
    # Each restart was seen at a push: back already, by its version (possible after the first kill,
    # while rank 1 is late), or not answering, then taken back at a later push (after the second).
    gone = rank0.count(f"rollout server {urls[1]} does not answer: pushing to the other 1")
    back = rank0.count(f"rollout server {urls[1]} answers again (weight version default): it gets this push")
    found = rank0.count(f"rollout server {urls[1]} holds weight version default, not 0: restarted since the last push")
    assert gone == back >= 1 and gone + found == 2, (gone, back, found, rank0[-5000:])
    assert [r.get("rollout/servers_up") for r in rl_rows(run)][1] == 1.0  # the push after step 1
    assert "records from other weights" not in rank0  # no client took an answer from its fresh start
    rows = rl_rows(run)
    assert [r["step"] for r in rows] == list(range(steps)), rows
    for step in range(steps):
        # Step s generates on weight version s (pushed after step s-1; "0" at the start).
        both = [r for reqs in served.values() for r in reqs if r["version"] == str(step)]
        # Sample j of prompt i carries seed base + i*n + j: each of the step's prompts x n seeds
        # was answered, once from step 1 on, and the n answers of a prompt share its prompt ids.
        seeds = sorted(r["seed"] for r in both)
        expect = list(range(seeds[0], seeds[0] + prompts * n))
        assert (sorted(set(seeds)) if step <= 1 else seeds) == expect, (step, seeds)
        by_prompt = {}
        for r in both:
            by_prompt.setdefault((r["seed"] - seeds[0]) // n, set()).add(r["prompt"])
        assert len(by_prompt) == prompts and all(len(p) == 1 for p in by_prompt.values()), by_prompt
    assert any(r["version"] == str(steps - 1) for r in served[urls[1]]), "server 1 did not serve after its restart"
    # Nothing was answered on a version the trainer did not ask for, but server 1's fresh start.
    assert {r["version"] for reqs in served.values() for r in reqs} - {"default"} == {str(s) for s in range(steps)}
    assert not {r["version"] for r in served[urls[0]]} - {str(s) for s in range(steps)}
    assert log.index("stopping the SGLang servers") < log.index("done; metrics in"), log


def test_disaggregated_async_partial_rollouts(slurm_cluster, tmp_path):
    """The same disaggregated layout (DP=2 producers, two servers on the rollout node), trained
    asynchronously: one step off-policy with partial rollouts, so rank 0 pauses and resumes the
    remote servers around every push while both producers' threads generate ahead (agreeing through
    the c10d store, not a collective). Whether a push finds a response in flight to cut depends on
    timing (here generation is usually done before training is); cutting and continuing are tested
    in tests/e2e/test_async_training.py."""
    from megatron_rl.models.tiny import make_tiny_checkpoint

    steps = 4
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128)
    run = tmp_path / "run"
    jobid = submit(tmp_path, ["tiny_cpu", f"trainer.steps={steps}", "rollout.prompts_per_step=8",
                              "rollout.n_samples=4", "rollout.max_new_tokens=16", "learner.micro_batch_size=16",
                              "algorithm.mini_batches=1", "eval.num_prompts=0", "trainer.plot=false",
                              f"model.hf_path={ckpt}", "rollout.weight_sync=distributed",
                              "trainer.max_staleness=1", "rollout.partial_rollouts=true"],
                   two_servers_env(ckpt, 30717), ("--nodes=2", "--ntasks-per-node=2"))
    info, log = finished(jobid, tmp_path)
    assert_two_ranks(run, jobid, log)
    rows = rl_rows(run)
    assert [r["step"] for r in rows] == list(range(steps)), rows
    assert all(r["async/staleness_max"] <= 1 and r["async/tokens_staleness_0"] + r["async/tokens_staleness_1"] > 0
               for r in rows), rows
    assert any(r["async/staleness_max"] == 1 for r in rows), rows  # generation ran ahead of the learner
    digests = [r["data/prompt_digest"] for r in rows]
    assert len(set(digests)) == steps, digests
    logs = run / "logs" / f"{jobid}.0"
    served = [r for k in range(2) for r in served_requests(logs / f"server{k}-{HOST}.log")]
    assert served and {r["version"] for r in served} <= {str(s) for s in range(steps)}, served[:5]
    print({r["step"]: (r["async/staleness_mean"], r["async/continued_samples"]) for r in rows})


# The RL trainer: `train tiny_cpu` with DP=2 (two srun tasks of distinct ranks), SGLang started by
# rank 0 beside them (local placement).
def rl_rows(run: Path) -> list[dict]:
    """Training rows of metrics.jsonl (evaluation-only rows have no rollout/ metrics)."""
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.open()] if metrics.exists() else []
    return [r for r in rows if "rollout/reward_mean" in r]


def stable(rows: list[dict]) -> list[dict]:
    """Everything but wall-clock times and server retries: what a run must reproduce."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "rollout/retries"))} for r in rows]


def assert_two_ranks(run: Path, jobid: str, log: str) -> None:
    ranks = sorted(p.name for p in (run / "logs" / f"{jobid}.0").glob("learner-rank*.log"))
    assert ranks == [f"learner-rank0-{HOST}.log", f"learner-rank1-{HOST}.log"], (ranks, log)


# Shrunk so that a step takes about a second on 2 cores (8 prompts x 4 samples, one mini-batch, a
# small eval) and USR1 lands mid-run (sent after step 1: eight steps to spare); the resumed part
# crosses an evaluation and a periodic checkpoint (every 4 steps).
RL_STEPS = 10
RL_RECIPE = ["tiny_cpu", f"trainer.steps={RL_STEPS}", "rollout.prompts_per_step=8",
             "rollout.n_samples=4", "learner.micro_batch_size=16", "algorithm.mini_batches=1",
             "eval.num_prompts=8", "eval.k=1", "eval.every=4", "trainer.save_every=4", "trainer.plot=false"]


def release(jobid: str, tmp_path: Path, restarts: int, timeout: float = 300, **update: str) -> None:
    """Wait until the job was requeued `restarts` times and is held, then release it (after 3 s:
    see wait_for) with `update` (e.g. TimeLimit=UNLIMITED)."""
    wait_until(lambda: (lambda i: int(i.get("Restarts", 0)) >= restarts and i["JobState"] == "PENDING")(job(jobid)),
               timeout, f"requeue #{restarts}", jobid, tmp_path)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={jobid}", "StartTime=now",
                    *(f"{k}={v}" for k, v in update.items())], check=True)


def attempts(run: Path, jobid: str, lines: int = 6) -> str:
    """Each attempt in short, for a failed assertion: its failure.txt, srun's stderr and the last
    lines of every rank log (the whole job log comes after, and CI keeps only its ends)."""
    out = []
    for folder in sorted((run / "logs").glob(f"{jobid}.*"), key=lambda p: int(p.name.split(".")[1])):
        out.append(f"==== attempt {folder.name}")
        for f in [folder / "failure.txt", folder / "srun.err", *sorted(folder.glob("learner-rank*.log"))]:
            if f.exists():
                tail = [line[:300] for line in f.read_text(errors="replace").splitlines()[-lines:]]
                out.append(f"-- {f.name}:\n" + "\n".join(tail))
    failures = run / "failures.tsv"
    out.append("==== failures.tsv:\n" + (failures.read_text() if failures.exists() else "(none)"))
    return "\n".join(out)


def kill_rank(jobid: str, rank: int) -> int:
    """SIGKILL learner rank `rank` of the job (the `megatron_rl.cli` process srun started with that
    SLURM_PROCID; not the servers or workers it started). Returns its PID."""
    import psutil

    for p in psutil.process_iter(["cmdline", "environ"]):
        env, cmd = p.info["environ"] or {}, " ".join(p.info["cmdline"] or [])
        if (env.get("SLURM_JOB_ID") == jobid and env.get("SLURM_PROCID") == str(rank)
                and "megatron_rl.cli train" in cmd):
            p.kill()
            return p.pid
    raise AssertionError(f"job {jobid}: no learner rank {rank} to kill")


@pytest.mark.xfail(not _has_rl_trainer(), reason="needs the RL trainer", strict=False)
def test_interruptions_and_failures_requeue_and_resume_rl_trainer(slurm_cluster, tmp_path):
    """Three interruptions of one job, every step trained exactly once, and the metrics equal, bit for
    bit, to an uninterrupted run's (seeded sampling, batch-invariant SGLang on CPU, exact resume):
    - attempt 0: a 3-minute time limit (squeue's end time is what the trainer reads; that it follows
      `scontrol update TimeLimit=` is tests/unit/test_operations.py's). Before a step that, with a
      save and trainer.time_limit_margin, would not fit, the ranks checkpoint and exit, and the job
      requeues itself (USR1 is set to come only 5 s before the end: it is not what stops them);
    - attempt 1 (released with no limit): the rollout server is killed during the weight push after
      the attempt's first step (tests/slurm/faults/sitecustomize.py: the server asked to receive,
      killed before the broadcast). Rank 0 sees it at once and fails, srun ends rank 1, and the job
      requeues itself with the reason in logs/JOB.1/failure.txt;
    - attempt 2: learner rank 1 is killed (SIGKILL) mid-step: a failure again, requeued;
    - attempt 3 finishes.
    (USR1 takes the trainer's SIGTERM path, tests/unit/test_run_dir.py and tests/e2e/test_trainer.py;
    its way through the launcher is test_usr1_checkpoints_requeues_resumes_launcher's.)"""
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    jobid = submit(straight_dir, [o for o in RL_RECIPE if o != "trainer.plot=false"], {})  # the recipe plots
    info = wait_for(jobid, straight_dir, timeout=600)
    log = job_log(straight_dir, jobid)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert_two_ranks(straight_dir / "run", jobid, log)
    assert (straight_dir / "run" / "curves.png").stat().st_size > 10_000
    straight = rl_rows(straight_dir / "run")

    run = tmp_path / "run"
    faults = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "faults"), os.environ.get("PYTHONPATH")])),
              "MRL_TEST_KILL_SERVER_AT": "1:2"}
    # A 3-minute job against a margin of 170 s: the ranks stop after their first step (server start
    # and the first step take more than 10 s here) with about two and a half minutes to spare.
    jobid = submit(tmp_path, [*RL_RECIPE, "trainer.time_limit_margin=170"], faults,
                   sbatch_opts=("--nodes=1", "--ntasks=2", "--time=3", "--signal=B:USR1@5"))
    release(jobid, tmp_path, restarts=1, TimeLimit="UNLIMITED")
    attempt0 = (run / "logs" / f"{jobid}.0" / f"learner-rank0-{HOST}.log").read_text()
    assert "time limit (" in attempt0 and "trainer.time_limit_margin=170s" in attempt0, attempt0[-3000:]
    stopped = len(rl_rows(run))
    assert 1 <= stopped < RL_STEPS - 3, stopped

    release(jobid, tmp_path, restarts=2)  # attempt 1 failed at its second push
    failure1 = (run / "logs" / f"{jobid}.1" / "failure.txt").read_text()
    assert f"job {jobid}, restart 1" in failure1 and f"latest checkpoint: step_{stopped:08d}" in failure1, failure1
    assert (f"learner-rank0-{HOST}.log: megatron_rl.weights.endpoint.WeightSyncError: rollout server "
            "http://127.0.0.1:") in failure1 and "failed during the weight push" in failure1, failure1
    assert exited(failure1, 0), failure1  # rank 1 may exit 1 too (its collective broke)
    rank0 = (run / "logs" / f"{jobid}.1" / f"learner-rank0-{HOST}.log").read_text()
    assert "[fault injection] killed 1 rollout server(s) during a weight push" in rank0, rank0[-3000:]

    done = len(rl_rows(run))
    wait_until(lambda: len(rl_rows(run)) >= done + 1, 300, "a step of attempt 2", jobid, tmp_path)
    kill_rank(jobid, 1)
    release(jobid, tmp_path, restarts=3)
    failure2 = (run / "logs" / f"{jobid}.2" / "failure.txt").read_text()
    assert "task 1: Killed" in failure2, failure2

    info = wait_for(jobid, tmp_path, timeout=500, release_requeued=True)
    log = job_log(tmp_path, jobid)
    why = attempts(run, jobid) + "\n==== job log:\n" + log
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", why
    assert info["Restarts"] == "3" and log.count("requeueing job") == 3, why
    assert "learner ranks stopped before the time limit: stopped at step" in log, log
    failures = [line.split("\t") for line in (run / "failures.tsv").read_text().splitlines()]
    assert [f[0] for f in failures] == [f"{jobid}.1", f"{jobid}.2"], why
    assert log.count("in a row without a newer checkpoint") == 2, why
    assert not (run / "requeue").exists()
    assert_two_ranks(run, jobid, log)
    preempted = rl_rows(run)
    assert [r["step"] for r in preempted] == list(range(RL_STEPS))  # every step exactly once
    for a, b in zip(stable(straight), stable(preempted), strict=True):
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"
