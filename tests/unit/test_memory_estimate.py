"""The learner's per-GPU memory estimate (megatron_rl/models/memory.py) and the dry-run's check.

- the estimator against hand arithmetic: Qwen3-30B-A3B's published shape (30.53B parameters; at
  TP 2 / EP 8, 0.78B dense + 3.62B expert per rank; 49 GB static at 16 learner ranks) and a small
  dense shape term by term;
- its parameter count against real models: the HF transformers model of tiny_qwen3 / tiny_qwen3_moe
  (TP 1), and an independent count (models/layout.py `parameter_count`); the per-rank split of a
  real Megatron model at TP 2, PP 2, EP 2 is in tests/distributed/test_weight_export.py
  (its world-2 process group);
- the dry-run of the paper recipe at the three layouts for 3 and 4 nodes (2+1, 2+2, 3+1), launched
  as the sbatch launches it: each passes and prints its learner line; an over-memory layout is
  refused, naming what would fit;
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on CUDA unless the user set it.
"""

from __future__ import annotations

import collections
import json
import shutil

import pytest

from megatron_rl.config.load import load_config, to_object
from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.memory import GB, Layout, check_memory, estimate, model_dims, params_per_rank

RECIPE = "dppo_topk_tv_qwen3_30b_a3b_base_r3"
# Qwen3-30B-A3B-Base's config.json (the published values the estimate reads)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                 "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                 "mlp_only_layers": []}


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """What the paper recipe points at: the 30B's full config.json (stand-in weights and tokenizer,
    as models/hub.py checks them) and DAPO-layout Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("paper30b")
    model = root / "models" / "Qwen3-30B-A3B-Base"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model-00001-of-00001.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    (root / "data").mkdir()
    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(5)]
    for name in ("dapo-math-17k", "aime-2024", "aime-2025"):
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{name}.parquet")
    return root


@pytest.fixture
def paper_env(paper, monkeypatch):
    monkeypatch.setenv("MRL_DATA", str(paper / "data"))
    monkeypatch.setenv("MRL_MODELS", str(paper / "models"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # A 30B run keeps three 427 GB checkpoints; this machine's disk is not the cluster's file system
    # (the storage check is run/checkpoint.py's, tested there).
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**14, 0, 10**14))
    return paper


def dims_30b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return model_dims(ModelConfig(hf_path=str(tmp_path)))


# ---------------------------------------------------------------------------------------------
# against hand arithmetic
# ---------------------------------------------------------------------------------------------
def test_30b_per_rank_by_hand(tmp_path):
    d = dims_30b(tmp_path)
    h, q, kv, f, E = 2048, 32 * 128, 4 * 128, 768, 128
    vocab = 152064  # 151,936 padded to a multiple of 128 x TP 2
    lay = Layout(world_size=16, tp=2, ep=8, sequence_parallel=True, tokens=20480, recompute=True)
    attention = (h * (q + 2 * kv) + q * h) // 2 + 2 * 128 + 2 * h  # QKV, proj / TP; q/k norms, 2 norms whole
    dense = 48 * (attention + h * E) + 2 * vocab * h // 2 + h  # + router per layer; embedding, output layer, final norm
    expert = 48 * (E // 8) * 3 * h * f
    assert params_per_rank(d, lay) == (dense, expert)
    assert round(dense / 1e9, 2) == 0.78 and round(expert / 1e9, 2) == 3.62  # the figures
    # the whole model at TP 1 (151,936 needs no padding at 128): 30.53B, as models/layout.py counts it
    from megatron_rl.models.layout import parameter_count

    total = sum(params_per_rank(d, Layout(world_size=1)))
    assert total == parameter_count(ModelConfig(hf_path=str(tmp_path))) and round(total / 1e9, 2) == 30.53

    e = estimate(d, lay)
    assert e.weights == 2 * (dense + expert) and e.grads == 4 * (dense + expert)
    assert e.optimizer == pytest.approx(12 * (dense / 8 + expert / 2))  # Adam + fp32 main over DP 8 / expert-DP 2
    static = (e.weights + e.grads + e.optimizer) / GB
    assert 49 <= static <= 49.5  # "about 49 GB static"
    # logits: bf16 logits, their gradient and its contiguous copy on the shard, + the loss's fp32 chunk
    assert e.logits == pytest.approx(3 * 20480 * vocab // 2 * 2 + 4 * 1024 * vocab // 2 * (1 + 1 / 16))
    # full recompute: every layer's input (b·h/TP per token, sequence parallel) + one layer and its gradients
    assert e.activations > 48 * 20480 * 2 * h / 2
    dynamic = (e.activations + e.logits) / GB
    assert 16 <= dynamic <= 21  # the 18-21 GB counts the margin's workspaces in part
    assert 68 <= e.total / GB <= 72 and e.fraction < 0.95


def test_small_dense_shape_term_by_term():
    """A dense shape, TP 1, no recompute: every term written out."""
    from megatron_rl.models.memory import MARGIN_BYTES, ModelDims

    d = ModelDims(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, experts=0, topk=0, moe_ffn=0,
                  moe_layers=0, vocab=256, tied=False, source="hand")
    lay = Layout(world_size=2, tokens=1000, dtype_bytes=4, distributed_optimizer=True)
    per_layer_params = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 16 + 2 * 64 + 3 * 64 * 128
    params = 2 * per_layer_params + 2 * 256 * 64 + 64
    assert params_per_rank(d, lay) == (params, 0)
    e = estimate(d, lay, device_bytes=1e9, device_name="test")
    assert (e.weights, e.grads) == (4 * params, 4 * params)
    assert e.optimizer == 8 * params / 2  # fp32 weights: Adam's m and v only, over DP 2
    attention = 4 * (2 * 64 + (64 + 64) + 3 * (64 + 32) + 64) + 4 * 4
    mlp = 4 * (2 * 64 + 3 * 128)
    assert e.activations == pytest.approx(1000 * (2 * (attention + mlp) + (attention + mlp)))  # 2 layers + 1 of gradients
    assert e.logits == pytest.approx(3 * 1000 * 256 * 4 + 4 * 1000 * 256 * (1 + 1 / 16))
    assert e.margin == pytest.approx(MARGIN_BYTES + 0.1 * (e.activations + e.logits))
    recomputed = estimate(d, Layout(world_size=2, tokens=1000, dtype_bytes=4, recompute=True))
    assert recomputed.activations == pytest.approx(1000 * (2 * 4 * 64 + 2 * (attention + mlp)))
    # PP 2 (1F1B): one layer per stage, its input kept for 2 micro-batches in flight
    piped = estimate(d, Layout(world_size=2, pp=2, tokens=1000, dtype_bytes=4, recompute=True))
    assert piped.activations == pytest.approx(1000 * (4 * 64 * 2 + 2 * (attention + mlp)))
    assert params_per_rank(d, Layout(world_size=2, pp=2)) == (per_layer_params + 64 + 256 * 64, 0)  # the last stage


@pytest.mark.parametrize("recipe", ["tiny_cpu", "tiny_moe_cpu_r3"])
def test_parameter_count_equals_the_real_models(recipe, tmp_path):
    """tiny_qwen3 / tiny_qwen3_moe (the recipes' model.tiny, and the HF checkpoint the run builds from
    it): the estimate's parameters at TP 1 are the HF model's numel, its expert part the experts'."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import make_tiny_checkpoint

    model = to_object(load_config(recipe)).model
    path = make_tiny_checkpoint(tmp_path / "m", **dataclasses.asdict(model.tiny))
    hf = AutoModelForCausalLM.from_pretrained(path)
    dense, expert = params_per_rank(model_dims(ModelConfig(hf_path=str(path))), Layout(world_size=1))
    assert dense + expert == sum(p.numel() for p in hf.parameters())
    assert expert == sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert (expert > 0) == model.tiny.moe
    assert params_per_rank(model_dims(model), Layout(world_size=1)) == (dense, expert)  # read from model.tiny


# ---------------------------------------------------------------------------------------------
# the dry-run at the three layouts, as the sbatch launches it
# ---------------------------------------------------------------------------------------------
def sbatch_dry_run(parallel: str, learner_nodes: int, rollout_nodes: int, out_dir) -> list[str]:
    """The dry-run line slurm/megatron_rl.sbatch runs: world size, servers, their URLs and TP."""
    addrs = [f"10.0.0.{20 + i}" for i in range(rollout_nodes)]
    urls = [f"http://{a}:{30000 + 16 * k}" for a in addrs for k in range(2)]
    return [RECIPE, f"parallel={parallel}", f"trainer.out_dir={out_dir}", "rollout.placement=disaggregated",
            f"rollout.server_urls=[{','.join(urls)}]", "rollout.server_tp=4",
            "--world-size", str(8 * learner_nodes), "--gpus-per-node", "8",
            "--rollout-nodes=" + ",".join(f"r{i}={a}" for i, a in enumerate(addrs)),
            "--rollout-args=--device cuda --dtype bfloat16"]


@pytest.mark.parametrize("parallel, learner, rollout, line", [
    ("h100_moe_2node", 2, 1, "learner memory per GPU: 71.3 GB of 80.0 (80GB, the recipe's hardware), 89 %"),
    ("h100_moe_2node", 2, 2, "learner memory per GPU: 71.3 GB of 80.0 (80GB, the recipe's hardware), 89 %"),
    ("h100_moe_3node", 3, 1, "learner memory per GPU: 63.7 GB of 80.0 (80GB, the recipe's hardware), 80 %"),
])
def test_three_and_four_node_layouts_pass_the_dry_run(parallel, learner, rollout, line, paper_env, tmp_path, capsys):
    import torch

    from megatron_rl import cli

    if torch.cuda.is_available():
        pytest.skip("the figures are the recipe's H100 80GB; a CUDA device here is checked as itself")
    assert cli.main(["dry-run", *sbatch_dry_run(parallel, learner, rollout, tmp_path / "run")]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"rollout servers: disaggregated -- {2 * rollout} on {rollout} node(s)" in out
    assert f"layout for world size {8 * learner}: tp=2 pp=1 vpp=None ep=8 etp=1 dp={4 * learner}" in out
    shown = next(s for s in out.splitlines() if s.startswith("learner memory per GPU"))
    assert shown.startswith(line)
    assert (f"0.78B dense + 3.62B expert parameters per rank (TP 2, PP 1, EP 8, ETP 1; DP {4 * learner}, "
            f"expert-DP {learner}), 20480 tokens per micro-batch, recompute full") in shown


@pytest.mark.parametrize("overrides, world, names", [
    # without recompute a 16k-token micro-batch keeps every layer's activations
    (["parallel=h100_moe_2node", "model.recompute=none"], 16, ["model.recompute=full: 71.3 GB"]),
    # one learner node: the expert Adam state is not sharded at all (expert-DP 1)
    (["parallel=h100_moe_2node", "parallel.world_size=8"], 8,
     ["2 learner nodes (world size 16): 71.3 GB", "3 learner nodes (world size 24): 63.7 GB"]),
])
def test_dry_run_refuses_a_layout_over_the_memory_limit(overrides, world, names, paper_env, tmp_path, capsys):
    import torch

    from megatron_rl import cli

    if torch.cuda.is_available():
        pytest.skip("the figures are the recipe's H100 80GB")
    argv = ["dry-run", RECIPE, *overrides, f"trainer.out_dir={tmp_path / 'run'}"]
    assert cli.main([*argv, "--world-size", str(world)]) == 2
    err = capsys.readouterr().err
    assert "the learner does not fit its GPUs: learner memory per GPU:" in err
    assert "above learner.memory_limit=0.95 (76.0 GB). Any of these fits: " in err
    for name in names:
        assert name in err
    # learner.memory_limit=0: the check is skipped (the estimate still printed)
    assert cli.main([*argv, "learner.memory_limit=0", "--world-size", str(world)]) == 0, capsys.readouterr().err
    assert "learner memory per GPU:" in capsys.readouterr().out


def test_refusal_names_a_token_budget_not_below_the_longest_response(tmp_path):
    d = dims_30b(tmp_path)
    e = estimate(d, Layout(world_size=16, tp=2, ep=8, sequence_parallel=True, tokens=65536, recompute=True))
    with pytest.raises(ValueError) as err:
        check_memory(e, 0.95, min_tokens=16384)
    budget = int(str(err.value).split("learner.max_tokens_per_micro_batch=")[1].split(":")[0])
    assert budget % 1024 == 0 and budget >= 16384
    fits = lambda tokens: estimate(d, Layout(world_size=16, tp=2, ep=8, sequence_parallel=True,  # noqa: E731
                                             tokens=tokens, recompute=True)).fraction <= 0.95
    assert fits(budget) and not fits(budget + 1024)  # the largest that fits
    with pytest.raises(ValueError) as err:
        check_memory(e, 0.95, min_tokens=budget + 1)  # no budget under the limit holds the longest response
    assert "max_tokens_per_micro_batch" not in str(err.value)


def test_cpu_recipes_print_no_estimate_and_partial_configs_say_why(tmp_path, capsys):
    import torch

    from megatron_rl import cli
    from megatron_rl.models.memory import check_learner_memory

    if not torch.cuda.is_available():
        assert cli.main(["dry-run", "tiny_cpu", f"trainer.out_dir={tmp_path / 'run'}"]) == 0
        assert "learner memory per GPU" not in capsys.readouterr().out
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_attention_heads": 32}))
    job = to_object(load_config(RECIPE, [f"model.hf_path={tmp_path / 'm'}"]))
    assert check_learner_memory(job, 32).startswith("learner memory per GPU: not estimated (")


# ---------------------------------------------------------------------------------------------
# the CUDA caching allocator
# ---------------------------------------------------------------------------------------------
def test_expandable_segments_on_cuda_unless_the_user_set_it():
    from megatron_rl.trainer.preflight import cuda_allocator_defaults

    env = {}
    cuda_allocator_defaults(env, cuda=True)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    cuda_allocator_defaults(env, cuda=True)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    env = {}
    cuda_allocator_defaults(env, cuda=False)
    assert env == {}
