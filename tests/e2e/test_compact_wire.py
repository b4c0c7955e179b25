"""Compact records on the wire of a real SGLang CPU server (tiny Qwen3-MoE, routed experts on):
what the client's request gets back, finished and aborted.

- A finished answer carries SGLang's flat base64 top-K (`output_top_logprobs_*`, float32 / int32,
  shape [T, K], null prefix 0) and no nested `output_top_logprobs`, and routes narrowed to uint8
  (`uint8:` prefix: patches/sglang_fixes.py reached the detokenizer process); the record read
  from it equals the one read from the same request answered nested (same seed, deterministic
  inference), top-K and routes included.
- A request cut by `/pause_generation` in abort mode (a weight push with partial rollouts) is
  answered as finished (finish_reason abort) with its tokens so far, the flat top-K of exactly
  those tokens and their routes, narrowed: what the client continues from.
"""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from megatron_rl.models.tiny import make_tiny_checkpoint
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.http import _loads
from megatron_rl.rollout.records import record_from_sglang

pytestmark = pytest.mark.slow

K, MOE_TOPK, NUM_EXPERTS = 5, 2, 4
PROMPT = [5, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_server):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("compact_wire") / "ckpt", moe=True, topk=MOE_TOPK,
                                num_experts=NUM_EXPERTS, init_std=0.3, seed=2)
    return shared_server(ckpt, routed=True).urls()[0]


def _payload(max_new_tokens, flat, **extra):
    p = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1, "stream": False,
         "top_logprobs_num": K, "return_routed_experts": True, "routed_experts_start_len": 0,
         "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": 7,
                             "skip_special_tokens": False, **extra}}
    if flat:  # what RolloutClient.generate asks for with top_k_logprobs
        p.update(return_flat_raw_output_top_logprobs=True, return_flat_raw_top_logprobs_b64=True)
    return p


def _record(out):
    return record_from_sglang(out, prompt_ids=PROMPT, prompt_index=0, sample_index=0, temperature=1.0,
                              top_k=K, moe_topk=MOE_TOPK, num_experts=NUM_EXPERTS)


async def _raw(session, url, payload):
    async with session.post(url + "/generate", json=payload) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def _check_flat(meta, T):
    assert "output_top_logprobs" not in meta
    assert meta["output_top_logprobs_shape"] == [T, K] and meta["output_top_logprobs_null_prefix"] == 0
    assert meta["output_top_logprobs_val_flat_b64_dtype"] == "float32"
    assert meta["output_top_logprobs_idx_flat_b64_dtype"] == "int32"
    assert meta["routed_experts"].startswith("uint8:")


def test_finished_answer_is_compact_and_reads_as_the_nested_one(server):
    async def go():
        async with RolloutClient([server]) as client:
            flat = await _raw(client.session, server, _payload(12, True))
            nested = await _raw(client.session, server, _payload(12, False))
            return flat, nested

    flat, nested = asyncio.run(go())

    meta = orjson.loads(flat)["meta_info"]
    T = len(orjson.loads(flat)["output_ids"])
    _check_flat(meta, T)
    assert "output_top_logprobs" in orjson.loads(nested)["meta_info"]
    assert len(flat) < len(nested)
    a, b = _record(_loads(flat, server, "/generate")), _record(_loads(nested, server, "/generate"))
    for name in ("response_ids", "rollout_logp", "topk_ids", "topk_logp", "routes"):
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name
    assert a.routes.shape == (len(PROMPT) + T - 1, 2, MOE_TOPK)


async def _progress_probe(session, url, tokens):
    """A streamed request sent after the sample (so decoding beside it): returns once it has
    `tokens` tokens, by when the sample has about as many (tokens, not seconds: a loaded machine
    decodes many times slower)."""
    payload = {"input_ids": [1, 90, 91, 92], "stream": True,
               "sampling_params": {"temperature": 1.0, "max_new_tokens": 480, "ignore_eos": True}}
    resp = await session.post(url + "/generate", json=payload)
    resp.raise_for_status()
    async for line in resp.content:
        if line.startswith(b"data: {") and orjson.loads(line[6:])["meta_info"]["completion_tokens"] >= tokens:
            return resp  # still streaming: the pause aborts it
    raise AssertionError(f"the progress probe ended before {tokens} tokens")


def test_aborted_answer_carries_its_tokens_compact(server):
    async def go():
        async with RolloutClient([server]) as client:
            api = client.server(server)
            task = asyncio.ensure_future(_raw(client.session, server, _payload(480, True, ignore_eos=True)))
            await asyncio.sleep(0.05)  # the sample's request leaves before the probe's
            probe = await asyncio.wait_for(_progress_probe(client.session, server, 12), 300)
            await api.pause_generation("abort")
            try:
                return await asyncio.wait_for(task, 120)
            finally:
                probe.close()
                await api.continue_generation()

    body = asyncio.run(go())
    out = orjson.loads(body)
    T = len(out["output_ids"])
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < T < 480
    _check_flat(out["meta_info"], T)
    rec = _record(_loads(body, server, "/generate"))
    assert rec.finish_reason == "abort" and rec.topk_ids.shape == (T, K)
    assert rec.routes.shape[0] == len(PROMPT) + T - 1
