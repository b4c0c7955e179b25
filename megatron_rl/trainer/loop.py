"""The RL loop: generate → (reward model) → (old log-probs) → (reference log-probs) → (values) →
advantages → (train critic) → train policy → sync weights → log → evaluate → checkpoint, one named
call per stage (`Trainer.fit`).

Every learner rank runs this. The loop only calls components built elsewhere:
- `BatchSource` (trainer/source.py): each step's batch. The model-parallel leader of each
  data-parallel rank produces that rank's share of whole prompt groups over the fleet, the
  producers balance every mini-batch's tokens across data-parallel ranks, and each hands its
  compact batch to its model-parallel peers: no rank holds the global batch (batch/ documents the
  layout);
- `Stages` (trainer/stages.py): the algorithm's stages on that batch, `algorithm.epochs` passes
  over `algorithm.mini_batches` mini-batches, each one optimizer step through Megatron's schedules
  with the policy loss of trainer/policy.py (divergences computed vocab-parallel on the logit
  shards). Router replay (MoE): r3 replays the engine's routes in every training forward; r2
  records the old-log-prob pass and replays it;
- `Fleet` (rollout/fleet.py): the servers; rank 0 starts local ones, pushes weights, evaluates;
- `Operations` (run/operations.py): checkpoints, time limit, stop signals; `MetricsLogger`
  (run/metrics.py).
The checks come before (trainer/preflight.py, shared with `dry-run`); the models are built by
trainer/setup.py.

The four-model PPO setup: `algorithm.kl_coef > 0` builds a frozen reference policy;
`reward_model.enabled` a frozen sequence-classification reward model whose score joins the rule
reward; `algorithm.advantage = gae` a critic (value model) whose values feed GAE and which trains on
the same mini-batches as the policy (first, so the policy's step sees the same batch). All of them
share the policy's parallel layout. With `algorithm.kl_in_reward` the KL penalty is subtracted
from the per-token rewards (estimator on the rollout log-probs) instead of added to the loss.

Modes (`trainer.mode`) swap the rollout source, not the loop: `train` (live SGLang),
`rollout_only` (live, batches saved to rollouts_dir, no training), `train_only` (batches read
back from rollouts_dir, no servers).

Generation runs on a producer thread (trainer/producer.py) that makes step t's share as soon as
the weights of step t − `trainer.max_staleness` are on the servers: with 0 that is the synchronous
loop (each step generates after the previous push, bit for bit as before the thread existed); with
k > 0 the servers generate the next steps while the learner trains, and every token's weight
version is in the batch (`versions`) for the staleness bound, the `async/*` metrics and the
trust-region diagnostics split into `fresh/` and `stale/` tokens. A push either waits for the
generation admitted before it (drain: exactly k steps off-policy) or, with
`rollout.partial_rollouts`, cuts it and lets the client continue each response under the new
weights (`sync_weights`, the one place the two differ).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from omegaconf import OmegaConf

from megatron_rl.batch import RolloutBatch
from megatron_rl.config.schema import JobConfig
from megatron_rl.data.prompts import PromptStream, TokenizedPrompts, load_examples, tokenize
from megatron_rl.distributed.context import ParallelContext, init_distributed
from megatron_rl.distributed.wait import Interrupted
from megatron_rl.models.bridge import choose_spec
from megatron_rl.run.checkpoint import load_checkpoint
from megatron_rl.run.metrics import MetricsLogger
from megatron_rl.run.operations import REQUEUE_EXIT, REQUEUE_MARKER, Operations
from megatron_rl.run.run_dir import Resume, check_resume, config_text, write_checkpoint_config, write_run_config
from megatron_rl.trainer.preflight import preflight, validate  # noqa: F401 (validate: the old import path)
from megatron_rl.trainer.setup import build_models
from megatron_rl.trainer.source import BatchSource
from megatron_rl.trainer.stages import Stages, TrainingError  # noqa: F401 (TrainingError: the old import path)


class Timer:
    def __init__(self):
        self.metrics: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.metrics[f"time/{name}"] = time.perf_counter() - t

    def total(self) -> dict[str, float]:
        return {**self.metrics, "time/step": time.perf_counter() - self.start}


class Trainer:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, resume: Optional[Resume] = None):
        """Builds the run's components; the checks come before (trainer/preflight.py, by `train`).
        `resume`: where the run folder has this run (`check_resume`); read here when not given."""
        from transformers import AutoTokenizer

        from megatron_rl.rollout.auth import share_job_key

        share_job_key()  # collective: the servers this job starts admit only its own requests (rollout/auth.py)
        self.cfg, self.ctx = cfg, ctx
        t = cfg.trainer
        self.out_dir = Path(t.out_dir)
        resume = resume or check_resume(cfg)
        notes = write_run_config(cfg, resume) if ctx.rank == 0 else []
        self._config_text = config_text(cfg)  # into every checkpoint it writes
        models = build_models(cfg, ctx, self.out_dir)
        self.learner, self.critic, self.reward_model = models.policy, models.critic, models.reward_model
        self.stages = Stages(cfg, ctx, models, self.out_dir)  # the algorithm's stages on a step's batch
        self.tokenizer = AutoTokenizer.from_pretrained(self.learner.hf_path)
        self.prompts = PromptStream(TokenizedPrompts(load_examples(cfg.data, "train"), self.tokenizer),
                                    seed=cfg.data.shuffle_seed)
        eval_examples = load_examples(cfg.data, "eval", cfg.eval.num_prompts) if cfg.eval.num_prompts else []
        self.eval_prompts = tokenize(eval_examples, self.tokenizer)
        self.step, self.weight_version = 0, "0"
        saved_queue: tuple[Optional[Path], dict] = (None, {})
        ckpt = resume.checkpoint
        if ckpt is not None:
            state = load_checkpoint(self.learner, ckpt, others=self._others())
            self.step, self.weight_version = state["step"], state["weight_version"]
            self.prompts.load_state_dict(state["prompts"])
            saved_queue = (ckpt, state.get("queue", {}))
        self.logger = MetricsLogger(self.out_dir, t, enabled=ctx.rank == 0, start_step=self.step,
                                    run_name=cfg.name, config_dict=OmegaConf.to_container(OmegaConf.structured(cfg)))
        if ckpt is not None:
            self.logger.message(f"[megatron-rl] resumed from {ckpt} at step {self.step}")
        for line in notes:
            self.logger.message(line)
        self.fleet = None  # the rollout servers (rollout/fleet.py): generate, push weights, evaluate
        if t.mode != "train_only":
            from megatron_rl.rollout.fleet import Fleet

            moe_topk = self.learner.config.moe_router_topk if self.learner.config.num_moe_experts else None
            self.fleet = Fleet(cfg, ctx, self.learner.hf_path, self.tokenizer, self.out_dir, moe_topk,
                               num_experts=self.learner.config.num_moe_experts)
        self.ops = Operations(t, ctx, self.out_dir, self.logger.message)  # checkpoints, time limit, stop signals
        self.source = BatchSource(cfg, ctx, self.fleet, self.learner, self.tokenizer, self.prompts,
                                  Path(t.rollouts_dir or self.out_dir / "rollouts"), self.ops,
                                  self.logger.message, saved_queue)  # each step's batch
        self.requeue = False  # stopped before the time limit: `train` exits REQUEUE_EXIT
        self.interrupted = False  # stopped mid-step (its generation given up)
        self.history: list[dict] = []
        self.eval_signal = None

    def _others(self) -> dict:
        """Trained models besides the policy, checkpointed with it."""
        return {"critic": self.critic} if self.critic is not None else {}

    # ------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        t, algo = self.cfg.trainer, self.stages
        if self.fleet is not None:
            # Servers may hold other weights (a resumed run; servers shared across runs): start
            # every run that samples (rollout_only too) by giving them exactly the learner's.
            self.sync_weights()
            # From here generation runs on a thread, up to trainer.max_staleness steps ahead.
            self.source.start(self.step)
        if self.step == 0 and self.eval_prompts and self.fleet is not None:
            initial = self.evaluate()
            if initial:
                self.logger.log(-1, initial)  # the initial policy, as row "step -1"
        while self.step < t.steps:
            self.ops.step_started()
            timer = Timer()
            try:
                with timer("generate"):
                    batch, metrics = self.generate()
            except Interrupted:
                self._stop_mid_step()
                break
            if t.mode == "rollout_only":
                self.source.save(self.step, batch, metrics)
            else:
                if self.reward_model is not None:
                    with timer("reward_model"):
                        metrics |= algo.score_with_reward_model(batch, self.step)
                with timer("old_logp"):
                    metrics |= algo.old_logprobs(batch)
                with timer("ref_logp"):
                    metrics |= algo.reference_logprobs(batch)
                if self.critic is not None:
                    with timer("values"):
                        batch["old_values"] = self.critic.forward_values(batch)
                with timer("advantages"):
                    metrics |= algo.compute_advantages(batch)
                if self.critic is not None:
                    with timer("train_critic"):
                        metrics |= algo.train_critic(batch, self.step)
                if self.step >= self.cfg.critic.warmup_steps or self.critic is None:
                    with timer("train"):
                        metrics |= algo.train_policy(batch, self.step)
            self.step += 1
            with timer("weight_sync"):
                metrics |= self.publish()
            beside = self.finished_eval()  # an evaluation beside training that has ended
            if self.eval_due():
                if beside and self.step >= t.steps:  # the last row is the last evaluation's
                    self.log_eval_row(beside)
                    beside = {}
                metrics |= self.evaluate()
            self.log(metrics | beside | timer.total())
            decision = self.ops.between_steps(self.step, t.steps, t.save_every)
            if decision.save:
                self.save()
            if decision.stop:
                self.cut_eval()
                self.ops.finish()  # the checkpoint is complete before the run says so
                why = f" ({self.ops.why})" if decision.requeue and self.ops.why else ""
                self.logger.message(f"[megatron-rl] {decision.stop}{why}: checkpoint at step {self.step} "
                                    f"written; stopping (resume continues from it)")
                self.requeue = decision.requeue
                break
        self.close()
        return self.history

    def _stop_mid_step(self) -> None:
        """A stop arrived while the step was generating: give its generation up and checkpoint the
        state after the last completed step (Operations.interrupt)."""
        self.interrupted = True
        self.cut_eval()
        self.source.stop(timeout=10)
        self.save()
        self.ops.finish()
        why = self.ops.stop.name() or "a stop requested on another rank"
        self.logger.message(f"[megatron-rl] {why} during step {self.step}'s generation: generation given up; "
                            f"checkpoint at step {self.step} written; stopping (resume continues from it)")

    # ------------------------------------------------------------------------------------------
    def generate(self) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's rollout batch for the step (collective) and the step's rollout metrics.

        Every model token must come from weights at most `trainer.max_staleness` steps old (its
        `versions`; with 0, exactly the weights just pushed). A server that died and was restarted
        serves its initial checkpoint (version unknown): the producer's shares from this step on
        are thrown away, the weights are pushed again and the same prompts are generated again.
        """
        while True:
            status, batch, metrics = self.source.take(self.step)
            if status == "ok":
                return batch, metrics
            if status.startswith("error:"):
                raise TrainingError(status[len("error:"):])
            self.logger.message(f"[megatron-rl] step {self.step}: records from other weights (a server "
                                "was restarted); pushing weights again and regenerating")
            self.sync_weights()
            self.source.restart(self.step)

    def sync_weights(self) -> dict[str, float]:
        """Collective: push the learner's weights (version = the step) to every server. Generation
        admitted before it either finishes first (drain: its tokens all come from the weights that
        admitted it) or, with rollout.partial_rollouts, is cut by a pause and continued under the
        new weights (each token's version recorded)."""
        self.weight_version = str(self.step)
        partial = self.cfg.rollout.partial_rollouts
        start = time.perf_counter()
        if not partial:
            self.source.drain()  # the learner waits here for the admitted generation: time/drain_wait
        waited = time.perf_counter() - start
        if partial and self.ctx.rank == 0:
            self.fleet.pause("abort")
        try:
            out = self.fleet.sync_weights(self.learner, self.weight_version)
        finally:
            if partial and self.ctx.rank == 0:
                self.fleet.resume()
        return out | {"time/drain_wait": waited}

    def publish(self) -> dict[str, float]:
        """After a training step: the servers get its weights (trainer.mode=train) and the
        producer may start every step up to `step + max_staleness`."""
        out = self.sync_weights() if self.cfg.trainer.mode == "train" else {}
        self.source.published(self.step)
        return out

    def eval_due(self) -> bool:
        e = self.cfg.eval
        return bool(self.eval_prompts) and self.fleet is not None and (
            self.step == self.cfg.trainer.steps or (e.every and self.step % e.every == 0))

    def evaluate(self) -> dict[str, float]:
        """The evaluation of the weights just pushed (version `self.step`). With eval.servers > 0
        (not at the last step) rank 0 starts it beside training and returns {} (its metrics join
        the row of the step it ends in: `finished_eval`); the other ranks go on at once. Otherwise,
        and at the last step (after any evaluation still running), rank 0 evaluates on every
        server while the other ranks wait on the store (not in a collective), then get the
        metrics."""
        if self.cfg.eval.servers and self.step < self.cfg.trainer.steps:
            if self.ctx.rank == 0:
                why = self.fleet.start_eval(self.eval_prompts, self.step)
                if why:
                    self.logger.message(f"[megatron-rl] eval at step {self.step} skipped: {why}")
            return {}
        pending = self.finished_eval(wait=True)
        if pending:
            self.log_eval_row(pending)
        out = [None]
        multi = dist.is_initialized() and dist.get_world_size() > 1
        if multi and self.eval_signal is None:
            from megatron_rl.distributed.wait import LeaderSignal

            t = self.cfg.trainer
            self.eval_signal = LeaderSignal("eval", timeout_s=t.rollout_wait_timeout,
                                            log_every_s=t.rollout_wait_log_every,
                                            timeout_name="trainer.rollout_wait_timeout")
        key = f"step{self.step}"
        if self.ctx.rank == 0:
            with self.eval_signal.leading(key) if multi else nullcontext():
                out = [self.fleet.evaluate(self.eval_prompts, self.step)]
        elif multi:
            self.eval_signal.wait(key)
        if multi:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def finished_eval(self, wait: bool = False) -> dict[str, float]:
        """Rank 0: the metrics of an evaluation beside training that has ended (waiting for it
        with `wait`), with eval/step, the version of the weights it evaluated; {} otherwise. A
        failed one is reported and the run goes on."""
        if self.fleet is None or self.ctx.rank != 0 or not self.cfg.eval.servers:
            return {}
        done = self.fleet.eval_result(wait=wait)
        if done is None:
            return {}
        step, metrics, error = done
        if error is not None:
            self.logger.message(f"[megatron-rl] eval of step {step}'s weights failed beside training "
                                f"({type(error).__name__}: {error}); training goes on")
            return {"eval/failed": 1.0, "eval/step": float(step)}
        return metrics | {"eval/step": float(step)}

    def log_eval_row(self, metrics: dict[str, float]) -> None:
        """Rank 0: an evaluation beside training that ended at the last step, in a row of its own
        before the last training row (which holds the last step's evaluation)."""
        self.history.append({"step": self.step - 1, **metrics})
        self.logger.log(self.step - 1, metrics)

    def cut_eval(self) -> None:
        """Rank 0, the run stopping: an evaluation still running beside training is aborted."""
        if self.fleet is not None and self.ctx.rank == 0 and self.cfg.eval.servers:
            if self.fleet.eval_running():
                self.logger.message("[megatron-rl] the evaluation running beside training is cut by the stop")
                self.fleet.abort_eval()
                self.fleet.eval_result(wait=True)

    def log(self, metrics: dict[str, float]) -> None:
        metrics["weight_version"] = float(self.weight_version)
        self.history.append({"step": self.step - 1, **metrics})
        self.logger.log(self.step - 1, metrics)

    def save(self) -> Optional[Path]:
        """Collective. With the producer ahead of the learner, its complete shares of the next
        steps are saved too (`queue/t<step>.dp<rank>.pt`, the same steps on every producer), so a
        resumed run trains on exactly them and generates from the step after."""
        shares, last = self.source.queued(self.step)
        state = {"step": self.step, "weight_version": self.weight_version,
                 "prompts": self.prompts.state_dict(),
                 "queue": {"targets": list(range(self.step, last + 1)), "dp": self.ctx.dp}}

        def write_extra(folder: Path) -> None:
            self.source.write_queue(folder, shares)
            if self.ctx.rank == 0:
                write_checkpoint_config(self._config_text, folder)

        return self.ops.checkpointer.save(self.learner, self.step, state, others=self._others(), extra=write_extra)

    def close(self) -> None:
        self.source.stop(timeout=0 if self.interrupted else 120)  # (interrupted: waited for in _stop_mid_step)
        if self.fleet is not None:
            self.fleet.close()
        if hasattr(self.reward_model, "close"):
            self.reward_model.close()
        self.logger.close()
        if self.ctx.rank == 0 and self.cfg.trainer.plot and self.history:
            from megatron_rl.run.curves import plot_run

            plot_run(self.out_dir)
        self.ops.finish()


def train(cfg: JobConfig) -> list[dict]:
    """Entry point for every learner rank (torchrun / srun / one process)."""
    # Before anything starts (trainer/preflight.py, the same checks as `dry-run`): the run folder
    # holds this run or none (else ResumeMismatch, naming the differences), and a finished run has
    # nothing to do (no model built, no server started).
    ready = preflight(cfg)
    if ready.idle is not None:
        if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
            print(ready.idle, flush=True)
        return []
    if cfg.model.hf_path is None and cfg.model.base.sft_steps > 0:
        from megatron_rl.models.base import ensure_base_model

        cfg.model.hf_path = str(ensure_base_model(cfg))  # built once, then cached (file-locked)
    ctx = init_distributed(cfg.parallel, timeout_s=cfg.trainer.collective_timeout)
    if ctx.rank == 0:
        print(f"[megatron-rl] {cfg.name}: {ctx.describe()}\n[megatron-rl] {choose_spec(cfg.model.spec).line()}",
              flush=True)
    trainer = Trainer(cfg, ctx, ready.resume)
    history = trainer.fit()
    if trainer.requeue:  # checkpointed before the time limit: the sbatch requeues
        if ctx.rank == 0:
            (Path(cfg.trainer.out_dir) / REQUEUE_MARKER).write_text(f"stopped at step {trainer.step}: {trainer.ops.why}\n")
        if dist.is_initialized():
            dist.barrier()  # the marker is there before any rank leaves (srun ends the others when one exits non-zero)
        raise SystemExit(REQUEUE_EXIT)
    return history
