"""Rollout records -> a data-parallel rank's compact rollout batch, its mini- and micro-batches.

Every data-parallel rank holds only its own sequences (`RolloutBatch`): its producer generated
whole groups (rollout/fleet.py), `rebalance` then exchanges sequences point-to-point so that
each mini-batch's tokens are balanced across ranks, and the model-parallel peers of a rank get a
copy of its batch by tensor broadcast (`RolloutBatch.broadcast`). Nothing is pickled and no rank
ever holds the global batch.

Storage is compact and per sequence (no padding until a micro-batch is formed):
    seq[name]  [b] per-sequence values: seq_len (P+T), prompt_len (P), rewards, group_ids (global
               prompt-group id), mini_batch (the optimizer step it belongs to), response_len,
               truncated, ...
    tok[name]  list of b tensors, one per sequence, rows = input positions:
               input_ids      int32 [P+T]     prompt + response tokens
               loss_mask      fp32  [P+T]     1 on response-token predictions (rows P−1..P+T−2),
                                              0 on an episode's environment tokens (record.loss_mask)
               rollout_logp   fp32  [P+T]     log μ(token s+1) on the loss rows, 0 elsewhere
               topk_ids       int32 [T, K]    rows P−1..P+T−2 only (`RESPONSE_ROWS`); −1 elsewhere
               topk_logp      fp32  [T, K]
               routed_experts uint8 [P+T−1, L, k] (int16 past 255 experts): the route of input
                              position s; the last position (never fed to the engine) has none
               versions       int32 [P+T]     the weight version (trainer step) that sampled the
                              token predicted at each loss row; −1 elsewhere and where unknown
               and whatever the loop adds (old_logp, ref_logp, advantages, R2's recorded routes,
               ...) as [P+T] rows.
Alignment (records.py's): input position s predicts `labels[s] = input_ids[s+1]`, so response
token t is predicted at position P−1+t.

`batch[name]` gives the learner's padded layout [b, S_max, ...] (S_max = this batch's longest
sequence; `labels` is derived; fill: pad_id for ids, −1 for top-K ids, `no_route` for routes, 0
otherwise) and `batch[name] = x` stores a padded [b, S] tensor (or a per-sequence [b] one) back.
`micro_batch(indices, S)` forms one micro-batch in that layout, trimmed to its own longest
sequence: the learner materialises micro-batches one at a time (learner.py), cut by
`plan_micro_batches` under `learner.max_tokens_per_micro_batch`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.rollout.records import (NO_ROUTE_U8, UNKNOWN_VERSION, RolloutRecord, no_route,  # noqa: F401
                                         route_dtype, version_number)

RESPONSE_ROWS = ("topk_ids", "topk_logp")
"""Token fields stored for response rows only (from input position P−1)."""


@dataclasses.dataclass
class RolloutBatch:
    seq: dict[str, torch.Tensor]
    tok: dict[str, list[torch.Tensor]]
    pad_id: int = 0
    spec: dict[str, tuple[torch.dtype, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    """(dtype, trailing shape) of every token field: known even when the batch is empty."""

    def __post_init__(self):
        for k, ts in self.tok.items():
            if k not in self.spec and ts:
                self.spec[k] = (ts[0].dtype, tuple(ts[0].shape[1:]))
        missing = [k for k in self.tok if k not in self.spec]
        if missing:
            raise ValueError(f"rollout batch: no dtype known for the empty token fields {missing}")

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_records(cls, records: Sequence[RolloutRecord], rewards: Sequence[float], *,
                     group_ids: Sequence[int], mini_batch: Sequence[int], pad_id: int,
                     with_topk: bool = False, with_routes: bool = False,
                     num_experts: Optional[int] = None,
                     route_shape: Optional[tuple[int, int]] = None,
                     with_versions: bool = False, top_k: Optional[int] = None) -> "RolloutBatch":
        """Compact batch of `records` (their tensors are kept, not copied, where the dtype fits).
        `num_experts` and `route_shape` (MoE layers, router top-k) type the routes of a batch that
        may be empty, `top_k` (rollout.top_k_logprobs) its top-K rows: an empty batch (a producer
        whose groups all went elsewhere) must have the schema of its peers' for the exchange."""
        P = torch.tensor([r.prompt_ids.numel() for r in records], dtype=torch.int64)
        T = torch.tensor([r.response_ids.numel() for r in records], dtype=torch.int64)
        seq = dict(seq_len=P + T, prompt_len=P, response_len=T,
                   rewards=torch.tensor(list(rewards), dtype=torch.float32),
                   group_ids=torch.tensor(list(group_ids), dtype=torch.int64),
                   mini_batch=torch.tensor(list(mini_batch), dtype=torch.int64),
                   truncated=torch.tensor([r.finish_reason == "length" for r in records], dtype=torch.bool))
        tok: dict[str, list[torch.Tensor]] = {"input_ids": [], "loss_mask": [], "rollout_logp": []}
        if with_topk:
            tok["topk_ids"], tok["topk_logp"] = [], []
        if with_routes:
            tok["routed_experts"] = []
        if with_versions:
            tok["versions"] = []
        for r, p, t in zip(records, P.tolist(), T.tolist()):
            tok["input_ids"].append(torch.cat([r.prompt_ids, r.response_ids]).to(torch.int32))
            mask = torch.zeros(p + t)
            mu = torch.zeros(p + t)
            if r.loss_mask is None:
                mask[p - 1:p - 1 + t] = 1.0
                mu[p - 1:p - 1 + t] = r.rollout_logp.float()
            else:  # an episode: the environment's tokens are no prediction of the policy's
                mask[p - 1:p - 1 + t] = r.loss_mask.float()
                mu[p - 1:p - 1 + t] = torch.where(r.loss_mask, r.rollout_logp.float(), 0.0)
            tok["loss_mask"].append(mask)
            tok["rollout_logp"].append(mu)
            if with_topk:
                tok["topk_ids"].append(r.topk_ids.to(torch.int32))
                tok["topk_logp"].append(r.topk_logp.float())
            if with_routes:
                tok["routed_experts"].append(r.routes)  # compact already (records.py)
            if with_versions:
                v = torch.full((p + t,), UNKNOWN_VERSION, dtype=torch.int32)
                v[p - 1:p - 1 + t] = (r.versions if r.versions is not None
                                      else torch.full((t,), version_number(r.weight_version), dtype=torch.int32))
                tok["versions"].append(v)
        spec = {"input_ids": (torch.int32, ()), "loss_mask": (torch.float32, ()),
                "rollout_logp": (torch.float32, ())}
        if with_topk:
            if not records and top_k is None:
                raise ValueError("an empty batch with top-K rows needs top_k")
            K = records[0].topk_ids.shape[1] if records else top_k
            spec.update(topk_ids=(torch.int32, (K,)), topk_logp=(torch.float32, (K,)))
        if with_versions:
            spec["versions"] = (torch.int32, ())
        if with_routes and tok["routed_experts"]:
            spec["routed_experts"] = (tok["routed_experts"][0].dtype, tuple(tok["routed_experts"][0].shape[1:]))
        elif with_routes:
            if route_shape is None or num_experts is None:
                raise ValueError("an empty batch with routes needs num_experts and route_shape")
            spec["routed_experts"] = (route_dtype(num_experts), tuple(route_shape))
        batch = cls(seq, tok, pad_id, spec)
        if with_topk:
            check_distinct_topk(batch, records)
        return batch

    # ------------------------------------------------------------------------------------------
    # views
    # ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.seq["seq_len"].numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.seq["seq_len"]

    def __contains__(self, name: str) -> bool:
        return name in self.seq or name in self.tok or (name == "labels" and "input_ids" in self.tok)

    def keys(self) -> list[str]:
        return [*self.seq, *self.tok]

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def nbytes(self) -> int:
        n = sum(v.numel() * v.element_size() for v in self.seq.values())
        return n + sum(t.numel() * t.element_size() for ts in self.tok.values() for t in ts)

    def fill(self, name: str, dtype: torch.dtype) -> int | float:
        if name == "input_ids" or name == "labels":
            return self.pad_id
        if name == "topk_ids":
            return -1
        if name == "routed_experts":
            return no_route(dtype)
        if name == "versions":
            return UNKNOWN_VERSION
        return 0

    def start(self, name: str) -> torch.Tensor:
        """[b] the input position of each sequence's first stored row of `name`."""
        if name in RESPONSE_ROWS:
            return self.seq["prompt_len"] - 1
        return torch.zeros_like(self.seq["prompt_len"])

    def padded(self, name: str, indices: Optional[torch.Tensor] = None, S: Optional[int] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """[len(indices), S, ...] of token field `name` (all sequences, S = their longest by default)."""
        idx = torch.arange(len(self)) if indices is None else indices
        lens = self.seq["seq_len"][idx]
        S = int(lens.max()) if S is None and lens.numel() else (S or 0)
        if name == "labels":
            ids = self.padded("input_ids", idx, S + 1, dtype)
            return ids[:, 1:].contiguous()
        rows = self.tok[name]
        own, trail = self.spec[name]
        out_dtype = dtype or own
        out = torch.full((len(idx), S, *trail), self.fill(name, own), dtype=out_dtype)
        starts = self.start(name)[idx].tolist()
        for j, (i, s0) in enumerate(zip(idx.tolist(), starts)):
            t = rows[i]
            n = min(t.shape[0], S - s0)
            if n > 0:
                out[j, s0:s0 + n] = t[:n]
        if name == "routed_experts" and out_dtype != own:
            # A wider dtype (the learner's int64) takes −1 where the compact one says 'no route'.
            out[out == no_route(own)] = -1
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.seq:
            return self.seq[name]
        if name == "labels" or name in self.tok:
            return self.padded(name)
        raise KeyError(f"rollout batch has no field {name!r}; it has {', '.join(self.keys())}")

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        """A per-sequence [b] tensor, or a padded token field [b, S≥seq_len, ...] (stored as rows)."""
        b = len(self)
        if value.shape[0] != b:
            raise ValueError(f"{name}: {tuple(value.shape)} for a batch of {b} sequences")
        if value.dim() == 1:
            self.tok.pop(name, None)
            self.seq[name] = value
            return
        lens = self.seq["seq_len"].tolist()
        if value.shape[1] < max(lens, default=0):
            raise ValueError(f"{name}: {value.shape[1]} positions, the batch's longest sequence has {max(lens)}")
        self.seq.pop(name, None)
        starts = self.start(name).tolist()
        self.tok[name] = [value[i, s0:n].clone() for i, (s0, n) in enumerate(zip(starts, lens))]
        self.spec[name] = (value.dtype, tuple(value.shape[2:]))

    # ------------------------------------------------------------------------------------------
    # subsets
    # ------------------------------------------------------------------------------------------
    def select(self, indices: torch.Tensor) -> "RolloutBatch":
        idx = indices.tolist()
        return RolloutBatch({k: v[indices] for k, v in self.seq.items()},
                            {k: [ts[i] for i in idx] for k, ts in self.tok.items()}, self.pad_id, dict(self.spec))

    @staticmethod
    def cat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        first = batches[0]
        return RolloutBatch({k: torch.cat([b.seq[k] for b in batches]) for k in first.seq},
                            {k: [t for b in batches for t in b.tok[k]] for k in first.tok}, first.pad_id,
                            dict(first.spec))

    def micro_batch(self, indices: torch.Tensor, S: int, device=None) -> dict[str, torch.Tensor]:
        """The learner's padded micro-batch of `indices`, S positions (≥ their longest). Routes
        stay compact (uint8 / int16, `no_route` on padding) on the way to the device; the
        learner's forward step widens them there (`widen_routes`)."""
        out = {}
        for name in self.tok:
            dtype = torch.long if name in ("input_ids", "topk_ids") else None
            out[name] = self.padded(name, indices, S, dtype)
        out["labels"] = self.padded("labels", indices, S, torch.long)
        for name, v in self.seq.items():
            out[name] = v[indices]
        return {k: v.to(device) for k, v in out.items()} if device is not None else out

    # ------------------------------------------------------------------------------------------
    # transport (tensor collectives only)
    # ------------------------------------------------------------------------------------------
    def schema(self) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
        """(kind, name, dtype, trailing shape) of every field, in a fixed order."""
        out = [("seq", k, v.dtype, ()) for k, v in sorted(self.seq.items())]
        return out + [("tok", k, *self.spec[k]) for k in sorted(self.tok)]

    def rows(self, name: str) -> torch.Tensor:
        """[b] stored rows of token field `name` per sequence."""
        return torch.tensor([t.shape[0] for t in self.tok[name]], dtype=torch.int64)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bytes, row counts [fields, b]): every field flattened into one uint8 buffer."""
        parts, rows = [], []
        for kind, name, _, _ in self.schema():
            if kind == "seq":
                parts.append(_bytes(self.seq[name]))
            else:
                parts.extend(_bytes(t) for t in self.tok[name])
                rows.append(self.rows(name))
        counts = torch.stack(rows) if rows else torch.zeros(0, len(self), dtype=torch.int64)
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)), counts

    @classmethod
    def unpack(cls, buf: torch.Tensor, counts: torch.Tensor, schema, b: int, pad_id: int) -> "RolloutBatch":
        seq, tok, spec, at, f = {}, {}, {}, 0, 0
        for kind, name, dtype, trail in schema:
            elem = torch.empty((), dtype=dtype).element_size()
            item = elem * math.prod(trail)
            if kind == "seq":
                n = b * elem
                seq[name] = buf[at:at + n].clone().view(dtype)
                at += n
                continue
            ts = []
            for r in counts[f].tolist():
                n = r * item
                ts.append(buf[at:at + n].clone().view(dtype).reshape(r, *trail))
                at += n
            tok[name] = ts
            spec[name] = (dtype, tuple(trail))
            f += 1
        if at != buf.numel():
            raise RuntimeError(f"rollout batch transport: {buf.numel()} bytes received, {at} expected")
        return cls(seq, tok, pad_id, spec)

    def seq_nbytes(self) -> torch.Tensor:
        """[b] bytes of each sequence (all its fields)."""
        n = torch.full((len(self),), sum(v.element_size() for v in self.seq.values()), dtype=torch.int64)
        for ts in self.tok.values():
            n += torch.tensor([t.numel() * t.element_size() for t in ts], dtype=torch.int64)
        return n

    @staticmethod
    def broadcast(batch: Optional["RolloutBatch"], src: int, group, device,
                  bucket_bytes: int = 256 << 20) -> "RolloutBatch":
        """Collective over `group`: every member returns global rank `src`'s batch (the others
        pass None). One small header (field names, dtypes, sizes) goes by object broadcast; the
        data in buckets of whole sequences (≤ `bucket_bytes` unless one sequence is larger), each
        a row-count tensor and one uint8 buffer, so the sender holds one bucket beyond its batch."""
        me = dist.get_rank()
        header = [None]
        if me == src:
            sizes, chunks, start, acc = batch.seq_nbytes().tolist(), [], 0, 0
            for i, n in enumerate(sizes):
                if acc and acc + n > bucket_bytes:
                    chunks.append((start, i))
                    start, acc = i, 0
                acc += n
            chunks.append((start, len(sizes)))
            header = [(batch.schema(), batch.pad_id, dict(batch.spec), chunks)]
        dist.broadcast_object_list(header, src=src, group=group)
        schema, pad_id, spec, chunks = header[0]
        n_tok = sum(kind == "tok" for kind, *_ in schema)
        parts = []
        for lo, hi in chunks:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            if me == src:
                buf, counts = batch.select(torch.arange(lo, hi)).pack()
                size[0] = buf.numel()
            dist.broadcast(size, src=src, group=group)
            if me == src:
                counts_d, buf_d = counts.to(device), buf.to(device)
            else:
                counts_d = torch.empty(n_tok, hi - lo, dtype=torch.int64, device=device)
                buf_d = torch.empty(int(size), dtype=torch.uint8, device=device)
            dist.broadcast(counts_d, src=src, group=group)
            dist.broadcast(buf_d, src=src, group=group)
            if me != src:
                parts.append(RolloutBatch.unpack(buf_d.cpu(), counts_d.cpu(), schema, hi - lo, pad_id))
            del buf_d
        if me == src:
            return batch
        return RolloutBatch.cat(parts) if parts else RolloutBatch(
            {k: torch.zeros(0, dtype=d) for kind, k, d, _ in schema if kind == "seq"},
            {k: [] for kind, k, _, _ in schema if kind == "tok"}, pad_id, spec)

    def save(self, path, metrics: Optional[dict] = None) -> None:
        """Write the batch (and step metrics) with torch.save: plain tensors, dtypes by name."""
        torch.save({"seq": self.seq, "tok": self.tok, "pad_id": self.pad_id, "metrics": metrics or {},
                    "spec": {k: (str(d).removeprefix("torch."), tr) for k, (d, tr) in self.spec.items()}}, path)

    @classmethod
    def load(cls, path) -> tuple["RolloutBatch", dict]:
        d = torch.load(path, weights_only=False)
        spec = {k: (getattr(torch, dt), tuple(tr)) for k, (dt, tr) in d["spec"].items()}
        return cls(d["seq"], d["tok"], d["pad_id"], spec), d["metrics"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)




# ----------------------------------------------------------------------------------------------
def check_distinct_topk(batch: RolloutBatch, records: Sequence[RolloutRecord]) -> None:
    """Raise if a top-K row names an id twice (−1 padding aside).

    An inference engine's top-K lists distinct tokens; a repeat means a malformed rollout, and the
    learner's top-K divergences assume there is none (`vocab_parallel_policy_stats(topk_distinct=
    True)`), so it is reported here, once per step, naming the sample and the response token.
    """
    for r, ids in zip(records, batch.tok["topk_ids"]):
        srt = ids.sort(dim=-1).values
        rep = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if bool(rep.any()):
            t, k = (int(v) for v in rep.nonzero()[0])
            raise ValueError(
                f"rollout sample (prompt {r.prompt_index}, sample {r.sample_index}): the top-K ids of "
                f"response token {t} name id {int(srt[t, k])} twice ({ids[t].tolist()}); an "
                "inference engine's top-K lists distinct tokens")


def token_rewards(batch) -> torch.Tensor:
    """[B, S]: each outcome reward on its sequence's last response-token prediction."""
    mask = batch["loss_mask"]
    last = (mask * torch.arange(mask.shape[1], dtype=mask.dtype)).argmax(dim=1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = batch["rewards"]
    return out


def mini_batches(batch: RolloutBatch, n: int) -> list[RolloutBatch]:
    """This rank's part of each of the n mini-batches (by `seq["mini_batch"]`; possibly empty)."""
    mb = batch.seq["mini_batch"]
    return [batch.select((mb == m).nonzero().flatten()) for m in range(n)]
