"""The RL trainer end to end: real Megatron-Core learner, real SGLang server on CPU.

The session's shared SGLang server of the recipe's architecture (tests/e2e/conftest.py; one per
pytest-xdist worker) serves every run here (runs pass `rollout.server_urls`; each run starts by
pushing its learner's weights, so the server always serves the run's own policy).
- a shorter version of the embedded default learns (train accuracy rises well above chance);
- exact resume: 6 steps straight == 3 steps, kill -9, resume, 3 more (samples and rewards bit-identical,
  other metrics to SGLang's fp32 noise), the interrupted run saving asynchronously;
- Ctrl-C (SIGINT to the process group) mid-run: checkpoint written, exit 0 within 60 s in a few
  lines, resume continues from it;
- rollout_only saves batches that train_only trains on without any server.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.run.metrics import read_metrics

pytestmark = pytest.mark.slow

SMALL = ["rollout.prompts_per_step=8", "rollout.n_samples=4", "algorithm.mini_batches=2",
         "learner.micro_batch_size=8", "eval.num_prompts=8", "eval.k=2", "eval.every=0",
         "trainer.progress=false", "trainer.plot=false"]
VOLATILE = ("time/", "rollout/retries")


def _recipe_server(tmp_path_factory, shared_server, recipe: str, **flags) -> str:
    """The shared server (tests/e2e/conftest.py) of `recipe`'s tiny model, deterministic inference.
    Function-scoped: every run pushes its own weights first, so the tests need no module of their
    own and spread over the pytest-xdist workers."""
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint

    tiny = to_object(load_config(recipe)).model.tiny
    ckpt = make_tiny_checkpoint(tmp_path_factory.getbasetemp() / f"{recipe}_model", **vars(tiny))  # idempotent
    return shared_server(ckpt, **flags).urls()[0]


@pytest.fixture
def server_url(tmp_path_factory, shared_server):
    return _recipe_server(tmp_path_factory, shared_server, "tiny_cpu")


def cli(out_dir: Path, url: str, *overrides: str, small: bool = True, recipe: str = "tiny_cpu") -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", recipe, f"trainer.out_dir={out_dir}",
            f"rollout.server_urls=[{url}]", *(SMALL if small else SMALL[-2:]), *overrides]


def run(out_dir: Path, url: str, *overrides: str, small: bool = True, recipe: str = "tiny_cpu",
        timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(cli(out_dir, url, *overrides, small=small, recipe=recipe), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows if r["step"] >= 0]


def wait_for_checkpoint(out_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    marker = out_dir / "checkpoints" / "latest"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if marker.exists() and marker.read_text().strip() == f"step_{step:08d}":
            return
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        time.sleep(0.05)
    raise TimeoutError(f"no checkpoint for step {step} after {timeout}s")


def test_exact_resume_after_kill9(server_url, tmp_path):
    straight = tmp_path / "straight"
    run(straight, server_url, "trainer.steps=6")
    killed = tmp_path / "killed"
    # Its own process group, killed whole: a lost node takes the trainer's helper processes
    # (multiprocessing children) down with it, and none is left orphaned behind the test.
    # Asynchronous saves: the kill may land while a forked writer writes; `latest` names only
    # complete checkpoints, so the resume is exact either way.
    proc = subprocess.Popen(cli(killed, server_url, "trainer.steps=6", "trainer.save_every=1", "trainer.async_save=true"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_checkpoint(killed, 3, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert [r["step"] for r in read_metrics(killed) if r["step"] >= 0][:3] == [0, 1, 2]
    out = run(killed, server_url, "trainer.steps=6", "trainer.save_every=1", "trainer.async_save=true")
    assert "resumed from" in out.stdout and "at step 3" in out.stdout
    a, b = stable(read_metrics(straight)), stable(read_metrics(killed))
    assert [r["step"] for r in b] == list(range(6))
    for ra, rb in zip(a, b):
        # Bitwise: seeded sampling, SGLang's CPU batch-invariant GEMMs (patches/sglang_cpu.py; the
        # resumed server sees other batch compositions than the straight run's), exact RNG and
        # data-stream restore.
        diff = {k: (ra[k], rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"


def test_ctrl_c_checkpoints_exits_zero_quietly_and_resumes(server_url, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole foreground process group (the trainer, its reward
    workers). SIGTERM and SIGUSR1 take the same path (tests/unit/test_run_dir.py; Slurm's USR1 in
    tests/slurm)."""
    out_dir = tmp_path / "term"
    proc = subprocess.Popen(cli(out_dir, server_url, "trainer.steps=50", "trainer.save_every=1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    wait_for_checkpoint(out_dir, 2, proc)
    sent, before = time.time(), len(lines)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=60)
    reader.join(10)
    output = "".join(lines)
    assert proc.returncode == 0, output[-3000:]
    assert time.time() - sent < 60
    after = [line for line in lines[before:] if line.strip()]
    steps = [line for line in after if line.startswith("step ")]  # the step in progress finishes and logs
    assert len(after) - len(steps) <= 5, "".join(after)
    assert "Ctrl-C: stopping with a checkpoint" in output
    latest = (out_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    # Where the signal lands is a race: in a step's training, that step finishes and is checkpointed;
    # in its generation (the loop's next step started as the checkpoint appeared), the generation is
    # given up and the checkpoint of the last completed step stays (trainer/loop.py _stop_mid_step).
    if "generation given up" in output:
        assert f"SIGINT during step {stopped_at}'s generation" in output, output[-3000:]
        assert stopped_at >= 2
    else:
        assert "SIGINT: checkpoint at step" in output, output[-3000:]
        assert stopped_at >= 3
    assert max(r["step"] for r in read_metrics(out_dir)) == stopped_at - 1
    out = run(out_dir, server_url, f"trainer.steps={stopped_at + 2}")
    assert f"at step {stopped_at}" in out.stdout
    assert [r["step"] for r in read_metrics(out_dir) if r["step"] >= 0] == list(range(stopped_at + 2))


SLOW_REWARD = """
import time
from pathlib import Path


def score(response, answer):
    if Path({flag!r}).exists():  # from the moment the test says so, generation takes minutes
        Path({sleeping!r}).touch()
        time.sleep(300)
    return 0.0
"""


def test_sigterm_mid_generation_gives_the_step_up_and_resumes(server_url, tmp_path):
    """A stop that arrives while a step is generating (a preemption's SIGTERM, minutes before the
    SIGKILL; a 16k-token step generates for longer) does not wait for the generation: it is given
    up, the state after the last completed step is checkpointed, and the run exits 0 in seconds;
    the resumed run trains every step exactly once."""
    out_dir, flag, sleeping = tmp_path / "run", tmp_path / "slow", tmp_path / "sleeping"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD.format(flag=str(flag), sleeping=str(sleeping)))
    args = ("trainer.steps=5", "trainer.save_every=1", f"data.reward={reward}:score", "data.reward_timeout=900")
    proc = subprocess.Popen(cli(out_dir, server_url, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for_checkpoint(out_dir, 2, proc)
        flag.touch()
        deadline = time.time() + 120
        while not sleeping.exists():
            assert time.time() < deadline and proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.1)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    output = "".join(lines)
    assert proc.returncode == 0, output[-3000:]
    assert time.time() - sent < 40, output[-3000:]  # the reward sleeps 300 s
    step = int(output.split("SIGTERM during step ")[1].split("'")[0])
    assert f"checkpoint at step {step} written" in output, output[-3000:]
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert max(r["step"] for r in read_metrics(out_dir)) == step - 1
    flag.unlink()
    out = run(out_dir, server_url, *args)
    assert f"at step {step}" in out.stdout
    assert [r["step"] for r in read_metrics(out_dir) if r["step"] >= 0] == list(range(5))


def test_server_layout_checked_against_the_config(server_url):
    """Before the weight-update group forms, each server's own /server_info is checked: the group
    is sized from its real TP, and a server that cannot serve the config is refused by name."""
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.rollout.placement import checked_endpoints

    def cfg(*overrides):
        return to_object(load_config("tiny_cpu", [f"rollout.server_urls=[{server_url}]", *overrides]))

    (ep,) = checked_endpoints([server_url], cfg())
    assert ep.tp_size == 1 and ep.url == server_url
    with pytest.raises(ValueError, match=f"{server_url} runs tp_size=1 .* rollout.server_tp=2"):
        checked_endpoints([server_url], cfg("rollout.server_tp=2"))
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        checked_endpoints([server_url], cfg("algorithm.router_replay=r3"))


def test_overlong_shaping_and_filter_through_the_loop(server_url, tmp_path):
    """DAPO's overlong punishment and overlong filter in the loop, against a float64 reference on
    the saved rollout batch: the penalty from each response's length, the shaped rewards, and the
    tokens the policy trains on (those of untruncated responses only)."""
    import torch

    d = tmp_path / "overlong"
    run(d, server_url, "trainer.steps=1", "trainer.mode=rollout_only", "rollout.max_new_tokens=3")
    from megatron_rl.batch import RolloutBatch

    path = d / "rollouts" / "step_00000000.dp0.pt"
    batch, metrics = RolloutBatch.load(path)
    # A random policy almost never stops early: mark every other response as finished by EOS so
    # that the filter has both kinds to tell apart (the loop reads only this flag).
    batch["truncated"] = batch["truncated"] & (torch.arange(len(batch["truncated"])) % 2 == 0)
    batch.save(path, metrics)
    run(d / "train", "http://127.0.0.1:9", "trainer.steps=1", "trainer.mode=train_only",
        f"trainer.rollouts_dir={d / 'rollouts'}", "rollout.max_new_tokens=3",
        "algorithm.overlong_buffer=2", "algorithm.overlong_penalty=0.5", "algorithm.overlong_filter=true")
    (row,) = stable(read_metrics(d / "train"))

    y = batch["response_len"].double()
    start, f = 3 - 2, 0.5  # L_max - L_buf, factor
    ref = [0.0 if n <= start else -f if n > 3 else (start - n) / 2 * f for n in y.tolist()]
    penalty = torch.tensor(ref, dtype=torch.float64)
    assert (penalty < 0).any()
    assert row["reward/overlong_penalty_mean"] == pytest.approx(float(penalty.mean()), abs=1e-12)
    shaped = batch["rewards"].double() + penalty
    assert row["reward/shaped_mean"] == pytest.approx(float(shaped.mean()), abs=1e-6)
    truncated = batch["truncated"].bool()
    assert 0 < int(truncated.sum()) < len(truncated)
    assert row["reward/overlong_filtered_frac"] == pytest.approx(float(truncated.double().mean()))
    # `tokens` is the mean over the step's mini-batches of the response tokens the loss sees.
    kept = float(y[~truncated].sum())
    assert row["tokens"] * int(dict(a.split("=") for a in SMALL)["algorithm.mini_batches"]) == kept


def test_rollout_only_then_train_only(server_url, tmp_path):
    d = tmp_path / "split"
    run(d, server_url, "trainer.steps=2", "trainer.mode=rollout_only")
    assert sorted(p.name for p in (d / "rollouts").iterdir()) == ["step_00000000.dp0.pt", "step_00000001.dp0.pt"]
    # The same launch again: nothing to do, said in one line, no server contacted (a dead URL).
    again = run(d, "http://127.0.0.1:9", "trainer.steps=2", "trainer.mode=rollout_only")
    assert "nothing to do" in again.stdout and "at step 2" in again.stdout, again.stdout
    # train_only in the rollout_only run's folder would resume its optimizer-less checkpoint: refused,
    # naming the difference and the way (before any model is built).
    refused = subprocess.run(cli(d, "http://127.0.0.1:9", "trainer.steps=2", "trainer.mode=train_only",
                                 f"trainer.rollouts_dir={d / 'rollouts'}"), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "trainer.mode: 'rollout_only' -> 'train_only'" in refused.stderr and "Traceback" not in refused.stderr
    # No server at all for train_only: a dead URL proves nothing is contacted.
    run(d / "train", "http://127.0.0.1:9", "trainer.steps=2", "trainer.mode=train_only",
        f"trainer.rollouts_dir={d / 'rollouts'}")
    rows = [r for r in read_metrics(d / "train") if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    assert all("loss/pg" in r and "grad_norm" in r for r in rows)
    # Same initial weights and the same first batch: train_only's first step is train mode's.
    ref = tmp_path / "ref"
    run(ref, server_url, "trainer.steps=1")
    r0 = stable(read_metrics(ref))[0]
    t0 = stable(read_metrics(d / "train"))[0]
    for k in ("loss/pg", "grad_norm", "rollout/accuracy", "entropy/mean"):
        assert t0[k] == r0[k], (k, t0[k], r0[k])


@pytest.fixture
def moe_server_url(tmp_path_factory, shared_server):
    """An SGLang server for tiny_moe_cpu_r3's model, returning routed experts."""
    return _recipe_server(tmp_path_factory, shared_server, "tiny_moe_cpu_r3", routed=True)


@pytest.mark.parametrize("replay", ["r3", "r2"])
def test_moe_router_replay_through_the_loop(moe_server_url, tmp_path, replay):
    """tiny_moe_cpu_r3 (and its R2 variant) end to end: the engine's routes (R3) or the old-log-prob
    pass's routes (R2) are replayed in every training forward. The first mini-batch of a step runs
    on the weights the rollouts came from, so with R3 its log-probs equal SGLang's (fp32)."""
    d = tmp_path / replay
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "tiny_moe_cpu_r3", f"trainer.out_dir={d}",
         f"rollout.server_urls=[{moe_server_url}]", f"algorithm.router_replay={replay}", "trainer.steps=2",
         *SMALL], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = [r for r in read_metrics(d) if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        agreement = [v for k, v in r.items() if k.startswith("router_agreement/layer")]
        assert len(agreement) == 2 and all(0.0 <= a <= 1.0 for a in agreement), r
        if replay == "r3":
            assert r["mismatch/train_vs_rollout_abs_logp"] <= 1e-5, r
        else:  # R2 replays the trainer's own old-log-prob routing (natural routing moves only
            # with the updates of the step's later mini-batches)
            assert all(a >= 0.9 for a in agreement), agreement
            assert r["mismatch/old_vs_rollout_abs_logp"] <= 1e-5, r
            assert r["mismatch/train_vs_rollout_abs_logp"] <= 1e-5, r


def test_compare_runs_every_algorithm_and_plots(tmp_path):
    """`megatron-rl compare`: algorithms x seeds on the tiny task against one shared server."""
    import json

    import yaml

    out = tmp_path / "compare"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "compare", "--algorithms", "dppo_binary_tv,pg_is",
         "--seeds", "2", "--first-seed", "3", "--steps", "2", "--out", str(out), *SMALL],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["methods"]) == ["dppo_binary_tv", "pg_is"] and summary["seeds"] == [3, 4]
    assert all(len(s["per_seed"]) == 2 for s in summary["methods"].values())
    assert (out / "accuracy.png").stat().st_size > 10_000
    for algo in summary["methods"]:
        for seed in (3, 4):  # --first-seed 3
            rows = [r for r in read_metrics(out / algo / f"seed{seed}") if r["step"] >= 0]
            assert [r["step"] for r in rows] == [0, 1]
            config = yaml.safe_load((out / algo / f"seed{seed}" / "config.yaml").read_text())
            assert config["trainer"]["seed"] == seed and config["algorithm"]["policy_loss"] == (
                "pg_is" if algo == "pg_is" else "dppo")
    # the seed reaches the model init: the two seeds' first steps differ
    a, b = (stable(read_metrics(out / "pg_is" / f"seed{s}"))[0] for s in (3, 4))
    assert a["entropy/mean"] != b["entropy/mean"]
    # PG-IS has no trust region: nothing masked or clipped, whatever the ratios
    assert all(r["masked_frac"] == 0 for r in stable(read_metrics(out / "pg_is" / "seed3")))


def test_kl_to_reference_through_the_loop(server_url, tmp_path):
    """algorithm.kl_coef > 0: the trainer builds the frozen reference, computes its log-probs every
    step and trains with the KL term; loss/kl is logged (0 before the policy first moves, then
    positive). The estimator's value itself is checked in tests/distributed/test_reference_kl.py."""
    # An entropy bonus moves the policy even when this small batch has no informative group.
    run(tmp_path / "kl", server_url, "trainer.steps=2", "algorithm.kl_coef=0.1", "algorithm.mini_batches=1",
        "algorithm.entropy_coef=0.01")
    rows = [r for r in read_metrics(tmp_path / "kl") if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    assert abs(rows[0]["loss/kl"]) < 1e-6 and rows[1]["loss/kl"] > 1e-6, rows
    assert all(r["time/ref_logp"] > 0 for r in rows)
    for r in rows:
        assert r["loss/total"] == pytest.approx(
            r["loss/pg"] + 0.1 * r["loss/kl"] - 0.01 * r["loss/entropy"], rel=1e-5, abs=1e-9)


def test_topk_divergence_through_the_loop(server_url, tmp_path):
    """DPPO's top-K trust region end to end: SGLang's top-20 log-probs -> records (sampled token
    forced in) -> RolloutBatch (rows checked distinct once per step) -> the learner's fused pass
    with topk_distinct. With one mini-batch and one epoch every update is on-policy, so the
    top-K KL between the engine's and the learner's distributions is rounding only -- at step 0
    and again after a weight sync; a second epoch over the batch sees a moved policy, so the
    top-K TV becomes positive (the values themselves: tests/unit/test_vocab_parallel.py)."""
    # An entropy bonus moves the policy even when this small batch has no informative group.
    run(tmp_path / "kl", server_url, "algorithm=dppo_topk_kl", "rollout.top_k_logprobs=20",
        "trainer.steps=2", "algorithm.mini_batches=1", "algorithm.entropy_coef=0.01")
    rows = [r for r in read_metrics(tmp_path / "kl") if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 <= r["divergence/mean"] < 1e-6 and r["divergence/max"] < 1e-4, r
    run(tmp_path / "tv", server_url, "algorithm=dppo_topk_tv", "rollout.top_k_logprobs=20",
        "trainer.steps=1", "algorithm.mini_batches=1", "algorithm.epochs=2",
        "algorithm.entropy_coef=0.01")
    (r,) = [r for r in read_metrics(tmp_path / "tv") if r["step"] >= 0]
    assert 1e-5 < r["divergence/mean"] <= r["divergence/max"] <= 1.0, r


def test_ppo_gae_exact_resume(server_url, tmp_path):
    """recipes/ppo_gae_tiny_cpu.yaml (policy, critic + GAE, reward model, reference; KL in the
    rewards) on a small batch. The four models run every step and their rewards combine as
    configured: whitened reward-model scores (mean 0) beside the rule reward, the KL penalty
    (estimator k1) in the rewards, not the loss. The critic's weights, optimizer and LR schedule are
    checkpointed with the policy: 3 steps straight == 2 steps, then resume for the third, on every
    metric. (The recipe learning -- reward up, the critic's error down to the returns' variance --
    over its own batch and 20 steps: benchmarks/bench_ppo_gae_learning.py.)"""
    ppo = dict(recipe="ppo_gae_tiny_cpu")
    no_eval = "eval.num_prompts=0"  # a run evaluates at its last step: the 2-step run's would differ
    run(tmp_path / "straight", server_url, "trainer.steps=3", no_eval, **ppo)
    rows = [r for r in read_metrics(tmp_path / "straight") if r["step"] >= 0]
    for r in rows:
        assert {"time/reward_model", "time/values", "time/train_critic", "time/ref_logp"} <= r.keys()
        # Whitened reward-model scores have mean 0: the combined mean is the rule reward's.
        assert r["reward/total_mean"] == pytest.approx(r["reward/rule_mean"], abs=1e-6)
        assert r["reward/rule_mean"] == pytest.approx(r["rollout/reward_mean"], abs=1e-6)
        assert r["reward/model_std"] > 0
        # One-token responses: the per-sequence KL penalty is coef · the token-mean k1.
        assert r["reward/with_kl_penalty_mean"] == pytest.approx(
            r["reward/total_mean"] - 0.01 * r["kl/rollout_vs_ref"], rel=1e-5, abs=1e-7)
        assert "loss/kl" not in r  # the penalty is in the rewards, not the loss
    assert abs(rows[0]["kl/rollout_vs_ref"]) < 1e-5  # step 0: the policy is the reference
    assert abs(rows[-1]["kl/rollout_vs_ref"]) > 1e-7  # then it has moved
    assert (tmp_path / "straight" / "checkpoints" / "step_00000003" / "critic" / "metadata.json").exists()
    run(tmp_path / "resumed", server_url, "trainer.steps=2", no_eval, **ppo)
    out = run(tmp_path / "resumed", server_url, "trainer.steps=3", no_eval, **ppo)
    assert "at step 2" in out.stdout
    a, b = stable(read_metrics(tmp_path / "straight")), stable(read_metrics(tmp_path / "resumed"))
    assert [r["step"] for r in b] == [0, 1, 2]
    assert any(k.startswith("critic/") for k in a[2])
    for ra, rb in zip(a, b):
        diff = {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys()
                if ra.get(k) != rb.get(k) and not (math.isnan(ra.get(k, 0.0)) and math.isnan(rb.get(k, 0.0)))}
        assert not diff, f"step {ra['step']}: {diff}"


def test_served_reward_model_scores_as_the_megatron_one_in_the_loop(server_url, tmp_path):
    """reward_model.backend=sglang (rank 0 launches an --is-embedding server of the same tiny
    reward model) and the Megatron reward model score the same seeded step-0 responses alike."""
    runs = {}
    for backend in ("megatron", "sglang"):
        run(tmp_path / backend, server_url, "trainer.steps=1", "eval.num_prompts=0",
            f"reward_model.backend={backend}", "reward_model.max_total_tokens=4096", recipe="ppo_gae_tiny_cpu")
        (runs[backend],) = [r for r in read_metrics(tmp_path / backend) if r["step"] >= 0]
    assert (tmp_path / "sglang" / "reward_server_logs").is_dir()
    assert runs["megatron"]["rollout/reward_mean"] == runs["sglang"]["rollout/reward_mean"]
    for k in ("reward/model_mean", "reward/model_std"):
        assert runs["sglang"][k] == pytest.approx(runs["megatron"][k], abs=1e-5), k


def test_small_real_model_recipe_cpu_smoke(server_url, tmp_path, tmp_path_factory):
    """recipes/dppo_binary_tv_qwen3_1p7b_base_gsm8k.yaml, two steps on CPU: the recipe as written
    (GSM8K files in the recipes' layout with DAPO's template, the math reward, token-budget
    micro-batches, DPPO binary-TV) with a tiny local checkpoint in Qwen3-1.7B-Base's place and the
    CPU server instead of GPU 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_rl.data.sources import DAPO_TEMPLATE

    files = {}
    for split, n in (("train", 16), ("test", 4)):
        rows = [{"data_source": f"gsm8k-{split}", "ability": "math",
                 "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=f"What is {i}+{i}?")}],
                 "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(n)]
        files[split] = tmp_path / f"gsm8k-{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    d = tmp_path / "small_real"
    run(d, server_url, "trainer.steps=2", f"model.hf_path={tmp_path_factory.getbasetemp() / 'tiny_cpu_model'}",
        "model.dtype=float32", "rollout.device=cpu", "rollout.dtype=float32", "rollout.gpu_ids=[]",
        "rollout.mem_fraction_static=null", "rollout.placement=auto", "rollout.max_new_tokens=8",
        f"data.train_files=[{files['train']}]", f"data.eval_files=[{files['test']}]",
        recipe="dppo_binary_tv_qwen3_1p7b_base_gsm8k")
    rows = [r for r in read_metrics(d) if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss/pg"]) and 0.0 <= r["rollout/accuracy"] <= 1.0 for r in rows), rows
    config = (d / "config.yaml").read_text()
    assert "policy_loss: dppo" in config and "max_tokens_per_micro_batch: 16384" in config
