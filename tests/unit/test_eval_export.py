"""`megatron-rl eval <exported folder>` evaluates with the run's config (issue 44): its data, reward
and eval settings, the user's overrides on top, seeded at the checkpoint's step — never silently on
the demo's synthetic task. Only the config resolution (`resolve_model`): no server, no process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config.load import load_config, to_object
from megatron_rl.tools.evaluate import eval_data, resolve_model
from megatron_rl.tools.export import (
    CONFIG_FILE, PROVENANCE_FILE, RUN_CONFIG_FILE, checkpoint_config_file, save_run_config,
)

RUN = ["data.source=files", "data.train_files=[byo/train.jsonl]", "data.eval_files=[byo/test.jsonl]",
       "data.messages_field=null", "data.text_field=question", "data.answer_field=answer",
       "data.reward=byo/my_reward.py:score", "data.correct_threshold=0.5", "eval.k=3", "eval.num_prompts=17",
       "trainer.seed=5", "parallel.tp=2"]


def exported(tmp_path: Path, *, copy: bool = True, run_config: bool = True, step: int = 40) -> Path:
    """A run folder and an export of its step `step`, as `megatron-rl export` leaves them (the
    weights aside: resolution reads none)."""
    run, hf = tmp_path / "runs" / "byo", tmp_path / "runs" / "byo" / "hf"
    cfg = to_object(load_config("tiny_cpu", [*RUN, "model.hf_path=byo/model"]))
    save_run_config(cfg, run)
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    record = {"run_dir": str(run.resolve()), "checkpoint": f"step_{step:08d}", "step": step}
    if copy:
        (hf / RUN_CONFIG_FILE).write_text((run / CONFIG_FILE).read_text())
        record["config"] = RUN_CONFIG_FILE
    (hf / PROVENANCE_FILE).write_text(json.dumps(record))
    if not run_config:
        (run / CONFIG_FILE).unlink()
    return hf


def test_an_export_is_evaluated_with_its_runs_config_and_the_overrides(tmp_path, capsys):
    hf = exported(tmp_path)
    cfg, served, step = resolve_model(str(hf), None, ["eval.k=8"], None)
    assert served == hf and step == 40  # the trainer's seeds at the exported step
    d = cfg.data
    assert (d.source, d.eval_files, d.reward, d.correct_threshold) == (
        "files", ["byo/test.jsonl"], "byo/my_reward.py:score", 0.5)
    assert (cfg.eval.k, cfg.eval.num_prompts, cfg.trainer.seed) == (8, 17, 5)  # the override on top
    assert cfg.model.hf_path == str(hf)  # the export is served, not the run's starting model
    assert cfg.parallel.tp == 1  # the training's layout is not the eval's
    assert eval_data(cfg) == ["byo/test.jsonl"]
    out = capsys.readouterr().out
    assert f"{hf} is an export of {(tmp_path / 'runs' / 'byo').resolve()} (step 40)" in out
    assert f"config {hf / RUN_CONFIG_FILE} + eval.k=8" in out


def test_the_exports_copy_travels_without_the_run(tmp_path):
    """The run folder is gone (the export was copied to another machine): its own copy suffices."""
    cfg, _, _ = resolve_model(str(exported(tmp_path, run_config=False)), None, [], None)
    assert cfg.data.eval_files == ["byo/test.jsonl"] and cfg.eval.k == 3


def test_an_older_export_reads_its_runs_config(tmp_path, capsys):
    """An export made before exports kept the config: the run named in megatron_rl_export.json."""
    hf = exported(tmp_path, copy=False)
    cfg, _, step = resolve_model(str(hf), None, [], None)
    assert cfg.data.reward == "byo/my_reward.py:score" and step == 40
    assert f"config {(tmp_path / 'runs' / 'byo').resolve() / CONFIG_FILE}" in capsys.readouterr().out


def test_an_export_whose_config_is_nowhere_is_an_error_not_the_demo_task(tmp_path):
    hf = exported(tmp_path, copy=False, run_config=False)
    with pytest.raises(FileNotFoundError, match=r"is an export of .* --recipe RECIPE"):
        resolve_model(str(hf), None, [], None)
    # With a recipe given, that recipe (and step 0), as for any HF folder.
    cfg, _, step = resolve_model(str(hf), "tiny_cpu", ["eval.k=2"], None)
    assert cfg.data.source == "synthetic" and cfg.eval.k == 2 and step == 0 and cfg.model.hf_path == str(hf)


def test_recipe_overrides_the_export_record(tmp_path, capsys):
    cfg, _, step = resolve_model(str(exported(tmp_path)), "tiny_cpu", [], None)
    assert cfg.data.source == "synthetic" and cfg.data.reward == "synthetic" and step == 0
    assert "config recipe tiny_cpu (--recipe)" in capsys.readouterr().out


def test_a_plain_hf_folder_says_it_uses_the_default_recipe(tmp_path, capsys):
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg, _, step = resolve_model(str(hf), None, [], None)
    assert cfg.data.source == "synthetic" and step == 0
    assert eval_data(cfg) == "synthetic op=max (held-out seed 1)"  # tiny_cpu: the demo task
    assert "config recipe tiny_cpu (the default for a HF folder; --recipe RECIPE to choose)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--step picks a checkpoint of a run directory"):
        resolve_model(str(exported(tmp_path)), None, [], 3)


def test_the_export_keeps_the_config_that_wrote_the_checkpoint(tmp_path):
    """The checkpoint's own config.yaml (run/run_dir.py writes one into each), else the run's."""
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (run / CONFIG_FILE).write_text("name: now\n")
    assert checkpoint_config_file(run, ckpt) == run / CONFIG_FILE
    (ckpt / CONFIG_FILE).write_text("name: then\n")
    assert checkpoint_config_file(run, ckpt) == ckpt / CONFIG_FILE
