"""Rollout placement (megatron_rl/rollout/placement.py): the disaggregated server plan, the model
against a server's TP / EP (SGLang's sharding rules), what is refused and why, the per-server
slot `launch_server --slurm-slot` takes, and the dry-run's printed layout.

The servers' own view (/server_info) and the launch itself are tested with real SGLang servers on
the local Slurm cluster (tests/slurm/test_sbatch.py::test_disaggregated_two_servers_rl_trainer).
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.config.load import load_config, to_object
from megatron_rl.rollout import placement
from megatron_rl.rollout.placement import ModelShape, check_model_fits_server, take_slurm_slot


def job(*overrides, recipe="tiny_cpu"):
    return to_object(load_config(recipe, list(overrides)))


# ---------------------------------------------------------------------------------------------
# the model against a server's TP / EP
# ---------------------------------------------------------------------------------------------
QWEN3_30B_A3B = ModelShape(heads=32, kv_heads=4, ffn=0, experts=128, moe_ffn=768, source="qwen3-30b-a3b")
QWEN3_8B = ModelShape(heads=32, kv_heads=8, ffn=12288, experts=0, moe_ffn=0, source="qwen3-8b")


@pytest.mark.parametrize("shape, tp, ep", [
    (QWEN3_30B_A3B, 4, 1), (QWEN3_30B_A3B, 8, 1),  # 4 KV heads replicated at TP 8
    (QWEN3_30B_A3B, 8, 8), (QWEN3_30B_A3B, 4, 2), (QWEN3_8B, 1, 1), (QWEN3_8B, 8, 1),
])
def test_layouts_sglang_accepts(shape, tp, ep):
    assert f"fit TP {tp}" in check_model_fits_server(shape, tp, ep)


@pytest.mark.parametrize("shape, tp, ep, message", [
    (QWEN3_8B, 3, 1, "32 attention heads are not divisible by TP 3"),
    (ModelShape(48, 12, 0, 0, 0, "m"), 8, 1, "12 KV heads are not divisible by TP 8"),
    (ModelShape(32, 8, 0, 0, 0, "m"), 16, 1, ""),  # 8 KV heads replicated twice: fine
    (ModelShape(20, 4, 0, 0, 0, "m"), 8, 1, "20 attention heads are not divisible by TP 8"),
    (ModelShape(32, 3, 0, 0, 0, "m"), 4, 1, "TP 4 is not a multiple of the 3 KV heads"),
    (ModelShape(32, 8, 0, 100, 768, "m"), 8, 8, "100 experts are not divisible by the server's EP 8"),
    (QWEN3_30B_A3B, 4, 8, "expert-parallel size 8 does not divide TP 4"),
    (ModelShape(32, 8, 0, 128, 100, "m"), 8, 1, "expert MLP width 100 is not divisible by the expert TP 8"),
    (QWEN3_8B, 2, 2, "--ep-size 2 on a dense model"),
])
def test_layouts_sglang_refuses(shape, tp, ep, message):
    if not message:
        check_model_fits_server(shape, tp, ep)
        return
    with pytest.raises(ValueError, match=message):
        check_model_fits_server(shape, tp, ep)


def test_model_shape_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 4,
                                                      "num_experts": 128, "moe_intermediate_size": 768}))
    assert placement.model_shape(job(f"model.hf_path={tmp_path}")) == ModelShape(32, 4, 0, 128, 768,
                                                                                 str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no num_attention_heads"):
        placement.model_shape(job(f"model.hf_path={tmp_path}"))
    assert placement.model_shape(job()) == ModelShape(4, 2, 128, 0, 0, "model.tiny")


# ---------------------------------------------------------------------------------------------
# the launcher's servers: plan, slots, dry-run
# ---------------------------------------------------------------------------------------------
def test_plan_one_server_per_replica_node_by_node():
    slots = placement.plan_servers([("gpu5", "10.0.0.5"), ("gpu6", "10.0.0.6")], gpus_per_node=8, tp=4,
                                   base_port=30000)
    assert [(s.index, s.node, s.slot, s.gpus, s.url) for s in slots] == [
        (0, "gpu5", 0, ("0", "1", "2", "3"), "http://10.0.0.5:30000"),
        (1, "gpu5", 1, ("4", "5", "6", "7"), "http://10.0.0.5:30016"),
        (2, "gpu6", 0, ("0", "1", "2", "3"), "http://10.0.0.6:30000"),
        (3, "gpu6", 1, ("4", "5", "6", "7"), "http://10.0.0.6:30016")]
    with pytest.raises(ValueError, match="ROLLOUT_TP=3 .* does not divide GPUS_PER_NODE=8"):
        placement.plan_servers([("n", "n")], gpus_per_node=8, tp=3, base_port=30000)


def test_slurm_slot_takes_its_gpus_and_port():
    env = {"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8,9", "SLURMD_NODENAME": "gpu5"}
    argv = take_slurm_slot(["--slurm-slot", "--model-path", "m", "--port", "30000", "--tp-size", "2",
                            "--device", "cuda"], env)
    # Slurm's visible set is sliced (task 1 of TP 2: its 3rd and 4th GPU), the port moved by 16.
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert argv == ["--model-path", "m", "--tp-size", "2", "--device", "cuda", "--port", "30016"]
    env = {"SLURM_LOCALID": "1"}
    argv = take_slurm_slot(["--slurm-slot", "--port=30617", "--device", "cpu"], env)
    assert argv == ["--device", "cpu", "--port", "30633"] and "CUDA_VISIBLE_DEVICES" not in env
    env = {"SLURM_LOCALID": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    with pytest.raises(ValueError, match="server slot 4 needs GPUs 8..9 but only 8 are visible"):
        take_slurm_slot(["--slurm-slot", "--tp-size", "2", "--device", "cuda"], env)
    assert take_slurm_slot(["--port", "1"], {}) == ["--port", "1"]  # without the flag: untouched


URLS = "rollout.server_urls=[http://10.0.0.5:30000,http://10.0.0.5:30016]"
LAUNCH = dict(gpus_per_node=8, rollout_nodes="gpu5=10.0.0.5", rollout_port=30000,
              rollout_args="--device cuda --dtype bfloat16 --enable-deterministic-inference")


def test_dry_run_layout_of_the_launchers_servers(tmp_path):
    lines = placement.layout_report(job(URLS, "rollout.server_tp=4", "rollout.placement=disaggregated"), **LAUNCH)
    assert lines[0].startswith("rollout servers: disaggregated -- 2 on 1 node(s), 2 per node (GPUS_PER_NODE 8 "
                               "/ TP 4), dp 1 each; weight sync distributed (group of 9: learner rank 0 + 2 servers x TP 4)")
    assert lines[1:] == ["rollout server 0: node gpu5 (10.0.0.5), GPUs 0,1,2,3, port 30000 -> http://10.0.0.5:30000",
                         "rollout server 1: node gpu5 (10.0.0.5), GPUs 4,5,6,7, port 30016 -> http://10.0.0.5:30016"]
    # The flags the recipe implies are added for the launcher, and the model it serves is the recipe's.
    from megatron_rl.models.tiny import make_tiny_checkpoint

    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    cfg = job(URLS, "rollout.server_tp=4", "rollout.placement=disaggregated", "algorithm.router_replay=r3",
              f"model.hf_path={moe}")
    lines = placement.layout_report(cfg, **{**LAUNCH, "rollout_args": "--device cuda"})
    assert lines[-2:] == ["rollout servers' added args: --enable-deterministic-inference --enable-return-routed-experts",
                          f"rollout servers' model: {moe}"]
    # FP8 rollouts: SGLang's FP8 serving, from the block-scaled copy the launcher makes.
    lines = placement.layout_report(job(URLS, "rollout.server_tp=4", "rollout.placement=disaggregated",
                                        "rollout.quantization=fp8", f"model.hf_path={moe}"),
                                    **{**LAUNCH, "rollout_args": "--device cuda"})
    assert lines[-3:] == ["rollout servers' added args: --quantization fp8 --enable-deterministic-inference",
                          f"rollout servers' model: {moe}", "rollout servers' quantization: fp8"]


@pytest.mark.parametrize("overrides, launch, message", [
    # the user's server_urls are not the launcher's servers
    (["rollout.server_urls=[http://10.0.0.5:30000]", "rollout.server_tp=4"], {}, "are not the servers the launcher starts"),
    # tiny_cpu's 4 heads cannot be split 8 ways
    ([URLS.replace(",http://10.0.0.5:30016", ""), "rollout.server_tp=8"], {}, "4 attention heads are not divisible by TP 8"),
    ([URLS, "rollout.server_tp=4"], {"rollout_args": "--device cuda --enable-deterministic-inference --dp-size 2"},
     "--dp-size 2: SGLang updates weights only on servers with one replica"),
    ([URLS, "rollout.server_tp=4"], {"rollout_args": "--device cuda --enable-deterministic-inference --tp-size 4"},
     "ROLLOUT_ARGS sets the server's TP size"),
    ([], {"rollout_nodes": ""}, None),  # the launcher starts none; tiny_cpu's local servers are fine
    (["rollout.placement=disaggregated"], {"rollout_nodes": ""}, "but none are given: submit with ROLLOUT_NODES"),
])
def test_dry_run_refuses_a_layout_that_cannot_work(overrides, launch, message):
    cfg = job(*overrides)
    if message is None:
        assert placement.layout_report(cfg, **{**LAUNCH, **launch})[0].startswith("rollout servers: local")
        return
    with pytest.raises(ValueError, match=message):
        placement.layout_report(cfg, **{**LAUNCH, **launch})


# ---------------------------------------------------------------------------------------------
# what is refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, device, message", [
    (["rollout.release_memory=true"], "cpu", "colocation on shared GPUs .* is not implemented. Supported: on GPUs"),
    (["rollout.release_memory=true", URLS], "cuda", "is not implemented"),
    (["rollout.weight_sync=tensor"], "cuda", "CUDA IPC handles of learner rank 0's GPU"),
    ([], "cuda", "rank 0 would start rollout.num_servers=1 SGLang server.* on CUDA with no GPUs of their own"),
    (["rollout.gpu_ids=[4,5]"], "cuda", r"need 1 distinct GPU indices \(num_servers=1 x server_tp=1\)"),
    (["rollout.gpu_ids=[4]"], "cpu", "these servers run on CPU"),
    (["rollout.gpu_ids=[4]", URLS], "cuda", "the servers' launcher places them"),
    (["rollout.placement=local", URLS], "cpu", "give one or the other"),
    (["rollout.placement=colocated"], "cpu", "valid: auto, local, disaggregated"),
    (["reward_model.enabled=true", "reward_model.backend=sglang", URLS], "cuda", "reward-model servers rank 0"),
    (["rollout.extra_server_args=[--dp-size,2]"], "cpu", "dp_size = pp_size = 1"),
])
def test_refused_with_what_is_supported(overrides, device, message):
    with pytest.raises(ValueError, match=message):
        placement.check_placement(job(*overrides), device)


def test_supported_placements():
    assert placement.check_placement(job(), "cpu") == "local"  # tiny_cpu: a server beside the learner
    assert placement.check_placement(job("rollout.weight_sync=tensor"), "cpu") == "local"
    assert placement.check_placement(job(URLS), "cuda") == "disaggregated"
    assert placement.check_placement(job("rollout.gpu_ids=[6,7]", "rollout.server_tp=2"), "cuda") == "local"


def test_local_gpu_servers_avoid_the_learners_gpus():
    cfg = job("rollout.gpu_ids=[4,5,6,7]", "rollout.server_tp=2", "rollout.num_servers=2")
    # Rank 0 sees physical GPUs 8..15; its node's learner ranks use the first four.
    visible = [str(g) for g in range(8, 16)]
    assert placement.local_server_gpus(cfg, {"8", "9", "10", "11"}, visible) == [["12", "13"], ["14", "15"]]
    with pytest.raises(ValueError, match="GPU.* 12,13 run learner ranks on rank 0's node"):
        placement.local_server_gpus(cfg, {"8", "9", "12", "13"}, visible)
    with pytest.raises(ValueError, match="rank 0 sees 4 GPUs"):
        placement.local_server_gpus(cfg, set(), visible[:4])
    # The dry-run knows GPUS_PER_NODE learner ranks per node sit on GPUs 0..GPUS_PER_NODE-1.
    cfg = job("rollout.gpu_ids=[4,5,6,7]", "rollout.server_tp=2", "rollout.num_servers=2", "rollout.device=cuda")
    assert placement.layout_report(cfg, gpus_per_node=4)[1:] == [
        "rollout server 0: rank 0's node, GPUs 4,5, a free port", "rollout server 1: rank 0's node, GPUs 6,7, a free port"]
    with pytest.raises(ValueError, match="GPUs below 8 are the learner ranks'"):
        placement.layout_report(cfg, gpus_per_node=8)
