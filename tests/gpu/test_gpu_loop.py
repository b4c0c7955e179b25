"""(b) The RL loop on one GPU, `trainer.mode=train_only` from rollouts saved on CPU by SGLang
(`suite.sh prepare`): dense (bf16 params, fp32 grads and Adam) and MoE with R3 replay (fp32, so
the replayed routes can be checked against the engine's log-probs). Every collective of the loop
runs on the process group `init_distributed` starts: NCCL on CUDA (world size 1 on the one GPU).

Per model, three runs of the CLI, the first two side by side:
  straight  8 steps, a checkpoint at the end (traced: which packages its code path imports);
  stopped   8 steps with a checkpoint every step, SIGTERM once the step-2 checkpoint exists: the
            step in flight finishes, a checkpoint is written, exit 0;
  resumed   the stopped run's folder again: resumes from its checkpoint and runs to step 8.
(The CPU dry run: 4 steps, SIGTERM after the step-1 checkpoint.)
The resumed run must equal the straight one. Metrics read from the saved batches (rollout/*,
reward/*) must be equal everywhere. The rest: on CPU (the dry run) bit for bit, as in the CPU
e2e tests. On CUDA, bit equality is not promised: megatron-core's MoE token dispatch sums with
atomics (scatter_add), and one differently rounded fp32 gradient can move a bf16 parameter by one
ulp. So on CUDA: every checkpointed tensor (parameters, fp32 master weights, Adam moments) of the
resumed run's final checkpoint must be within 5 % of how far the resumed steps moved it
(‖θ_resumed − θ_straight‖ ≤ 0.05 ‖θ_straight − θ_at_stop‖, summed over tensors) — a resume that
loses the weights or the optimizer state is off by O(1) — and the computed metrics within
2 % relative + 2e-3 absolute.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpu_common

# A GPU step of these tiny models takes well under a second: 8 steps leave SIGTERM (sent once the
# step-2 checkpoint exists) time to land mid-run. CPU steps are slower: 4 steps, stop after 1.
STEPS = {"cuda": gpu_common.ROLLOUT_STEPS, "cpu": 4}[gpu_common.device()]
STOP_AFTER = {"cuda": 2, "cpu": 1}[gpu_common.device()]  # SIGTERM once this step's checkpoint exists
EXACT = ("rollout/", "reward/")  # read from the saved batches
VOLATILE = ("time/",)
DTYPE = {"dense": "bfloat16", "moe": "float32"}
CUDA_TOL = dict(weights=0.05, rel=0.02, abs=2e-3)
# Step 0's first mini-batch runs on the weights the rollouts were sampled with (SGLang, fp32 on
# CPU): |log π − log μ| is then the learner-vs-engine gap alone. fp32: rounding (~1e-6 here);
# 1e-4 leaves room for GPU kernels. bf16: the logits of this tiny model carry ~1e-2 absolute
# rounding; 0.05 still catches a wrong weight or route (O(1) on the affected tokens).
MISMATCH_TOL = {"float32": 1e-4, "bfloat16": 0.05}


def _cli(model: str, out_dir: Path, *extra: str, trace: Path | None = None) -> list[str]:
    data = gpu_common.data_dir()
    m = gpu_common.manifest()["models"][model]
    tracer = [str(Path(__file__).with_name("trace_imports.py")), str(trace)] if trace else []
    return [sys.executable, *tracer, "-m", "megatron_rl.cli", "train", m["recipe"], f"trainer.out_dir={out_dir}",
            "trainer.mode=train_only", f"trainer.rollouts_dir={data / m['rollouts']}",
            f"model.hf_path={data / m['hf_path']}", "model.spec=local", f"model.dtype={DTYPE[model]}",
            f"trainer.steps={STEPS}", *gpu_common.LOOP_OVERRIDES, *extra]


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(gpu_common.REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _popen(cmd, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=gpu_common.REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{' '.join(map(str, proc.args[-12:]))} did not finish in {timeout:.0f}s:\n"
                             f"{log.read_text()[-4000:]}")
    text = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-6000:]}"
    return text


def _latest(out_dir: Path) -> str | None:
    marker = out_dir / "checkpoints" / "latest"
    return marker.read_text().strip() if marker.exists() else None


def _checkpoint_tensors(folder: Path, tmp: Path) -> dict:
    """Every tensor of a megatron-core torch_dist checkpoint (model and optimizer), on CPU."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    return {k: v.double() for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _is_optimizer(key: str) -> bool:
    # "optimizer.state.exp_avg.<param>", or "chained_<i>.optimizer..." when dense and expert
    # parameters have an optimizer each (MoE)
    return key.split(".")[0] == "optimizer" or key.startswith("chained_")


def _rows(out_dir: Path) -> list[dict]:
    from megatron_rl.run.metrics import read_metrics

    return [r for r in read_metrics(out_dir) if r["step"] >= 0]


@pytest.fixture(scope="module", params=list(gpu_common.LOOP_MODELS))
def runs(request, tmp_path_factory):
    model = request.param
    manifest = gpu_common.manifest()
    if manifest["loop_overrides"] != gpu_common.LOOP_OVERRIDES or manifest["rollout_steps"] < STEPS:
        pytest.fail(f"{gpu_common.data_dir()} was prepared with other loop settings: run "
                    "`tests/gpu/suite.sh prepare` again")
    tmp = tmp_path_factory.mktemp(model)
    straight, stopped = tmp / "straight", tmp / "stopped"
    every_step = ("trainer.save_every=1", "trainer.keep_checkpoints=100")
    p_straight = _popen(_cli(model, straight, trace=tmp / "imports.json"), tmp / "straight.log")
    p_stop = _popen(_cli(model, stopped, *every_step), tmp / "stopped.log")
    try:
        deadline = time.time() + 300
        while _latest(stopped) != f"step_{STOP_AFTER:08d}":
            if p_stop.poll() is not None:
                break  # _finish below reports how it ended
            assert time.time() < deadline, f"no step-{STOP_AFTER} checkpoint after 300 s"
            time.sleep(0.01)
        sent = time.time()
        p_stop.send_signal(signal.SIGTERM)
        stop_log = _finish(p_stop, tmp / "stopped.log", timeout=300)
        stop_seconds = time.time() - sent
        stopped_at = _latest(stopped)
        rows_at_stop = _rows(stopped)
        straight_log = _finish(p_straight, tmp / "straight.log", timeout=300)
    finally:
        for p in (p_straight, p_stop):  # a failed wait above must not leave a run behind
            if p.poll() is None:
                p.kill()
                p.wait()
    resume_log = _finish(_popen(_cli(model, stopped, *every_step), tmp / "resumed.log"), tmp / "resumed.log",
                         timeout=300)
    return dict(model=model, tmp=tmp, straight=straight, imports=tmp / "imports.json", stopped=stopped,
                stop_log=stop_log, stop_seconds=stop_seconds, stopped_at=stopped_at, rows_at_stop=rows_at_stop,
                straight_log=straight_log, resume_log=resume_log)


def _stop_step(runs) -> int:
    return int(runs["stopped_at"].split("_")[1])


def test_every_run_on_the_expected_device(runs):
    for log in ("straight_log", "stop_log", "resume_log"):
        assert f"device={gpu_common.ctx_device()}" in runs[log], runs[log][-3000:]


def test_sigterm_writes_a_checkpoint_and_exits_zero(runs):
    k = _stop_step(runs)
    assert f"SIGTERM: checkpoint at step {k} written" in runs["stop_log"], runs["stop_log"][-3000:]
    assert STOP_AFTER < k < STEPS, f"stopped at step {k}: the run ended before SIGTERM landed"
    assert runs["stop_seconds"] < 120
    assert [r["step"] for r in runs["rows_at_stop"]] == list(range(k))
    assert (runs["stopped"] / "checkpoints" / runs["stopped_at"] / "metadata.json").exists()


def test_resumed_run_equals_the_straight_run(runs):
    k = _stop_step(runs)
    assert f"at step {k}" in runs["resume_log"] and "resumed from" in runs["resume_log"]
    a, b = _rows(runs["straight"]), _rows(runs["stopped"])
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(STEPS))
    worst = {}
    for ra, rb in zip(a, b):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith(VOLATILE)}
        assert keys <= ra.keys() & rb.keys(), (ra["step"], keys ^ (ra.keys() & rb.keys()))
        for key in sorted(keys):
            x, y = ra[key], rb[key]
            if key.startswith(EXACT) or not gpu_common.cuda():
                assert x == y or (math.isnan(x) and math.isnan(y)), (ra["step"], key, x, y)
            else:
                assert abs(x - y) <= CUDA_TOL["rel"] * abs(x) + CUDA_TOL["abs"], (ra["step"], key, x, y)
                worst[key] = max(worst.get(key, 0.0), abs(x - y))
    gpu_common.record("b_loop", {f"{runs['model']}_resume_max_abs_metric_diff": worst})


def test_resumed_checkpoint_equals_the_straight_one(runs):
    tmp = runs["tmp"]
    final = f"step_{STEPS:08d}"
    straight = _checkpoint_tensors(runs["straight"] / "checkpoints" / final, tmp)
    resumed = _checkpoint_tensors(runs["stopped"] / "checkpoints" / final, tmp)
    at_stop = _checkpoint_tensors(runs["stopped"] / "checkpoints" / runs["stopped_at"], tmp)
    assert straight.keys() == resumed.keys() == at_stop.keys()
    assert any(_is_optimizer(k) for k in straight), sorted(straight)[:20]
    out = {}
    for part in ("model", "optimizer"):
        keys = [k for k in straight if _is_optimizer(k) == (part == "optimizer")]
        diff = math.sqrt(sum(float((resumed[k] - straight[k]).square().sum()) for k in keys))
        moved = math.sqrt(sum(float((straight[k] - at_stop[k]).square().sum()) for k in keys))
        out[part] = {"diff": diff, "moved_since_stop": moved}
        assert moved > 0, f"{part}: nothing changed in the resumed steps (did the loop train?)"
        if gpu_common.cuda():
            assert diff <= CUDA_TOL["weights"] * moved, (part, diff, moved)
        else:
            assert diff == 0.0, (part, diff, moved)
    gpu_common.record("b_loop", {f"{runs['model']}_resume_checkpoint_distance": out})


def test_training_happened_with_finite_metrics(runs):
    rows = _rows(runs["straight"])
    for r in rows:
        assert math.isfinite(r["loss/pg"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        assert r["update_skipped"] == 0.0, r
    mismatch = rows[0]["mismatch/train_vs_rollout_abs_logp"]
    gpu_common.record("b_loop", {f"{runs['model']}_step0_train_vs_rollout_abs_logp": mismatch})
    assert mismatch <= MISMATCH_TOL[DTYPE[runs["model"]]], mismatch
    if runs["model"] == "moe":
        for r in rows:
            agreement = [v for k, v in r.items() if k.startswith("router_agreement/layer")]
            assert len(agreement) == 2 and all(0.0 <= x <= 1.0 for x in agreement), r


def test_train_only_imports_resolve_on_the_gpu_machine(runs):
    """What the straight run imported from the project's code, or through a package that travels
    as a wheel, is the standard library's, a wheel's of tests/gpu/wheels.txt or the GPU image's
    (tests/gpu/image-packages.txt). In the CPU dry run this is the check that counts: a package
    missing on the GPU machine is found before GPU time is spent."""
    import json

    import prepare

    problems, where = prepare.check_imports(json.loads(runs["imports"].read_text()), prepare.read_pins())
    assert not problems, problems
    assert {"megatron", "mbridge", "hydra", "omegaconf"} <= set(where["wheel"]), where
    assert {"torch", "transformers"} <= set(where["image"]), where
