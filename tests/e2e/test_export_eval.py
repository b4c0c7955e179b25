"""`megatron-rl export` and `megatron-rl eval`, end to end on CPU.

The checkpoints are real runs of the supervised path (`lm_demo.run`, the body of `train-lm`, which
writes config.yaml and the trainer's checkpoint) on two gloo processes: dense Qwen3 at TP2
(sequence parallel, a vocabulary padded for TP2) and Qwen3-MoE at EP2, each once with lr 0 and once
trained (lr > 0, 2 steps), a trained dense run at PP2 x VPP2 and a bfloat16 one at TP2 (lr 0). The export runs as the CLI in one
process (world size 1, not the training's 2), and once under torchrun at another layout (TP2).

References, independent of the export path:
- lr 0: every tensor of the export equals the initial HF checkpoint's, bit for bit (rounded to
  bfloat16 for a bfloat16 run: Megatron holds the weights so);
- trained: the learner's own logits at the training layout (a fresh Learner resumed from the
  checkpoint with the trainer's `load_checkpoint`) equal transformers' on the export;
- eval: `megatron-rl eval RUN_DIR` (export of the newest checkpoint, a local SGLang server started
  by the command, greedy samples, a reward by import path) and `megatron-rl eval HF_FOLDER` on a
  running server (`rollout.server_urls`, started on the initial weights and told to load the
  export) report the mean@k / pass@k of transformers' own greedy continuations of the same prompts
  under the same reward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# name: (tiny model, training layout, runs). The dense TP2 model has 128 rows of vocabulary, which
# Megatron pads to 256 at TP2 (a multiple of 128·TP) and not at the export's TP1: the stored
# embedding and output layer are larger than the export's. PP2 x VPP2 stores 4 layers from
# `model0` / `model1` of two ranks; the export holds them in one chunk.
LAYOUTS = {
    "dense_tp2": (dict(vocab_size=128), {"tp": 2}, ("lr0", "trained")),
    "moe_ep2": (dict(moe=True), {"ep": 2}, ("lr0", "trained")),
    "dense_pp2_vpp2": (dict(num_layers=4), {"pp": 2, "vpp": 2}, ("trained",)),
    # A bfloat16 run (a GPU run's dtype): the export keeps bfloat16, norms included.
    "dense_tp2_bf16": (dict(vocab_size=128, dtype="bfloat16"), {"tp": 2}, ("lr0",)),
}
# lr, steps. 2 steps at 1e-3 move the logits by ~0.4 and change some greedy answers; at 1e-2
# every answer is already the end-of-turn token, which no reward could tell apart.
RUNS = {"lr0": (0.0, 1), "trained": (1e-3, 2)}
B, S = 8, 9  # 2 micro-batches of 4: the interleaved schedule needs at least PP


def probe_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 99, (B, S), generator=g)
    return dict(input_ids=ids, labels=torch.roll(ids, -1, dims=1), loss_mask=torch.ones(B, S))


def _job(run_dir: Path, tiny: dict, parallel: dict, lr: float, steps: int):
    from megatron_rl.config.schema import JobConfig, ParallelConfig

    cfg = JobConfig(name=run_dir.name)
    for k, v in tiny.items():
        setattr(cfg.model if k == "dtype" else cfg.model.tiny, k, v)
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr = lr
    cfg.learner.micro_batch_size = 4
    cfg.train.steps, cfg.train.global_batch_size, cfg.train.log_every = steps, 8, steps
    cfg.train.out_dir = str(run_dir)
    return cfg


def learner_logits(learner, ctx):
    """The learner's full logits [B, S, V] of the probe batch (None on ranks off the last stage)."""
    import torch.distributed as dist

    def collect(logits_BSV, mb, tp_group, vocab_size):
        return logits_BSV.new_zeros(()), {"logits": logits_BSV.detach()}

    per_mb = learner.run_micro_batches(probe_batch(), collect, forward_only=True)
    if not ctx.is_last_stage:
        return None
    local = torch.cat([m["logits"] for m in per_mb])
    shards = [torch.empty_like(local) for _ in range(ctx.tp)]
    dist.all_gather(shards, local, group=ctx.tp_group)
    full = torch.cat(shards, dim=-1)
    rows = [torch.empty_like(full) for _ in range(ctx.dp)]
    dist.all_gather(rows, full, group=ctx.dp_group)
    return torch.cat(rows)[:, :S, :learner.vocab_size]


def train_worker(rank, world_size, root):
    """Every layout's runs (the supervised path, which writes config.yaml and the checkpoint), then
    the trained run's logits from a Learner resumed from its checkpoint at the same layout."""
    from megatron_rl.tools import lm_demo
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.run.checkpoint import latest_checkpoint, load_checkpoint

    out = {}
    for name, (tiny, parallel, runs) in LAYOUTS.items():
        for tag in runs:
            cfg = _job(Path(root) / f"{name}_{tag}", tiny, parallel, *RUNS[tag])
            ctx = init_distributed(cfg.parallel)
            lm_demo.run(cfg, ctx)
        if "trained" not in runs:
            continue
        learner = Learner(cfg, ctx, run_dir=cfg.train.out_dir)
        load_checkpoint(learner, latest_checkpoint(cfg.train.out_dir))
        out[name] = dict(logits=learner_logits(learner, ctx), layout=ctx.describe())
        del learner
    return out


def cli(*args: str, path: str = "", nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """`megatron-rl ARGS` in a process of its own (under torchrun with `nproc` ranks)."""
    from megatron_rl.distributed.spawn import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}
    launch = [sys.executable] if nproc == 1 else [str(Path(sys.executable).with_name("torchrun")),
                                                   "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    proc = subprocess.run([*launch, "-m", "megatron_rl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"megatron-rl {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    start = time.monotonic()
    ranks = run_distributed(train_worker, 2, str(root))
    print(f"train-lm runs at TP2, EP2, PP2xVPP2, TP2 bf16: {time.monotonic() - start:.0f}s")
    # Logits from the rank of the last pipeline stage; the layouts from rank 0.
    out = {name: dict(ranks[0][name], logits=next(r[name]["logits"] for r in ranks if r[name]["logits"] is not None))
           for name in ranks[0]}
    return root, out


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    got = {}
    for f in sorted(folder.glob("*.safetensors")):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("name", [n for n, (_, _, runs) in LAYOUTS.items() if "lr0" in runs])
def test_export_at_lr0_is_the_initial_checkpoint(runs, name, tmp_path):
    root, out = runs
    run = root / f"{name}_lr0"
    start = time.monotonic()
    cli("export", str(run), str(tmp_path / "hf"))
    print(f"export {name}: {time.monotonic() - start:.1f}s")
    exported, initial = tensors(tmp_path / "hf"), tensors(run / "tiny_model")
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32  # the tiny model is float32
    assert set(exported) == set(initial)
    for k, w in initial.items():
        assert exported[k].dtype == dtype and torch.equal(exported[k], w.to(dtype)), k
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / f).is_file(), f
    meta = json.loads((tmp_path / "hf" / "megatron_rl_export.json").read_text())
    assert meta["step"] == 1 and "world=1" in meta["export_layout"]


@pytest.mark.parametrize("name", [n for n, (_, _, runs) in LAYOUTS.items() if "trained" in runs])
def test_export_of_trained_run_has_the_learners_logits(runs, name, tmp_path):
    from transformers import AutoModelForCausalLM

    root, out = runs
    run = root / f"{name}_trained"
    want = {"dense_tp2": "tp=2 pp=1 vpp=None", "moe_ep2": "ep=2", "dense_pp2_vpp2": "pp=2 vpp=2"}[name]
    assert want in out[name]["layout"], out[name]["layout"]
    if name == "moe_ep2":  # under torchrun at another layout (TP2: experts whole, attention split)
        proc = cli("export", str(run), str(tmp_path / "hf"), "parallel.tp=2", nproc=2)
        assert "world=2 tp=2 pp=1 vpp=None dp=1 ep=1" in proc.stdout, proc.stdout
    else:
        cli("export", str(run), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    logits = model(probe_batch()["input_ids"]).logits.detach()
    diff = (logits - out[name]["logits"]).abs().max().item()
    assert diff <= 1e-4, f"{name}: transformers on the export differs from the learner by {diff}"
    # Training moved the weights: the same check on the initial model would fail.
    initial = AutoModelForCausalLM.from_pretrained(run / "tiny_model", dtype=torch.float32)
    moved = (initial(probe_batch()["input_ids"]).logits - logits).abs().max().item()
    assert moved > 100 * 1e-4, moved


REWARD = '''
def score(response: str, answer: str) -> float:
    """A reward spread over [0, 1] by the response's characters, so that mean@k depends on every
    response (a random model's answers are never right: exact match would read 0 whatever happened)."""
    text = response.split("<|im_end|>")[0].split("<|endoftext|>")[0]
    return (sum(map(ord, text)) % 5) / 4
'''
K, N, NEW_TOKENS = 2, 16, 4
EVAL = ["data.reward=export_eval_reward:score", "eval.temperature=0", f"eval.k={K}", f"eval.num_prompts={N}",
        f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.max_total_tokens=4096",
        "data.correct_threshold=0.25"]  # the reward is 0, 0.25, ..., 1: every positive one counts as correct


def greedy_reference(hf: Path, cfg, reward_dir: Path) -> dict[str, float]:
    """mean@k / pass@k of transformers' greedy continuations of the config's eval prompts (k equal
    samples each), under the same reward."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.prompts import load_examples, tokenize

    spec = importlib.util.spec_from_file_location("reward_ref", reward_dir / "export_eval_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    scores = []
    for p in tokenize(load_examples(cfg.data, "eval", N), tokenizer):
        ids = torch.tensor([p.ids])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        scores.append(reward.score(text, p.answer))
    scores = torch.tensor(scores, dtype=torch.float64)
    assert 0 < float(scores.mean()) < 1 and len(set(scores.tolist())) > 1, scores  # the check can fail
    return {f"eval/mean@{K}": float(scores.mean()), f"eval/pass@{K}": float((scores >= 0.25).double().mean())}


@pytest.fixture(scope="module")
def evaluated_run(runs, tmp_path_factory):
    """`megatron-rl eval RUN_DIR` of the trained dense run: export, then a local server of its own."""
    root, _ = runs
    run, tmp = root / "dense_tp2_trained", tmp_path_factory.mktemp("eval")
    # A user's reward by import path: a module on the eval's PYTHONPATH.
    (tmp / "export_eval_reward.py").write_text(REWARD)
    start = time.monotonic()
    proc = cli("eval", str(run), *EVAL, "--out", str(tmp / "eval.json"), path=str(tmp))
    print(f"eval RUN_DIR (export + server start + {N}x{K} samples): {time.monotonic() - start:.0f}s")
    return run, tmp, proc.stdout, json.loads((tmp / "eval.json").read_text())


def test_eval_of_a_run_matches_transformers_greedy(evaluated_run):
    from megatron_rl.tools.export import load_run_config

    run, tmp, stdout, report = evaluated_run
    hf = run / "export" / "step_00000002"
    assert report["model"] == str(hf) and report["step"] == 2 and report["num_prompts"] == N
    assert f"eval/mean@{K}" in stdout
    want = greedy_reference(hf, load_run_config(run, EVAL), tmp)
    assert report["metrics"] == pytest.approx(want, abs=1e-6)


def test_eval_on_running_servers_loads_the_model(evaluated_run, tmp_path, shared_server):
    """`rollout.server_urls`: a server serving the initial weights (the session's shared server of
    this architecture, tests/e2e/conftest.py) is told to load the export (a HF folder, with a recipe
    as its config)."""
    from megatron_rl.config.load import load_config, to_object

    run, tmp, _, _ = evaluated_run
    hf = run / "export" / "step_00000002"
    manager = shared_server(run / "tiny_model")  # float32, deterministic inference
    overrides = [*EVAL, f"rollout.server_urls=[{manager.urls()[0]}]"]
    cli("eval", str(hf), "--recipe", "tiny_cpu", *overrides, "--out", str(tmp_path / "eval.json"), path=str(tmp))
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["model"] == str(hf) and report["step"] == 0
    assert report["metrics"] == pytest.approx(greedy_reference(hf, to_object(load_config("tiny_cpu", overrides)), tmp),
                                              abs=1e-6)
