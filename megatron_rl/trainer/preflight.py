"""Every check a run passes before anything starts, in one place: `megatron-rl dry-run` and `train`
call the same `preflight`, so the trainer's constructor only builds.

In the order a user meets the failures:
- the driver, the Python and its GPU (`check_driver`: a driver older than torch's CUDA needs;
  `check_gpu_python`: a GPU recipe on a Python without CUDA);
- the layout (`check_layout`: heads, KV heads, MLP vs TP, layers vs PP/VPP, experts vs EP);
- the configuration (`validate`: algorithm arguments, registries, rollout and evaluation settings,
  the placement of the servers), which needs no process group;
- the batch against the data-parallel ranks (`check_batch_split`: a prompt group per producer, a
  sequence per rank in each mini-batch);
- the learner's GPU memory, for a GPU run (`check_learner_memory`, models/memory.py: one rank's
  estimated peak from the model's shape and the layout, refused above learner.memory_limit of the
  device's memory, naming what would fit);
- the data files (`check_data_files`);
- the run folder (`check_resume`: it holds this run or none; `nothing_to_do`: a finished run) and,
  for `train_only`, the saved rollouts of every step it will train (`check_saved_rollouts`);
- storage (`storage_check`: the checkpoints fit the quota and the disk).
`train` also gets the CUDA caching allocator's expandable segments here (`cuda_allocator_defaults`),
before its first CUDA allocation.
Each check lives with its owner (models/layout.py, rollout/placement.py, run/...); this module only
calls them, so a new setting's check is written beside the code that reads it and added here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os
from typing import Optional

from megatron_rl.algorithms.registry import get
from megatron_rl.config.schema import JobConfig
from megatron_rl.run.run_dir import Resume
from megatron_rl.vocab_parallel import TOPK_DIVERGENCES


def _check_kwargs(field: str, given, kind: str, name: str, tensors: tuple[str, ...],
                  extra: tuple[str, ...] = ()) -> None:
    """`algorithm.<field>` may set only keyword-only arguments of the registered `kind` function
    `name` (the `tensors` among them come from the trainer) and `extra`."""
    params = inspect.signature(get(kind.replace(" ", "_"), name)).parameters
    valid = sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY and k not in tensors)
    valid += list(extra)
    for k in given:
        if k not in valid:
            raise ValueError(f"algorithm.{field}.{k} is not an argument of {kind} {name!r}; "
                             f"valid: {', '.join(valid) or '(none)'}")


def validate(cfg: JobConfig) -> None:
    """Config checks that need no process group (also run by `dry-run`)."""
    a, r = cfg.algorithm, cfg.rollout
    _check_kwargs("loss_kwargs", a.loss_kwargs, "policy loss", a.policy_loss,
                  tensors=("divergence", "old_logp", "response_mask", "scan_mask"),
                  extra=("entropy_eps",) if a.policy_loss == "aspo" else ())
    _check_kwargs("advantage_kwargs", a.advantage_kwargs, "advantage", a.advantage,
                  tensors=("group_ids_B", "values_BT"))
    from megatron_rl.vocab_parallel import DIVERGENCES

    if a.divergence is not None and a.divergence not in DIVERGENCES:
        raise ValueError(f"algorithm.divergence={a.divergence!r}; valid: {', '.join(DIVERGENCES)} (or null)")
    for key, kind, name in (("agg_mode", "aggregation", a.agg_mode), ("correction", "correction", a.correction)):
        if name:
            try:
                get(kind, name)
            except ValueError as e:
                raise ValueError(f"algorithm.{key}: {e}") from None
    if a.router_replay not in ("none", "r2", "r3"):
        raise ValueError(f"algorithm.router_replay={a.router_replay!r}; valid: none, r2, r3")
    if cfg.learner.pack_sequences and a.router_replay == "r2":
        raise ValueError("learner.pack_sequences=true with algorithm.router_replay=r2: recording the learner's "
                         "own routes from packed micro-batches is not built; use r3 (the engine's routes, "
                         "replayed packed) or learner.pack_sequences=false")
    if a.divergence in TOPK_DIVERGENCES and r.top_k_logprobs <= 0:
        raise ValueError(f"algorithm.divergence={a.divergence} needs rollout.top_k_logprobs > 0 (e.g. 20)")
    if a.correction and not a.recompute_old_logp:
        raise ValueError(f"algorithm.correction={a.correction} needs algorithm.recompute_old_logp=true")
    get("kl", a.kl_estimator)
    if a.kl_in_reward and not a.kl_coef:
        raise ValueError("algorithm.kl_in_reward=true needs algorithm.kl_coef > 0")
    if a.advantage == "gae":
        get("value_loss", cfg.critic.value_loss)
    rm = cfg.reward_model
    if cfg.data.reward == "none" and not rm.enabled:
        raise ValueError("data.reward=none (no rule reward) needs reward_model.enabled=true")
    if rm.enabled:
        from megatron_rl.rewards.model_rewards import NORMALIZE

        if rm.backend not in ("megatron", "sglang"):
            raise ValueError(f"reward_model.backend={rm.backend!r}; valid: megatron, sglang")
        if rm.normalize not in NORMALIZE:
            raise ValueError(f"reward_model.normalize={rm.normalize!r}; valid: {', '.join(NORMALIZE)}")
        if r.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling filters groups by their rule rewards before the "
                             "reward model scores them; it cannot be combined with reward_model.enabled")
    if a.overlong_buffer and not 0 < a.overlong_buffer <= r.max_new_tokens:
        raise ValueError(f"algorithm.overlong_buffer={a.overlong_buffer} must lie in 1..rollout.max_new_tokens "
                         f"({r.max_new_tokens}): the punishment ramps over the last overlong_buffer tokens")
    for name in ("rollout_wait_timeout", "rollout_wait_log_every"):
        if getattr(cfg.trainer, name) <= 0:
            raise ValueError(f"trainer.{name}={getattr(cfg.trainer, name)} must be > 0 (seconds)")
    if cfg.data.reward_workers < 1 or cfg.data.reward_timeout <= 0:
        raise ValueError(f"data.reward_workers={cfg.data.reward_workers} must be >= 1 and data.reward_timeout="
                         f"{cfg.data.reward_timeout} > 0 (rewards are scored in worker processes, each call "
                         "killed past the timeout)")
    from megatron_rl.rewards import get_reward, reward_kind
    from megatron_rl.rewards.pool import ON_ERROR

    if not math.isfinite(cfg.data.correct_threshold):
        raise ValueError(f"data.correct_threshold={cfg.data.correct_threshold}: a finite reward (a sample scoring at "
                         "least this is correct, where the reward function gives no verdict of its own)")
    if cfg.data.reward_on_error not in ON_ERROR:
        raise ValueError(f"data.reward_on_error={cfg.data.reward_on_error!r}; valid: {', '.join(ON_ERROR)}")
    # The reward resolves here, in the parent, with plugins' error (a missing module or function),
    # before any reward worker starts.
    reward_kind(get_reward(cfg.data.reward), cfg.data.reward)
    if r.max_inflight_per_server < 0 or (r.request_timeout is not None and r.request_timeout <= 0):
        raise ValueError(f"rollout.max_inflight_per_server={r.max_inflight_per_server} must be >= 0 (0: derived) and "
                         f"rollout.request_timeout={r.request_timeout} null (no total timeout) or > 0")
    if r.stall_timeout is not None and not r.stall_timeout > 0:
        raise ValueError(f"rollout.stall_timeout={r.stall_timeout}: seconds > 0, or null for no watchdog "
                         "(then rollout.request_timeout, or one derived from max_new_tokens, bounds each request)")
    if cfg.learner.max_tokens_per_micro_batch < 0:
        raise ValueError(f"learner.max_tokens_per_micro_batch={cfg.learner.max_tokens_per_micro_batch}; "
                         "valid: 0 (micro_batch_size sequences per micro-batch) or a positive token budget")
    if r.prompts_per_step % a.mini_batches:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by "
                         f"algorithm.mini_batches={a.mini_batches} (mini-batches hold whole groups)")
    from megatron_rl.models.bridge import SPECS

    if cfg.model.spec not in SPECS:
        raise ValueError(f"model.spec={cfg.model.spec!r}; valid: {', '.join(SPECS)}")
    if r.generate:  # a missing module or function, or one that is not async, fails here (dry-run too)
        from megatron_rl.rollout.episode import load_episode_fn

        load_episode_fn(r.generate)
        if a.overlong_buffer:
            raise ValueError("algorithm.overlong_buffer ramps a penalty up to rollout.max_new_tokens, the length "
                             "of one sampled response; an episode of rollout.generate has several turns and "
                             "environment tokens, which that bound does not describe")
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.trainer, flag) and importlib.util.find_spec(package) is None:
            raise ValueError(f"trainer.{flag}=true needs the {package} package, which is not installed: "
                             f"pip install -e '.[loggers]' (tensorboard and wandb), or pip install {package}")
    from megatron_rl.vocab_parallel import KERNELS
    from megatron_rl.weights.fp8 import QUANTIZATIONS

    if cfg.learner.pack_sequences and cfg.model.spec in ("local", "te"):
        raise ValueError(f"learner.pack_sequences=true needs model.spec=torch (its attention runs packed "
                         f"sequences: torch's varlen flash attention on CUDA); model.spec={cfg.model.spec}")
    if cfg.learner.loss_kernel not in ("auto", *KERNELS):
        raise ValueError(f"learner.loss_kernel={cfg.learner.loss_kernel!r}; valid: auto, {', '.join(KERNELS)}")
    if cfg.learner.loss_kernel == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("learner.loss_kernel=triton needs the triton package, which is not importable here "
                         "(it comes with CUDA builds of torch); learner.loss_kernel=torch runs everywhere")

    if r.quantization not in QUANTIZATIONS:
        raise ValueError(f"rollout.quantization={r.quantization!r}; valid: {', '.join(QUANTIZATIONS)}")
    if cfg.trainer.max_staleness < 0:
        raise ValueError(f"trainer.max_staleness={cfg.trainer.max_staleness} must be >= 0 (0: synchronous)")
    if r.partial_rollouts and (cfg.trainer.max_staleness < 1 or cfg.trainer.mode != "train"):
        raise ValueError("rollout.partial_rollouts=true cuts generation in flight at a weight push; it needs "
                         "trainer.max_staleness >= 1 and trainer.mode=train (synchronously nothing is in flight "
                         "at a push)")
    e, t = cfg.eval, cfg.trainer
    if e.timeout is not None and not 0 < e.timeout < t.rollout_wait_timeout:
        raise ValueError(f"eval.timeout={e.timeout}: seconds, more than 0 and less than trainer.rollout_wait_timeout="
                         f"{t.rollout_wait_timeout:g} (the other ranks wait that long for the evaluation)")
    # The launcher passes a disaggregated layout's servers (rollout.server_urls) at launch.
    servers = len(r.server_urls) if r.server_urls else None if r.placement == "disaggregated" else r.num_servers
    if e.servers and servers is not None:
        from megatron_rl.rollout.evaluation import beside_share

        held = beside_share(e.servers, servers, e.share) == 0  # whole servers, not a share of each
    else:
        held = e.servers > 0
    if e.servers < 0 or (held and servers is not None and e.servers >= servers):
        raise ValueError(f"eval.servers={e.servers}: servers an evaluation holds beside training, fewer than the "
                         f"{servers} rollout servers (at least one must serve training), or 0 to evaluate on all "
                         "of them between steps (or eval.share > 0: a share of every server)")
    if cfg.trainer.mode not in ("train", "rollout_only", "train_only"):
        raise ValueError(f"trainer.mode={cfg.trainer.mode!r}; valid: train, rollout_only, train_only")
    if cfg.trainer.mode != "train_only":  # train_only contacts no server
        from megatron_rl.rollout.placement import check_placement

        check_placement(cfg)


def check_batch_split(cfg: JobConfig, dp: int) -> None:
    """Every data-parallel rank produces groups and trains a share of every mini-batch: at least
    one prompt group per rank each step, and at least one sequence per rank in each mini-batch."""
    r, a = cfg.rollout, cfg.algorithm
    if r.prompts_per_step < dp:
        raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} is fewer than the {dp} data-parallel "
                         f"ranks: each rank's producer generates whole prompt groups; use at least {dp} prompts "
                         "per step, or fewer ranks")
    per_mini = r.prompts_per_step // a.mini_batches * r.n_samples
    if per_mini < dp:
        raise ValueError(f"a mini-batch holds {per_mini} sequences (rollout.prompts_per_step={r.prompts_per_step} / "
                         f"algorithm.mini_batches={a.mini_batches} x rollout.n_samples={r.n_samples}), fewer than "
                         f"the {dp} data-parallel ranks that each train a share of it")


def check_saved_rollouts(cfg: JobConfig, first_step: int) -> None:
    """trainer.mode=train_only: the saved rollouts of every step it will train are there (a missing
    step would fail mid-run, after hours, where no checkpoint may hold what was trained)."""
    from pathlib import Path

    t = cfg.trainer
    folder = Path(t.rollouts_dir or Path(t.out_dir) / "rollouts")
    if not folder.is_dir():
        raise ValueError(f"trainer.mode=train_only reads the rollouts a rollout_only run saved, and "
                         f"trainer.rollouts_dir={folder} is no folder (write them with trainer.mode=rollout_only)")
    have = {int(f.name[len("step_"):len("step_") + 8]) for f in folder.glob("step_*.dp*.pt")}
    missing = [s for s in range(first_step, t.steps) if s not in have]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (f", ... ({len(missing)} steps)" if len(missing) > 8 else "")
        raise ValueError(f"trainer.mode=train_only trains steps {first_step}..{t.steps - 1} from {folder}, which holds "
                         f"no saved rollouts for step {shown} (it has {len(have)} steps"
                         + (f": {min(have)}..{max(have)}" if have else "") + "); set trainer.steps, or save them "
                         "with trainer.mode=rollout_only")


@dataclasses.dataclass
class Ready:
    """What the checks found: where the run resumes, whether it has nothing to do (what to say
    then), and the storage line (what its checkpoints take, what is free)."""
    resume: Resume
    idle: Optional[str]
    storage: Optional[str]
    memory: Optional[str] = None  # the learner's per-GPU memory line (GPU runs)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def cuda_allocator_defaults(environ=os.environ, cuda: Optional[bool] = None) -> None:
    """On CUDA, `expandable_segments:True` unless the user set PYTORCH_CUDA_ALLOC_CONF: token-budgeted
    micro-batches change shape every step, and a fragmented cache can turn free memory into an
    out-of-memory error hours in. The allocator reads the variable at its first allocation, so this
    runs first in `train` (the sbatch sets the same for its learner steps)."""
    import torch

    if ALLOC_CONF not in environ and (torch.cuda.is_available() if cuda is None else cuda):
        environ[ALLOC_CONF] = "expandable_segments:True"


def as_run(cfg: JobConfig) -> JobConfig:
    """The configuration the run folder records: `cfg`, or, for a run that builds its supervised base
    model first (`model.base.sft_steps > 0` and no `model.hf_path`), `cfg` with the path `train` will
    find that base at (built later, outside the checks)."""
    if cfg.model.hf_path is not None or cfg.model.base.sft_steps <= 0:
        return cfg
    import copy

    from megatron_rl.models.base import base_dir

    run = copy.deepcopy(cfg)
    run.model.hf_path = str(base_dir(cfg) / "hf")
    return run


class _Problems:
    """The checks' failures, collected so that a dry-run names every problem at once; a check that
    needs an earlier one's result runs only when that one passed."""

    def __init__(self):
        self.errors: list[Exception] = []

    def check(self, fn, *args):
        """(passed, fn's result)."""
        try:
            return True, fn(*args)
        except (ValueError, FileNotFoundError) as e:
            self.errors.append(e)
            return False, None

    def raise_any(self) -> None:
        """One problem: as it was raised (its type kept: ConfigError, ResumeMismatch, ...); several:
        one ValueError listing them."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            items = ["  {}. {}".format(i, str(e).replace("\n", "\n     ")) for i, e in enumerate(self.errors, 1)]
            raise ValueError(f"{len(self.errors)} problems, found before anything started:\n" + "\n".join(items))


def preflight(cfg: JobConfig, *, command: str = "train", world_size: Optional[int] = None) -> Ready:
    """Every check of a run before any process group, model or server exists (the module's
    docstring lists them); `cfg`'s hub ids become local folders on the way. `command="train-lm"`:
    no RL run folder, so no resume or storage checks. `world_size`: the launch's (default: the
    launcher's variables, else parallel.world_size, else the smallest the layout fits). Raises
    ValueError (ConfigError, ResumeMismatch) naming what to change: every problem found, at once."""
    from megatron_rl.data.prompts import check_data_files
    from megatron_rl.distributed.context import check_driver, check_gpu_python, launch_world, layout_sizes
    from megatron_rl.models.hub import resolve_model_paths
    from megatron_rl.models.layout import check_layout

    if command == "train":
        cuda_allocator_defaults()
    p = _Problems()
    # A GPU recipe on a node whose driver is older than torch's CUDA (both versions named), else, in a
    # Slurm job, on a Python without CUDA
    driver_ok, _ = p.check(check_driver, cfg)
    if driver_ok:
        p.check(check_gpu_python, cfg)
    # hub ids -> the hub cache's snapshot folders (HF_HUB_OFFLINE=1: the cache only)
    model_found, _ = p.check(resolve_model_paths, cfg)
    layout_ok = False
    if model_found:  # what Megatron-Core would refuse after the start, said now
        layout_ok, _ = p.check(check_layout, cfg.model, cfg.parallel)
    p.check(validate, cfg)
    p.check(check_data_files, cfg.data)
    if command != "train":
        p.raise_any()
        return Ready(Resume(None), None, None)
    world = world_size or launch_world(cfg)
    split_ok, _ = p.check(lambda: check_batch_split(cfg, layout_sizes(cfg.parallel, world)["dp"]))
    memory = None
    if layout_ok and split_ok and _gpu_run(cfg):  # the layout's memory on the recipe's GPUs (on a laptop too)
        import torch

        from megatron_rl.models.memory import check_learner_memory

        _, memory = p.check(check_learner_memory, cfg, world, torch.cuda.device_count() or 8)
    from megatron_rl.run.checkpoint import storage_check
    from megatron_rl.run.run_dir import check_resume, nothing_to_do

    run = as_run(cfg)
    resumable, resume = p.check(check_resume, run)  # a resume of another experiment, not after the queue
    idle = nothing_to_do(run, resume) if resumable else None
    if resumable and cfg.trainer.mode == "train_only" and idle is None:
        p.check(check_saved_rollouts, run, resume.step)
    storage = None
    if model_found:  # a full quota found by the first save, hours in, is found now
        _, found = p.check(storage_check, run)
        if found is not None:
            storage, problems = found
            if problems:
                p.errors.append(ValueError("the run's checkpoints do not fit:\n  " + "\n  ".join(problems)))
    p.raise_any()
    return Ready(resume, idle, storage, memory)


def _gpu_run(cfg: JobConfig) -> bool:
    """A run whose learner is on GPUs: a GPU recipe (`hardware` not "cpu..."), or CUDA here."""
    import torch

    return not cfg.hardware.lower().startswith("cpu") or torch.cuda.is_available()
