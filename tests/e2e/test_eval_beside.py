"""eval.servers=1 on two real SGLang servers: too few to hold one whole (it would halve the fleet), so
the evaluation beside training takes a share of both (eval.share unset: 0.2 of each server's room),
at the weights it evaluates, and the next push waits for it (rollout/evaluation.py).

Through the real trainer (tiny_cpu, 5 steps, synchronous, an evaluation due after every step, 8
samples of up to 4 tokens each: one that fits in a step, the learner's time, four updates of 64
samples, being the evaluation's room; 16 samples of 8 tokens beside two updates of 32 did not fit
on a fast machine under the suite's load, where every push waited 0.03-0.12 s):
- every evaluation beside training names the weights it evaluated (eval/step = v) and every token
  it scored came from exactly those weights (eval/weight_version, from the servers' own per-token
  version spans), though it shared both servers with training: no push came while it ran;
- none is skipped (the push waited for the one before), the initial policy's is the first, the
  last step's runs on both servers at the end, as without eval.servers;
- every push reached both servers (rollout/servers_up) and the weight-update group was formed once,
  at the start (weight_sync/groups_formed): never again for an evaluation;
- training did not wait for an evaluation that fit in its step (time/eval_wait 0 at the pushes).

Whole servers held at the evaluated weights (eval.share=0, what a bigger fleet gets by default), on
the same two servers, with an evaluation several steps long (64 samples of up to 128 tokens beside
steps of 32 one-token samples: it took 4.8-5.2 s against steps of 0.3-0.75 s here):
- the evaluation holds the second server: a push while it runs reaches the first only
  (rollout/servers_up 1) and forms the update group anew without it; training never waits for
  it (time/eval_wait 0 at every push, as holding a server is built);
- every token it scored still came from the weights it names (eval/weight_version = eval/step),
  though pushes came while it ran; an evaluation due while the server is held is skipped, not
  started on other weights.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rl.run.metrics import read_metrics

STEPS = 5
HOLD_STEPS = 3


def two_servers(tmp_path_factory, shared_server) -> list[str]:
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint

    tiny = to_object(load_config("tiny_cpu")).model.tiny
    ckpt = make_tiny_checkpoint(tmp_path_factory.getbasetemp() / "tiny_cpu_model", **vars(tiny))  # idempotent
    # Two servers of the model (deterministic inference or not: unseeded sampling needs neither).
    return [shared_server(ckpt).urls()[0], shared_server(ckpt, deterministic=False).urls()[0]]


def train_on_two_servers(run, urls: list[str], steps: int, *overrides: str) -> subprocess.CompletedProcess:
    """tiny_cpu on both servers, unseeded, an evaluation beside training due after every step."""
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "tiny_cpu", f"trainer.out_dir={run}",
         f"rollout.server_urls=[{urls[0]},{urls[1]}]", "rollout.seeded=false", f"trainer.steps={steps}",
         "trainer.progress=false", "trainer.plot=false", "eval.every=1", "eval.servers=1", *overrides],
        capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_eval_beside_training_keeps_its_weights(tmp_path, tmp_path_factory, shared_server):
    run = tmp_path / "run"
    out = train_on_two_servers(run, two_servers(tmp_path_factory, shared_server), STEPS,
                               "rollout.prompts_per_step=16", "rollout.n_samples=4", "algorithm.mini_batches=4",
                               "learner.micro_batch_size=8", "eval.num_prompts=2", "eval.k=4",
                               "eval.max_new_tokens=4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    log = out.stdout + out.stderr
    assert "evaluation beside training: 20% of every server's room" in log, log[-3000:]
    rows = read_metrics(run)
    train = [r for r in rows if "rollout/accuracy" in r]
    assert [r["step"] for r in train] == list(range(STEPS)), [r["step"] for r in rows]
    assert not [r for r in rows if r["step"] < 0]  # the initial evaluation ran beside training too
    # An evaluation that ends at the last step has a row of its own, before the last training row's.
    assert all("rollout/accuracy" in r or r["step"] == STEPS - 1 for r in rows), rows
    beside = [r for r in rows if "eval/step" in r]
    evaluated = [int(r["eval/step"]) for r in beside]
    # None skipped: each ended before the next push, which waited for it.
    assert evaluated == list(range(STEPS)) and " skipped: " not in log, (evaluated, log[-3000:])
    for r in beside:
        # Every scored token came from the weights of the step it names, whatever training pushed.
        assert r["eval/weight_version"] == r["eval/step"], r
        assert r["step"] == r["eval/step"] and "eval/mean@4" in r and r["time/eval"] > 0, r
    # The last step's evaluation: on every server, in the last row, as without eval.servers.
    assert rows[-1] is train[-1] and "eval/mean@4" in rows[-1] and "eval/step" not in rows[-1], rows[-1]
    # Every push reached both servers, over the update group formed at the start: none formed anew.
    assert all(r["rollout/servers_up"] == 2.0 and r["weight_sync/groups_formed"] == 1.0 for r in train), train
    # An evaluation that fits in its step costs the push no wait (0: it had ended before it).
    waits = [r["time/eval_wait"] for r in train]
    assert sum(w == 0.0 for w in waits) >= STEPS - 1, waits


@pytest.mark.slow
def test_eval_holding_a_server_keeps_its_weights_while_pushes_pass_it(tmp_path, tmp_path_factory, shared_server):
    run = tmp_path / "run"
    out = train_on_two_servers(run, two_servers(tmp_path_factory, shared_server), HOLD_STEPS,
                               "rollout.prompts_per_step=8", "rollout.n_samples=4", "algorithm.mini_batches=1",
                               "learner.micro_batch_size=32", "eval.share=0", "eval.num_prompts=8", "eval.k=8",
                               "eval.max_new_tokens=128")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    log = out.stdout + out.stderr
    assert "evaluation beside training: on 1 whole server(s) held at its weights" in log, log[-3000:]
    rows = read_metrics(run)
    train = [r for r in rows if "rollout/accuracy" in r]
    assert [r["step"] for r in train] == list(range(HOLD_STEPS)), [r["step"] for r in rows]
    beside = [r for r in rows if "eval/step" in r]
    assert beside, log[-3000:]
    for r in beside:  # its weights, though pushes passed the held server while it ran
        assert r["eval/weight_version"] == r["eval/step"] and "eval/mean@8" in r, r
    # A push while it ran reached the other server only, and the group was formed anew for it.
    ups = [r.get("rollout/servers_up") for r in train]
    assert 1.0 in ups, ups
    assert train[-1]["weight_sync/groups_formed"] > 1.0, train[-1]
    # An evaluation due while the server was held was skipped, never started on other weights.
    assert len(beside) + log.count(" skipped: ") == HOLD_STEPS, (len(beside), log[-3000:])
    # Holding a server never delays a push.
    assert all(r["time/eval_wait"] == 0.0 for r in train), [r["time/eval_wait"] for r in train]
