"""One run per folder: what a resume may change, and what makes it another run.

`train` resumes from the newest checkpoint in `trainer.out_dir`. Every checkpoint carries the
configuration that wrote it (`<checkpoint>/config.yaml`), and before anything is built or started
`check_resume` compares it with this launch's configuration:

- keys that say only how the run is operated (`OPERATIONAL`: its length, checkpoint cadence,
  logging, the servers' addresses and sizes, timeouts, evaluation) may change: that is the same run,
  continued;
- any other difference (algorithm, model, data, optimizer, layout, mode, seeds, ...) is another
  experiment. The error names every difference and the ways on: another `trainer.out_dir`,
  `trainer.resume=false` (start over in this folder: its checkpoints are removed when
  the new run starts), `trainer.allow_config_change=true` (continue
  this run's weights and optimizer under the new values);
- a run already at `trainer.steps` has nothing to do: one line says so, and nothing is started.

`config.yaml` in the run folder is the configuration the newest checkpoint continues. It is
written when a run starts, rewritten when a resume changes only operational keys, and a resume
allowed to change others first keeps the one before as `config.before_step_<N>.yaml`. `export` and
`eval` read it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

from megatron_rl.config.load import ConfigError
from megatron_rl.run.checkpoint import PREFIX, latest_checkpoint

CONFIG = "config.yaml"

# Dotted keys (or key prefixes ending in ".") a resume may change. Everything else defines the
# experiment; a new config key is therefore part of it until it is listed here.
OPERATIONAL = (
    "name", "hardware", "data.correct_threshold",
    "trainer.steps", "trainer.out_dir", "trainer.resume", "trainer.allow_config_change",
    "trainer.save_every", "trainer.keep_checkpoints", "trainer.async_save", "trainer.time_limit",
    "trainer.time_limit_margin", "trainer.progress", "trainer.plot",
    "trainer.tensorboard", "trainer.wandb", "trainer.wandb_project", "trainer.rollout_wait_timeout",
    "trainer.rollout_wait_log_every", "trainer.collective_timeout", "trainer.token_log_every",
    "eval.",  # seeded apart from training: evaluating more or less often changes no training step
    "parallel.world_size",  # the dry-run's assumption; the launch's real layout is parallel.tp/pp/...
    "model.base.cache_dir",
    "rollout.placement", "rollout.server_urls", "rollout.num_servers", "rollout.gpu_ids",
    "rollout.max_total_tokens", "rollout.mem_fraction_static", "rollout.extra_server_args",
    "rollout.request_timeout", "rollout.stall_timeout", "rollout.max_inflight_per_server",
    "reward_model.server_urls", "reward_model.num_servers", "reward_model.max_total_tokens",
    "reward_model.mem_fraction_static",
    "data.reward_workers", "data.reward_timeout",
    "learner.memory_limit",  # a check before the start, not the run
    "learner.loss_kernel",  # the same quantities (both kernels checked against float64), another kernel
)


class ResumeMismatch(ConfigError):
    """The run folder holds a run made with another configuration."""


@dataclasses.dataclass
class Resume:
    checkpoint: Optional[Path]  # the newest checkpoint of out_dir, None: the run starts at step 0
    step: int = 0
    changed: list[str] = dataclasses.field(default_factory=list)  # "key: old -> new", experiment keys
    operational: list[str] = dataclasses.field(default_factory=list)  # the same for operational keys
    saved: Optional[dict] = None  # the checkpoint's configuration


def as_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf}; lists and empty dicts are leaves."""
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def is_operational(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in OPERATIONAL)


def schema_defaults() -> dict[str, Any]:
    """Every key's default in the schema, flattened (interpolations unresolved)."""
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import JobConfig

    return flatten(OmegaConf.to_container(OmegaConf.structured(JobConfig), resolve=False))


def differences(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(experiment differences, operational differences) as "key: old -> new" lines. A key the
    old configuration lacks (added to the schema after it was written) whose new value is the
    schema's default is no difference: a new key's default is what the code did before it."""
    a, b = flatten(old), flatten(new)
    missing = object()
    defaults = None
    changed, operational = [], []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va == vb:
            continue
        if va is missing:
            defaults = schema_defaults() if defaults is None else defaults
            if key in defaults and defaults[key] == vb:
                continue
        line = f"{key}: {'(absent)' if va is missing else va!r} -> {'(absent)' if vb is missing else vb!r}"
        (operational if is_operational(key) else changed).append(line)
    return changed, operational


def saved_config(checkpoint: Path) -> Optional[dict]:
    """The configuration that wrote `checkpoint` (its own copy; for checkpoints written before
    checkpoints carried one, the run folder's config.yaml), or None."""
    from omegaconf import OmegaConf

    for path in (checkpoint / CONFIG, checkpoint.parent.parent / CONFIG):
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return None


def check_resume(cfg) -> Resume:
    """Before a `train` builds anything: where this launch starts, or ResumeMismatch naming every
    difference between this configuration and the one that wrote the checkpoint it would resume."""
    t = cfg.trainer
    out_dir = Path(t.out_dir)
    if not t.resume:
        return Resume(None)
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        return Resume(None)
    step = int(ckpt.name[len(PREFIX):])
    saved = saved_config(ckpt)
    if saved is None:
        raise ResumeMismatch(f"{ckpt} has no {CONFIG} (nor has {out_dir}): the configuration that wrote it is "
                             f"unknown. Give this run its own folder (trainer.out_dir=...), or start over in this "
                             f"one with trainer.resume=false")
    changed, operational = differences(saved, as_dict(cfg))
    if changed and not t.allow_config_change:
        modes = (saved.get("trainer", {}).get("mode"), t.mode)
        hint = ""
        if modes[0] == "rollout_only" and modes[1] != "rollout_only":
            hint = (f"\n  {out_dir} holds a rollout_only run: its checkpoints hold no optimizer state. To train "
                    f"on its rollouts, give the training run a folder of its own: trainer.out_dir=<new folder> "
                    f"trainer.rollouts_dir={Path(t.rollouts_dir or out_dir / 'rollouts')}")
        raise ResumeMismatch(
            f"{out_dir} holds a run at step {step} ({ckpt.name}) made with another configuration; resuming it "
            f"would continue that run, not start this one. Differences (checkpoint -> now):\n  "
            + "\n  ".join(changed) + hint
            + "\nEither give this run its own folder (trainer.out_dir=...), start over in this one "
            "(trainer.resume=false: its checkpoints are removed), or continue the saved run under the new "
            "values (trainer.allow_config_change=true).")
    return Resume(ckpt, step, changed, operational, saved)


def nothing_to_do(cfg, resume: Resume) -> Optional[str]:
    """The line to print when the resumed run is already at trainer.steps (else None)."""
    if resume.checkpoint is None or resume.step < cfg.trainer.steps:
        return None
    return (f"[megatron-rl] nothing to do: {cfg.trainer.out_dir} is at step {resume.step} and trainer.steps="
            f"{cfg.trainer.steps}. Raise trainer.steps to continue it, or give a new run its own "
            f"trainer.out_dir (trainer.resume=false starts over in this one)")


def write_run_config(cfg, resume: Resume) -> list[str]:
    """Rank 0, at the start of a run: out_dir/config.yaml as the run-folder rules say. Returns the
    lines to log (what a resume changed)."""
    from omegaconf import OmegaConf

    out_dir = Path(cfg.trainer.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CONFIG
    notes = []
    old = latest_checkpoint(out_dir) if resume.checkpoint is None else None
    if old is not None:  # trainer.resume=false: this folder's earlier run is replaced
        import shutil

        shutil.rmtree(old.parent)
        notes.append(f"[megatron-rl] trainer.resume=false: starting over in {out_dir} (its checkpoints up to "
                     f"{old.name} were removed)")
    if resume.changed:  # allowed by trainer.allow_config_change
        kept = out_dir / f"config.before_step_{resume.step:08d}.yaml"
        if path.is_file():
            os.replace(path, kept)
        else:
            kept.write_text(OmegaConf.to_yaml(OmegaConf.create(resume.saved)))
        notes.append(f"[megatron-rl] continuing {resume.checkpoint.name} under a changed configuration "
                     f"(trainer.allow_config_change=true; the one before: {kept.name}): " + "; ".join(resume.changed))
    if resume.operational:
        notes.append("[megatron-rl] resumed with " + "; ".join(resume.operational))
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(config_text(cfg))
    os.replace(tmp, path)
    return notes


def config_text(cfg) -> str:
    """The run's configuration as config.yaml holds it (made once per run: it does not change)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_checkpoint_config(text: str, folder: Path) -> None:
    """The configuration that wrote a checkpoint (`config_text`), inside it (rank 0)."""
    (folder / CONFIG).write_text(text)
