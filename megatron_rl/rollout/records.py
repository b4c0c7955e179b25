"""Typed rollout records, and their construction from one SGLang `/generate` response.

Shapes: P prompt tokens, T response tokens, K top-K width (`top_logprobs_num`), L MoE layers,
k experts per token (the router's top-k), E experts per MoE layer.

Alignment (one rule for every per-token field of the response): row t of `rollout_logp`,
`topk_ids`, `topk_logp` and `routed_experts` comes from the decoding step that *produced*
`response_ids[t]`, i.e. the forward step whose input is the token at sequence position P−1+t of
`prompt_ids + response_ids` (the last prompt token for t = 0, response token t−1 after that) and
whose output distribution was sampled to give `response_ids[t]`. That is the same position at
which a learner, running the usual next-token forward over `(prompt_ids + response_ids)[:-1]`,
reads the log-prob of `response_ids[t]`.

Compact storage (a 16k-token response of a 48-layer, top-8 model carries 6.3 M routing entries):
- `routes` is ONE tensor [P+T−1, L, k] — the routing of every input position of
  `(prompt_ids + response_ids)[:-1]` — in `route_dtype(E)`: uint8 while E ≤ 255, else int16
  (E ≤ 32767). Records from a server hold real expert ids only; the value reserved for "no
  route" (`no_route(dtype)`: `NO_ROUTE_U8` = 255 in uint8, −1 in int16) is for whoever pads
  routes into a batch. `routed_experts` ([T, L, k], rows P−1..) and `prompt_routed_experts`
  ([P−1, L, k], rows ..P−2) are views of it, not copies.
- top-K: `topk_ids` int32, `topk_logp` float32.

SGLang's answer on the wire (its raw layouts, their decoding into arrays, `MalformedResponse`):
wire.py. Row j of its routed experts (asked from start 0) is `routes[j]`, so rows [0, P−1) are the
prompt positions 0..P−2 and rows [P−1, P−1+T) the steps that produced the response tokens.

Weight versions: `meta_info.weight_versions` is [{version, start, end}] spans tiling the output
tokens [0, T) in order: tokens start..end−1 were produced under weights `version` (SGLang appends
a span at every weight load that happens while the request has output, utils/weight_versions.py,
and sets `meta_info.weight_version` to the last span's version). → `versions` [T] int32 via
`version_number`: our trainer names versions by step ("0", "1", ...), so a canonical decimal in
[0, 2^31) is its number and anything else — a fresh server's "default", evaluate.py's "eval",
"" — is `UNKNOWN_VERSION` (−1), which no trainer step equals, so such tokens always count as
stale. A server without spans gives every token `meta_info.weight_version`.

A response generated in segments (an episode's turns; a sample the client continued after an
abort) becomes one record by `merge_segments`, which keeps the alignment above.

A malformed or missing field raises `MalformedResponse(field, detail)` (wire.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .wire import (
    MalformedResponse, decode_routed_experts, describe, finish_reason, output_ids, route_width, token_logprobs,
    top_logprobs,
)

NO_ROUTE_U8 = 255
"""The "no route" value of uint8 routes (expert ids 0..254 are real)."""
NO_ROUTE_I16 = -1
"""The "no route" value of int16 routes."""

UNKNOWN_VERSION = -1
"""`versions` value of a token whose weights are not a trainer step (a fresh server's "default",
any non-numeric version) and of an episode's environment tokens (no weights produced them)."""
_VERSION = re.compile(r"0|[1-9][0-9]{0,9}")  # canonical: "07" or "+7" never equals str(step)


def version_number(version: Any) -> int:
    """A weight version string → its trainer step (a canonical decimal in [0, 2^31)), else
    `UNKNOWN_VERSION`."""
    if isinstance(version, str) and _VERSION.fullmatch(version) and int(version) < 2 ** 31:
        return int(version)
    return UNKNOWN_VERSION


def route_dtype(num_experts: int) -> torch.dtype:
    """The dtype of routes of a model with `num_experts` experts per MoE layer: uint8 while ids
    0..E−1 leave 255 free for `NO_ROUTE_U8`, else int16 (E ≤ 32767; `wire.route_width`, the
    width the decoder narrows to). ValueError outside 1..32767."""
    return torch.uint8 if route_width(num_experts) == np.uint8 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The "no route" sentinel of a routes dtype (padding positions of a batch)."""
    if dtype == torch.uint8:
        return NO_ROUTE_U8
    if dtype == torch.int16:
        return NO_ROUTE_I16
    raise ValueError(f"routes are uint8 or int16, not {dtype}")


@dataclasses.dataclass
class RolloutRecord:
    """One sampled response to one prompt, as the rollout engine produced it.

    Per-token response fields have T rows and share one alignment: row t belongs to the decoding
    step that produced `response_ids[t]` (input position P−1+t; see the module docstring). In a
    multi-turn episode the response also holds tokens no decoding step produced (`loss_mask`
    False); their rows are placeholders the loss never reads, but their routes are real.
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
    """[T, K] int32 the K most likely ids under the same temperature-scaled distribution, most
    likely first, with the sampled token forced in: when `response_ids[t]` is not among SGLang's
    top-K, the last (K-th, least likely) entry is replaced by it (its log-prob is below every
    other entry, so the row stays sorted). Column order is otherwise SGLang's."""
    topk_logp: torch.Tensor | None
    """[T, K] float32 log-probs of `topk_ids` (same scaling as `rollout_logp`)."""
    routes: torch.Tensor | None
    """[P+T−1, L, k] expert ids chosen by each MoE layer's router for every input position of
    `(prompt_ids + response_ids)[:-1]`, in `route_dtype(E)` (uint8 while E ≤ 255, else int16);
    None for dense models or when not requested. Row P−1+t is the step that produced
    `response_ids[t]`."""
    finish_reason: str
    """"stop" (a stop token / EOS), "length" (max_new_tokens) or "abort"."""
    weight_version: str
    """The server's weight version when the request finished (set by weight updates)."""
    temperature: float
    """Sampling temperature used; `rollout_logp` and `topk_logp` are scaled by it."""
    loss_mask: torch.Tensor | None = None
    """[T] bool: True where the model sampled `response_ids[t]`, False on tokens it did not
    (tool outputs, user turns: an episode's environment tokens, rollout/episode.py). None: every
    response token is the model's (a single sampled response). Environment rows carry μ 0, top-K
    ids −1 with log-probs 0, and the routes the engine used when it read them."""
    versions: torch.Tensor | None = None
    """[T] int32: the weight version (trainer step, `version_number`) that produced
    `response_ids[t]`, from SGLang's per-token spans; `UNKNOWN_VERSION` (−1) for a version that is
    no step and for environment tokens. None: not recorded (records built by hand)."""
    segments: list[RolloutRecord] | None = dataclasses.field(default=None, repr=False, compare=False)
    """A sample the client continued after aborts (`continue_aborted`): its segments' own records,
    whose routes of older weight versions the merged record does not keep (merge_segments); for
    tests and diagnostics, never batched. None otherwise."""

    def __post_init__(self):
        P, T = self.prompt_ids.numel(), self.response_ids.numel()
        where = f"RolloutRecord (prompt {self.prompt_index}, sample {self.sample_index})"
        if P < 1 or self.rollout_logp.shape != (T,):
            raise ValueError(f"{where}: needs P ≥ 1 prompt tokens and rollout_logp [T={T}], got "
                             f"P = {P}, rollout_logp {tuple(self.rollout_logp.shape)}")
        if (self.topk_ids is None) != (self.topk_logp is None):
            raise ValueError(f"{where}: topk_ids and topk_logp come together")
        if self.topk_ids is not None and not (
                self.topk_ids.dtype == torch.int32 and self.topk_logp.dtype == torch.float32
                and self.topk_ids.dim() == 2 and self.topk_ids.shape[0] == T
                and self.topk_logp.shape == self.topk_ids.shape):
            raise ValueError(f"{where}: topk_ids / topk_logp must be [T={T}, K] int32 / float32, got "
                             f"{tuple(self.topk_ids.shape)} {self.topk_ids.dtype} / "
                             f"{tuple(self.topk_logp.shape)} {self.topk_logp.dtype}")
        if self.routes is not None and not (
                self.routes.dtype in (torch.uint8, torch.int16) and self.routes.dim() == 3
                and self.routes.shape[0] == P + T - 1):
            raise ValueError(f"{where}: routes must be [P+T−1={P + T - 1}, L, k] uint8 or int16 "
                             f"(route_dtype), got {tuple(self.routes.shape)} {self.routes.dtype}")
        if self.loss_mask is not None:
            if self.loss_mask.dtype != torch.bool or self.loss_mask.shape != (T,):
                raise ValueError(f"{where}: loss_mask must be [T={T}] bool, got "
                                 f"{tuple(self.loss_mask.shape)} {self.loss_mask.dtype}")
            if not bool(self.loss_mask.any()):
                raise ValueError(f"{where}: loss_mask marks no response token as the model's; an "
                                 "episode needs at least one model turn")
        if self.versions is not None:
            if self.versions.dtype != torch.int32 or self.versions.shape != (T,):
                raise ValueError(f"{where}: versions must be [T={T}] int32, got "
                                 f"{tuple(self.versions.shape)} {self.versions.dtype}")
            if T and int(self.versions.min()) < UNKNOWN_VERSION:
                raise ValueError(f"{where}: versions holds {int(self.versions.min())}; a version is a "
                                 f"trainer step ≥ 0 or UNKNOWN_VERSION ({UNKNOWN_VERSION})")

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.numel())

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version among the model's tokens (`loss_mask` rows; all rows without
        one): `UNKNOWN_VERSION` when any of them has no known version; None without `versions`
        or tokens."""
        if self.versions is None:
            return None
        v = self.versions if self.loss_mask is None else self.versions[self.loss_mask]
        return int(v.min()) if v.numel() else None

    @property
    def routed_experts(self) -> torch.Tensor | None:
        """[T, L, k] view of `routes` rows P−1.. : the routing of the step that produced
        `response_ids[t]`; None without routes."""
        return None if self.routes is None else self.routes[self.prompt_ids.numel() - 1:]

    @property
    def prompt_routed_experts(self) -> torch.Tensor | None:
        """[P−1, L, k] view of `routes` rows ..P−2: prompt positions 0..P−2 (the last prompt
        position's routing is `routed_experts[0]`); None without routes."""
        return None if self.routes is None else self.routes[: self.prompt_ids.numel() - 1]

    def sequence_routed_experts(self) -> torch.Tensor:
        """[P+T−1, L, k]: `routes`, the routing of every input position of
        `(prompt_ids + response_ids)[:-1]`."""
        if self.routes is None:
            raise ValueError("record has no routed experts (dense model or not requested)")
        return self.routes


def force_sampled_into_topk(topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                            sampled_ids: torch.Tensor, sampled_logp: torch.Tensor):
    """Return copies of ([T, K], [T, K]) where every row contains its sampled token.

    A row missing its sampled token gets it in the last column (the least likely entry).
    """
    ids, logp = topk_ids.clone(), topk_logp.clone()
    _force_sampled_in_place(ids.numpy(), logp.numpy(), sampled_ids.numpy(), sampled_logp.numpy())
    return ids, logp


def _force_sampled_in_place(ids: np.ndarray, logp: np.ndarray, sampled_ids: np.ndarray,
                            sampled_logp: np.ndarray) -> None:
    # numpy, not torch: ~50x faster on [16384, 20] (torch's per-op dispatch and int64 promotion)
    missing = ~(ids == sampled_ids[:, None]).any(axis=1)
    ids[missing, -1] = sampled_ids[missing]
    logp[missing, -1] = sampled_logp[missing]


def token_versions(meta: dict[str, Any], T: int) -> np.ndarray:
    """[T] int32 weight version of each output token from `meta_info.weight_versions` (spans
    tiling [0, T); `version_number` of each); without spans, every token gets
    `meta_info.weight_version`. A loop runs per span (one per weight load during the request),
    never per token. Raises MalformedResponse naming the first bad span."""
    newest = str(meta.get("weight_version", ""))
    spans = meta.get("weight_versions")
    if spans is None:
        return np.full(T, version_number(newest), dtype=np.int32)
    field = "meta_info.weight_versions"
    if type(spans) is not list or not spans:
        raise MalformedResponse(field, "expected a non-empty list of {version, start, end} spans, got "
                                f"{describe(spans)}")
    numbers, lengths, at = [], [], 0
    for s, span in enumerate(spans):
        path = f"{field}[{s}]"
        if type(span) is not dict:
            raise MalformedResponse(path, f"expected {{version, start, end}}, got {describe(span)}")
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(version, str):
            raise MalformedResponse(f"{path}.version", f"expected a version string, got {describe(version)}")
        for name, x in (("start", start), ("end", end)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise MalformedResponse(f"{path}.{name}", f"expected a token index, got {describe(x)}")
        if start != at:
            raise MalformedResponse(f"{path}.start", f"is {start}, expected {at}: the spans must tile the "
                                    f"{T} output tokens in order, each starting where the previous ended")
        if not start < end <= T and not start == end == T == 0:
            raise MalformedResponse(f"{path}.end", f"is {end}: a span ends after its start ({start}) and "
                                    f"at most at the {T} output tokens")
        numbers.append(version_number(version))
        lengths.append(end - start)
        at = end
    if at != T:
        raise MalformedResponse(field, f"cover output tokens [0, {at}), not all {T} (output_ids)")
    if spans[-1]["version"] != newest:
        raise MalformedResponse("meta_info.weight_version", f"{newest!r} differs from the last span's "
                                f"version {spans[-1]['version']!r} (SGLang sets it to that)")
    return np.repeat(np.array(numbers, dtype=np.int32), lengths)


def record_from_sglang(
    response: dict[str, Any],
    *,
    prompt_ids: list[int],
    prompt_index: int,
    sample_index: int,
    temperature: float,
    top_k: int,
    moe_topk: int | None,
    num_experts: int | None = None,
) -> RolloutRecord:
    """Build a RolloutRecord from one SGLang /generate response (a single, non-streamed sample).

    The request must have set `return_logprob=True` and `logprob_start_len=-1` (response tokens
    only); `top_k > 0` means `top_logprobs_num=top_k` was asked for; `moe_topk` (the router's
    top-k) means `return_routed_experts=True` with `routed_experts_start_len=0`, and needs
    `num_experts` (experts per MoE layer) to check the ids and pick the routes' dtype.
    Raises MalformedResponse naming the first missing or malformed field.
    """
    kind = finish_reason(response)
    meta = response["meta_info"]
    response_np = output_ids(response.get("output_ids"))
    T, P = response_np.size, len(prompt_ids)
    if T == 0:
        raise MalformedResponse("output_ids", "is empty (a finished sample has at least one token)")

    rollout_logp, logp_ids = token_logprobs(meta, T)
    if not np.array_equal(logp_ids, response_np):
        t = int(np.argmax(logp_ids != response_np))
        raise MalformedResponse(f"meta_info.output_token_logprobs[{t}][1]",
                                f"token id {int(logp_ids[t])} differs from output_ids[{t}] = {int(response_np[t])}")

    topk_ids = topk_logp = None
    if top_k > 0:
        lp, ids = top_logprobs(meta, T, top_k)
        _force_sampled_in_place(ids, lp, logp_ids, rollout_logp)  # fresh arrays: no copy needed
        topk_ids, topk_logp = torch.from_numpy(ids), torch.from_numpy(lp)

    routes = None
    if moe_topk is not None:
        if num_experts is None:
            raise ValueError("decoding routed experts needs num_experts (experts per MoE layer)")
        b64 = meta.get("routed_experts")
        if b64 is None:
            raise MalformedResponse("meta_info.routed_experts", "missing: start the server with "
                                    "--enable-return-routed-experts")
        routes = decode_routed_experts(b64, P + T - 1, moe_topk, num_experts)
    versions = torch.from_numpy(token_versions(meta, T))

    return RolloutRecord(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_ids=torch.from_numpy(response_np),
        rollout_logp=torch.from_numpy(rollout_logp),
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        routes=routes,
        finish_reason=kind,
        weight_version=str(meta.get("weight_version", "")),
        temperature=float(temperature),
        versions=versions,
    )


def same_layout(a: RolloutRecord, b: RolloutRecord) -> bool:
    """Whether two records can be segments of one record: the same temperature (the learner
    divides its logits by one), top-K width and routes layout."""
    return (a.temperature == b.temperature
            and (a.topk_ids is None) == (b.topk_ids is None)
            and (a.topk_ids is None or a.topk_ids.shape[1] == b.topk_ids.shape[1])
            and (a.routes is None) == (b.routes is None)
            and (a.routes is None or (a.routes.dtype == b.routes.dtype and a.routes.shape[1:] == b.routes.shape[1:]))
            and (a.versions is None) == (b.versions is None))


def _route_version(rec: RolloutRecord) -> int:
    """The weight version a segment's routes came from: its last token's (SGLang's routes of one
    response come from its latest forwards: after a retract, the re-prefill computes them all;
    a record merged from segments has the newest version's routes, which made its last token)."""
    if rec.versions is not None and rec.versions.numel():
        return int(rec.versions[-1])
    return version_number(rec.weight_version.rsplit(",", 1)[-1])


def merge_segments(prompt_ids: Sequence[int] | torch.Tensor, response_ids: Sequence[int] | torch.Tensor,
                   segments: Sequence[tuple[int, RolloutRecord]], *, prompt_index: int, sample_index: int,
                   finish_reason: str | None = None, always_mask: bool = False) -> RolloutRecord:
    """ONE record of a response generated in segments: the one merge rule of an episode's turns
    (rollout/episode.py) and of a sample continued after an abort (prompt + its tokens so far,
    re-submitted with the remaining budget: a turn with no environment tokens before it).

    `segments`: (offset in `response_ids`, record) in order; each record is one response to
    exactly `prompt_ids + response_ids[:offset]` and its tokens are `response_ids[offset:...]`.
    Tokens between segments are environment tokens (no weights produced them); `response_ids`
    ends with the last segment. Every per-token row keeps records.py's alignment:
    - μ, top-K and `versions` rows are the producing segment's rows at its offset; environment
      rows hold μ 0, top-K ids −1 with log-probs 0, version `UNKNOWN_VERSION`;
    - `loss_mask` is True on segment rows, None when there is no environment token (unless
      `always_mask`: an episode's record always has one);
    - `routes` (input positions [0, P+T−1)): every segment returns rows for all of its input
      positions [0, C_k+T_k−1) (C_k its request's tokens). Position p takes its row from the
      first segment, among those covering p, of the newest weight version that covers p (a
      segment's version here is the one its routes came from: its last token's, `_route_version`). With one
      version this is a partition: segment k gives rows from where segment k−1's end through its
      own decoding steps (the prefill of the tokens new to it, then its steps), and the rows a
      later segment returned for earlier positions are unused (they may have been recomputed
      after a prefix-cache eviction; the earlier segment's rows are the ones its log-probs came
      from). After a weight change the whole prefix up to the first newer-version segment comes
      from that segment: replaying the newest version's tokens needs the routing that version
      computed for every earlier position (attention carries it to later tokens), while older
      tokens stay anchored by their exact μ.
    - `finish_reason`: the last segment's unless given (the client's fix-ups of an abort);
      `weight_version`: the segments' distinct versions in order (a merged segment's each),
      joined by commas when they differ (never equal to one trainer version, so a check on `weight_version` treats a
      mixed record as stale; `versions` says which token is which); `temperature`: the
      segments' common one.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()
    response = torch.as_tensor(response_ids, dtype=torch.int64).flatten()
    P, T = prompt.numel(), response.numel()
    where = f"merge_segments (prompt {prompt_index}, sample {sample_index})"
    if not segments:
        raise ValueError(f"{where}: no segment (a response needs at least one sampled segment)")
    first = segments[0][1]
    end = 0
    for k, (off, rec) in enumerate(segments):
        Tk = rec.response_ids.numel()
        if Tk == 0:
            raise ValueError(f"{where}: segment {k} has no token (drop empty segments before merging)")
        if off < end:
            raise ValueError(f"{where}: segment {k} starts at response offset {off}, inside the previous "
                             f"segment (which ends at {end}); segments come in order, not overlapping")
        if k and not same_layout(first, rec):
            raise ValueError(f"{where}: segment {k} was sampled with another temperature, top-K width, routes "
                             "layout or versions presence than segment 0; a record's segments share them")
        if off + Tk > T or not torch.equal(rec.response_ids, response[off:off + Tk]):
            raise ValueError(f"{where}: segment {k}'s {Tk} tokens are not response_ids[{off}:{off + Tk}]")
        C = rec.prompt_ids.numel()
        if C != P + off or not (torch.equal(rec.prompt_ids[:P], prompt)
                                and torch.equal(rec.prompt_ids[P:], response[:off])):
            raise ValueError(f"{where}: segment {k}'s request held {C} tokens that are not the prompt and the "
                             f"{off} response tokens before it; a segment continues the response so far")
        end = off + Tk
    if end != T:
        raise ValueError(f"{where}: the response has {T} tokens but the last segment ends at {end} (drop "
                         "environment tokens after the last segment: no model token reads them)")

    mask = torch.zeros(T, dtype=torch.bool)
    logp = torch.zeros(T, dtype=torch.float32)
    topk_ids = topk_logp = versions = None
    if first.topk_ids is not None:
        topk_ids = torch.full((T, first.topk_ids.shape[1]), -1, dtype=torch.int32)
        topk_logp = torch.zeros(T, first.topk_ids.shape[1], dtype=torch.float32)
    if first.versions is not None:
        versions = torch.full((T,), UNKNOWN_VERSION, dtype=torch.int32)
    for off, rec in segments:
        rows = slice(off, off + rec.response_ids.numel())
        mask[rows] = True
        logp[rows] = rec.rollout_logp
        if topk_ids is not None:
            topk_ids[rows], topk_logp[rows] = rec.topk_ids, rec.topk_logp
        if versions is not None:
            versions[rows] = rec.versions

    routes = None
    if first.routes is not None:
        # owner[p]: the segment whose row p is kept (the docstring's rule), by one vectorised
        # update per segment; strictly newer wins, so the first segment of a version keeps its rows.
        N = P + T - 1
        owner = np.full(N, -1, dtype=np.int64)
        best = np.full(N, np.iinfo(np.int64).min, dtype=np.int64)
        for k, (off, rec) in enumerate(segments):
            e = P + off + rec.response_ids.numel() - 1
            v = _route_version(rec)
            newer = v > best[:e]
            owner[:e][newer] = k
            best[:e][newer] = v
        cuts = [0, *(np.flatnonzero(np.diff(owner)) + 1).tolist(), N]
        routes = torch.cat([segments[int(owner[a])][1].routes[a:b] for a, b in zip(cuts, cuts[1:]) if b > a])

    weight_versions = list(dict.fromkeys(v for _, rec in segments for v in rec.weight_version.split(",")))
    return RolloutRecord(
        prompt_index=prompt_index, sample_index=sample_index, prompt_ids=prompt.clone(),
        response_ids=response.clone(), rollout_logp=logp, topk_ids=topk_ids, topk_logp=topk_logp,
        routes=routes, finish_reason=segments[-1][1].finish_reason if finish_reason is None else finish_reason,
        weight_version=",".join(weight_versions), temperature=first.temperature,
        loss_mask=mask if always_mask or not bool(mask.all()) else None, versions=versions)
