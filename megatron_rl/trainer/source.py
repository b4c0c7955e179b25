"""Where each step's batch comes from: the rollout producer (live generation over the fleet, up to
`trainer.max_staleness` steps ahead) or the batches a `rollout_only` run saved (`train_only`).

The model-parallel leader of each data-parallel rank produces that rank's share of whole prompt
groups on a thread (trainer/producer.py), over the fleet (rollout/fleet.py); the producers meet on
the store, check the share (every model token within the staleness bound, every μ finite), exchange
sequences so every mini-batch's tokens are balanced across data-parallel ranks (batch/exchange.py),
and each hands its compact batch to its model-parallel peers by tensor broadcast: no rank holds the
global batch. A checkpoint saves the complete shares made ahead (`queue/`), so a resumed run trains
on exactly them.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import batch as batching
from megatron_rl.batch import RolloutBatch
from megatron_rl.config.schema import JobConfig
from megatron_rl.data.prompts import PromptStream
from megatron_rl.distributed.collectives import all_reduce_sum
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.distributed.wait import Interrupted
from megatron_rl.vocab_parallel import TOPK_DIVERGENCES


def _spans_versions(rec) -> bool:
    """Whether the record's model tokens come from more than one weight version."""
    known = rec.versions[rec.versions >= 0] if rec.versions is not None else None
    return known is not None and known.numel() > 0 and int(known.min()) != int(known.max())


class BatchSource:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, fleet, learner, tokenizer, prompts: PromptStream,
                 rollouts_dir: Path, ops, log, saved_queue: tuple[Optional[Path], dict] = (None, {})):
        """`fleet`: rollout/fleet.py's `Fleet` (None with trainer.mode=train_only); `prompts`: the
        learner's prompt position (advanced as shares are taken, checkpointed by the trainer);
        `ops`: the run's `Operations` (stop requests interrupt a wait); `saved_queue`: the
        checkpoint the run resumed from and its queue entry."""
        self.cfg, self.ctx, self.fleet, self.learner, self.tokenizer = cfg, ctx, fleet, learner, tokenizer
        self.prompts, self.rollouts_dir, self.ops, self.log = prompts, rollouts_dir, ops, log
        self._saved_queue = saved_queue
        self.feeder = None  # the rollout producer thread (trainer/producer.py), on producer ranks
        self._attempt = 0
        self.restarts = 0  # steps whose rollouts were made again (a server served other weights)
        t = cfg.trainer
        self.signal = None
        if dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1:
            from megatron_rl.distributed.wait import LeaderSignal

            self.signal = LeaderSignal("rollouts", timeout_s=t.rollout_wait_timeout,
                                       log_every_s=t.rollout_wait_log_every,
                                       timeout_name="trainer.rollout_wait_timeout")
        # Data-parallel producers meet on the store before their first collective of a step.
        self.meeting = None
        if dist.is_initialized() and ctx.dp > 1 and self.producer:
            from megatron_rl.distributed.wait import StoreMeeting

            self.meeting = StoreMeeting("producers", ctx.dp_rank, ctx.dp, timeout_s=t.rollout_wait_timeout,
                                        log_every_s=t.rollout_wait_log_every, what="data-parallel producer",
                                        timeout_name="trainer.rollout_wait_timeout")

    def restart(self, step: int) -> None:
        """The step's shares came from other weights (a restarted server): the producer makes them
        again, from the step's prompts, after the trainer pushed the weights again."""
        self.restarts += 1
        if self.feeder is not None:
            self.feeder.restart(step, self.prompts.state_dict())

    def drain(self) -> None:
        """Wait for the generation admitted before a push (no partial rollouts)."""
        if self.feeder is not None:
            self.feeder.drain()

    def published(self, step: int) -> None:
        """The weights of `step` are on the servers: the producer may start every step up to
        `step + max_staleness`."""
        if self.feeder is not None:
            self.feeder.published(step)

    def stop(self, timeout: float) -> None:
        if self.feeder is not None:
            self.feeder.stop(abort=self.fleet.abort_other_lanes, timeout=timeout)

    def queued(self, step: int) -> tuple[list, int]:
        """Collective: the complete shares made ahead of `step`, contiguous from it and the same
        steps on every producer (a checkpoint saves them), and the last step among them."""
        shares = self.feeder.snapshot() if self.feeder is not None else []
        shares = [s for i, s in enumerate(shares) if s.target == step + i]  # contiguous
        last = torch.tensor([shares[-1].target if shares else step - 1
                             if self.producer else 2 ** 62], dtype=torch.int64, device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(last, op=dist.ReduceOp.MIN)
        return [s for s in shares if s.target <= int(last)], int(last)

    def write_queue(self, folder: Path, shares: list) -> None:
        """This producer's queued shares into a checkpoint folder (`queue/t<step>.dp<rank>.pt`)."""
        if not shares or not self.producer:
            return
        (folder / "queue").mkdir(exist_ok=True)
        for s in shares:
            s.batch.save(folder / "queue" / f"t{s.target:08d}.dp{self.ctx.dp_rank}.pt",
                         {"metrics": s.metrics, "position": s.position})

    @property
    def producer(self) -> bool:
        """The model-parallel leader of each data-parallel rank produces that rank's rollouts."""
        return dist.get_rank(self.ctx.mp_group) == 0 if dist.is_initialized() else True

    def take(self, step: int) -> tuple[str, Optional[RolloutBatch], dict]:
        """Producers take their share of whole groups from their producer thread (or read it
        back) and exchange sequences among themselves to balance every mini-batch's tokens
        (batch/exchange.py `rebalance`); each then hands its batch to its model-parallel peers by
        tensor broadcast. Returns (status: "ok", "stale" or "error:<message>" — the same on every
        rank —, batch, metrics)."""
        ctx, t, a = self.ctx, self.cfg.trainer, self.cfg.algorithm
        shared = dist.is_initialized() and dist.get_world_size(ctx.mp_group) > 1
        batch, metrics, status = None, {}, "ok"
        leader = dist.get_global_rank(ctx.mp_group, 0) if shared else 0
        # Model-parallel peers wait for their producer on the store, not inside a collective (the
        # NCCL watchdog would kill a broadcast that outlasts its timeout while rollouts run).
        self._attempt += 1
        key = f"step{step}/try{self._attempt}/leader{leader}"
        if self.producer:
            with self.signal.leading(key) if shared else nullcontext():
                if t.mode == "train_only":
                    batch, metrics = self._read(step)
                else:
                    batch, metrics, status = self._take_share(step)
                if status == "ok" and t.mode != "rollout_only" and ctx.dp > 1:
                    batch, stats = batching.rebalance(batch, ctx.dp_group, a.mini_batches, ctx.device)
                    moved = all_reduce_sum(torch.tensor([stats["recv_bytes"], batch.nbytes()], dtype=torch.float64),
                                           ctx.dp_group, ctx.device)
                    metrics["data/rebalanced_frac"] = float(moved[0] / moved[1].clamp(min=1))
        elif shared:
            self.signal.wait(key)
        if shared:
            header = [(status, self.prompts.state_dict(), metrics) if self.producer else None]
            dist.broadcast_object_list(header, src=leader, group=ctx.mp_group)
            status, position, metrics = header[0]
            if not self.producer:
                self.prompts.load_state_dict(position)
            if status == "ok":
                batch = RolloutBatch.broadcast(batch, leader, ctx.mp_group, ctx.device)
        return status, batch, metrics

    # -- the producer thread (trainer/producer.py) -------------------------------------------------
    def start(self, step: int) -> None:
        """Producer ranks: start the thread that makes each step's share ahead of the learner
        (at most trainer.max_staleness steps), from the consumer's prompt position or after the
        shares a resumed checkpoint saved."""
        from megatron_rl.rollout.client import GenerationAborted
        from megatron_rl.trainer.producer import Producer, ProducerStopped, StoreSum

        if not self.producer:
            return
        ctx = self.ctx
        agree = None
        if dist.is_initialized() and ctx.dp > 1:
            store = dist.distributed_c10d._get_default_store().clone()
            agree = StoreSum(store, f"agree/{self.cfg.name}", ctx.dp_rank, ctx.dp,
                             timeout_s=self.cfg.trainer.rollout_wait_timeout,
                             log_every_s=self.cfg.trainer.rollout_wait_log_every)
        stream = PromptStream(self.prompts.prompts, seed=self.prompts.seed)
        stream.load_state_dict(self.prompts.state_dict())
        saved = self._load_queue()
        if saved:
            stream.load_state_dict(saved[-1].position)

        def make(target: int, s: PromptStream) -> tuple[RolloutBatch, dict]:
            try:
                return self._make_share(target, s, agree)
            except (ProducerStopped, GenerationAborted):
                raise  # a stop, not a failure
            except BaseException as e:
                if agree is not None:  # the other producers' threads stop waiting for this one
                    agree.fail(f"step {target}: {type(e).__name__}: {e}")
                raise

        # Partial rollouts without dynamic sampling: the next admitted target starts in the slots
        # the current one's tail frees (trainer/producer.py, overlap).
        r = self.cfg.rollout
        self.feeder = Producer(make, stream,
                               self.cfg.trainer.max_staleness, last_target=self.cfg.trainer.steps - 1,
                               on_exit=self.fleet.close_lane,
                               overlap=r.partial_rollouts and not r.dynamic_sampling)
        self.feeder.start(step, published=step, saved=saved)

    def _make_share(self, target: int, stream: PromptStream, agree) -> tuple[RolloutBatch, dict]:
        """Producer thread: this rank's groups of step `target` as a compact batch, with the
        versions of their tokens checked against the staleness bound (no collective here)."""
        r, a = self.cfg.rollout, self.cfg.algorithm
        records, rewards, gids, metrics = self.fleet.generate(stream.take, target, agree=agree)
        routes = a.router_replay == "r3"
        cfg = self.learner.config
        batch = RolloutBatch.from_records(
            records, rewards, group_ids=gids, mini_batch=[g * a.mini_batches // r.prompts_per_step for g in gids],
            pad_id=self.tokenizer.pad_token_id, with_topk=a.divergence in TOPK_DIVERGENCES and r.top_k_logprobs > 0,
            with_routes=routes, num_experts=cfg.num_moe_experts if routes else None,
            route_shape=(self.learner.router_replay.num_moe_layers, cfg.moe_router_topk) if routes else None,
            with_versions=True, top_k=r.top_k_logprobs)
        metrics["_async"] = self._version_counts(batch, records, target)
        return batch, metrics

    def _version_counts(self, batch: RolloutBatch, records, target: int) -> torch.Tensor:
        """[k+1 token counts by staleness 0..k, tokens outside the bound (older, newer or of
        unknown weights), samples continued after a cut, samples spanning several versions]."""
        k = self.cfg.trainer.max_staleness
        counts = torch.zeros(k + 4, dtype=torch.float64)
        if not len(batch):
            return counts
        mask = torch.cat(batch.tok["loss_mask"]) > 0
        v = torch.cat(batch.tok["versions"])[mask].long()
        d = target - v
        ok = (v >= 0) & (d >= 0) & (d <= k)
        counts[:k + 1] = torch.bincount(d[ok], minlength=k + 1)[:k + 1].double()
        counts[k + 1] = float((~ok).sum())
        counts[k + 2] = float(sum(len(rec.segments or ()) > 1 for rec in records))
        counts[k + 3] = float(sum(_spans_versions(rec) for rec in records))
        return counts

    def _take_share(self, step: int) -> tuple[Optional[RolloutBatch], dict, str]:
        """Producers (collective over them): this rank's share of the step from the producer
        thread, checked: every model token within the staleness bound, every μ finite."""
        ctx = self.ctx
        # Each producer waits for its own thread, then for the others on the store: a producer
        # later than the process group's timeout is waited for here, not inside the all-reduce.
        key = f"step{step}/try{self._attempt}"
        try:
            share = self.feeder.get(step, interrupt=self.ops.interrupt)
        except Interrupted:
            raise  # every producer learns it from the store (Operations.interrupt)
        except BaseException as e:
            if self.meeting:
                self.meeting.fail(f"step {step}: {type(e).__name__}: {e}")
            raise
        waited = self.meeting.meet(key, interrupt=self.ops.interrupt) if self.meeting else 0.0
        batch, metrics = share.batch, dict(share.metrics)
        counts = metrics.pop("_async")
        stale = self.cfg.trainer.mode == "train" and bool(counts[self.cfg.trainer.max_staleness + 1] > 0)
        bad = ""
        if not stale and len(batch):
            mask = torch.cat(batch.tok["loss_mask"]) > 0
            mu = torch.cat(batch.tok["rollout_logp"])
            if not bool(torch.isfinite(mu[mask]).all()):
                i = next(i for i, x in enumerate(batch.tok["rollout_logp"]) if not torch.isfinite(x).all())
                s_ = int((~torch.isfinite(batch.tok["rollout_logp"][i])).nonzero()[0])
                bad = (f"step {step}: rollout log-prob is {float(batch.tok['rollout_logp'][i][s_])} for "
                       f"group {int(batch.seq['group_ids'][i])} (a sample of data-parallel rank {ctx.dp_rank}) "
                       f"position {s_}; not training on it")
        flags = torch.tensor([float(stale), float(bool(bad))], dtype=torch.float64)
        sums = metrics.pop("_sums")
        if dist.is_initialized() and ctx.dp > 1:
            flags = all_reduce_sum(flags, ctx.dp_group, ctx.device)
            sums = all_reduce_sum(sums, ctx.dp_group, ctx.device)
            counts = all_reduce_sum(counts, ctx.dp_group, ctx.device)
        metrics |= self.fleet.finish_metrics(sums) | self._async_metrics(counts)
        metrics["time/queue_wait"] = self.feeder.waited_s
        if self.meeting:
            metrics["time/producers_wait"] = waited  # for the other data-parallel producers, on the store
        if flags[1]:
            return None, metrics, "error:" + (bad or "a rollout log-prob is not finite on another "
                                                    "data-parallel rank (its log names it)")
        if flags[0]:
            return None, metrics, "stale"
        self.prompts.load_state_dict(share.position)
        return batch, metrics, "ok"

    def _async_metrics(self, counts: torch.Tensor) -> dict[str, float]:
        k = self.cfg.trainer.max_staleness
        counts = counts.cpu()  # all-reduced on the learner's device
        by_age = counts[:k + 1]
        n = float(by_age.sum())
        ages = torch.arange(k + 1, dtype=torch.float64)
        out = {f"async/tokens_staleness_{d}": float(by_age[d]) for d in range(k + 1)}
        out |= {"async/staleness_mean": float((by_age * ages).sum()) / max(n, 1.0),
                "async/staleness_max": float(ages[by_age > 0].max()) if n else 0.0,
                "async/old_token_frac": float(by_age[1:].sum()) / max(n, 1.0),
                "async/continued_samples": float(counts[k + 2]),
                "async/multi_version_samples": float(counts[k + 3]),
                "async/regenerated_steps": float(self.restarts),
                "async/queue_depth": float(self.feeder.depth())}
        return out

    def _rollouts_file(self, step: int, dp_rank: int) -> Path:
        return self.rollouts_dir / f"step_{step:08d}.dp{dp_rank}.pt"

    def save(self, step: int, batch: RolloutBatch, metrics: dict[str, float]) -> None:
        """rollout_only: each producer writes its share (groups whole, before any rebalancing)."""
        if self.producer:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            batch.save(self._rollouts_file(step, self.ctx.dp_rank), metrics if self.ctx.dp_rank == 0 else {})

    def _read(self, step: int) -> tuple[RolloutBatch, dict]:
        """train_only: this rank's groups (group id mod DP) of the step's saved shares — written
        with any data-parallel size."""
        files = sorted(self.rollouts_dir.glob(f"step_{step:08d}.dp*.pt"))
        if not files:
            raise FileNotFoundError(f"trainer.mode=train_only: no saved rollouts {self._rollouts_file(step, 0)} "
                                    "(write them with trainer.mode=rollout_only)")
        parts, metrics = [], {}
        for f in files:
            part, m = RolloutBatch.load(f)
            parts.append(part)
            metrics |= m
        whole = RolloutBatch.cat(parts)
        mine = (whole.seq["group_ids"] % self.ctx.dp == self.ctx.dp_rank).nonzero().flatten()
        return whole.select(mine), metrics

    def _load_queue(self) -> list:
        """The shares a resumed checkpoint saved for this producer (none if the data-parallel size
        changed: they are generated again, from the same prompts)."""
        from megatron_rl.trainer.producer import StepShare

        ckpt, queue = self._saved_queue
        if ckpt is None or not queue.get("targets"):
            return []
        if queue["dp"] != self.ctx.dp:
            self.log(f"[megatron-rl] the checkpoint's {len(queue['targets'])} queued rollout step(s) were "
                                f"made by {queue['dp']} data-parallel producers, this run has {self.ctx.dp}: "
                                "generating them again")
            return []
        out = []
        for t in queue["targets"]:
            batch, extra = RolloutBatch.load(ckpt / "queue" / f"t{t:08d}.dp{self.ctx.dp_rank}.pt")
            out.append(StepShare(t, batch, extra["metrics"], extra["position"]))
        return out
