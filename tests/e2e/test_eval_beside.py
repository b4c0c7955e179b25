"""eval.servers=1: the evaluation runs beside training on one of two real SGLang servers, held at
the weights of the step it evaluates while the trainer pushes newer weights to the other.

Through the real trainer (tiny_cpu, 5 steps, an evaluation due after every step, each one longer
than a training step: 64 samples of up to 48 tokens on one server):
- every evaluation beside training names the weights it evaluated (eval/step = v) and every token
  it scored came from exactly those weights (eval/weight_version, from the servers' own per-token
  version spans): no push reached its server while it ran, though training pushed newer ones;
- the initial policy's evaluation is one of them; one due while another runs, or before the
  other's server has the current weights again, is skipped, saying so; the last step's evaluation
  runs on both servers at the end, as without eval.servers;
- every training step ran and was logged once, with the pushes that left the held server out
  reaching one server (rollout/servers_up).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_rl.run.metrics import read_metrics

STEPS = 5


@pytest.mark.slow
def test_eval_beside_training_keeps_its_weights(tmp_path, tmp_path_factory, shared_server):
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.models.tiny import make_tiny_checkpoint

    tiny = to_object(load_config("tiny_cpu")).model.tiny
    ckpt = make_tiny_checkpoint(tmp_path_factory.getbasetemp() / "tiny_cpu_model", **vars(tiny))  # idempotent
    # Two servers of the model (deterministic inference or not: unseeded sampling needs neither).
    urls = [shared_server(ckpt).urls()[0], shared_server(ckpt, deterministic=False).urls()[0]]
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "tiny_cpu", f"trainer.out_dir={run}",
         f"rollout.server_urls=[{urls[0]},{urls[1]}]", "rollout.seeded=false", f"trainer.steps={STEPS}",
         "rollout.prompts_per_step=8", "rollout.n_samples=4", "algorithm.mini_batches=2",
         "learner.micro_batch_size=8", "trainer.progress=false", "trainer.plot=false",
         "eval.every=1", "eval.servers=1", "eval.num_prompts=16", "eval.k=4", "eval.max_new_tokens=48"],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = read_metrics(run)
    train = [r for r in rows if "rollout/accuracy" in r]
    assert [r["step"] for r in train] == list(range(STEPS)), [r["step"] for r in rows]
    assert not [r for r in rows if r["step"] < 0]  # the initial evaluation ran beside training too
    # An evaluation that ends at the last step has a row of its own, before the last training row's.
    assert all("rollout/accuracy" in r or r["step"] == STEPS - 1 for r in rows), rows
    beside = [r for r in rows if "eval/step" in r]
    evaluated = [int(r["eval/step"]) for r in beside]
    assert evaluated and evaluated[0] == 0 and evaluated == sorted(set(evaluated)), evaluated
    for r in beside:
        # Every scored token came from the weights of the step it names, whatever training pushed.
        assert r["eval/weight_version"] == r["eval/step"], r
        assert r["step"] >= r["eval/step"] - 1 and "eval/mean@4" in r and r["time/eval"] > 0, r
    skipped = [v for v in range(1, STEPS) if f"eval at step {v} skipped: " in out.stdout + out.stderr]
    assert sorted(evaluated + skipped) == list(range(STEPS)), (evaluated, skipped)
    # The last step's evaluation: on every server, in the last row, as without eval.servers.
    assert rows[-1] is train[-1] and "eval/mean@4" in rows[-1] and "eval/step" not in rows[-1], rows[-1]
    assert any(r.get("rollout/servers_up") == 1.0 for r in train), train  # a push left the held server out
