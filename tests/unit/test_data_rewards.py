"""Datasets (JSONL / Parquet, DAPO-Math layout), the synthetic task and the rewards."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.datasets import DataError, load_prompts, render_prompt
from megatron_rl.data.synthetic import as_prompt_examples, make_problems
from megatron_rl.rewards import get_reward, reward_names

DAPO_ROW = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": "What is 2+3? Put the answer in \\boxed{}."}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "a1"},
}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_dapo_layout(tmp_path):
    rows = [DAPO_ROW, {**DAPO_ROW, "reward_model": {"ground_truth": 7}}]
    ex = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(ex) == 2
    assert ex[0].messages == tuple(DAPO_ROW["prompt"]) and ex[0].answer == "5"
    assert ex[1].answer == "7" and ex[0].source == "math_dapo"
    assert ex[1].origin.endswith("d.jsonl:2")


def test_parquet_dapo_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([DAPO_ROW, DAPO_ROW]), path)
    ex = load_prompts(path)
    assert len(ex) == 2 and ex[1].messages[0]["content"].startswith("What is 2+3")


def test_text_field_layout(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1=", "answer": "2"}])
    ex = load_prompts(path, messages_field=None, text_field="question", answer_field="answer")
    assert ex[0].messages == ({"role": "user", "content": "1+1="},) and ex[0].answer == "2"


@pytest.mark.parametrize(
    "bad_row,match",
    [
        ({**DAPO_ROW, "reward_model": {}}, r"row 2: field 'reward_model\.ground_truth' is missing"),
        ({k: v for k, v in DAPO_ROW.items() if k != "prompt"}, r"row 2: field 'prompt' is missing"),
        ({**DAPO_ROW, "prompt": "just text"}, r"row 2: field 'prompt': expected a non-empty list"),
        ({**DAPO_ROW, "prompt": [{"role": "user"}]}, r"row 2: field 'prompt\[0\]'"),
        ({**DAPO_ROW, "reward_model": {"ground_truth": " "}}, r"row 2: field 'reward_model\.ground_truth'"),
        ("{not json", r"row 2: not valid JSON"),
        ("[1, 2]", r"row 2: expected an object"),
    ],
)
def test_malformed_row_names_file_row_and_field(tmp_path, bad_row, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [DAPO_ROW, bad_row, DAPO_ROW])
    with pytest.raises(DataError, match=match) as err:
        load_prompts(path)
    assert str(path) in str(err.value)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported dataset format"):
        load_prompts(tmp_path / "x.csv")


def test_render_prompt_uses_the_chat_template(tmp_path):
    from megatron_rl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = render_prompt(tok, [{"role": "user", "content": "3+4="}])
    assert tok.decode(ids) == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


def test_synthetic_task_is_seeded_and_correct():
    a, b = make_problems(50, seed=3), make_problems(50, seed=3)
    assert a == b and a != make_problems(50, seed=4)
    for p in make_problems(200, seed=1, operand_digits=2, num_operands=3):
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 — our own arithmetic strings
    for p in make_problems(200, seed=1, modulo=10):
        expr = p.prompt[: p.prompt.index("%")]
        assert (eval(expr) % 10) == int(p.answer) and len(p.answer) == 1  # noqa: S307
    ex = as_prompt_examples(make_problems(2, seed=0))
    assert ex[0].messages[0]["role"] == "user" and ex[1].origin == "synthetic:2"
    with pytest.raises(ValueError):
        make_problems(1, seed=0, num_operands=1)


def test_synthetic_reward():
    r = get_reward("synthetic")
    assert r("7<|im_end|>", "7") == 1.0
    assert r(" 7 <|im_end|>junk", "7") == 1.0
    assert r("17<|im_end|>", "7") == 0.0
    assert r("", "7") == 0.0


def test_math_reward_uses_math_verify():
    r = get_reward("math")
    assert r("The answer is \\boxed{5}.", "5") == 1.0
    assert r("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert r("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert r("\\boxed{6}", "5") == 0.0
    assert r("no answer here", "5") == 0.0


def test_unknown_reward_lists_valid_names():
    assert {"math", "synthetic", "none"} <= set(reward_names())
    with pytest.raises(ValueError, match="unknown reward .maths.; valid: math, none, (.+, )?synthetic, .*or a "
                                         "function by import path"):
        get_reward("maths")  # (other test modules may have registered rewards of their own)
    assert get_reward("none")("anything", "") == 0.0


def test_balanced_answers_are_uniform_and_problems_uniform_within_an_answer():
    from collections import Counter

    problems = make_problems(20000, seed=5, op="max", balance_answers=True)
    answers = Counter(p.answer for p in problems)
    assert sorted(answers) == [str(k) for k in range(10)]
    assert all(abs(c - 2000) < 200 for c in answers.values()), answers  # ~4.5 sigma
    assert all(p.answer == str(max(int(x) for x in p.prompt[4:-2].split(","))) for p in problems)
    # within answer 4: the 9 pairs with max 4, each ~1/9 of them
    pairs = Counter(p.prompt for p in problems if p.answer == "4")
    assert len(pairs) == 9 and max(pairs.values()) < 1.35 * min(pairs.values()), pairs
    # unbalanced max keeps the natural (2k+1)/100 skew
    skewed = Counter(p.answer for p in make_problems(20000, seed=5, op="max"))
    assert skewed["9"] > 10 * skewed["0"]
    # balanced sums with a cap: answers 0..9 of two-digit-operand sums
    sums = Counter(p.answer for p in make_problems(5000, seed=1, max_answer=9, balance_answers=True))
    assert sorted(sums) == [str(k) for k in range(10)] and min(sums.values()) > 350


def test_prompts_without_answers_for_reward_model_only_training(tmp_path):
    """answer_field: null (RLHF prompt sets): rows need no ground truth; a bad prompt still names
    file, row and field."""
    import json

    from megatron_rl.data.datasets import DataError, load_prompts

    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "Write a haiku."}]}) + "\n"
                 + json.dumps({"prompt": "not a list"}) + "\n")
    with pytest.raises(DataError, match=rf"{f}: row 2.*'prompt'"):
        load_prompts(f, answer_field=None)
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "Write a haiku."}]}) + "\n")
    (ex,) = load_prompts(f, answer_field=None)
    assert ex.answer == "" and ex.messages[0]["content"] == "Write a haiku."
