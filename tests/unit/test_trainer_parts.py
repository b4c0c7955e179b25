"""Trainer pieces without processes: batch alignment, prompt stream resume, metrics truncation,
recipes' dry-run, actionable errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from megatron_rl.config.load import ConfigError, available_recipes, load_config, to_object
from megatron_rl.rollout.records import RolloutRecord
from megatron_rl import batch as batching
from megatron_rl.data.prompts import Prompt, PromptStream


def record(prompt, response, logp, topk=None, routes=None, i=0, j=0, finish="stop"):
    P, T = len(prompt), len(response)
    return RolloutRecord(
        prompt_index=i, sample_index=j, prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
        rollout_logp=torch.tensor(logp), topk_ids=None if topk is None else topk[0].int(),
        topk_logp=None if topk is None else topk[1], routes=routes,
        finish_reason=finish, weight_version="0", temperature=1.0)


def build(recs, rewards, **kw):
    return batching.RolloutBatch.from_records(recs, rewards, group_ids=[r.prompt_index for r in recs],
                                              mini_batch=[0] * len(recs), pad_id=0, **kw)


def test_batch_alignment_matches_records():
    g = torch.Generator().manual_seed(0)
    recs = []
    for i, (P, T) in enumerate([(3, 2), (5, 4), (2, 1)]):
        prompt = torch.randint(3, 90, (P,), generator=g).tolist()
        resp = torch.randint(3, 90, (T,), generator=g).tolist()
        topk_ids = torch.stack([torch.randperm(90, generator=g)[:3] for _ in range(T)])
        topk = (topk_ids, torch.randn(T, 3, generator=g))
        routes = torch.randint(0, 4, (P + T - 1, 2, 2), generator=g, dtype=torch.uint8)
        recs.append(record(prompt, resp, torch.randn(T, generator=g).tolist(), topk, routes, i=i))
    b = build(recs, [1.0, 0.0, 1.0], with_topk=True, with_routes=True, num_experts=4)
    # Compact storage: routes uint8 per sequence, top-K only on response rows, ids int32.
    assert b.tok["routed_experts"][1].dtype == torch.uint8 and b.tok["routed_experts"][1].shape == (8, 2, 2)
    assert b.tok["topk_ids"][1].shape == (4, 3) and b.tok["input_ids"][1].dtype == torch.int32
    b = b.micro_batch(torch.arange(3), 11)  # the learner's padded layout, 11 positions
    for i, r in enumerate(recs):
        P, T = r.prompt_ids.numel(), r.response_ids.numel()
        seq = torch.cat([r.prompt_ids, r.response_ids])
        # Position s predicts labels[s] = token s+1; the response mask covers exactly the response.
        assert torch.equal(b["input_ids"][i, :P + T], seq)
        assert torch.equal(b["labels"][i, :P + T - 1], seq[1:])
        on = b["loss_mask"][i].nonzero().flatten()
        assert on.tolist() == list(range(P - 1, P - 1 + T))
        assert torch.equal(b["labels"][i, on], r.response_ids)
        assert torch.equal(b["rollout_logp"][i, on], r.rollout_logp)
        assert torch.equal(b["topk_ids"][i, on], r.topk_ids)
        # Routes stay compact (uint8, 255 = no route) until the learner's forward step widens them.
        assert torch.equal(b["routed_experts"][i, :P + T - 1], r.sequence_routed_experts())
        assert (b["routed_experts"][i, P + T - 1:] == 255).all()
    tr = batching.token_rewards(b)
    assert tr.sum(1).tolist() == [1.0, 0.0, 1.0]
    assert tr[0, 3].item() == 1.0  # last response prediction of sequence 0 (P=3, T=2) is position 3
    # A top-K row naming an id twice is a malformed rollout: one error naming sample and token.
    recs[1].topk_ids[2, 2] = recs[1].topk_ids[2, 0]
    with pytest.raises(ValueError, match=r"prompt 1, sample 0\): the top-K ids of response token 2 "
                       rf"name id {int(recs[1].topk_ids[2, 0])} twice"):
        build(recs, [1.0, 0.0, 1.0], with_topk=True, with_routes=True, num_experts=4)


def test_rollout_batch_fields_round_trip():
    """Padded views, stores, subsets, concatenation and the byte transport all keep every field."""
    g = torch.Generator().manual_seed(1)
    recs = [record(torch.randint(3, 90, (P,), generator=g).tolist(), torch.randint(3, 90, (T,), generator=g).tolist(),
                   torch.randn(T, generator=g).tolist(), i=i,
                   routes=torch.randint(0, 200, (P + T - 1, 3, 2), generator=g, dtype=torch.uint8))
            for i, (P, T) in enumerate([(4, 7), (2, 1), (6, 3), (3, 9)])]
    b = build(recs, [1.0, 0.0, 0.5, 1.0], with_routes=True, num_experts=200)
    adv = torch.randn(4, int(b.seq_lens.max()), generator=g)
    b["advantages"] = adv
    lens = b.seq_lens.tolist()
    for i, n in enumerate(lens):  # stored rows = the sequence's positions; padding reads back as 0
        assert torch.equal(b["advantages"][i, :n], adv[i, :n]) and not b["advantages"][i, n:].any()
    sub = b.select(torch.tensor([3, 1]))
    assert sub["rewards"].tolist() == [1.0, 0.0] and torch.equal(sub["advantages"][0, :lens[3]], adv[3, :lens[3]])
    both = batching.RolloutBatch.cat([sub, b.select(torch.tensor([0]))])
    assert both.seq["group_ids"].tolist() == [3, 1, 0]
    buf, counts = b.pack()
    assert buf.dtype == torch.uint8 and buf.numel() == b.nbytes()
    back = batching.RolloutBatch.unpack(buf, counts, b.schema(), len(b), b.pad_id)
    for name in b.keys():
        assert torch.equal(back[name], b[name]), name
    # uint8 routes travel compact and widen to the learner's int64 with −1 where a position has no
    # route; int16 routes (past 255 experts) likewise; int64 ones pass unchanged.
    mb = b.micro_batch(torch.tensor([1]), 8)
    assert mb["routed_experts"].dtype == torch.uint8 and (mb["routed_experts"][0, 2:] == 255).all()
    wide = batching.widen_routes(mb["routed_experts"])
    assert wide.dtype == torch.int64 and (wide[0, 2:] == -1).all()
    assert torch.equal(wide[0, :2], recs[1].sequence_routed_experts().long())
    i16 = torch.tensor([[3, 300], [-1, 0]], dtype=torch.int16)
    assert batching.widen_routes(i16).tolist() == [[3, 300], [-1, 0]]
    assert batching.widen_routes(wide) is wide
    with pytest.raises(ValueError, match="positions, the batch's longest sequence has 12"):
        b["advantages"] = adv[:, :5]


def test_micro_batches_follow_the_token_budget_and_trim_padding():
    lens = torch.tensor([5, 100, 30, 7, 90, 60, 8, 31])
    plan = batching.plan_micro_batches(lens, max_tokens=200, multiple=8)
    assert sorted(i for mb in plan for i in mb.tolist()) == list(range(8))  # each sequence once
    for mb in plan:  # within the budget (padded longest x sequences), or one sequence alone
        S = batching.padded_len(int(lens[mb].max()), 8)
        assert S * mb.numel() <= 200 or mb.numel() == 1
    pad, slots = batching.padding_waste(lens, plan, 8)
    global_pad, global_slots = batching.padding_waste(lens, [torch.arange(8)], 8)  # one micro-batch at the global max
    assert pad / slots < global_pad / global_slots / 2
    # Ranks that must run more micro-batches split their largest; count-based without a budget.
    assert len(batching.plan_micro_batches(lens, max_tokens=200, multiple=8, n_micro=6)) == 6
    assert [m.tolist() for m in batching.plan_micro_batches(lens, max_sequences=3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_micro_batches_are_made_one_ahead_and_unchanged():
    """The schedule's iterator (learner.Prefetched) makes micro-batch i+1 as i is taken, so its host
    work and copies overlap i's compute; what each forward step gets is what its maker made."""
    from megatron_rl.learner.learner import Prefetched

    made = []

    def maker(i):
        def make():
            made.append(i)
            return {"input_ids": torch.full((1, 2), i)}
        return make

    it = Prefetched([maker(i) for i in range(3)], "cpu")
    assert made == [0]
    got = []
    for step in it:
        got.append(int(step()["input_ids"][0, 0]))
        assert made == list(range(min(len(got) + 1, 3)))  # the next one is ready before this runs
    assert got == [0, 1, 2] and list(Prefetched([], "cpu")) == []


def test_balance_plan_moves_only_the_surplus():
    lens = [torch.tensor([100, 5, 7]), torch.tensor([30, 90, 60]), torch.tensor([1])]
    mb = [torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long)]
    plan = batching.balance_plan(lens, mb, 1)
    loads = [0, 0, 0]
    for r in range(3):
        for L, d in zip(lens[r].tolist(), plan[r].tolist()):
            loads[d] += L
    assert max(loads) - min(loads) <= 5 and sum(loads) == 293
    moved = sum(L for r in range(3) for L, d in zip(lens[r].tolist(), plan[r].tolist()) if d != r)
    assert moved < 293 / 2  # the 100-token sequence stays where it is
    # Mini-batches are balanced one by one: a balanced mini-batch moves nothing.
    even = batching.balance_plan([torch.tensor([10, 10]), torch.tensor([10, 10])],
                                 [torch.tensor([0, 1]), torch.tensor([0, 1])], 2)
    assert [p.tolist() for p in even] == [[0, 0], [1, 1]]


def test_mini_batches_select_by_index():
    recs = [record([5, 6], [7], [-1.0], i=i) for i in range(6)]
    b = batching.RolloutBatch.from_records(recs, [float(i) for i in range(6)], group_ids=list(range(6)),
                                           mini_batch=[0, 0, 1, 1, 2, 2], pad_id=0)
    parts = batching.mini_batches(b, 3)
    assert [p["rewards"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


def test_prompt_stream_resume_is_exact():
    prompts = [Prompt((i,), str(i), f"p{i}") for i in range(7)]
    a = PromptStream(prompts, seed=3)
    first = [p.uid for p in a.take(5)]
    state = a.state_dict()
    rest = [p.uid for p in a.take(12)]  # crosses two epoch boundaries
    b = PromptStream(prompts, seed=3)
    b.load_state_dict(state)
    assert [p.uid for p in b.take(12)] == rest
    assert sorted(first + rest[:2]) == sorted(f"p{i}" for i in range(7))  # an epoch is a permutation


def test_prompts_are_rendered_when_drawn_as_tokenize_renders_them():
    from megatron_rl.data.datasets import PromptExample
    from megatron_rl.models.tiny import build_char_tokenizer
    from megatron_rl.data.prompts import TokenizedPrompts, tokenize

    tok = build_char_tokenizer()
    examples = [PromptExample(messages=({"role": "user", "content": f"q{i}"},), answer=str(i), source="", origin=f"f:{i}")
                for i in range(50)]
    lazy = TokenizedPrompts(examples, tok)
    stream = PromptStream(lazy, seed=1)
    drawn = stream.take(8)
    assert len(lazy) == 50 and len(lazy._rendered) == 8  # only what was drawn
    eager = {p.uid: p for p in tokenize(examples, tok)}
    assert all(p == eager[p.uid] for p in drawn)
    assert drawn[0].ids[-2:] == tuple(tok.encode("t\n", add_special_tokens=False))  # "<|im_start|>assistant\n"
    assert lazy[int(drawn[0].uid[2:])] is drawn[0]  # kept for later epochs


def test_metrics_logger_drops_rows_from_resumed_step(tmp_path):
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.run.metrics import MetricsLogger, read_metrics

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(-1, 6)))
    log = MetricsLogger(tmp_path, TrainerConfig(progress=False), enabled=True, start_step=3, run_name="t")
    log.log(3, {"x": 30.0})
    log.close()
    assert [(m["step"], m["x"]) for m in read_metrics(tmp_path)] == [(-1, -1), (0, 0), (1, 1), (2, 2), (3, 30.0)]


@pytest.fixture(scope="module")
def paper_inputs(tmp_path_factory):
    """What the GPU recipes point at, in miniature: DAPO-layout Parquet files and HF config folders."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("paper")
    rows = [{"data_source": "math", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(5)]
    (root / "data").mkdir()
    for name in ("dapo-math-17k", "aime-2024", "aime-2025", "gsm8k-train", "gsm8k-test"):
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{name}.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": r["prompt"]} for r in rows]),
                   root / "data" / "ultrafeedback-prompts.parquet")
    # The shapes the dry-run checks the servers' TP against (the published configs' values).
    moe = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
           "moe_intermediate_size": 768, "intermediate_size": 6144, "decoder_sparse_step": 1, "mlp_only_layers": []}
    qwen3_4b = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 9728}
    for name, shape in (("Qwen3-30B-A3B-Base", moe), ("Qwen3-30B-A3B", moe),
                        ("Qwen3-8B-Base", {"num_hidden_layers": 36, "num_attention_heads": 32,
                                           "num_key_value_heads": 8, "intermediate_size": 12288}),
                        ("Qwen3-4B-Instruct-2507", qwen3_4b), ("Skywork-Reward-V2-Qwen3-4B", qwen3_4b)):
        (root / "models" / name).mkdir(parents=True)
        (root / "models" / name / "config.json").write_text(json.dumps(shape))
        _weights_and_tokenizer(root / "models" / name)
    # Hub ids (model.hf_path=Qwen/...): a hub cache laid out as huggingface_hub lays it out.
    commit = "a" * 40
    for repo, shape in (("Qwen/Qwen3-1.7B-Base", {"num_hidden_layers": 28, "num_attention_heads": 16,
                                                  "num_key_value_heads": 8, "intermediate_size": 6144}),):
        cached = root / "hub" / f"models--{repo.replace('/', '--')}"
        (cached / "snapshots" / commit).mkdir(parents=True)
        (cached / "snapshots" / commit / "config.json").write_text(json.dumps(shape))
        _weights_and_tokenizer(cached / "snapshots" / commit)
        (cached / "refs").mkdir()
        (cached / "refs" / "main").write_text(commit)
    return root


def _weights_and_tokenizer(folder):
    """What the dry-run checks a checkpoint folder holds besides config.json (models/hub.py):
    the shards its index names (empty stand-ins) and a tokenizer."""
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")


@pytest.fixture
def paper_env(paper_inputs, monkeypatch):
    """The environment a launcher sets for the GPU recipes, pointing at `paper_inputs`."""
    monkeypatch.setenv("MRL_DATA", str(paper_inputs / "data"))
    monkeypatch.setenv("MRL_MODELS", str(paper_inputs / "models"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(paper_inputs / "hub"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return paper_inputs


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_passes_dry_run(recipe, paper_env, capsys):
    """`megatron-rl dry-run RECIPE` (what the sbatch script runs first): config, algorithm
    arguments, model path, every data row and the layout at the recipe's world size."""
    from megatron_rl import cli

    assert cli.main(["dry-run", recipe]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    job = to_object(load_config(recipe))
    assert f"hardware: {job.hardware}" in out  # every recipe names what it is meant for
    if job.data.source == "files":
        assert f"data: 5 training prompts, {5 * len(job.data.eval_files)} eval prompts" in out
    if job.parallel.world_size:
        assert f"layout for world size {job.parallel.world_size}:" in out


@pytest.mark.parametrize("args,message", [
    # an empty producer: rank 1 would generate nothing (this crashed in the exchange, batch/exchange.py)
    (["tiny_cpu", "rollout.prompts_per_step=1", "algorithm.mini_batches=1", "--world-size", "2"],
     "rollout.prompts_per_step=1 is fewer than the 2 data-parallel ranks"),
    (["dppo_binary_tv_qwen3_1p7b_base_gsm8k", "--world-size", "128"],
     "rollout.prompts_per_step=64 is fewer than the 128 data-parallel ranks"),
    (["tiny_cpu", "rollout.prompts_per_step=4", "rollout.n_samples=1", "algorithm.mini_batches=4",
      "--world-size", "2"], "a mini-batch holds 1 sequences"),
])
def test_dry_run_refuses_fewer_groups_or_sequences_than_data_parallel_ranks(args, message, paper_env, capsys):
    from megatron_rl import cli
    from megatron_rl.trainer.preflight import check_batch_split

    assert cli.main(["dry-run", *args]) == 2
    assert message in capsys.readouterr().err
    overrides = [a for a in args[1:-2]]
    with pytest.raises(ValueError, match=re.escape(message)):  # `train` calls it before init_distributed
        check_batch_split(to_object(load_config(args[0], overrides)), int(args[-1]))
    assert cli.main(["dry-run", args[0], *overrides, "--world-size", "1"]) == 0


@pytest.mark.parametrize("recipe,override,message", [
    ("tiny_cpu", "parallel.tp=3", "parallel.tp=3: 4 attention heads are not divisible by it"),
    ("tiny_cpu", "parallel.pp=3", "parallel.pp=3: 2 layers are not divisible by it"),
    ("tiny_moe_cpu_r3", "parallel.ep=3", "parallel.ep=3: 4 experts are not divisible by it"),
    ("tiny_cpu", "parallel.ep=2", "parallel.ep=2: the model has no experts"),
    ("dppo_binary_tv_qwen3_30b_a3b_base_r3", "parallel.tp=3", "parallel.tp=3: 32 attention heads"),
    ("dppo_binary_tv_qwen3_30b_a3b_base_r3", "parallel.ep=3", "parallel.ep=3: 128 experts are not divisible"),
    ("dppo_binary_tv_qwen3_30b_a3b_base_r3", "parallel.pp=5", "parallel.pp=5: 48 layers are not divisible"),
    ("dppo_binary_tv_qwen3_30b_a3b_base_r3", "parallel.pp=4 parallel.vpp=5",
     "parallel.vpp=5: 12 layers per pipeline stage"),
    ("tiny_cpu", "algorithm.divergence=binary_tvv", "algorithm.divergence='binary_tvv'; valid: binary_tv"),
    ("tiny_cpu", "algorithm.agg_mode=token_mean", "algorithm.agg_mode: unknown aggregation 'token_mean'"),
])
def test_dry_run_refuses_what_would_fail_after_the_launch(recipe, override, message, paper_env, capsys):
    """Layouts Megatron-Core refuses for the model's shape, and registry names used only after the
    first rollouts: the dry-run (and `train`, before it starts anything) names them."""
    from megatron_rl import cli
    from megatron_rl.models.layout import check_layout

    assert cli.main(["dry-run", recipe, *override.split()]) == 2
    assert message in capsys.readouterr().err
    job = to_object(load_config(recipe, override.split()))
    if override.startswith("parallel."):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_layout(job.model, job.parallel)  # what `train` calls before init_distributed


NOT_PAPER_RECIPES = {"dppo_binary_tv_qwen3_1p7b_base_gsm8k"}  # GPU recipes that are not the DPPO paper's runs


def test_paper_recipes_keep_the_papers_settings():
    """DPPO Table 1 in every GPU math recipe; the trust-region constants of the named method. The
    RLHF recipe (the paper's reward-model experiment): the reward model is the only reward."""
    for recipe in available_recipes():
        job = to_object(load_config(recipe))
        if "cpu" in job.hardware or recipe in NOT_PAPER_RECIPES:
            continue
        if "rlhf" in recipe:
            rm = job.reward_model
            assert rm.enabled and rm.hf_path and rm.rule_weight == 0.0 and job.data.reward == "none", recipe
            assert job.algorithm.policy_loss == "dppo" and job.algorithm.loss_kwargs["delta"] == 0.2, recipe
            continue
        r, a, e = job.rollout, job.algorithm, job.eval
        assert (r.prompts_per_step, r.n_samples, r.temperature, job.optim.lr) == (256, 16, 1.0, 1e-6), recipe
        assert r.prompts_per_step // a.mini_batches == 32, recipe
        # The DPPO paper's runs and baselines share Dr.GRPO; ASPO / ATR-GRPO keep their papers' GRPO.
        assert a.advantage == ("grpo" if recipe.startswith(("aspo", "atr")) else "dr_grpo"), recipe
        assert (e.k, e.temperature, e.top_p) == (32, 0.7, 0.95), recipe
        assert r.max_new_tokens == (16384 if job.model.tiny.moe or "30b" in recipe else 8192), recipe
        # math-verify on an 8k-16k-token response can take ~10.5 s when both its limits fire
        assert job.data.reward_timeout >= 30, (recipe, job.data.reward_timeout)
        if a.policy_loss == "dppo":
            assert a.loss_kwargs["delta"] == (0.2 if a.divergence.endswith("tv") else 0.05), recipe
            assert a.loss_kwargs["truncation"] == 5.0, recipe
        if a.policy_loss == "drpo":  # DRPO's reported δ, with the FP8 rollouts its claims are about
            assert a.loss_kwargs["delta"] == 12.5 and job.rollout.quantization == "fp8", recipe
        assert (a.router_replay == "r3") == recipe.endswith("_r3"), recipe


def test_loss_kwargs_typo_names_the_valid_arguments():
    from megatron_rl.trainer.preflight import validate

    job = to_object(load_config("tiny_cpu", ["+algorithm.loss_kwargs.detla=0.2"]))
    with pytest.raises(ValueError, match=r"loss_kwargs.detla .* valid: .*delta"):
        validate(job)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_config_typo_is_one_actionable_line():
    out = run_cli("dry-run", "tiny_cpu", "rollout.n_sample=4")
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert "rollout.n_sample" in err[0] and "did you mean 'n_samples'" in err[0] and "valid keys of rollout" in err[0]


@pytest.mark.slow
def test_malformed_data_row_is_one_actionable_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}) + "\n"
                   + json.dumps({"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {}}) + "\n")
    out = run_cli("dry-run", "tiny_cpu", "data.source=files", f"data.train_files=[{bad}]")
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert f"{bad}: row 2" in err[0] and "reward_model.ground_truth" in err[0]


@pytest.mark.slow
def test_missing_dataset_and_unknown_recipe_fail_fast(tmp_path):
    out = run_cli("dry-run", "tiny_cpu", "data.source=files", f"data.train_files=[{tmp_path}/nope.parquet]")
    assert out.returncode == 2 and "nope.parquet does not exist" in out.stderr
    out = run_cli("dry-run", "no_such_recipe")
    assert out.returncode == 2 and "unknown recipe 'no_such_recipe'" in out.stderr and "tiny_cpu" in out.stderr


def test_validate_rejects_inconsistent_algorithm():
    from megatron_rl.trainer.preflight import validate

    job = to_object(load_config("tiny_cpu", ["algorithm=dppo_topk_tv"]))
    with pytest.raises(ValueError, match="top_k_logprobs"):
        validate(job)
    job = to_object(load_config("tiny_cpu", ["algorithm.policy_loss=dpo"]))
    with pytest.raises(ValueError, match="dppo"):
        validate(job)
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config("tiny_cpu", ["algorithm.delta=0.2"])
    # A new key in a free-form dict field needs Hydra's '+'; the error says so, and with it the
    # key reaches the config.
    with pytest.raises(ConfigError, match=r"add one with a leading '\+': \+algorithm.loss_kwargs.anchor="):
        load_config("tiny_cpu", ["algorithm.loss_kwargs.anchor=old"])
    assert to_object(load_config("tiny_cpu", ["+algorithm.loss_kwargs.anchor=old"])).algorithm.loss_kwargs == {
        "anchor": "old"}


def test_reward_model_reads_prompt_and_response_tokens():
    """The attention mask handed to the reward model covers exactly prompt + response (RolloutBatch
    layout), so it pools at the last response token."""
    from megatron_rl.rewards.model_rewards import sequence_attention_mask

    recs = [record([5, 6, 7], [8, 9], [-1.0, -2.0]), record([5, 6], [8, 9, 10, 11], [-1.0] * 4, i=1),
            record([5, 6, 7, 8, 9], [10], [-1.0], i=2)]
    b = build(recs, [0.0, 1.0, 0.0])
    mask = sequence_attention_mask(b["loss_mask"])
    assert mask.sum(1).tolist() == [5, 6, 6]
    for i, r in enumerate(recs):
        n = r.prompt_ids.numel() + r.response_ids.numel()
        assert torch.equal(b["input_ids"][i, :n][mask[i, :n].bool()], torch.cat([r.prompt_ids, r.response_ids]))
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        sequence_attention_mask(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_reward_model_scores_combine_with_rule_rewards():
    from megatron_rl.rewards.model_rewards import combine_rewards

    g = torch.Generator().manual_seed(0)
    rule, scores = (torch.rand(16, generator=g) > 0.5).float(), 3.0 * torch.randn(16, generator=g) + 1.0
    out, m = combine_rewards(rule, scores, weight=0.5, rule_weight=2.0)
    torch.testing.assert_close(out.double(), 2.0 * rule.double() + 0.5 * scores.double())
    out, m = combine_rewards(rule, scores, weight=0.5, rule_weight=1.0, normalize="batch", clip=1.0)
    s = scores.double()
    z = ((s - s.mean()) / s.std(unbiased=False)).clamp(-1.0, 1.0)
    torch.testing.assert_close(out.double(), rule.double() + 0.5 * z, rtol=1e-6, atol=1e-6)
    assert m["reward/model_mean"] == pytest.approx(float(s.mean()))
    assert m["reward/total_mean"] == pytest.approx(float(out.double().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="valid: none, batch"):
        combine_rewards(rule, scores, weight=1.0, rule_weight=1.0, normalize="running")


def test_gae_with_kl_in_reward_matches_float64_reference():
    """The trainer's advantage stage with a critic: per-token rewards = outcome on the last response
    token − coef·k1(μ, π_ref) on every response token, then GAE over the critic's values."""
    from types import SimpleNamespace

    from megatron_rl.trainer.stages import Stages

    job = to_object(load_config("ppo_gae_tiny_cpu", ["algorithm.advantage_kwargs.gamma=0.9", "algorithm.advantage_kwargs.lam=0.8",
                                                       "+algorithm.advantage_kwargs.whiten=false"]))
    g = torch.Generator().manual_seed(0)
    recs = [record([5, 6, 7], [8, 9, 4], torch.randn(3, generator=g).tolist()),
            record([5, 6], [8], torch.randn(1, generator=g).tolist(), i=1)]
    b = build(recs, [1.0, 0.5])
    b["ref_logp"] = torch.randn(b["loss_mask"].shape, generator=g) * b["loss_mask"]
    b["old_values"] = torch.randn(b["loss_mask"].shape, generator=g)
    metrics = Stages.compute_advantages(SimpleNamespace(cfg=job, ctx=SimpleNamespace(dp=1),
                                                         _mean=lambda total, n: total / max(n, 1)), b)
    coef, gamma, lam = 0.01, 0.9, 0.8
    for i, r in enumerate(recs):
        P, T = r.prompt_ids.numel(), r.response_ids.numel()
        pos = list(range(P - 1, P - 1 + T))
        mu, ref, v = (b[k][i, pos].double() for k in ("rollout_logp", "ref_logp", "old_values"))
        rew = -coef * (mu - ref)
        rew[-1] += b["rewards"][i].double()
        adv, nxt_v, nxt_a = torch.zeros(T, dtype=torch.float64), 0.0, 0.0
        for t in reversed(range(T)):
            delta = rew[t] + gamma * nxt_v - v[t]
            nxt_a = delta + gamma * lam * nxt_a
            adv[t], nxt_v = nxt_a, v[t]
        torch.testing.assert_close(b["advantages"][i, pos].double(), adv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b["returns"][i, pos].double(), adv + v, rtol=1e-5, atol=1e-6)
    assert set(metrics) == {"reward/with_kl_penalty_mean"}


@pytest.mark.parametrize("recipe, override, message", [
    ("ppo_gae_tiny_cpu", "+algorithm.advantage_kwargs.lamda=0.9", r"advantage_kwargs.lamda .* valid: gamma, lam, whiten"),
    ("ppo_gae_tiny_cpu", "algorithm.kl_coef=0", "kl_in_reward=true needs algorithm.kl_coef > 0"),
    ("ppo_gae_tiny_cpu", "rollout.dynamic_sampling=true", "dynamic_sampling"),
    ("ppo_gae_tiny_cpu", "reward_model.normalize=running", "valid: none, batch"),
    ("ppo_gae_tiny_cpu", "critic.value_loss=huber", "value_loss"),
    ("ppo_gae_tiny_cpu", "reward_model.backend=vllm", "backend='vllm'; valid: megatron, sglang"),
    ("tiny_cpu", "data.reward=none", "data.reward=none .* needs reward_model.enabled"),
])
def test_validate_rejects_inconsistent_ppo_settings(recipe, override, message):
    from megatron_rl.trainer.preflight import validate

    with pytest.raises(ValueError, match=message):
        validate(to_object(load_config(recipe, [override])))


def test_padding_routes_spread_evenly_over_experts():
    """Positions without a route (padding) must not pile onto experts 0..k−1: under expert
    parallelism that would be one rank's hot spot."""
    from megatron_rl.learner.router_replay import padding_routes

    for n, k, E in [(1000, 8, 128), (37, 2, 4), (5, 4, 4)]:
        r = padding_routes(n, k, E)
        assert all(len(set(row)) == k for row in r.tolist())  # k distinct experts per token
        load = torch.bincount(r.flatten(), minlength=E)
        assert int(load.max() - load.min()) <= 1, (n, k, E, load.tolist())


@pytest.mark.parametrize("override,message", [
    ("data.reward_workers=0", "data.reward_workers=0 must be >= 1"),
    ("rollout.request_timeout=-1", r"rollout.request_timeout=-1.0 null \(no total timeout\) or > 0"),
    ("rollout.stall_timeout=0", r"rollout.stall_timeout=0.0: seconds > 0, or null for no watchdog"),
    ("rollout.max_inflight_per_server=-1", r"rollout.max_inflight_per_server=-1 must be >= 0 \(0: derived\)"),
    ("learner.max_tokens_per_micro_batch=-5", "learner.max_tokens_per_micro_batch=-5; valid: 0"),
    ("trainer.rollout_wait_timeout=0", "trainer.rollout_wait_timeout=0.0 must be > 0"),
    # (whole servers held: eval.share=0; by default one server's fleet evaluates on a share of it)
    ("eval.servers=1 eval.share=0", r"eval.servers=1: servers an evaluation holds beside training, fewer than the 1 rollout"),
    ("eval.servers=1 eval.share=1.5", r"eval.share=1.5: the share of every server's room"),
    ("eval.servers=-1", "eval.servers=-1: servers an evaluation holds"),
])
def test_data_path_settings_are_checked(override, message):
    from megatron_rl.trainer.preflight import validate

    with pytest.raises(ValueError, match=message):
        validate(to_object(load_config("tiny_cpu", override.split())))


def test_eval_metrics_with_and_without_missing_samples():
    """What an evaluation cut by eval.timeout reports, against the arithmetic written out."""
    from megatron_rl.rollout.fleet import eval_metrics

    full = [[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert eval_metrics(full, 2) == {"eval/mean@2": 0.5, "eval/pass@2": 2 / 3}
    cut = [[0.0], [0.0, 0.0], [1.0, 1.0]]  # prompt 0's second sample aborted
    assert eval_metrics(cut, 2, missing=1) == {"eval/mean@2": 2 / 5, "eval/pass@2": 1 / 2,
                                              "eval/missing_samples": 1.0}
    assert eval_metrics([[], []], 2, missing=4) == {"eval/missing_samples": 4.0}  # nothing finished: no NaN


def test_learner_loss_kernel_is_checked_and_reaches_the_policy_stats(monkeypatch):
    """learner.loss_kernel: a typo names the valid kernels; triton where it cannot be imported is
    refused before the start (it is kept off this CPU venv's path); `auto` (the default) is the
    Triton kernel on CUDA where triton imports, torch elsewhere; PolicyLoss hands the choice on."""
    import importlib.util

    from megatron_rl.trainer.preflight import validate
    from megatron_rl.trainer.policy import PolicyLoss
    from megatron_rl.vocab_parallel import resolve_kernel

    assert to_object(load_config("tiny_cpu")).learner.loss_kernel == "auto"
    assert resolve_kernel("auto", "cpu") == "torch" and resolve_kernel("torch", "cuda") == "torch"
    assert resolve_kernel("auto", "cuda") == ("triton" if importlib.util.find_spec("triton") else "torch")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "triton" else real(n, *a))
    assert resolve_kernel("auto", "cuda:0") == "triton" and resolve_kernel("auto", "cpu") == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else real(n, *a))
    assert resolve_kernel("auto", "cuda") == "torch"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        validate(to_object(load_config("tiny_cpu", ["learner.loss_kernel=cuda"])))
    with pytest.raises(ValueError, match="needs the triton package"):
        validate(to_object(load_config("tiny_cpu", ["learner.loss_kernel=triton"])))
    cfg = to_object(load_config("tiny_cpu"))
    mb = dict(loss_mask=torch.ones(1, 3), labels=torch.zeros(1, 3, dtype=torch.long),
              rollout_logp=torch.zeros(1, 3), advantages=torch.ones(1, 3))
    loss = PolicyLoss(cfg.algorithm, mb, 1.0, 3, kernel="bogus")
    with pytest.raises(ValueError, match="unknown kernel 'bogus'"):
        loss(torch.zeros(1, 3, 8), mb, None, 8)
