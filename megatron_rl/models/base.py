"""The supervised base stage: a pretrained-like starting point for RL, built once and cached.

The DPPO paper's regime needs a policy that already solves the task sometimes, with a long tail of
low-probability tokens, not a random one. On machines without a model hub the base is made here:
the config's `model.tiny` architecture is trained (`train-lm`, Megatron-Core, one process) on the
solutions of `data.synthetic`'s problems in the chat format the rollouts use, until its greedy
held-out accuracy first reaches `model.base.target_accuracy` (checked every `eval_every` steps, at
most `sft_steps`), then exported (`megatron-rl export`) as a HF checkpoint.

The result lives in `<cache_dir>/<key>/hf`, where the key hashes everything that determines the
weights (the architecture, the task, the stage's settings and `BASE_VERSION`), so every RL run,
seed and algorithm of a comparison starts from the same base, and a changed config builds a new
one. `base.json` next to it records the spec, the steps taken and the held-out accuracy. Concurrent
callers (the ranks of a run, parallel runs) serialise on a file lock: one builds, the others reuse.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.config.schema import JobConfig

BASE_VERSION = 1  # bump when the stage's recipe changes what the same spec builds

# Variables of the caller's launch that would make the stage's own process join the caller's job.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "TORCHELASTIC_RUN_ID")


def base_spec(cfg: JobConfig) -> dict:
    """Everything that determines the base's weights (the cache key's content)."""
    from megatron_rl.data.synthetic import task_kwargs

    task = task_kwargs(cfg.data.synthetic)  # not num_train / seed: the RL prompt stream's; the stage draws its own
    stage = dataclasses.asdict(cfg.model.base)
    stage.pop("cache_dir")
    return {"version": BASE_VERSION, "tiny": dataclasses.asdict(cfg.model.tiny), "task": task, "stage": stage}


def base_dir(cfg: JobConfig) -> Path:
    key = hashlib.sha256(json.dumps(base_spec(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.model.base.cache_dir) / key


def _overrides(spec: dict, out_dir: Path) -> list[str]:
    def val(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    st = spec["stage"]
    return (["name=base_model", f"train.out_dir={out_dir}", "train.chat=true", "trainer.progress=false",
             f"train.steps={st['sft_steps']}", f"train.global_batch_size={st['batch_size']}",
             f"learner.micro_batch_size={st['batch_size']}", f"train.seed={st['seed']}",
             f"train.log_every={st['eval_every']}", f"train.target_accuracy={st['target_accuracy']}",
             f"optim.lr={st['lr']}", f"optim.lr_warmup_steps={st['warmup_steps']}", "optim.clip_grad=1.0"]
            + [f"model.tiny.{k}={val(v)}" for k, v in spec["tiny"].items()]
            + [f"data.synthetic.{k}={val(v)}" for k, v in spec["task"].items()])


def ensure_base_model(cfg: JobConfig, log=print) -> Path:
    """The base's HF folder, built first if the cache does not hold it (see the module docstring)."""
    if cfg.model.base.sft_steps <= 0:
        raise ValueError("model.base.sft_steps must be > 0 for a base stage")
    if cfg.data.source != "synthetic":
        raise ValueError(f"model.base trains on data.synthetic's problems; data.source is {cfg.data.source!r}")
    root = base_dir(cfg)
    done = root / "base.json"
    if done.is_file():
        return root / "hf"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait here, then find it built
        if done.is_file():
            return root / "hf"
        spec = base_spec(cfg)
        if root.exists():  # a build that died half-way
            import shutil

            shutil.rmtree(root)
        root.mkdir()
        (root / "spec.json").write_text(json.dumps(spec, indent=1, sort_keys=True))
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        start = time.perf_counter()
        log(f"[megatron-rl] building the base model {root} (supervised, up to {spec['stage']['sft_steps']} "
            f"steps, target greedy accuracy {spec['stage']['target_accuracy']})")
        cli = [sys.executable, "-m", "megatron_rl.cli"]
        for cmd, name in ((cli + ["train-lm", "tiny_lm_cpu", *_overrides(spec, root / "sft")], "sft"),
                          (cli + ["export", str(root / "sft"), str(root / "hf")], "export")):
            with open(root / f"{name}.log", "w") as out:
                if subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
                    raise RuntimeError(f"the base model's {name} stage failed; see {root / f'{name}.log'}")
        history = [json.loads(line) for line in (root / "sft" / "metrics.jsonl").read_text().splitlines()]
        evals = [h for h in history if "eval_accuracy" in h]
        record = {"spec": spec, "steps": history[-1]["step"], "final_loss": history[-1]["loss"],
                  "greedy_eval_accuracy": evals[-1]["eval_accuracy"],
                  "eval_curve": [(h["step"], h["eval_accuracy"]) for h in evals],
                  "build_s": round(time.perf_counter() - start, 1)}
        done.write_text(json.dumps(record, indent=1))
        log(f"[megatron-rl] base model built in {record['build_s']:.0f} s: {record['steps']} steps, greedy "
            f"held-out accuracy {record['greedy_eval_accuracy']:.2f}")
    return root / "hf"
