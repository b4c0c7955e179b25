"""benchmarks/bench_data_path.py (issue 20) at --scale small, both designs, as CI runs it.

- the stand-in server's payload has the shape of a real SGLang 0.5.23 `/generate` answer: on the
  nested wire the same keys in the same order and nesting as one captured from a real server
  (tiny Qwen3-MoE, top_logprobs_num=3, routed experts; tests/e2e/data/sglang_generate_topk_routed.json),
  and the client's `record_from_sglang` reads both; on the compact wire (the default: flat base64
  top-K, `uint8:` routes) the same draws, read into the same record, in fewer bytes;
- each design's JSON has the issue's keys with sane values, and what the pipeline measured agrees
  with arithmetic on the drawn lengths (funnel: the padding waste of padding everything to the
  longest sequence; the received batch bytes = B x S_pad x the batch's bytes per position);
- at this scale the sharded design beats the funnel on each of the four figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_data_path.py"
CAPTURED = Path(__file__).parent / "data" / "sglang_generate_topk_routed.json"
KEYS = ("rank0_peak_over_batch_bytes", "max_rank_recv_over_share", "padding_waste", "assemble_distribute_s")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_data_path", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_data_path"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def skeleton(x):
    """Keys (in order) and value types, lists by the skeleton of their first element."""
    if isinstance(x, dict):
        return {k: skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        return [skeleton(x[0])] if x else []
    return type(x).__name__


def test_payload_is_shaped_like_sglang():
    from megatron_rl.rollout.records import record_from_sglang

    bench = _bench()
    real = json.loads(CAPTURED.read_bytes())
    # the captured request: prompt of 9 tokens, max_new_tokens=6, top_logprobs_num=3, 2 MoE
    # layers x top-2 of 8 experts
    prompt = [1, 40, 41, 18, 20, 2, 5, 1, 13]
    ours = json.loads(bench.dumps_json(bench.sglang_response(
        rid="b-0-0-a0", prompt=prompt, T=6, max_new_tokens=6, vocab=256, top_k=3, routed=(2, 2, 8),
        rng=np.random.default_rng(0), wire="nested")))
    assert skeleton(ours) == skeleton(real)
    assert ours["meta_info"]["finish_reason"] == real["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    # the server's own serialisation reproduces the captured bytes exactly
    assert bench.dumps_json(real) == CAPTURED.read_bytes()
    for resp in (real, ours):
        rec = record_from_sglang(resp, prompt_ids=prompt, prompt_index=0, sample_index=0, temperature=1.0,
                                 top_k=3, moe_topk=2, num_experts=8)
        assert rec.routed_experts.shape == (6, 2, 2) and rec.prompt_routed_experts.shape == (8, 2, 2)

    # a long stopped sample at Table-1 widths: sorted distinct top-K rows holding the sampled token
    # mostly, distinct experts per (token, layer), EOS last
    T = 500
    resp = json.loads(bench.dumps_json(bench.sglang_response(
        rid="b-3-1-a0", prompt=prompt, T=T, max_new_tokens=16384, vocab=151936, top_k=20, routed=(48, 8, 128),
        rng=np.random.default_rng(1), wire="nested")))
    assert resp["meta_info"]["finish_reason"] == {"type": "stop", "matched": bench.EOS_ID}
    rec = record_from_sglang(resp, prompt_ids=prompt, prompt_index=3, sample_index=1, temperature=1.0,
                             top_k=20, moe_topk=8, num_experts=128)
    assert rec.response_ids[-1] == bench.EOS_ID and rec.finish_reason == "stop"
    raw = np.array([[e[0] for e in row] for row in resp["meta_info"]["output_top_logprobs"]])
    assert (np.diff(raw, axis=1) <= 0).all()
    assert all(len(set(r)) == 20 for r in rec.topk_ids.tolist())
    inside = np.array([int(i) in row for i, row in
                       zip(resp["output_ids"], [[e[1] for e in r] for r in resp["meta_info"]["output_top_logprobs"]])])
    assert 0.85 < inside.mean() < 1.0
    routes = rec.sequence_routed_experts()
    assert routes.shape == (len(prompt) + T - 1, 48, 8)
    assert (routes.sort(dim=-1).values.diff(dim=-1) > 0).all()

    # the compact wire: the same draws, flat top-K in place of the nested one, uint8 routes; the
    # client's body parse reads it into the same record
    from megatron_rl.rollout.http import _loads

    body = bench.dumps_json(bench.sglang_response(
        rid="b-3-1-a0", prompt=prompt, T=T, max_new_tokens=16384, vocab=151936, top_k=20, routed=(48, 8, 128),
        rng=np.random.default_rng(1), wire="compact"))
    compact = json.loads(body)
    meta, nested_meta = compact["meta_info"], resp["meta_info"]
    assert "output_top_logprobs" not in meta and meta["output_top_logprobs_shape"] == [T, 20]
    assert meta["routed_experts"].startswith("uint8:")
    flat_keys = [k for k in meta if k.startswith("output_top_logprobs_")]
    assert [k for k in meta if k not in flat_keys] == [k for k in nested_meta if k != "output_top_logprobs"]
    assert len(body) < len(bench.dumps_json(resp)) / 3
    rec2 = record_from_sglang(_loads(body, "b", "/generate"), prompt_ids=prompt, prompt_index=3, sample_index=1,
                              temperature=1.0, top_k=20, moe_topk=8, num_experts=128)
    for name in ("response_ids", "rollout_logp", "topk_ids", "topk_logp", "routes", "versions"):
        assert torch.equal(getattr(rec2, name), getattr(rec, name)), name
    assert rec2.finish_reason == rec.finish_reason and rec2.weight_version == rec.weight_version


def _run(design: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{design}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, str(BENCH), "--scale", "small", "--design", design, "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def funnel(tmp_path_factory):
    return _run("funnel", tmp_path_factory.mktemp("bench_funnel"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return _run("sharded", tmp_path_factory.mktemp("bench_sharded"))


def _sane(res: dict, design: str):
    for k in KEYS:
        assert isinstance(res[k], float) and np.isfinite(res[k]) and res[k] > 0, (k, res[k])
    assert 0 < res["padding_waste"] < 1
    assert res["assemble_distribute_s"] < 60
    L = res["lengths_whole_batch"]
    assert L["sequences"] == 32 * 4 and 400 < L["response_mean"] < 1000 and L["response_max"] <= 2048
    ranks = res["per_rank"]
    assert len(ranks) == 2
    for r in ranks:
        assert 0 < r["peak_extra_bytes"] < 4 << 30
        # the sampled peak can only miss what ru_maxrss sees
        assert r["peak_extra_bytes_sampled"] <= r["peak_extra_bytes"] + (16 << 20)
        assert r["micro_batches"] > 0 and 0 < r["real_tokens"] < r["slots"]
    assert sum(s["responses"] for s in res["server"]) == 128


@pytest.mark.slow
def test_funnel_figures(funnel):
    bench = _bench()
    res = funnel
    _sane(res, "funnel")
    s = bench.SCALES["small"]
    P, T = bench.draw_lengths(s, 0)
    # every sequence went through (both ranks' micro-batches together = the whole batch) and the
    # waste is that of padding all to the longest
    assert sum(r["real_tokens"] for r in res["per_rank"]) == int((P[:, None] + T).sum())
    assert res["padding_waste"] == pytest.approx(bench.funnel_waste(P, T, s), abs=1e-12)
    # rank 1 received the whole padded batch: per position ids/labels int64, mask/logp fp32, top-K
    # ids int64 + logp fp32, routes int64 [L, k]; per sequence reward fp32, group id/length int64,
    # truncated bool
    B, S = 128, res["per_rank"][0]["S_pad"]
    assert S >= int((P[:, None] + T).max())
    per_pos = 8 + 8 + 4 + 4 + s.topk_logprobs * 12 + s.moe_layers * s.moe_topk * 8
    assert res["per_rank"][1]["recv_bytes"] == B * (S * per_pos + 4 + 8 + 8 + 1)
    assert res["per_rank"][0]["recv_bytes"] == 0
    assert res["max_rank_recv_over_share"] > s.dp  # every rank receives more than the whole batch


@pytest.mark.slow
def test_sharded_figures(sharded):
    bench = _bench()
    res = sharded
    _sane(res, "sharded")
    s = bench.SCALES["small"]
    P, T = bench.draw_lengths(s, 0)
    ranks = res["per_rank"]
    # each rank built its compact batch from its own groups (prompt j on rank j mod DP): the API's
    # nbytes equals the count from the drawn lengths
    for r, groups in zip(ranks, bench.shares(s)):
        assert r["responses"] == len(groups) * s.samples
        assert r["own_nbytes"] == bench.compact_nbytes(P[groups][:, None].repeat(s.samples, 1), T[groups], s)
    # rebalancing moved sequences between the two ranks and lost none; every sequence went into
    # exactly one micro-batch
    assert ranks[0]["recv_bytes"] == ranks[1]["sent_bytes"] and ranks[1]["recv_bytes"] == ranks[0]["sent_bytes"]
    assert sum(r["sequences_after"] for r in ranks) == 128
    assert sum(r["batch_nbytes"] for r in ranks) == sum(r["own_nbytes"] for r in ranks)
    assert sum(r["real_tokens"] for r in ranks) == int((P[:, None] + T).sum())


@pytest.mark.slow
def test_sharded_beats_funnel(funnel, sharded):
    for k in KEYS:
        assert sharded[k] < funnel[k], (k, sharded[k], funnel[k])
