"""Asynchronous training: partial rollouts across a weight update, against the Megatron learner.

`test_per_token_mu_across_weight_update[dense|moe]`: a real SGLang CPU server starts on weights
v0 (a tiny checkpoint, served as version "0"); 8 prompts x 2 samples are generated through
`RolloutClient(continue_aborted=True)`, and while they run the server is paused in abort mode,
reloaded with v1 (same architecture, another seed; version "1") and continued, as a trainer's
weight push does with partial rollouts. The client continues each aborted sample as prompt + its
tokens under v1. Against the Megatron learner holding each version's weights:
- every token's rollout log-prob μ and its top-K log-probs equal the learner's (logits /
  temperature, fp32) under the version `record.versions` names for that token, to 1e-4 (the
  tolerance of test_learner_vs_sglang.py), while the other version's log-probs are far off;
- `versions` changes exactly at the segment boundaries (`record.segments`), v0 then v1;
- MoE (R3): the merged record's routes replayed under v1 reproduce the v1 tokens' μ, and
  `segments[0].routes` replayed under v0 reproduce the v0 tokens', to MU_R3_TOL (fp32 noise between
  the two implementations; wrong routes are off by far more); an aborted running request's routes
  cover all P+T−1 input positions (design risk §6).
One server and one learner process per parameter. The pause is timed by a streamed probe request
decoding beside the samples (tokens, not seconds: a loaded CI machine decodes many times slower);
the generation is retried (≤3 tries, pausing at another point) if no sample was cut by the update.

Through the real trainer (real Megatron-Core learner, real SGLang server):
- trainer.max_staleness=0 is the synchronous loop, bit for bit: the metrics of a seeded run equal
  those recorded from the loop before the producer thread existed (tests/e2e/data/
  sync_golden_tiny_cpu.json, made at git cb2010e; the comparison needs the same CPU, torch,
  megatron-core and SGLang, which the file records);
- max_staleness=1 without partial rollouts (drain) is exactly one step off-policy at every step
  after the first, and kill -9 then resume gives the same run bit for bit (the producer's queued
  share is saved in the checkpoint and trained on after the resume); with partial rollouts a
  resumed run trains on the same prompts at every step;
- partial rollouts with the server killed mid-run: the run completes, every step trains on new
  prompts (no prompt lost or repeated), no token is older than the bound, cut responses were
  continued under new weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import time
from importlib.metadata import version as dist_version
from pathlib import Path

import psutil
import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint
from megatron_rl.run.metrics import read_metrics
from tests.e2e.test_trainer import cli, run, server_url, wait_for_checkpoint  # noqa: F401 - fixture

MU_PROMPTS = [[1, 40, 41, 18, 20, 2, 5, 1, 13], [1, 33, 31, 17, 30, 98, 2, 5, 1, 13, 40], [1, 50, 2, 1, 13],
              [5, 40, 41, 42], [1, 60, 61, 62, 63, 64, 65], [70, 71], [80, 81, 82, 83, 84], [1, 13, 7, 77, 24]]
MU_N, MU_K, MU_MAX_NEW, MU_TEMPERATURE = 2, 5, 64, 0.7
# R3 replays with exact routes differ from μ by SGLang-vs-Megatron fp32 noise only: up to 1.1e-05 measured
# over these ~1000 tokens at T = 0.7 (uncorrelated with |μ|; test_learner_vs_sglang's 48 tokens stay
# under 1e-05), while a wrong route (v0's routing for a v1 prefix) is off by ~5.
MU_R3_TOL = 3e-5
MU_MOE = dict(moe=True, topk=2, num_experts=4)  # router top-k, experts per MoE layer
MU_PAUSE_AT = (12, 4, 24)  # per try: pause once a probe batched with the samples has this many tokens


@pytest.fixture(scope="module", params=["dense", "moe"])
def mu_server(request, tmp_path_factory, shared_server):
    """(moe, v0 path, v1 path, url): one SGLang server on v0, announced as weight version "0"."""
    moe = request.param == "moe"
    root = tmp_path_factory.mktemp(f"mu_{request.param}")
    tiny = dict(MU_MOE if moe else {}, init_std=0.2)  # a larger std: peaked, varied distributions
    v0 = make_tiny_checkpoint(root / "v0", seed=0, **tiny)
    v1 = make_tiny_checkpoint(root / "v1", seed=1, **tiny)
    # Deterministic inference makes `sampling_seed` count (a retried try is reproducible).
    return moe, v0, v1, shared_server(v0, routed=moe, weight_version="0").urls()[0]


async def _progress_probe(session, url, tokens):
    """Stream one extra request (sent after the samples, so batched with them or behind them) and
    return once it has `tokens` tokens: by then every sample is decoding, `tokens` or a few more
    steps in. Waiting on tokens, not on time, keeps the pause inside the samples' decoding on a
    loaded machine too."""
    payload = {"input_ids": [1, 90, 91, 92], "stream": True,
               "sampling_params": {"temperature": 1.0, "max_new_tokens": 4 * MU_MAX_NEW, "ignore_eos": True}}
    resp = await session.post(url + "/generate", json=payload)
    resp.raise_for_status()
    async for line in resp.content:
        if line.startswith(b"data: {") and json.loads(line[6:])["meta_info"]["completion_tokens"] >= tokens:
            return resp  # still streaming: the pause aborts it
    raise AssertionError(f"the progress probe ended before {tokens} tokens")


def _generate_across_update(url, v0, v1, moe, attempt):
    """All samples, with a pause(abort) → load v1 as "1" → continue while they run; returns
    (records, seconds from the pause to continue)."""
    from megatron_rl.rollout.client import RolloutClient, SamplingParams

    eos = json.loads((v0 / "config.json").read_text())["eos_token_id"]
    sampling = SamplingParams(temperature=MU_TEMPERATURE, max_new_tokens=MU_MAX_NEW, seed=1000 * attempt)

    async def go():
        async with RolloutClient([url], moe_topk=MU_MOE["topk"] if moe else None,
                                 num_experts=MU_MOE["num_experts"] if moe else None, backoff_initial=0.1,
                                 continue_aborted=True, eos_token_ids=[eos]) as client:
            api = client.server(url)
            if attempt:  # an earlier try left v1 loaded
                await api.update_weights_from_disk(str(v0), weight_version="0")
            task = asyncio.ensure_future(client.generate(MU_PROMPTS, sampling, n=MU_N, top_k_logprobs=MU_K,
                                                         return_routed_experts=moe))
            deadline = time.monotonic() + 60
            while len(client._inflight.get(url, {})) < len(MU_PROMPTS) * MU_N and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)  # the client's own requests leave before the probe's
            probe = await asyncio.wait_for(_progress_probe(client.session, url, MU_PAUSE_AT[attempt]), 300)
            t = time.monotonic()
            await api.pause_generation("abort")
            await api.update_weights_from_disk(str(v1), weight_version="1")
            await api.continue_generation()
            paused = time.monotonic() - t
            probe.close()
            return [r for row in await task for r in row], paused

    return asyncio.run(go())


def _as_batch(parts, routes):
    """Right-padded [B, S] batch of (prompt, response, record-with-routes) parts; labels are the
    next tokens; top-K ids at each response token's producing position P−1+t."""
    seqs = [p.tolist() + r.tolist() for p, r, _ in parts]
    B, S = len(seqs), max(map(len, seqs))
    ids = torch.zeros(B, S, dtype=torch.long)
    topk = torch.full((B, S, MU_K), -1, dtype=torch.long)
    for i, ((p, r, rec), s) in enumerate(zip(parts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        topk[i, len(p) - 1:len(s) - 1] = rec.topk_ids[:len(r)]
    batch = dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.zeros(B, S), topk_ids=topk)
    if routes:
        out = torch.full((B, S, *parts[0][2].routes.shape[1:]), -1, dtype=torch.long)
        for i, (p, r, rec) in enumerate(parts):
            n = len(p) + len(r) - 1
            out[i, :n] = rec.routes[:n].long()
        batch["routed_experts"] = out
    return batch


def _mu_learner_worker(rank, world_size, v0, v1, full, v0_parts, moe):
    """Under v0, then v1 (reloaded into the same model): log-probs of labels and top-K ids of
    `full` (natural routing), and for MoE the R3 replays (v0: `v0_parts`; v1: `full`)."""
    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.bridge import load_hf_weights
    from megatron_rl.vocab_parallel import vocab_parallel_log_probs

    cfg = JobConfig()
    cfg.model.hf_path = str(v0)
    cfg.learner.micro_batch_size = 64  # each batch in one micro-batch
    learner = Learner(cfg, init_distributed(cfg.parallel), run_dir="/nonexistent", trainable=False)

    def closure(logits_BSV, mb, tp_group, vocab_size):
        ids = torch.cat([mb["labels"][..., None], mb["topk_ids"].clamp(min=0)], dim=-1)
        logp = vocab_parallel_log_probs(logits_BSV.detach(), ids, tp_group, temperature=MU_TEMPERATURE,
                                        vocab_size=vocab_size)
        return logits_BSV.new_zeros(()), {"logp": logp}

    out = {}
    for version, path in ((0, v0), (1, v1)):
        if version:
            load_hf_weights(learner.bridge, learner.model, path)
        for m in learner.model:
            m.eval()
        with torch.no_grad():
            out[version] = torch.cat([m["logp"] for m in learner.run_micro_batches(full, closure, forward_only=True)])
        if moe:
            out[f"replay{version}"] = learner.forward_logprobs(v0_parts if version == 0 else full, routing="replay",
                                                               temperature=MU_TEMPERATURE)
    return out


@pytest.mark.slow
def test_per_token_mu_across_weight_update(mu_server):
    moe, v0, v1, url = mu_server
    for attempt in range(len(MU_PAUSE_AT)):
        records, paused = _generate_across_update(url, v0, v1, moe, attempt)
        mixed = [r for r in records if len(set(r.versions.tolist())) > 1]
        if mixed:
            break
    else:
        pytest.fail(f"in {len(MU_PAUSE_AT)} tries no sample was running when the server paused for the weight "
                    f"update (pauses after {MU_PAUSE_AT} tokens of a probe request sent with them)")
    assert sorted((r.prompt_index, r.sample_index) for r in records) == [
        (i, j) for i in range(len(MU_PROMPTS)) for j in range(MU_N)]
    assert all(r.finish_reason in ("stop", "length") for r in records)

    # versions change exactly where the client started a new segment: v0 (aborted) then v1.
    v0_parts = []  # (prompt, v0 tokens, the record whose routes the v0 tokens were sampled with)
    for r in records:
        P, T, v = len(r.prompt_ids), r.num_response_tokens, r.versions.tolist()
        if r.segments is None:
            assert len(set(v)) == 1 and v[0] in (0, 1) and r.loss_mask is None, (v, r.weight_version)
            if v[0] == 0:
                v0_parts.append((r.prompt_ids, r.response_ids, r))
            continue
        assert len(r.segments) == 2 and r.weight_version == "0,1", (len(r.segments), r.weight_version)
        first, second = r.segments
        T0 = first.num_response_tokens
        assert first.finish_reason == "abort" and second.finish_reason in ("stop", "length")
        assert v == [0] * T0 + [1] * (T - T0)
        assert first.versions.tolist() == v[:T0] and second.versions.tolist() == v[T0:]
        assert torch.equal(second.prompt_ids, torch.cat([r.prompt_ids, first.response_ids]))
        if moe:  # risk §6: the aborted running request's routes cover its P+T0−1 input positions
            assert first.routes.shape[0] == P + T0 - 1 and torch.equal(r.routes, second.routes)
        v0_parts.append((r.prompt_ids, first.response_ids, first))
    assert v0_parts, "every sample was aborted before its first token: nothing of v0 to compare"

    full = _as_batch([(r.prompt_ids, r.response_ids, r) for r in records], routes=moe)
    start = time.monotonic()
    out = run_distributed(_mu_learner_worker, 1, v0, v1, full, _as_batch(v0_parts, routes=moe), moe)[0]
    learner_s = time.monotonic() - start

    worst = {0: [0.0, 0.0], 1: [0.0, 0.0]}  # per version: max |Δ| of μ, of top-K log-probs
    other_version_gap = 0.0
    replay = {0: 0.0, 1: 0.0}
    for i, r in enumerate(records):
        P, T = len(r.prompt_ids), r.num_response_tokens
        for version in (0, 1):
            sel = r.versions == version
            if not sel.any():
                continue
            rows = out[version][i, P - 1:P - 1 + T][sel].double()  # [T_v, 1 + K]
            worst[version][0] = max(worst[version][0], (rows[:, 0] - r.rollout_logp[sel].double()).abs().max().item())
            worst[version][1] = max(worst[version][1], (rows[:, 1:] - r.topk_logp[sel].double()).abs().max().item())
            wrong = out[1 - version][i, P - 1:P - 1 + T][sel][:, 0].double()
            other_version_gap = max(other_version_gap, (wrong - r.rollout_logp[sel].double()).abs().max().item())
            if moe and version == 1:
                got = out["replay1"][i, P - 1:P - 1 + T][sel].double()
                replay[1] = max(replay[1], (got - r.rollout_logp[sel].double()).abs().max().item())
    if moe:
        for i, (p, toks, rec) in enumerate(v0_parts):
            P, T0 = len(p), len(toks)
            got = out["replay0"][i, P - 1:P - 1 + T0].double()
            replay[0] = max(replay[0], (got - rec.rollout_logp[:T0].double()).abs().max().item())
    counts = {v: sum(int((r.versions == v).sum()) for r in records) for v in (0, 1)}
    print(f"{'moe' if moe else 'dense'}: {len(mixed)}/{len(records)} samples span v0 and v1 (try {attempt + 1}, "
          f"pause+load+continue {paused:.2f}s, learner {learner_s:.1f}s); tokens per version {counts}; "
          f"max |μ - learner|: v0 {worst[0][0]:.2e}, v1 {worst[1][0]:.2e}; top-K: v0 {worst[0][1]:.2e}, "
          f"v1 {worst[1][1]:.2e}; against the other version {other_version_gap:.2f}"
          + (f"; R3 replay: v0 {replay[0]:.2e}, v1 {replay[1]:.2e}" if moe else ""))
    assert all(worst[v][0] <= 1e-4 and worst[v][1] <= 1e-4 for v in (0, 1)), worst
    assert other_version_gap > 0.1, other_version_gap  # the two versions' weights are far apart
    if moe:
        assert replay[0] <= MU_R3_TOL and replay[1] <= MU_R3_TOL, replay


# --- through the trainer ---------------------------------------------------------------------
GOLDEN = Path(__file__).parent / "data" / "sync_golden_tiny_cpu.json"
K0_ARGS = ["eval.num_prompts=8", "eval.k=2", "eval.every=2", "trainer.steps=3"]
VOLATILE = ("time/", "rollout/retries", "async/queue_depth")


def fingerprint() -> dict:
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    return {"torch": torch.__version__, "sglang": dist_version("sglang"), "megatron-core": dist_version("megatron-core"),
            "machine": platform.machine(), "cpu": cpu, "avx512f": "avx512f" in flags}


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
def test_k0_is_the_synchronous_loop_bit_for_bit(server_url, tmp_path):  # noqa: F811
    golden = json.loads(GOLDEN.read_text())
    if golden["fingerprint"] != fingerprint():
        pytest.skip(f"the golden was recorded on {golden['fingerprint']}, this is {fingerprint()}: "
                    "other kernels round differently (re-record it with the module docstring's commit)")
    run(tmp_path / "k0", server_url, "trainer.max_staleness=0", *K0_ARGS, small=False)
    rows = read_metrics(tmp_path / "k0")
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]] == [-1, 0, 1, 2]
    for want, got in zip(golden["rows"], rows):
        diff = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
        assert not diff, f"step {want['step']}: {diff}"
    steps = [r for r in rows if r["step"] >= 0]
    assert all(r["async/staleness_max"] == 0 and r["async/tokens_staleness_0"] > 0 for r in steps)
    assert any(r["rollout/accuracy"] > 0 for r in steps)  # the golden trains on real rewards


def kill9_at_checkpoint(out_dir: Path, url: str, args: list[str], step: int) -> None:
    """Start a run in its own process group and kill -9 all of it once checkpoint `step` exists."""
    proc = subprocess.Popen(cli(out_dir, url, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_checkpoint(out_dir, step, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def final_rows(out_dir: Path) -> list[dict]:
    """Training rows of a killed and resumed run, the resumed run's row where a step is logged twice."""
    rows = [r for r in read_metrics(out_dir) if r["step"] >= 0]
    return [r for i, r in enumerate(rows) if r["step"] not in [x["step"] for x in rows[i + 1:]]]


@pytest.mark.slow
def test_one_step_off_drain_is_exact_and_resumes_bit_for_bit(server_url, tmp_path):  # noqa: F811
    args = ["trainer.max_staleness=1", "trainer.steps=5", "trainer.save_every=1"]
    straight = tmp_path / "straight"
    run(straight, server_url, *args)
    a = [r for r in read_metrics(straight) if r["step"] >= 0]
    for r in a:
        # Drain: step t's tokens are all from the weights of step t-1 (t >= 1), i.e. exactly one
        # step off-policy; step 0's from the initial weights.
        assert r["async/staleness_max"] == min(r["step"], 1) == r["async/staleness_mean"], r
        assert r["async/old_token_frac"] == min(r["step"], 1)
        assert r["async/tokens_staleness_0"] + r["async/tokens_staleness_1"] > 0
        # The trust-region diagnostics split by staleness: every token is fresh at step 0 and
        # stale after; stale tokens meet a policy that has moved since they were sampled.
        assert (r["stale/tokens"], r["fresh/tokens"]) == ((r["tokens"], 0.0) if r["step"] else (0.0, r["tokens"]))
    assert all(r["stale/abs_logp_diff/mean"] > 0 for r in a[1:])
    digests = [r["data/prompt_digest"] for r in a]
    assert len(set(digests)) == len(digests)

    killed = tmp_path / "killed"
    kill9_at_checkpoint(killed, server_url, args, 2)
    # The checkpoint holds the producer's share of step 2 (made under the weights of step 1).
    assert (killed / "checkpoints" / "step_00000002" / "queue" / "t00000002.dp0.pt").exists()
    out = run(killed, server_url, *args)
    assert "at step 2" in out.stdout
    b = final_rows(killed)
    assert [r["step"] for r in b] == list(range(5))
    for ra, rb in zip(stable(a), stable(b)):
        diff = {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"

    # With partial rollouts where a response is cut depends on timing, so only the prompts are
    # guaranteed: after kill -9 and resume, every step trains on the prompts the straight run did
    # (the step's prompts do not depend on the staleness or the cuts).
    partial = tmp_path / "partial"
    pargs = [*args, "rollout.partial_rollouts=true", "rollout.max_new_tokens=16"]
    kill9_at_checkpoint(partial, server_url, pargs, 2)
    run(partial, server_url, *pargs)
    c = final_rows(partial)
    assert [r["step"] for r in c] == list(range(5))
    assert [r["data/prompt_digest"] for r in c] == digests


def _rows(out_dir: Path) -> list[dict]:
    return read_metrics(out_dir) if (out_dir / "metrics.jsonl").exists() else []


def _sglang_servers(root: psutil.Process) -> list[psutil.Process]:
    return [p for p in root.children(recursive=True)
            if "megatron_rl.rollout.launch_server" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_partial_rollouts_survive_a_killed_server(tmp_path):
    """Local placement (the trainer's own server, which its manager restarts): kill the server
    while the producer generates ahead; the run completes with every step's prompts new."""
    out_dir = tmp_path / "partial"
    args = ["trainer.max_staleness=1", "rollout.partial_rollouts=true", "rollout.max_new_tokens=24",
            "rollout.max_total_tokens=8192", "trainer.steps=6"]
    cmd = [a for a in cli(out_dir, "", *args) if not a.startswith("rollout.server_urls")]
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not any(r["step"] >= 1 for r in _rows(out_dir)):
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-5000:]
            time.sleep(0.2)
        victims = _sglang_servers(psutil.Process(proc.pid))
        assert victims, "no SGLang server under the trainer"
        for v in victims:
            for p in [v, *v.children(recursive=True)]:
                p.kill()
        assert proc.wait(timeout=900) == 0, (tmp_path / "log.txt").read_text()[-8000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log.txt").read_text()
    rows = [r for r in read_metrics(out_dir) if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(6))
    digests = [r["data/prompt_digest"] for r in rows]
    assert len(set(digests)) == len(digests), digests  # no step's prompts lost or used twice
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert sum(r["async/continued_samples"] for r in rows) > 0  # responses cut at a push went on
    assert sum(r["async/multi_version_samples"] for r in rows) > 0
    assert "restart" in text.lower(), text[-3000:]  # the manager brought the server back
    print({r["step"]: (r["async/staleness_mean"], r["async/continued_samples"], r["async/regenerated_steps"],
                       r["rollout/retries"]) for r in rows})
