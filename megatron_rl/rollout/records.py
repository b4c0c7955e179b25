"""Typed rollout records, and their construction from one SGLang `/generate` response.

Shapes: P prompt tokens, T response tokens, K top-K width (`top_logprobs_num`), L MoE layers,
k experts per token (the router's top-k).

Alignment (one rule for every per-token field of the response): row t of `rollout_logp`,
`topk_ids`, `topk_logp` and `routed_experts` comes from the decoding step that *produced*
`response_ids[t]`, i.e. the forward step whose input is the token at sequence position P−1+t of
`prompt_ids + response_ids` (the last prompt token for t = 0, response token t−1 after that) and
whose output distribution was sampled to give `response_ids[t]`. That is the same position at
which a learner, running the usual next-token forward over `(prompt_ids + response_ids)[:-1]`,
reads the log-prob of `response_ids[t]`.

SGLang's raw layouts and how they map:
- `output_token_logprobs`: [T] of (logp, token_id, text) — row t is `response_ids[t]`'s log-prob.
- `output_top_logprobs`: [T] lists of K (logp, token_id, text), most likely first.
- `routed_experts`: base64 of int32 [P+T−1−start, L, k]; row j is the routing of the token at
  sequence position start+j (its input position). The last response token is never fed through
  the model, so it has no row. With start = 0 (what the client asks for) the rows split into
  `prompt_routed_experts` = rows [0, P−1) (positions 0..P−2) and `routed_experts` = rows
  [P−1, P−1+T) (positions P−1..P+T−2), i.e. exactly the step that produced each response token.
  Prefix-cache hits do not change this: SGLang keeps routing beside the cached KV entries.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np
import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class RolloutRecord:
    """One sampled response to one prompt, as the rollout engine produced it.

    Per-token response fields have T rows and share one alignment: row t belongs to the decoding
    step that produced `response_ids[t]` (input position P−1+t; see the module docstring).
    """

    prompt_index: int
    """Index of the prompt in the batch passed to the client (= the GRPO group id)."""
    sample_index: int
    """0..n−1 within the prompt's group; (prompt_index, sample_index) is unique in a batch."""
    prompt_ids: torch.Tensor
    """[P] int64 prompt token ids as sent to the engine."""
    response_ids: torch.Tensor
    """[T] int64 generated token ids (the stop token included when generation stopped on one)."""
    rollout_logp: torch.Tensor
    """[T] float32 log μ(response_ids[t] | prefix): log-prob under the rollout policy *after*
    temperature scaling, i.e. log_softmax(logits / temperature) — what SGLang returns (unless the
    server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1). A learner must divide its logits by the
    same `temperature` to compare. top_p / top_k truncation is not reflected in these values."""
    topk_ids: torch.Tensor | None
    """[T, K] int64 the K most likely ids under the same temperature-scaled distribution, most
    likely first, with the sampled token forced in: when `response_ids[t]` is not among SGLang's
    top-K, the last (K-th, least likely) entry is replaced by it (its log-prob is below every
    other entry, so the row stays sorted). Column order is otherwise SGLang's."""
    topk_logp: torch.Tensor | None
    """[T, K] float32 log-probs of `topk_ids` (same scaling as `rollout_logp`)."""
    routed_experts: torch.Tensor | None
    """[T, L, k] int32 expert ids chosen by each MoE layer's router at the step that produced
    `response_ids[t]` (input position P−1+t); None for dense models or when not requested."""
    prompt_routed_experts: torch.Tensor | None
    """[P−1, L, k] int32 routing of prompt positions 0..P−2 (the last prompt position's routing
    is `routed_experts[0]`); None when `routed_experts` is None."""
    finish_reason: str
    """"stop" (a stop token / EOS), "length" (max_new_tokens) or "abort"."""
    weight_version: str
    """The server's weight version when the request finished (set by weight updates)."""
    temperature: float
    """Sampling temperature used; `rollout_logp` and `topk_logp` are scaled by it."""

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.numel())

    def sequence_routed_experts(self) -> torch.Tensor:
        """[P+T−1, L, k]: routing of every input position of `(prompt_ids + response_ids)[:-1]`."""
        if self.routed_experts is None:
            raise ValueError("record has no routed experts (dense model or not requested)")
        return torch.cat([self.prompt_routed_experts, self.routed_experts], dim=0)


def force_sampled_into_topk(topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                            sampled_ids: torch.Tensor, sampled_logp: torch.Tensor):
    """Return copies of ([T, K], [T, K]) where every row contains its sampled token.

    A row missing its sampled token gets it in the last column (the least likely entry).
    """
    ids, logp = topk_ids.clone(), topk_logp.clone()
    missing = ~(ids == sampled_ids[:, None]).any(dim=1)
    ids[missing, -1] = sampled_ids[missing]
    logp[missing, -1] = sampled_logp[missing]
    return ids, logp


def decode_routed_experts(b64: str, num_rows: int, moe_topk: int) -> torch.Tensor:
    """SGLang's base64 int32 routed experts → [num_rows, L, moe_topk] int32."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    per_row = moe_topk * max(num_rows, 1)
    if num_rows == 0 or flat.size % per_row:
        raise ValueError(
            f"routed_experts holds {flat.size} int32 values, which is not {num_rows} rows × "
            f"L layers × {moe_topk} experts for any L; check moe_topk (num_experts_per_tok)"
        )
    return torch.from_numpy(flat.reshape(num_rows, -1, moe_topk).copy())


def _finish_reason(meta: dict[str, Any]) -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in FINISH_REASONS:
        raise ValueError(f"unexpected finish_reason {fr!r} from SGLang (expected one of {FINISH_REASONS})")
    return kind


def record_from_sglang(
    response: dict[str, Any],
    *,
    prompt_ids: list[int],
    prompt_index: int,
    sample_index: int,
    temperature: float,
    top_k: int,
    moe_topk: int | None,
) -> RolloutRecord:
    """Build a RolloutRecord from one SGLang /generate response (a single, non-streamed sample).

    The request must have set `return_logprob=True` and `logprob_start_len=-1` (response tokens
    only); `top_k > 0` means `top_logprobs_num=top_k` was asked for; `moe_topk` (the router's
    top-k) means `return_routed_experts=True` with `routed_experts_start_len=0`.
    """
    meta = response["meta_info"]
    response_ids = torch.tensor(response["output_ids"], dtype=torch.int64)
    T, P = response_ids.numel(), len(prompt_ids)
    token_logprobs = meta["output_token_logprobs"]
    if len(token_logprobs) != T:
        raise ValueError(f"SGLang returned {len(token_logprobs)} log-probs for {T} output tokens")
    logp_ids = torch.tensor([int(x[1]) for x in token_logprobs], dtype=torch.int64)
    if not torch.equal(logp_ids, response_ids):
        raise ValueError("SGLang's output_token_logprobs ids differ from output_ids")
    rollout_logp = torch.tensor([float(x[0]) for x in token_logprobs], dtype=torch.float32)

    topk_ids = topk_logp = None
    if top_k > 0:
        rows = meta["output_top_logprobs"]
        if len(rows) != T or any(len(r) != top_k for r in rows):
            raise ValueError(f"SGLang's output_top_logprobs is not [{T}, {top_k}]")
        raw_ids = torch.tensor([[int(e[1]) for e in r] for r in rows], dtype=torch.int64).reshape(T, top_k)
        raw_logp = torch.tensor([[float(e[0]) for e in r] for r in rows], dtype=torch.float32).reshape(T, top_k)
        topk_ids, topk_logp = force_sampled_into_topk(raw_ids, raw_logp, response_ids, rollout_logp)

    routed = prompt_routed = None
    if moe_topk is not None:
        b64 = meta.get("routed_experts")
        if b64 is None:
            raise ValueError("no routed_experts in the response: start the server with "
                             "--enable-return-routed-experts")
        seq = decode_routed_experts(b64, P + T - 1, moe_topk)
        prompt_routed, routed = seq[: P - 1], seq[P - 1 :]

    return RolloutRecord(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_ids=response_ids,
        rollout_logp=rollout_logp,
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        routed_experts=routed,
        prompt_routed_experts=prompt_routed,
        finish_reason=_finish_reason(meta),
        weight_version=str(meta.get("weight_version", "")),
        temperature=float(temperature),
    )
