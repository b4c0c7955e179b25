"""The Megatron-Core learner: model chunks, DDP, optimizer, and train / forward-only steps.

Megatron owns micro-batching, pipeline scheduling and gradient accumulation: `train_step` builds
micro-batches, hands `forward_step` to `get_forward_backward_func()` (plain or interleaved 1F1B)
and steps Megatron's optimizer. Loss closures plug in from outside (RL losses later):

    loss_fn(logits_BSV, mb, tp_group, vocab_size) -> (loss, metrics)

`logits_BSV` is this rank's vocab shard [b, s, V/TP] of the padded vocab, `mb` the micro-batch dict
(tensors [b, s] plus any extra per-token fields the caller put into the batch), `loss` a scalar
already divided by the *global* normaliser (computed once per step, before micro-batching: from
the whole batch when every rank passes it, all-reduced over data-parallel ranks when each passes
its own `RolloutBatch`), and `metrics` a dict of scalar tensors that are summed over micro-batches
and data-parallel ranks. Because losses are pre-normalised,
Megatron runs with `calculate_per_token_loss` and the grad finaliser does not rescale: the loss
and its gradients do not depend on the TP/PP/DP/micro-batch layout.

Batch layout: `input_ids`, `labels` (the token each position predicts), `loss_mask` (float),
all [B, S], right-padded; positions are 0..S-1. Two kinds of batch: a dict is the global batch
every rank passes (each takes its contiguous slice; micro-batches of `micro_batch_size` padded to
the global longest — tests and tools); a `trainer.batch.RolloutBatch` is this rank's own sequences
(the RL loop): micro-batches under `learner.max_tokens_per_micro_batch`, each trimmed to its own
longest, the same number on every data-parallel rank, materialised one at a time.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from patches.megatron_cpu import device_mode_paused
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.learner.losses import masked_nll_loss, token_logprobs
from megatron_rl.batch.packing import packed_positions, packing, per_token, unpacked
from megatron_rl.batch import (
    RolloutBatch, empty_micro_batch, no_route, padded_len, plan_micro_batches, route_dtype, route_fill,
    split_micro_batches, widen_routes,
)
from megatron_rl.models.bridge import (
    build_model_chunks, load_hf_weights, make_bridge, resolve_dtype, resolve_hf_path, resolve_spec,
)

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _finalize_without_rescale(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    # Losses arrive pre-normalised by global counts, so skip Megatron's 1/num_tokens scaling.
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, pg_collection=pg_collection,
                                force_all_reduce=force_all_reduce)


def fused_adam(optimizer, device_type: str = "cuda") -> int:
    """Switch torch's Adam under megatron-core's optimizer wrappers to its fused kernel for every
    parameter group whose parameters all lie on `device_type`; returns how many groups switched.

    Without Transformer Engine or apex, megatron-core steps `torch.optim.AdamW` with torch's
    default there, the foreach implementation: three multi-tensor passes per step, each reading
    and writing the fp32 master weights or moments. The fused kernel does the update in one pass
    (the same update rule: decoupled weight decay, bias correction). TE's and apex's FusedAdam, what
    megatron-core uses when they are installed, are such fused kernels too. The flag is read by
    every `step()`; a checkpoint's param groups carry it (torch keeps a fused group's step count on
    the device)."""
    n = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW is an Adam in torch >= 2.6
            continue
        for group in inner.param_groups:
            params = group["params"]
            if (params and all(p.device.type == device_type and p.is_floating_point() for p in params)
                    and not group.get("differentiable") and not group.get("capturable")):
                group["fused"], group["foreach"] = True, False
                n += 1
    return n


def to_device(mb: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A host micro-batch on `device`: on CUDA through pinned memory with non-blocking copies (a
    copy from pageable memory first waits for everything queued on the stream)."""
    if not _on_gpu(device):
        return {k: v.to(device) for k, v in mb.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in mb.items()}


def _on_gpu(device) -> bool:
    """A real CUDA device (the CPU layer, patches/megatron_cpu.py, names "cuda" on a machine without one)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


class Prefetched:
    """The schedule's data iterator over micro-batch makers, one ahead: when micro-batch i is
    taken, i+1 is made at once, so its host work and copies overlap i's compute. On CUDA it is made
    on a side stream that the compute stream waits on (an event) before using it; elsewhere the
    same order, synchronous. Yields zero-argument callables, as the makers themselves."""

    def __init__(self, makers: list[Callable[[], dict]], device):
        self._makers, self._i = list(makers), 0
        self._stream = torch.cuda.Stream(torch.device(device)) if _on_gpu(device) else None
        self._ready = self._make(0) if self._makers else None

    def _make(self, i: int):
        if self._stream is None:
            return self._makers[i](), None
        self._stream.wait_stream(torch.cuda.current_stream())  # inputs it reads were written there
        with torch.cuda.stream(self._stream):
            mb = self._makers[i]()
        event = torch.cuda.Event()
        event.record(self._stream)
        return mb, event

    def __iter__(self):
        return self

    def __next__(self) -> Callable[[], dict]:
        if self._ready is None:
            raise StopIteration
        mb, event = self._ready
        self._i += 1
        if event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(event)
            for v in mb.values():
                v.record_stream(stream)  # the allocator must not hand it back while it is in use there
        self._ready = self._make(self._i) if self._i < len(self._makers) else None
        return lambda: mb


class Learner:
    """Megatron GPTModel chunks + DDP + optimizer for one parallel layout.

    `trainable=False` builds a frozen, forward-only model (reward / reference models): the same
    chunks and forward passes, no DDP grad buffers, no optimizer.
    """

    packs = True  # learner.pack_sequences applies (its loss closures unpack per-token outputs)

    def __init__(self, cfg: JobConfig, ctx: ParallelContext, run_dir: str, total_steps: int = 1,
                 *, trainable: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module

        self.cfg, self.ctx = cfg, ctx
        model_parallel_cuda_manual_seed(cfg.model.seed)
        self.hf_path = resolve_hf_path(cfg.model, run_dir)
        self.bridge = make_bridge(self.hf_path, cfg.model, ctx)
        chunks = self._build_chunks()
        self.config = chunks[0].config
        self.dtype = resolve_dtype(cfg.model.dtype)
        if self.dtype != torch.float32:
            chunks = [Float16Module(self.config, c) for c in chunks]
        self.vocab_size = self.bridge.hf_config.vocab_size
        # Packed micro-batches (batch/packing.py): token-budget ones only; the loss closures
        # unpack what they compute per token. Scalar-head learners (critic.py) keep padded rows.
        self.pack = cfg.learner.pack_sequences and self.packs
        if self.pack and resolve_spec(cfg.model.spec) != "torch":
            raise ValueError(f"learner.pack_sequences=true needs model.spec=torch (packed attention); "
                             f"model.spec={cfg.model.spec} runs {resolve_spec(cfg.model.spec)} here")
        if not trainable:
            self._init_forward_only(chunks)
            return

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            # Each bucket's data-parallel reduce starts when the last micro-batch's backward has
            # filled it, overlapping the rest of the backward (the schedules enable grad sync for
            # the last micro-batch of each chunk; finalize_model_grads waits for the handles).
            overlap_grad_reduce=True,
            use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.model = [
            DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=c,
                                    disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        self.config.finalize_model_grads_func = _finalize_without_rescale
        no_sync = [m.no_sync for m in self.model]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype, use_distributed_optimizer=o.use_distributed_optimizer,
            ),
            self.model,
        )
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.fused_adam_groups = fused_adam(self.optimizer) if self.ctx.device.type == "cuda" else 0
        self._chunk_index = {id(m): i for i, m in enumerate(self.model)}
        self.router_replay = None
        if self.config.num_moe_experts:
            from megatron_rl.learner.router_replay import RouterReplayController

            self.router_replay = RouterReplayController(self.model, ctx,
                                                        recompute=cfg.model.recompute != "none")
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.lr_warmup_steps else o.lr, max_lr=o.lr,
            min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=max(o.lr_decay_steps or total_steps, o.lr_warmup_steps + 1),
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )

    def _build_chunks(self) -> list[torch.nn.Module]:
        """This rank's GPTModel chunks with the checkpoint loaded; subclasses with another output
        layer (critic, reward model: learner/critic.py) override this."""
        chunks = build_model_chunks(self.bridge, self.ctx)
        load_hf_weights(self.bridge, chunks, self.hf_path)
        return chunks

    def _init_forward_only(self, chunks: list[torch.nn.Module]) -> None:
        """A frozen model (`trainable=False`): no DDP grad buffers, no optimizer state."""
        for c in chunks:
            c.requires_grad_(False)
        self.model = chunks
        self.optimizer = self.scheduler = None
        self._chunk_index = {id(m): i for i, m in enumerate(self.model)}
        self.router_replay = None
        if self.config.num_moe_experts:
            from megatron_rl.learner.router_replay import RouterReplayController

            self.router_replay = RouterReplayController(self.model, self.ctx,
                                                        recompute=self.cfg.model.recompute != "none")

    # ------------------------------------------------------------------------------------------
    # batches
    # ------------------------------------------------------------------------------------------
    def _local_micro_batches(self, batch: dict[str, torch.Tensor]) -> tuple[list[dict], int, int]:
        """This DP rank's contiguous slice of the global batch, padded and cut into micro-batches.

        Returns (micro-batches, padded sequence length, micro-batch size); a batch smaller than
        dp x micro_batch_size (a probe) runs as micro-batches of what each rank has.
        """
        B = batch["input_ids"].shape[0]
        dp = self.ctx.dp
        if B % dp:
            raise ValueError(f"global batch of {B} sequences is not divisible by dp = {dp}")
        per_rank = B // dp
        mbs = min(self.cfg.learner.micro_batch_size, per_rank)
        if per_rank % mbs:
            raise ValueError(f"{per_rank} sequences per data-parallel rank are not divisible by "
                             f"learner.micro_batch_size = {mbs}")
        lo = self.ctx.dp_rank * per_rank
        S = batch["input_ids"].shape[1]
        mult = self.cfg.learner.pad_to_multiple_of * (self.ctx.tp if self.ctx.sequence_parallel else 1)
        S_pad = -(-S // mult) * mult
        mbs_list = []
        for start in range(lo, lo + per_rank, mbs):
            mb = {}
            for k, v in batch.items():
                v = v[start:start + mbs]
                if v.dim() >= 2 and v.shape[1] == S and S_pad != S:
                    # Padded positions have no route (-1, or a compact dtype's `no_route`), not expert 0.
                    fill = route_fill(v.dtype) if k == "routed_experts" else 0
                    pad = v.new_full((v.shape[0], S_pad - S, *v.shape[2:]), fill)
                    v = torch.cat([v, pad], dim=1)
                mb[k] = v.to(self.ctx.device)
            mb["position_ids"] = torch.arange(S_pad, device=self.ctx.device).expand(mb["input_ids"].shape[0], -1)
            mbs_list.append(mb)
        return mbs_list, S_pad, mbs

    def _budget_micro_batches(self, batch: RolloutBatch) -> tuple[list[Callable[[], dict]], int, int]:
        """This rank's own sequences (a `RolloutBatch`) cut under `learner.max_tokens_per_micro_batch`
        (or `micro_batch_size` sequences when it is 0), each micro-batch trimmed to its own longest
        sequence. Every data-parallel rank runs the same number of micro-batches (expert-parallel
        peers exchange tokens in every forward): a rank short of micro-batches splits its largest,
        then runs empty ones (one padding sequence, no loss). Returns (micro-batch makers, longest
        padded length, largest micro-batch)."""
        lc = self.cfg.learner
        mult = lc.pad_to_multiple_of * (self.ctx.tp if self.ctx.sequence_parallel else 1)
        lens = batch.seq_lens
        plan = plan_micro_batches(lens, max_tokens=lc.max_tokens_per_micro_batch,
                                  max_sequences=lc.micro_batch_size, multiple=mult, packed=self.pack)
        if self.ctx.dp > 1:
            n = torch.tensor([len(plan)], dtype=torch.int64, device=self.ctx.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.ctx.dp_group)
            n = int(n)
            plan = split_micro_batches(plan, n)
            plan += [None] * (n - len(plan))
        self._plan = [p for p in plan if p is not None]
        device = self.ctx.device

        def make(idx):
            if idx is None:
                mb = empty_micro_batch(batch, mult)
            else:
                mb = batch.micro_batch(idx, padded_len(int(lens[idx].max()), mult))
            mb = to_device(mb, device)
            b, S = mb["input_ids"].shape
            if self.pack:  # the sequences end to end: [1, T], T = their lengths' sum
                pk = packing(lens[idx] if idx is not None else torch.tensor([S], device="cpu"), S, mult)
                mb["packing"], mb["position_ids"] = pk.to(device), packed_positions(pk, device)
            else:
                mb["position_ids"] = torch.arange(S, device=device).expand(b, -1)
            return mb

        makers = [partial(make, idx) for idx in plan]
        S_max = max((padded_len(int(lens[i].max()), mult) for i in self._plan), default=mult)
        b_max = max((i.numel() for i in self._plan), default=1)
        return makers, S_max, b_max

    def run_micro_batches(self, batch, loss_fn: LossFn, forward_only: bool) -> list[dict]:
        """Megatron's schedule over this rank's micro-batches of `batch`: a dict is the global
        batch every rank passes (each takes its contiguous slice, `micro_batch_size` sequences per
        micro-batch padded to the global longest); a `RolloutBatch` is this rank's own sequences
        (token-budget micro-batches, `_budget_micro_batches`; their order is `self._plan`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if isinstance(batch, RolloutBatch):
            makers, S, mbs = self._budget_micro_batches(batch)
            # Micro-batches differ in shape: pipeline stages exchange shapes before tensors.
            self.config.variable_seq_lengths = self.ctx.pp > 1
        else:
            micro_batches, S, mbs = self._local_micro_batches(batch)
            makers = [(lambda m=m: m) for m in micro_batches]
            self._plan = None

        replay = self.router_replay

        def forward_step(data_iterator, model):
            mb = next(data_iterator)()
            chunk = self._chunk_index[id(model)]
            pk = mb.get("packing")
            if replay is not None and replay.mode == "replay" and "routed_experts" in mb:
                # Routes travel compact (uint8 for up to 255 experts, 8x less than int64) and are
                # widened here, on the device, for the router replay (packed like the tokens).
                routes = widen_routes(mb["routed_experts"])
                mb = {**mb, "routed_experts": pk.pack(routes, fill=-1) if pk is not None else routes}
            if replay is not None:
                replay.before_forward(chunk, mb)
            if pk is not None:
                output = model(pk.pack(mb["input_ids"]), mb["position_ids"], None, packed_seq_params=pk.params)
            else:
                output = model(mb["input_ids"], mb["position_ids"], None)
            if replay is not None:
                replay.after_forward(chunk, mb)
            return output, partial(self._loss_closure, loss_fn, mb)

        # Each micro-batch is made while the one before it runs (Prefetched).
        iters = [Prefetched(makers, self.ctx.device) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.model,
            num_microbatches=len(makers),
            seq_length=S,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    def local_rows(self, batch: RolloutBatch, per_mb: list[dict], key: str,
                   row_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's [len(batch), *row_shape] fp32 (host) from the last stage's per-micro-batch
        outputs `key` ([b_mb, S_mb] when row_shape = (S,), else [b_mb]), in batch order."""
        out = torch.zeros(len(batch), *row_shape, dtype=torch.float32, device=self.ctx.device)
        if self.ctx.is_last_stage:
            for idx, m in zip(self._plan, per_mb):  # empty micro-batches run last
                rows, idx = m[key].float(), idx.to(self.ctx.device)
                if row_shape:
                    n = min(rows.shape[1], row_shape[0])
                    out[idx, :n] = rows[:, :n]
                else:
                    out[idx] = rows
        if self.ctx.pp > 1:
            dist.broadcast(out, src=dist.get_global_rank(self.ctx.pp_group, self.ctx.pp - 1),
                           group=self.ctx.pp_group)
        return out.cpu()

    def _loss_closure(self, loss_fn: LossFn, mb: dict, logits_BSV: torch.Tensor):
        with device_mode_paused():  # our loss code names no device; skip the CPU layer's hop
            loss, metrics = loss_fn(logits_BSV, mb, tp_group=self.ctx.tp_group, vocab_size=self.vocab_size)
        # (loss, num_tokens, reduced): the 3-tuple form keeps Megatron from averaging over
        # micro-batches; our finaliser ignores num_tokens.
        return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

    def reduce_metrics(self, per_mb: list[dict]) -> dict[str, float]:
        """Sum metric dicts over micro-batches and DP ranks; every rank returns the same values."""
        # Only the last pipeline stage has metrics: broadcast their names, then their values.
        keys = sorted(per_mb[0]) if per_mb else []
        src = dist.get_global_rank(self.ctx.pp_group, self.ctx.pp - 1)
        names = [keys]
        dist.broadcast_object_list(names, src=src, group=self.ctx.pp_group)
        keys = names[0]
        vals = torch.zeros(len(keys), dtype=torch.float64, device=self.ctx.device)
        if self.ctx.is_last_stage:
            for i, k in enumerate(keys):
                vals[i] = sum(float(m[k].detach()) for m in per_mb)
            dist.all_reduce(vals, group=self.ctx.dp_group)
        dist.broadcast(vals, src=src, group=self.ctx.pp_group)
        return {k: float(v) for k, v in zip(keys, vals.tolist())}

    # ------------------------------------------------------------------------------------------
    # public steps
    # ------------------------------------------------------------------------------------------
    def _routing(self, mode: Optional[str], backward: bool):
        if mode is None:
            return nullcontext()
        if self.router_replay is None:
            raise ValueError(f"router replay ({mode}) needs an MoE model")
        return self.router_replay.phase(mode, backward=backward)

    def _agreement_metrics(self) -> dict[str, float]:
        agreement = self.router_replay.agreement.clone()
        dist.all_reduce(agreement)
        rates = agreement[0] / agreement[1].clamp(min=1)
        return {f"router_agreement/layer{i}": float(r) for i, r in enumerate(rates)}

    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: Optional[LossFn] = None,
                   routing: Optional[str] = None) -> dict[str, float]:
        """One optimizer step on a global batch (every rank passes the same batch).

        `routing="replay"` replays `batch["routed_experts"]` ([B, S, L, k], see router_replay.py)
        in every forward and recompute of the step (R2 / R3).
        """
        if self.optimizer is None:
            raise RuntimeError("this model was built with trainable=False (forward-only)")
        if loss_fn is None:
            count = batch["loss_mask"].sum().to(self.ctx.device)
            if isinstance(batch, RolloutBatch):  # this rank's sequences: count them all
                dist.all_reduce(count, group=self.ctx.dp_group)
            loss_fn = partial(masked_nll_loss, denom=float(count.clamp(min=1)))
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._routing(routing, backward=True):
            per_mb = self.run_micro_batches(batch, loss_fn, forward_only=False)
            metrics = self.reduce_metrics(per_mb)
            if routing == "replay":
                metrics.update(self._agreement_metrics())
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                       lr=self.optimizer.param_groups[0]["lr"], update_skipped=float(not ok))
        return metrics

    @torch.no_grad()
    def forward_logprobs(self, batch: dict[str, torch.Tensor], routing: Optional[str] = None,
                         temperature: float = 1.0):
        """log π(labels) for every position of the global batch, [B, S] fp32 on the host (as the
        batch), on every rank (of softmax(logits / temperature), the sampling distribution at
        that temperature).

        `routing="replay"` replays `batch["routed_experts"]`; `routing="record"` (R2) also
        returns the routes the model chose: [B, S, L, k] int64 (-1 on padding) on every rank for a global
        batch dict; this rank's compact routes (`_recorded_local_routes`) for a RolloutBatch.
        """
        for m in self.model:
            m.eval()

        def collect(logits_BSV, mb, tp_group, vocab_size):
            if temperature != 1.0:
                logits_BSV = logits_BSV / temperature
            logp = token_logprobs(logits_BSV, per_token(mb, "labels"), tp_group, vocab_size)
            return logits_BSV.new_zeros(()), {"logp": unpacked(mb, logp)}

        if isinstance(batch, RolloutBatch):
            S = int(batch.seq_lens.max()) if len(batch) else 0
            with self._routing(routing, backward=False):
                per_mb = self.run_micro_batches(batch, collect, forward_only=True)
                routes = self._recorded_local_routes(len(batch), S) if routing == "record" else None
            out = self.local_rows(batch, per_mb, "logp", (S,))
            return out if routing != "record" else (out, routes)
        B, S = batch["input_ids"].shape
        with self._routing(routing, backward=False):
            per_mb = self.run_micro_batches(batch, collect, forward_only=True)
            routes = self._gather_recorded_routes(B // self.ctx.dp, S) if routing == "record" else None
        local = torch.zeros(B // self.ctx.dp, S, dtype=torch.float32, device=self.ctx.device)
        if self.ctx.is_last_stage:
            local = torch.cat([m["logp"] for m in per_mb])[:, :S].float()
        out = self._gather_dp_rows(local)
        dist.broadcast(out, src=dist.get_global_rank(self.ctx.pp_group, self.ctx.pp - 1),
                       group=self.ctx.pp_group)
        out = out.cpu()  # beside the rollout batch, which lives on the host
        return out if routing != "record" else (out, routes)

    def _gather_dp_rows(self, local: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(local) for _ in range(self.ctx.dp)]
        dist.all_gather(gathered, local.contiguous(), group=self.ctx.dp_group)
        return torch.cat(gathered)

    def _recorded_local_routes(self, b: int, S: int) -> torch.Tensor:
        """R2: the routes this rank's model-parallel group recorded for its own sequences,
        [b, S, L, k] compact (`trainer.batch.route_dtype`: uint8 with 255 where none, while the
        model has ≤ 254 experts) on the host, in batch order. Ranks combine expert id + 1 (0 = not
        theirs) with one MAX all-reduce of that compact buffer (NCCL has no int16: int32 past 254)."""
        E = self.config.num_moe_experts
        wire = torch.uint8 if E <= 254 else torch.int32
        order = torch.cat(self._plan) if self._plan else torch.zeros(0, dtype=torch.int64)
        local = self.router_replay.recorded_routes(b, S, self.config.moe_router_topk, order=order,
                                                   shifted_dtype=wire).to(self.ctx.device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.ctx.mp_group)
        local = local.cpu()
        dtype = route_dtype(E)
        if wire == torch.uint8:  # id + 1 → id, and 0 (none) → 255 by uint8 wrap-around
            return local.sub_(1)
        return torch.where(local == 0, no_route(dtype), local - 1).to(dtype)

    def _gather_recorded_routes(self, B_local: int, S: int) -> torch.Tensor:
        """Combine the routes each rank recorded (its layers, its sequence chunk) for the batch."""
        local = self.router_replay.recorded_routes(B_local, S, self.config.moe_router_topk)
        local = local.to(self.ctx.device)
        # Every (position, layer) is filled by exactly one model-parallel rank; others hold -1.
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.ctx.mp_group)
        return self._gather_dp_rows(local).cpu()

    def export_hf_weights(self):
        """(HF name, tensor) for every weight; a collective every model-parallel rank iterates."""
        return self.bridge.export_weights(self.model)
