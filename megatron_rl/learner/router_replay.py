"""Router replay for MoE (R2 / R3) on megatron-core's built-in `RouterReplay`.

R3 replays the experts the inference engine routed each token to; R2 records the trainer's own
routing in the old-log-prob pass and replays it in the update. Only the *selection* is replayed:
Megatron gathers the router's current scores at the replayed ids, so the router keeps its gradient.

Layout. Routes come in as `routes_BSLk` int64 [b, S, L, k]: for sequence b and input position s
(the token at `input_ids[b, s]`), the k global expert ids of MoE layer l (l counts MoE layers in
global layer order, dense layers skipped); -1 marks positions without a recorded route (padding,
the final token that the engine never ran). Megatron flattens tokens sequence-major ([S·b]) and,
under sequence parallelism, each TP rank routes only its contiguous chunk of S; each pipeline
stage / virtual chunk owns a subset of the MoE layers. `RouterReplayController` maps one to the
other and feeds each local router exactly its slice, once per micro-batch forward.

Phases are explicit (`controller.phase("replay" | "record" | None)`), never environment
variables. With activation recompute the routers re-run in backward: after each micro-batch's
forward the action switches to REPLAY_BACKWARD, which pops that micro-batch's ids in FIFO order
(Megatron's schedules run backwards in forward order per chunk). At the end of a step every
router must have consumed exactly what was fed — otherwise an error names the layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.distributed.context import ParallelContext


@dataclass
class _LocalRouter:
    moe_index: int  # index among all MoE layers of the model (global order)
    layer_number: int  # Megatron's 1-based global layer number
    replay: object  # megatron.core.transformer.moe.router_replay.RouterReplay


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def padding_routes(n: int, k: int, num_experts: int, device=None) -> torch.Tensor:
    """[n, k] routes for n tokens without one: token j takes experts jk .. jk+k−1 (mod E) — k
    distinct experts each, every expert loaded within one token of the others."""
    j = torch.arange(n, device=device)[:, None] * k + torch.arange(k, device=device)
    return j % num_experts


class RouterReplayController:
    """Feeds recorded routes to the MoE routers of this rank's model chunks, micro-batch by micro-batch."""

    def __init__(self, model_chunks: list, ctx: ParallelContext, recompute: bool):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.Action = RouterReplayAction
        self.ctx = ctx
        self.num_experts = _unwrap(model_chunks[0]).config.num_moe_experts
        self.recompute = recompute
        local: list[list[tuple[int, object]]] = []
        for chunk in model_chunks:
            layers = []
            for layer in _unwrap(chunk).decoder.layers:
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if router is not None:
                    if router.router_replay is None:
                        raise RuntimeError("MoE router has no RouterReplay: build the model with "
                                           "moe_enable_routing_replay=True")
                    layers.append((layer.layer_number, router.router_replay))
            local.append(layers)
        # Global MoE layer order: gather every pipeline rank's MoE layer numbers.
        mine = [n for layers in local for n, _ in layers]
        everyone: list = [None] * ctx.pp
        dist.all_gather_object(everyone, mine, group=ctx.pp_group)
        order = {n: i for i, n in enumerate(sorted(n for ns in everyone for n in ns))}
        self.num_moe_layers = len(order)
        self.chunks = [[_LocalRouter(order[n], n, r) for n, r in layers] for layers in local]
        self.mode: Optional[str] = None
        self.fed = [[0] * len(c) for c in self.chunks]
        self.recorded: list[list] = [[] for _ in self.chunks]  # per chunk, per micro-batch
        self._valid: dict[int, torch.Tensor] = {}  # moe_index -> valid-token mask of the current mb
        # (sum, count) per MoE layer, on the device: accumulated without a host sync per layer and
        # all-reduced as is by the learner.
        self.agreement = torch.zeros(2, self.num_moe_layers, dtype=torch.float64, device=ctx.device)
        for chunk in self.chunks:
            for lr in chunk:
                self._measure_agreement(lr)

    def _measure_agreement(self, lr: _LocalRouter) -> None:
        """Wrap the router's top-k so a replayed forward also scores the natural routing."""
        orig = lr.replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, idx = orig(scores, topk, num_groups, group_topk, default_compute_topk)
            if self.mode == "replay" and lr.replay.router_replay_action == self.Action.REPLAY_FORWARD:
                with torch.no_grad():
                    _, natural = default_compute_topk(scores, topk, num_groups=num_groups,
                                                      group_topk=group_topk)
                    # Fraction of the k replayed experts the router would have chosen itself.
                    overlap = (natural[:, :, None] == idx[:, None, :]).any(-1).double().mean(-1)
                    valid = self._valid[lr.moe_index].to(overlap.device).double()
                    self.agreement[0, lr.moe_index] += (overlap * valid).sum()
                    self.agreement[1, lr.moe_index] += valid.sum()
            return probs, idx

        lr.replay.get_replay_topk = get_replay_topk

    # ---------------------------------------------------------------------------------------
    def _local_tokens(self, routes_BSLk: torch.Tensor, moe_index: int) -> torch.Tensor:
        """[b, S, L, k] -> this rank's [S_local·b, k] in Megatron's sequence-major order."""
        r = routes_BSLk[:, :, moe_index, :]  # [b, S, k]
        b, S, k = r.shape
        if self.ctx.sequence_parallel and self.ctx.tp > 1:
            chunk = S // self.ctx.tp
            r = r[:, self.ctx.tp_rank * chunk:(self.ctx.tp_rank + 1) * chunk]
        r = r.transpose(0, 1).reshape(-1, k).long()
        # Positions without a recorded route come after every valid token of their sequence, so
        # under causal attention they influence nothing that counts; they are spread evenly over
        # all experts (token j takes experts jk..jk+k−1 mod E), never piled onto experts 0..k−1,
        # which would load one expert-parallel rank with every padding token.
        missing = (r < 0).any(dim=-1)
        self._valid[moe_index] = ~missing
        # Unconditionally (no `missing.any()`): a branch on it would synchronise with the host once
        # per MoE layer and micro-batch.
        r = torch.where(missing[:, None], padding_routes(r.shape[0], k, self.num_experts, r.device), r)
        return r

    def before_forward(self, chunk_idx: int, mb: dict) -> None:
        """Called in forward_step before the chunk's forward of micro-batch `mb`."""
        if self.mode == "replay":
            routes = mb.get("routed_experts")
            if routes is None:
                raise KeyError("router replay is on but the micro-batch has no 'routed_experts'")
            if routes.shape[2] != self.num_moe_layers:
                raise ValueError(f"routed_experts has {routes.shape[2]} MoE layers, the model "
                                 f"{self.num_moe_layers}")
            for j, lr in enumerate(self.chunks[chunk_idx]):
                lr.replay.set_target_indices(self._local_tokens(routes, lr.moe_index).to(self.ctx.device))
                self.fed[chunk_idx][j] += 1
                lr.replay.set_router_replay_action(self.Action.REPLAY_FORWARD)
        elif self.mode == "record":
            for lr in self.chunks[chunk_idx]:
                lr.replay.set_router_replay_action(self.Action.RECORD)

    def after_forward(self, chunk_idx: int, mb: dict) -> None:
        """Called in forward_step right after the chunk's forward of `mb`."""
        if self.mode == "replay":
            for lr in self.chunks[chunk_idx]:
                lr.replay.set_router_replay_action(self.Action.REPLAY_BACKWARD)
        elif self.mode == "record":
            b, S = mb["input_ids"].shape
            per_layer = {lr.moe_index: lr.replay.get_recorded_indices() for lr in self.chunks[chunk_idx]}
            self.recorded[chunk_idx].append((b, S, per_layer))

    # ---------------------------------------------------------------------------------------
    @contextmanager
    def phase(self, mode: Optional[str], backward: bool):
        """Replay or record routes for the runs inside the block (None: natural routing).

        `backward`: the block runs backward passes too (with recompute they consume replays)."""
        if mode not in (None, "replay", "record"):
            raise ValueError(f"router replay phase {mode!r}; valid: None, replay, record")
        self.mode = mode
        self.backward = backward
        self.fed = [[0] * len(c) for c in self.chunks]
        self.recorded = [[] for _ in self.chunks]
        self.agreement.zero_()
        try:
            yield self
            if mode == "replay":
                self._check_consumed()
        finally:
            for chunk in self.chunks:
                for lr in chunk:
                    lr.replay.clear_indices()
                    lr.replay.clear_router_replay_action()
            self.mode = None

    def _check_consumed(self) -> None:
        for c, chunk in enumerate(self.chunks):
            for j, lr in enumerate(chunk):
                left = len(lr.replay.replay_backward_list)
                # Recompute in backward pops every replay; forward-only or no recompute, none.
                expected = 0 if (self.recompute and self.backward) else self.fed[c][j]
                if left != expected:
                    raise RuntimeError(
                        f"router replay: MoE layer {lr.layer_number} (chunk {c}) was fed "
                        f"{self.fed[c][j]} micro-batches but {left} replays are left unconsumed "
                        f"(expected {expected})")

    def agreement_by_layer(self) -> list[float]:
        """After a replay phase: per MoE layer, the mean fraction of replayed experts that the
        trainer's own router would have picked (this rank's tokens; combine with all-reduce)."""
        return (self.agreement[0] / self.agreement[1].clamp(min=1)).tolist()

    def recorded_routes(self, b_local: int, S: int, k: int, order: Optional[torch.Tensor] = None,
                        shifted_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """After a `record` phase: this rank's routes as [b_local, S, L, k] (-1 where not local).

        Each pipeline rank fills its own layers and each TP rank (under SP) its sequence chunk;
        the caller combines ranks with a MAX all-reduce over the model-parallel group.
        `shifted_dtype` (e.g. uint8): store expert id + 1 in that dtype, 0 where not local — a
        compact buffer for the same MAX all-reduce. `order`:
        the batch row of each micro-batch row, in run order (token-budget micro-batches); empty
        micro-batches (beyond `order`) are skipped.
        """
        shift = 1 if shifted_dtype is not None else 0
        out = torch.full((b_local, S, self.num_moe_layers, k), shift - 1, dtype=shifted_dtype or torch.long)
        for mbs in self.recorded:  # one list per virtual chunk, micro-batches in order
            row = 0
            for b, S_pad, per_layer in mbs:
                if order is not None and row >= order.numel():
                    break
                rows = order[row:row + b] if order is not None else slice(row, row + b)
                for moe_index, idx in per_layer.items():
                    S_local = idx.shape[0] // b
                    start = self.ctx.tp_rank * S_local if self.ctx.sequence_parallel and self.ctx.tp > 1 else 0
                    block = idx.view(S_local, b, k).transpose(0, 1).cpu()
                    stop = min(start + S_local, S)
                    if stop > start:
                        out[rows, start:stop, moe_index] = (block[:, : stop - start] + shift).to(out.dtype)
                row += b
        return out
