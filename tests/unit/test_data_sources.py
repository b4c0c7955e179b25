"""`megatron-rl data`: each public set's hub files, in miniature and shaped as each source ships
them, read offline from a hub cache laid out as huggingface_hub lays it out; the output is what the
paper recipes read (configs/paper/dppo_table1.yaml's files, loaded by the trainer's own loader)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl import cli
from megatron_rl.config.load import load_config, to_object
from megatron_rl.data.datasets import DataError
from megatron_rl.data.sources import DAPO_TEMPLATE, SOURCES, convert
from megatron_rl.rewards.math import math_verify_reward
from megatron_rl.data.prompts import load_examples

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
DAPO_PROMPT = DAPO_TEMPLATE.format(problem="What is 3+4?")


def _snapshot(cache, repo):
    d = cache / f"datasets--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(COMMIT)
    return d / "snapshots" / COMMIT


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    dapo = [{"data_source": "math_dapo", "prompt": [{"content": DAPO_PROMPT, "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "a1"}},
            {"data_source": "math_dapo", "prompt": [{"content": DAPO_TEMPLATE.format(problem="Half of 1?"), "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
             "extra_info": {"index": "a2"}}]
    _parquet(_snapshot(cache, "BytedTsinghua-SIA/DAPO-Math-17k") / "data" / "dapo-math-17k.parquet", dapo * 3)
    _parquet(_snapshot(cache, "HuggingFaceH4/aime_2024") / "data" / "train-00000-of-00001.parquet",
             [{"id": 60, "problem": "Find x if 2x=10.", "solution": "x=5", "answer": "5", "url": "u", "year": "2024"}])
    s = _snapshot(cache, "opencompass/AIME2025")
    _jsonl(s / "aime2025-I.jsonl", [{"question": "Compute 6*7.", "answer": "42"}])
    _jsonl(s / "aime2025-II.jsonl", [{"question": "Compute 2^10.", "answer": "1024"}])
    _parquet(_snapshot(cache, "openai/gsm8k") / "main" / "test-00000-of-00001.parquet",
             [{"question": "Tom has 1,200 apples and eats 3. How many?", "answer": "1200-3=1197\n#### 1,197"}])
    _parquet(_snapshot(cache, "openai/gsm8k") / "main" / "train-00000-of-00001.parquet",
             [{"question": "Ann has 2 pens and buys 1,000. How many?", "answer": "2+1000=1002\n#### 1,002"}])
    _jsonl(_snapshot(cache, "HuggingFaceH4/MATH-500") / "test.jsonl",
           [{"problem": "Simplify $\\sqrt{16}$.", "solution": "4", "answer": "4", "subject": "Algebra", "level": 1,
             "unique_id": "test/algebra/1.json"}])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_every_set_in_the_recipes_layout(hub, tmp_path, capsys, monkeypatch):
    out = tmp_path / "data"
    assert cli.main(["data", "all", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dapo-math-17k: 2 prompts (4 repeated rows kept once)" in printed
    expect = {"aime-2024": [("Find x if 2x=10.", "5")], "aime-2025": [("Compute 6*7.", "42"), ("Compute 2^10.", "1024")],
              "gsm8k-test": [("Tom has 1,200 apples and eats 3. How many?", "1197")],
              "gsm8k-train": [("Ann has 2 pens and buys 1,000. How many?", "1002")],
              "math-500": [("Simplify $\\sqrt{16}$.", "4")]}
    for name, pairs in expect.items():
        rows = pq.read_table(out / f"{name}.parquet").to_pylist()
        assert [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows] == [
            (DAPO_TEMPLATE.format(problem=p), a) for p, a in pairs]
        assert all(r["data_source"] == name and r["prompt"][0]["role"] == "user" for r in rows)
    dapo = pq.read_table(out / "dapo-math-17k.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in dapo][0] == DAPO_PROMPT  # already templated: kept as it is
    # What the paper recipes read, through the trainer's loader; a right "Answer:" line scores 1.
    monkeypatch.setenv("MRL_DATA", str(out))
    data = to_object(load_config("dppo_binary_tv_qwen3_30b_a3b_base_r3")).data
    train, evals = load_examples(data, "train"), load_examples(data, "eval")
    assert len(train) == 2 and [e.answer for e in evals] == ["5", "42", "1024"]
    assert math_verify_reward("6*7 = 42.\nAnswer: 42", evals[1].answer) == 1.0
    assert math_verify_reward("Answer: 41", evals[1].answer) == 0.0


def test_a_bad_source_row_is_named(hub, tmp_path, capsys):
    s = hub / "datasets--HuggingFaceH4--MATH-500" / "snapshots" / COMMIT
    _jsonl(s / "test.jsonl", [{"problem": "ok", "answer": "1"}, {"problem": "no answer here"}])
    with pytest.raises(DataError, match=r"test.jsonl: row 2: field 'answer' is missing"):
        convert("math-500", tmp_path / "out")
    assert not (tmp_path / "out" / "math-500.parquet").exists()
    assert cli.main(["data", "aime-2026", "--out", str(tmp_path)]) == 2
    assert "unknown dataset 'aime-2026'; valid: " + ", ".join(SOURCES) in capsys.readouterr().err
