"""The rollout-to-learner data path at the DPPO paper's scale, simulated without models (issue 20).

What runs is the project's own code from the HTTP response on: `RolloutClient.generate` (aiohttp,
its JSON decode, `record_from_sglang`), the batch building, the distribution to data-parallel
ranks over gloo, and the micro-batch cut. Only the model is missing: one stand-in server process
per rank answers `/generate` with the bytes SGLang 0.5.23 would send for that sample.

Wire (--wire). `compact` (the default: what the project's patched servers send since commit 7c14963):
the client asks for SGLang's flat base64 top-K (`return_flat_raw_output_top_logprobs` +
`return_flat_raw_top_logprobs_b64`), so `output_top_logprobs` is replaced by
`output_top_logprobs_val_flat_b64` (base64 of float32 [T, K]), `…_idx_flat_b64` (int32 [T, K]),
their `…_dtype` markers, `…_shape` [T, K] and `…_null_prefix` 0, and the routes are narrowed to
uint8 behind a `uint8:` prefix (patches/sglang_fixes.py `encode_routes`, the detokenizer's patch).
`nested` (before): SGLang's defaults, described next. Both draw the same arrays, so the records the
client builds are identical; only the bytes on the wire and their parse differ. The JSON keeps
`wire`, the bytes the servers sent (`server`) and `json_bytes_per_response_token`.

Payloads. `sglang_response` builds the dict SGLang's tokenizer manager returns for one
non-streamed sample (`tokenizer_manager.py`: text, output_ids, meta_info with id, finish_reason
{"type": "stop", "matched": eos} or {"type": "length", "length": T}, prompt_tokens,
weight_version, num_retractions, input_token_logprobs [] (logprob_start_len=-1),
output_token_logprobs [T] of [logp, id, null], output_token_logprobs_length, input_top_logprobs
[] and output_top_logprobs [T] of K [logp, id, null] (when top_logprobs_num was asked),
reasoning/completion/cached tokens, weight_versions, cached_tokens_details, routed_experts =
base64 of int32 [P+T−1, L, k] (the detokenizer's pybase64 of the capturer's int32 tensor),
dp_rank, e2e_latency, response_sent_to_client_ts), serialised as the server does
(`sglang.srt.utils.json_response.dumps_json`: orjson with OPT_NON_STR_KEYS | OPT_SERIALIZE_NUMPY).
That is the `nested` wire; its key order and nesting equal a response captured from a real SGLang
0.5.23 server (tests/e2e/data/sglang_generate_topk_routed.json; the e2e test compares them). The
`compact` wire puts the six flat top-K fields where `output_top_logprobs` was (no capture of a
patched server's body is kept; the e2e test checks the client reads both into the same record).
Log-probs are float32 values (SGLang's tensors are float32) printed as their float64 repr, as SGLang's
`.tolist()` + orjson print them; top-K rows are sorted, name distinct ids and hold the sampled
token in ~95 % of rows; expert ids are distinct per (token, layer).

Shapes (--scale table1 = DPPO Table 1 with Qwen3-30B-A3B): 256 prompts x 16 samples = 4096
sequences, prompts of 100–400 tokens (uniform), responses ~ lognormal(mu=8.14, sigma=1.0)
rounded and clipped to [64, 16384] (mean ≈ 5000 tokens, ≈ 5.9 % clipped = finish "length"),
48 MoE layers x top-8 of 128 experts, top-K log-probs K = 20, 8 mini-batches, DP = 32, vocab
151936. --scale small: 32 prompts x 4 samples, lengths clipped to [64, 2048] (mu − ln 8), 4 MoE
layers, DP = 2 (the two processes are the whole DP group), else the same. Lengths are drawn
once for the whole batch (seeded), so both designs see the same samples.

Why the funnel design cannot run whole at Table-1 scale on 24 GiB: `build_batch` writes the R3
routes as one int64 [B, S, L, k] tensor padded to the longest sequence, i.e. 4096 x ~16.7k x 48
x 8 x 8 B ≈ 210 GB (≈ 214 GB at S = 17k), and broadcast_object_list pickles it (two more
copies on rank 0, two on every receiver). Even the per-record int32 routes the client keeps are
4096 x ~5.2k x 48 x 8 x 4 B ≈ 33 GB, and the JSON bodies ≈ 2.9 KB per token on the nested
wire (base64 int32 routes 2 KiB, top-K text ~0.6 KiB) ≈ 14 MB per mean response ≈ 58 GB through
rank 0; ≈ 0.8 KB per token on the compact wire (uint8 routes 512 B a position, flat top-K 213 B).
So `--design funnel` runs a fraction of the batch (`--fraction`, whole groups: the first groups of the draw) and
reports the ratios measured there; its times and bytes are also extrapolated linearly to the
full batch (by padded bytes B x S_pad, which is what those phases move), labelled extrapolated.

Designs.
- funnel (the path before per-rank batches, commit 80e815a): rank 0 generates every sample of
  the batch (`RolloutClient.generate`, records per response), `build_batch` (batch/rollout_batch.py of
  that commit, kept verbatim below as `legacy_build_batch`), frees the records (they were locals
  of the trainer's `_generate_on_driver`), `broadcast_object_list` of (batch, metrics) to every
  rank; each rank then cuts every mini-batch (`legacy_mini_batches`) into its micro-batches with
  the learner's own `Learner._local_micro_batches` (DP = the 2 processes, `micro_batch_size`
  sequences, padded to the global longest), one mini-batch at a time as `train_step` does.
- sharded (trainer/loop.py `_produce` now): each process is one DP rank of DP = 32 (table1) and
  generates only its own share of whole groups (prompt j by rank j mod DP: 8 groups x 16
  samples, one group of every mini-batch), `RolloutBatch.from_records` (compact, per sequence),
  `rebalance` (lengths all-gathered, sequences sent point-to-point so that each mini-batch's
  tokens are balanced), and the learner's `Learner._budget_micro_batches` on every mini-batch
  (`learner.max_tokens_per_micro_batch` = 20480 at table1, each micro-batch trimmed to its own
  longest), every micro-batch materialised once. Per-rank figures are those of a DP = 32 rank
  measured directly; only the balancing runs among the 2 processes, not 32 ranks.
Both request top-K 20 (a top-K divergence; with a binary one the new design asks for none).

Measured, per rank: peak extra host memory = ru_maxrss at the end minus the RSS just before
generation starts (ru_maxrss cannot miss a short spike; a thread sampling /proc/self/statm every
5 ms gives a cross-check, `peak_extra_bytes_sampled`); bytes received from other ranks (funnel:
the tensor bytes of the unpickled batch, a lower bound of the pickle by a few hundred bytes;
sharded: `rebalance`'s recv_bytes); the client's CPU seconds during generation (decode + parse;
the server is another process); JSON bytes the rank's server sent.

JSON keys (issue 20): rank0_peak_over_batch_bytes = rank 0's peak extra / the compact bytes of
the batch rank 0 holds (funnel: the measured fraction; sharded: rank 0's share); the compact
bytes are counted from the lengths alone, independently of either design, in the compact layout
of `RolloutBatch` (`compact_nbytes`; equal to `RolloutBatch.nbytes()`).
max_rank_recv_over_share = the most bytes a rank receives from other ranks / its share of the
compact batch at the scale's DP (funnel: every rank receives the whole batch, its share is 1/DP
of it). padding_waste = padded token slots / all slots over the micro-batches cut (a token =
one position of prompt + response). assemble_distribute_s = wall time from the last response
parsed (the latest rank's `generate` returning) to the last rank holding its micro-batches (all
mini-batches cut). Targets at table1: <= 1.5, <= 1.1, <= 0.10, <= 8 s.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_data_path.py --scale table1 --design funnel --fraction 1/256 --json out.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_data_path.py --scale table1 --design sharded --json out.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_data_path.py --scale small --design funnel|sharded --json out.json
    (each with --wire compact (default) or --wire nested: SGLang's own encoding, for a before/after)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime
import fractions
import itertools
import json
import math
import multiprocessing
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patches.sglang_fixes import encode_routes  # noqa: E402

EOS_ID, PAD_ID = 151645, 151643  # Qwen3's <|im_end|> and <|endoftext|>
TOPK_STRIDE = 7919  # top-K ids = sampled id + j·7919 mod V: distinct for |j| < 20 (20·7919 < V)
PAGE = os.sysconf("SC_PAGE_SIZE")
WIRES = ("compact", "nested")


@dataclasses.dataclass(frozen=True)
class Scale:
    prompts: int
    samples: int
    moe_layers: int
    experts: int
    moe_topk: int
    topk_logprobs: int
    mini_batches: int
    dp: int
    len_min: int
    len_max: int
    mu: float
    sigma: float
    prompt_min: int = 100
    prompt_max: int = 400
    vocab: int = 151936
    micro_batch_size: int = 1  # funnel: learner.micro_batch_size
    max_tokens: int = 20480  # sharded: token budget of a micro-batch (configs/paper/dppo_table1.yaml)
    pad_to_multiple_of: int = 8  # learner.pad_to_multiple_of (TP = 1, no sequence parallel)
    fraction: str = "1/256"  # funnel: the part of the batch that runs (one group: ~2.5 GB per rank)


SCALES = {
    "table1": Scale(prompts=256, samples=16, moe_layers=48, experts=128, moe_topk=8, topk_logprobs=20,
                    mini_batches=8, dp=32, len_min=64, len_max=16384, mu=8.14, sigma=1.0),
    "small": Scale(prompts=32, samples=4, moe_layers=4, experts=128, moe_topk=8, topk_logprobs=20,
                   mini_batches=8, dp=2, len_min=64, len_max=2048, mu=8.14 - math.log(8), sigma=1.0,
                   max_tokens=4096, fraction="1"),
}


# ------------------------------------------------------------------------------------------------
# the simulated batch
# ------------------------------------------------------------------------------------------------
def draw_lengths(s: Scale, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths [G], response lengths [G, n]) of the whole batch."""
    rng = np.random.default_rng(seed)
    P = rng.integers(s.prompt_min, s.prompt_max + 1, s.prompts)
    T = np.clip(np.rint(rng.lognormal(s.mu, s.sigma, (s.prompts, s.samples))), s.len_min, s.len_max)
    return P.astype(np.int64), T.astype(np.int64)


def prompt_ids(s: Scale, seed: int, group: int, length: int) -> list[int]:
    return np.random.default_rng([seed, 1, group]).integers(0, PAD_ID, length).tolist()


def sglang_response(*, rid: str, prompt: list[int], T: int, max_new_tokens: int, vocab: int,
                    top_k: int, routed: tuple[int, int, int] | None, rng: np.random.Generator,
                    wire: str) -> dict:
    """One sample's /generate answer, as SGLang 0.5.23's tokenizer manager builds it.

    `routed` = (L, k, E) when routed experts were asked for. `wire`: "nested" (SGLang's defaults)
    or "compact" (flat base64 top-K, uint8 routes: the patched server answering the client's
    request); the same draws either way. See the module docstring.
    """
    if wire not in WIRES:
        raise ValueError(f"wire {wire!r} is not one of {WIRES}")
    P = len(prompt)
    length_cut = T >= max_new_tokens
    ids = rng.integers(0, PAD_ID, T)
    if not length_cut:
        ids[-1] = EOS_ID
    if top_k:
        gaps = rng.exponential(0.7, (T, top_k)).astype(np.float32)
        gaps[:, 0] = rng.exponential(0.3, T)
        top_logp = -np.cumsum(gaps, axis=1, dtype=np.float32)  # sorted, most likely first
        pos = np.minimum(rng.geometric(0.6, T) - 1, top_k - 1)  # where the sampled token sits
        inside = rng.random(T) < 0.95
        offs = np.arange(top_k)[None, :] - np.where(inside, pos, -1)[:, None]
        top_ids = (ids[:, None] + offs * TOPK_STRIDE) % vocab
        logp = np.where(inside, top_logp[np.arange(T), pos],
                        top_logp[:, -1] - rng.exponential(1.0, T).astype(np.float32)).astype(np.float32)
    else:
        logp = -rng.exponential(1.5, T).astype(np.float32)
    ids_l = ids.tolist()
    none = itertools.repeat(None)
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": T} if length_cut else {"type": "stop", "matched": EOS_ID},
        "prompt_tokens": P,
        "weight_version": "7",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": list(zip(logp.tolist(), ids_l, none)),
        "output_token_logprobs_length": T,
    }
    if top_k:
        meta["input_top_logprobs"] = []
        if wire == "compact":  # tokenizer_manager.py's flat fields (return_b64=True)
            meta.update(output_top_logprobs_val_flat_b64=base64.b64encode(top_logp.tobytes()).decode(),
                        output_top_logprobs_idx_flat_b64=base64.b64encode(top_ids.astype(np.int32).tobytes()).decode(),
                        output_top_logprobs_val_flat_b64_dtype="float32",
                        output_top_logprobs_idx_flat_b64_dtype="int32",
                        output_top_logprobs_shape=[T, top_k], output_top_logprobs_null_prefix=0)
        else:
            meta["output_top_logprobs"] = [list(zip(lr, ir, none))
                                           for lr, ir in zip(top_logp.tolist(), top_ids.tolist())]
    meta.update(reasoning_tokens=0, completion_tokens=T, cached_tokens=0,
                weight_versions=[{"version": "7", "start": 0, "end": T}], cached_tokens_details=None)
    if routed is not None:
        L, k, E = routed
        first = rng.integers(0, E, (P + T - 1, L, 1), dtype=np.int32)
        experts = (first + np.arange(k, dtype=np.int32) * (E // k)) % E  # distinct per (token, layer)
        meta["routed_experts"] = (encode_routes(experts) if wire == "compact" else  # patches/sglang_fixes.py
                                  base64.b64encode(experts.astype(np.int32).tobytes()).decode("utf-8"))
    meta.update(dp_rank=None, e2e_latency=0.02 * T, response_sent_to_client_ts=time.time())
    text = rng.integers(97, 123, 4 * T, dtype=np.uint8).tobytes().decode("ascii")
    return {"text": text, "output_ids": ids_l, "meta_info": meta}


def dumps_json(content) -> bytes:
    """sglang.srt.utils.json_response.dumps_json (sglang 0.5.23), which `/generate` answers with."""
    import orjson

    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


# ------------------------------------------------------------------------------------------------
# the stand-in server (one process per rank)
# ------------------------------------------------------------------------------------------------
def serve(conn, s: Scale, seed: int, name: str, groups: list[int], resp_len: np.ndarray, wire: str) -> None:
    """Answer /generate for prompt i of the rank's call (= global group groups[i]), sample j, with
    SGLang-shaped bytes on `wire` (the client asks for the flat top-K, which a patched server
    then sends; checked); /bench_stats reports and stops. One response is built at a time."""
    from aiohttp import web

    stats = dict(responses=0, bytes=0, build_s=0.0)
    total = len(groups) * s.samples
    done = asyncio.Event()

    async def generate(request):
        req = await request.json()
        _, i, j, _ = req["rid"].rsplit("-", 3)  # RolloutClient's rid: f"{batch}-{i}-{j}-a{attempt}"
        i, j = int(i), int(j)
        assert req["logprob_start_len"] == -1 and not req["stream"], req
        assert not req.get("top_logprobs_num") or (req.get("return_flat_raw_output_top_logprobs")
                                                   and req.get("return_flat_raw_top_logprobs_b64")), req.keys()
        t = time.perf_counter()
        out = sglang_response(
            rid=req["rid"], prompt=req["input_ids"], T=int(resp_len[groups[i], j]),
            max_new_tokens=req["sampling_params"]["max_new_tokens"], vocab=s.vocab,
            top_k=req.get("top_logprobs_num", 0),
            routed=(s.moe_layers, s.moe_topk, s.experts) if req.get("return_routed_experts") else None,
            rng=np.random.default_rng([seed, 2, groups[i], j]), wire=wire)
        body = dumps_json(out)
        del out
        stats["build_s"] += time.perf_counter() - t
        stats["responses"] += 1
        stats["bytes"] += len(body)
        n = stats["responses"]
        if n % max(1, total // 8) == 0 or n == total:
            print(f"[{name}] {n}/{total} responses sent, {stats['bytes'] / 2**30:.2f} GiB", flush=True)
        return web.Response(body=body, content_type="application/json")

    async def bench_stats(request):
        done.set()
        return web.json_response(stats)

    async def loads(request):  # the client's stall watchdog probes SGLang's /v1/loads
        return web.json_response({"loads": [{"dp_rank": 0}]})

    async def main():
        app = web.Application(client_max_size=1 << 30)
        app.add_routes([web.post("/generate", generate), web.get("/bench_stats", bench_stats),
                        web.get("/v1/loads", loads)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(site._server.sockets[0].getsockname()[1])
        await done.wait()
        await asyncio.sleep(0.2)  # let the stats answer go out
        await runner.cleanup()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------
# the funnel's batch code: batch/rollout_batch.py as of commit 80e815a (before per-rank batches), verbatim
# but for the names; what `_generate_on_driver` and `_mini_batch_steps` called
# ------------------------------------------------------------------------------------------------


def legacy_build_batch(records: Sequence, rewards: Sequence[float], pad_id: int,
                with_topk: bool, with_routes: bool) -> dict[str, torch.Tensor]:
    B = len(records)
    S = max(r.prompt_ids.numel() + r.response_ids.numel() for r in records)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S)
    mu = torch.zeros(B, S)
    K = records[0].topk_ids.shape[1] if with_topk else 0
    topk_ids = torch.full((B, S, K), -1, dtype=torch.long) if with_topk else None
    topk_logp = torch.zeros(B, S, K) if with_topk else None
    routes = None
    if with_routes:
        L, k = records[0].routed_experts.shape[1:]
        routes = torch.full((B, S, L, k), -1, dtype=torch.long)
    for i, r in enumerate(records):
        P, T = r.prompt_ids.numel(), r.response_ids.numel()
        ids[i, :P] = r.prompt_ids
        ids[i, P:P + T] = r.response_ids
        rows = slice(P - 1, P - 1 + T)
        mask[i, rows] = 1.0
        mu[i, rows] = r.rollout_logp.float()
        if with_topk:
            topk_ids[i, rows] = r.topk_ids.long()
            topk_logp[i, rows] = r.topk_logp.float()
        if with_routes:
            seq = r.sequence_routed_experts()
            routes[i, : seq.shape[0]] = seq.long()
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = pad_id
    batch = dict(input_ids=ids, labels=labels, loss_mask=mask, rollout_logp=mu,
                 rewards=torch.tensor(list(rewards), dtype=torch.float32),
                 group_ids=torch.tensor([r.prompt_index for r in records], dtype=torch.long),
                 response_len=torch.tensor([r.response_ids.numel() for r in records]),
                 truncated=torch.tensor([r.finish_reason == "length" for r in records]))
    if with_topk:
        legacy_check_distinct_topk(topk_ids, records)
        batch.update(topk_ids=topk_ids, topk_logp=topk_logp)
    if with_routes:
        batch["routed_experts"] = routes
    return batch


def legacy_check_distinct_topk(topk_ids: torch.Tensor, records: Sequence) -> None:
    """Raise if a top-K row of `topk_ids` [B, S, K] names an id twice (−1 padding aside).

    An inference engine's top-K lists distinct tokens; a repeat means a malformed rollout, and the
    learner's top-K divergences assume there is none (`vocab_parallel_policy_stats(topk_distinct=
    True)`), so it is reported here, naming the sample and the response token.
    """
    srt = topk_ids.sort(dim=-1).values
    rep = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if not bool(rep.any()):
        return
    i, s, k = (int(v) for v in rep.nonzero()[0])
    r = records[i]
    t = s - (r.prompt_ids.numel() - 1)
    raise ValueError(
        f"rollout sample (prompt {r.prompt_index}, sample {r.sample_index}): the top-K ids of "
        f"response token {t} name id {int(srt[i, s, k])} twice ({topk_ids[i, s].tolist()}); an "
        "inference engine's top-K lists distinct tokens")


def legacy_mini_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Split the global batch into n contiguous mini-batches of whole prompt groups."""
    B = batch["input_ids"].shape[0]
    if B % n:
        raise ValueError(f"{B} sequences do not split into algorithm.mini_batches = {n}")
    size = B // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakMemory:
    """Peak extra RSS of this process over a `with` block: ru_maxrss after − RSS before, and a
    thread sampling /proc/self/statm every 5 ms (cross-check)."""

    def __enter__(self):
        self.before, self.maxrss_before = rss_bytes(), maxrss_bytes()
        self.peak, self._stop = self.before, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = maxrss_bytes() - self.before
        self.extra_sampled = self.peak - self.before

    def mark(self, phase: str) -> None:
        """Record the RSS now and the peak so far (both over the baseline) at the end of `phase`."""
        self.phases = getattr(self, "phases", {})
        self.phases[phase] = dict(rss_extra=rss_bytes() - self.before, peak_extra=maxrss_bytes() - self.before)

    def report(self) -> dict:
        return dict(peak_extra_bytes=self.extra, peak_extra_bytes_sampled=self.extra_sampled,
                    rss_before_bytes=self.before, maxrss_before_bytes=self.maxrss_before,
                    phase_memory=getattr(self, "phases", {}))


def compact_nbytes(P: np.ndarray, T: np.ndarray, s: Scale) -> int:
    """Bytes of sequences in the compact per-sequence layout (batch/rollout_batch.py `RolloutBatch`,
    counted here from the lengths alone): per position input ids int32, loss mask and rollout
    log-probs fp32; per response token K top-K ids int32 + log-probs fp32; per input position but
    the last L x k uint8 routes; per sequence 5 int64, 1 fp32, 1 bool."""
    P, T = np.asarray(P, dtype=np.int64), np.asarray(T, dtype=np.int64)
    per = (12 * (P + T) + 8 * T * s.topk_logprobs + (P + T - 1) * s.moe_layers * s.moe_topk
           + 5 * 8 + 4 + 1)
    return int(per.sum())


def shares(s: Scale) -> list[list[int]]:
    """Groups of each DP rank: prompt j of the step is produced by rank j mod DP
    (rollout/fleet.py `Fleet.generate`), i.e. prompts/(mini-batches x DP) of every mini-batch."""
    return [list(range(r, s.prompts, s.dp)) for r in range(s.dp)]


async def _generate(url: str, s: Scale, seed: int, groups: list[int], prompt_len: np.ndarray):
    from megatron_rl.rollout.client import RolloutClient, SamplingParams

    prompts = [prompt_ids(s, seed, g, int(prompt_len[g])) for g in groups]
    async with RolloutClient([url], moe_topk=s.moe_topk, num_experts=s.experts, request_timeout=3600.0) as client:
        out = await client.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=s.len_max),
                                    n=s.samples, top_k_logprobs=s.topk_logprobs, return_routed_experts=True)
    return [r for row in out for r in row]


def generate(url: str, s: Scale, seed: int, groups: list[int], prompt_len: np.ndarray):
    """This rank's records (whole groups), with (parsed-at time, client CPU seconds)."""
    cpu = time.process_time()
    records = asyncio.run(_generate(url, s, seed, groups, prompt_len))
    return records, time.monotonic(), time.process_time() - cpu


def rewards_for(records, seed: int) -> list[float]:
    return [float(np.random.default_rng([seed, 3, r.prompt_index, r.sample_index]).integers(0, 2))
            for r in records]


def funnel_rank(rank: int, world: int, s: Scale, seed: int, urls: list[str], rank_groups: list[list[int]],
                prompt_len: np.ndarray) -> dict:
    """The path before per-rank batches: rank 0 generates and builds the global batch,
    broadcast_object_list, each rank cuts its micro-batches with the learner's
    `_local_micro_batches` (still the learner's path for a dict batch)."""
    import torch.distributed as dist

    from megatron_rl.learner.learner import Learner

    torch.set_num_threads(1)
    learner = learner_stand_in(s, rank, world)
    url, groups = urls[0], rank_groups[0]  # rank 0 generates every sample
    n_mini = min(s.mini_batches, len(groups))
    out: dict = dict(rank=rank)
    dist.barrier()
    with PeakMemory() as mem:
        if rank == 0:
            def driver():  # trainer/loop.py `_generate_on_driver`: records die with it
                records, t_parsed, cpu = generate(url, s, seed, groups, prompt_len)
                mem.mark("generated (records held)")
                out.update(t_parsed=t_parsed, client_cpu_s=cpu, responses=len(records),
                           response_tokens=sum(r.num_response_tokens for r in records))
                print(f"[rank 0] {len(records)} records parsed ({cpu:.1f} s client CPU); build_batch", flush=True)
                batch = legacy_build_batch(records, rewards_for(records, seed), pad_id=PAD_ID,
                                           with_topk=True, with_routes=True)
                return batch, {"reward/mean": 0.5}

            payload = [driver()]
            out["t_built"] = time.monotonic()
            mem.mark("built (records freed)")
            print(f"[rank 0] batch {tuple(payload[0][0]['routed_experts'].shape)} routes; broadcast", flush=True)
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=0)
        out["t_bcast"] = time.monotonic()
        mem.mark("distributed")
        batch = payload[0][0]
        del payload
        out["recv_bytes"] = 0 if rank == 0 else sum(v.nbytes for v in batch.values())
        out["batch_tensor_bytes"] = sum(v.nbytes for v in batch.values())
        real = slots = n_mb = 0
        for mb in legacy_mini_batches(batch, n_mini):
            micro, S_pad, _ = Learner._local_micro_batches(learner, mb)
            for m in micro:
                # real tokens of a row = P + T = (last response-mask position) + 2
                mask = m["loss_mask"]
                last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)
                real += int((last + 2).sum())
                slots += mask.numel()
                n_mb += 1
            del micro
        out["t_hold"] = time.monotonic()
        out["S_pad"] = int(S_pad)
        del batch
    out.update(mem.report(), real_tokens=real, slots=slots, micro_batches=n_mb)
    print(f"[rank {rank}] done: peak extra {mem.extra / 2**30:.2f} GiB, received "
          f"{out['recv_bytes'] / 2**30:.2f} GiB", flush=True)
    return out


def sharded_rank(rank: int, world: int, s: Scale, seed: int, urls: list[str], rank_groups: list[list[int]],
                 prompt_len: np.ndarray) -> dict:
    """The new path (trainer/loop.py `_produce`): this rank generates its own share of groups,
    `RolloutBatch.from_records`, `rebalance` with the DP group, and the learner's token-budget
    micro-batches (`Learner._budget_micro_batches`) of every mini-batch."""
    import torch.distributed as dist

    from megatron_rl.learner.learner import Learner
    from megatron_rl import batch as batching
    from megatron_rl.batch import RolloutBatch

    from megatron_rl.rollout.memory import return_large_frees

    torch.set_num_threads(1)
    learner = learner_stand_in(s, rank, world)
    url, groups = urls[rank], rank_groups[rank]
    out: dict = dict(rank=rank)
    return_large_frees()  # as every producer does (rollout/fleet.py)
    dist.barrier()
    with PeakMemory() as mem:
        records, t_parsed, cpu = generate(url, s, seed, groups, prompt_len)
        mem.mark("generated (records held)")
        out.update(t_parsed=t_parsed, client_cpu_s=cpu, responses=len(records),
                   response_tokens=sum(r.num_response_tokens for r in records))
        print(f"[rank {rank}] {len(records)} records parsed ({cpu:.1f} s client CPU)", flush=True)
        gids = [groups[r.prompt_index] for r in records]
        batch = RolloutBatch.from_records(
            records, rewards_for(records, seed), group_ids=gids,
            mini_batch=[g * s.mini_batches // s.prompts for g in gids], pad_id=PAD_ID,
            with_topk=True, with_routes=True, num_experts=s.experts, route_shape=(s.moe_layers, s.moe_topk))
        del records
        out["own_nbytes"] = batch.nbytes()
        out["t_built"] = time.monotonic()
        mem.mark("built (records freed)")
        batch, stats = batching.rebalance(batch, dist.group.WORLD, s.mini_batches, torch.device("cpu"))
        out["t_bcast"] = time.monotonic()
        mem.mark("distributed")
        out.update(recv_bytes=int(stats["recv_bytes"]), sent_bytes=int(stats["sent_bytes"]),
                   moved_sequences=int(stats["moved_sequences"]), sequences_after=len(batch),
                   batch_nbytes=batch.nbytes())
        real = slots = n_mb = 0
        for mb in batching.mini_batches(batch, s.mini_batches):
            makers, _, _ = Learner._budget_micro_batches(learner, mb)
            for make in makers:  # the learner materialises one micro-batch at a time
                m = make()
                real += int(m["seq_len"].sum())  # a filler micro-batch's seq fields are 0
                slots += m["input_ids"].numel()
                n_mb += 1
                del m
        out["t_hold"] = time.monotonic()
        del batch, mb
    out.update(mem.report(), real_tokens=real, slots=slots, micro_batches=n_mb)
    print(f"[rank {rank}] done: peak extra {mem.extra / 2**30:.2f} GiB, received "
          f"{out['recv_bytes'] / 2**20:.1f} MiB", flush=True)
    return out


def learner_stand_in(s: Scale, rank: int, world: int):
    """What the learner's micro-batch methods read of `self`: the learner config and the DP layout
    (the 2 processes are the DP group; TP = 1)."""
    import types

    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig

    cfg = JobConfig()
    cfg.learner.micro_batch_size = s.micro_batch_size
    cfg.learner.pad_to_multiple_of = s.pad_to_multiple_of
    cfg.learner.max_tokens_per_micro_batch = s.max_tokens
    ctx = types.SimpleNamespace(dp=world, dp_rank=rank, dp_group=dist.group.WORLD, tp=1,
                                sequence_parallel=False, device=torch.device("cpu"))
    # pack: padded micro-batches, what the figures measure (learner.pack_sequences off)
    return types.SimpleNamespace(cfg=cfg, ctx=ctx, pack=False)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def start_servers(s: Scale, seed: int, rank_groups: list[list[int]], resp_len: np.ndarray, wire: str):
    ctx = multiprocessing.get_context("spawn")
    servers = []
    for r, groups in enumerate(rank_groups):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=serve, args=(child, s, seed, f"server r{r}", groups, resp_len, wire), daemon=True)
        p.start()
        servers.append((p, parent))
    urls = []
    for p, conn in servers:
        if not conn.poll(120):
            raise RuntimeError("a stand-in server did not start within 120 s")
        urls.append(f"http://127.0.0.1:{conn.recv()}")
    return servers, urls


def stop_servers(servers, urls) -> list[dict]:
    import urllib.request

    stats = []
    for (p, _), url in zip(servers, urls):
        with urllib.request.urlopen(url + "/bench_stats", timeout=60) as r:
            stats.append(json.loads(r.read()))
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return stats


def length_summary(P: np.ndarray, T: np.ndarray, s: Scale) -> dict:
    T = np.asarray(T).ravel()
    return dict(sequences=int(T.size), response_mean=float(T.mean()),
                response_p50=float(np.percentile(T, 50)), response_p90=float(np.percentile(T, 90)),
                response_p99=float(np.percentile(T, 99)), response_max=int(T.max()),
                clipped_at_max=float((T >= s.len_max).mean()), prompt_mean=float(np.mean(P)))


def funnel_waste(P: np.ndarray, T: np.ndarray, s: Scale) -> float:
    """Padding waste of the funnel's rule on a set of sequences: all padded to the longest."""
    L = (np.asarray(P)[:, None] + np.asarray(T)).ravel()
    S_pad = -(-int(L.max()) // s.pad_to_multiple_of) * s.pad_to_multiple_of
    return 1.0 - float(L.sum()) / (L.size * S_pad)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="small")
    ap.add_argument("--design", choices=("funnel", "sharded"), default="funnel")
    ap.add_argument("--fraction", default=None,
                    help="funnel: part of the batch to run, whole groups (table1 default 1/256, i.e. one group; small: 1)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="sharded: learner.max_tokens_per_micro_batch (default per scale: table1 20480, small 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wire", choices=WIRES, default="compact",
                    help="the stand-in servers' encoding: compact (patched servers: flat base64 top-K, uint8 "
                         "routes) or nested (SGLang's own JSON top-K, int32 routes: the figures before 7c14963)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()

    from megatron_rl.distributed.spawn import run_distributed

    s = SCALES[args.scale]
    if args.max_tokens is not None:
        if args.max_tokens <= 0:
            raise SystemExit(f"--max-tokens must be positive (got {args.max_tokens})")
        s = dataclasses.replace(s, max_tokens=args.max_tokens)
    world = 2
    prompt_len, resp_len = draw_lengths(s, args.seed)
    if s.prompts % (s.mini_batches * s.dp):
        raise SystemExit(f"{s.prompts} prompts do not split into {s.mini_batches} mini-batches x DP {s.dp}")
    if args.design == "funnel":
        frac = fractions.Fraction(args.fraction or s.fraction)
        n_groups = frac * s.prompts
        if not 0 < frac <= 1 or n_groups.denominator != 1:
            raise SystemExit(f"--fraction {frac} of {s.prompts} prompts is not a whole number of groups")
        rank_groups = [list(range(int(n_groups)))]  # rank 0 generates everything
    else:
        frac = fractions.Fraction(1)
        rank_groups = shares(s)[:world]
    gen_groups = sorted(g for gs in rank_groups for g in gs)
    print(f"bench_data_path: scale={args.scale} design={args.design} wire={args.wire} "
          f"groups generated={len(gen_groups)} x {s.samples} samples, response mean of the whole draw {resp_len.mean():.0f} tokens", flush=True)

    servers, urls = start_servers(s, args.seed, rank_groups, resp_len, args.wire)
    try:
        t0 = time.monotonic()
        fn = funnel_rank if args.design == "funnel" else sharded_rank
        ranks = run_distributed(fn, world, s, args.seed, urls, rank_groups, prompt_len, timeout=3600.0)
        wall = time.monotonic() - t0
    finally:
        server_stats = stop_servers(servers, urls)

    t_parsed = max(r["t_parsed"] for r in ranks if "t_parsed" in r)
    t_hold = max(r["t_hold"] for r in ranks)
    assemble = t_hold - t_parsed
    real = sum(r["real_tokens"] for r in ranks)
    slots = sum(r["slots"] for r in ranks)
    gP, gT = prompt_len[gen_groups], resp_len[gen_groups]
    res: dict = dict(
        scale=args.scale, design=args.design, wire=args.wire, commit=git_commit(),
        date=datetime.date.today().isoformat(), torch=torch.__version__, processes=world,
        config=dataclasses.asdict(s) | dict(
            lengths=f"response ~ round(lognormal(mu={s.mu:.4f}, sigma={s.sigma})) clipped to "
                    f"[{s.len_min}, {s.len_max}]; prompt ~ uniform[{s.prompt_min}, {s.prompt_max}]"),
        lengths_whole_batch=length_summary(prompt_len, resp_len, s),
        lengths_generated=length_summary(gP, gT, s),
        memory_method="peak_extra_bytes = ru_maxrss at the end − RSS before generation; "
                      "peak_extra_bytes_sampled = /proc/self/statm every 5 ms − RSS before",
        wall_s=wall, server=server_stats, per_rank=ranks,
        json_bytes_per_response_token=sum(x["bytes"] for x in server_stats) / float(gT.sum()),
        client_cpu_s_per_response_token=sum(r["client_cpu_s"] for r in ranks if "client_cpu_s" in r) / float(gT.sum()),
    )
    share_of = lambda groups: compact_nbytes(prompt_len[groups][:, None].repeat(s.samples, 1), resp_len[groups], s)
    if args.design == "funnel":
        compact = share_of(gen_groups)
        share = compact / s.dp
        r0 = ranks[0]
        res.update(
            fraction=str(frac), groups=len(gen_groups), compact_batch_bytes=compact, share_bytes=share,
            rank0_peak_over_batch_bytes=r0["peak_extra_bytes"] / compact,
            max_rank_recv_over_share=max(r["recv_bytes"] for r in ranks) / share,
            max_rank_recv_over_share_note=f"share = 1/{s.dp} of the measured batch (DP = {s.dp}); "
                                          "every rank receives the whole batch",
            padding_waste=1.0 - real / slots,
            assemble_distribute_s=assemble,
            phases_s=dict(build=r0["t_built"] - t_parsed,
                          broadcast=max(r["t_bcast"] for r in ranks) - r0["t_built"],
                          cut=max(r["t_hold"] - r["t_bcast"] for r in ranks)),
        )
        if frac != 1:
            S_full = -(-int((prompt_len[:, None] + resp_len).max()) // s.pad_to_multiple_of) * s.pad_to_multiple_of
            B_full, B_meas = s.prompts * s.samples, len(gen_groups) * s.samples
            padded = (B_full * S_full) / (B_meas * r0["S_pad"])
            cut = (B_full / s.dp * S_full) / (B_meas / world * r0["S_pad"])
            ph = res["phases_s"]
            res["extrapolated_full_batch"] = dict(
                note="EXTRAPOLATED linearly from the measured fraction: build/broadcast/memory/bytes by "
                     "padded positions B x S_pad, the per-rank cut by its B/DP x S_pad, the client's CPU by "
                     "response tokens; broadcast as one link (the fan-out to DP-1 ranks is not modelled)",
                padded_positions_factor=padded, cut_factor=cut, S_pad_full=S_full, S_pad_measured=r0["S_pad"],
                assemble_distribute_s=(ph["build"] + ph["broadcast"]) * padded + ph["cut"] * cut,
                rank0_peak_extra_bytes=r0["peak_extra_bytes"] * padded,
                recv_bytes_per_rank=max(r["recv_bytes"] for r in ranks) * padded,
                rank0_client_cpu_s=r0["client_cpu_s"] * float(resp_len.sum()) / r0["response_tokens"],
                json_bytes_to_rank0=server_stats[0]["bytes"] * float(resp_len.sum()) / float(gT.sum()),
                compact_batch_bytes=share_of(list(range(s.prompts))),
            )
            res["padding_waste_whole_batch"] = funnel_waste(prompt_len, resp_len, s)
            res["padding_waste_whole_batch_note"] = "computed from all lengths under the same rule (pad to the longest)"
    else:
        own = [share_of(g) for g in rank_groups]
        r0 = ranks[0]
        res.update(
            compact_share_bytes=own,
            rank0_peak_over_batch_bytes=r0["peak_extra_bytes"] / own[0],
            max_rank_peak_over_share=max(r["peak_extra_bytes"] / o for r, o in zip(ranks, own)),
            max_rank_recv_over_share=max(r["recv_bytes"] / o for r, o in zip(ranks, own)),
            padding_waste=1.0 - real / slots,
            assemble_distribute_s=assemble,
            phases_s=dict(build=max(r["t_built"] for r in ranks) - t_parsed,
                          rebalance=max(r["t_bcast"] for r in ranks) - max(r["t_built"] for r in ranks),
                          cut=max(r["t_hold"] - r["t_bcast"] for r in ranks)),
            dp_note=f"each process holds one DP rank's share at DP = {s.dp}; per-rank bytes and times are "
                    f"those of a DP = {s.dp} rank (the balancing exchange runs among {world} ranks, not {s.dp})",
        )
    for k in ("rank0_peak_over_batch_bytes", "max_rank_recv_over_share", "padding_waste", "assemble_distribute_s"):
        print(f"{k:32s} {res[k]:.3f}")
    print(f"{'json_bytes_per_response_token':32s} {res['json_bytes_per_response_token']:.0f}  ({args.wire} wire)")
    print(f"{'client_cpu_us_per_response_token':32s} {res['client_cpu_s_per_response_token'] * 1e6:.2f}")
    if "extrapolated_full_batch" in res:
        e = res["extrapolated_full_batch"]
        print(f"extrapolated to the full batch: assemble_distribute_s {e['assemble_distribute_s']:.1f}, rank 0 peak "
              f"{e['rank0_peak_extra_bytes'] / 1e9:.0f} GB, received per rank {e['recv_bytes_per_rank'] / 1e9:.0f} GB, "
              f"padding waste {res['padding_waste_whole_batch']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
