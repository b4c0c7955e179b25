"""One run per folder (run/run_dir.py), `compare`'s reuse of finished runs, and Ctrl-C.

The run folders here are what `train` leaves: a checkpoint folder holding the configuration that
wrote it (written by the same function the trainer calls) and the `latest` marker; the checks read
nothing else before they decide. The CLI runs in this process: a launch that has nothing to do, or
that would resume another experiment, returns before any model is built or server started (the
server's start is made to fail loudly here, so reaching it would fail the test).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from megatron_rl import cli
from megatron_rl.config.load import load_config, to_object
from megatron_rl.tools.compare import reusable
from megatron_rl.run.run_dir import (ResumeMismatch, as_dict, check_resume, config_text, differences,
                                         nothing_to_do, write_checkpoint_config, write_run_config)
from megatron_rl.run.signals import StopRequest


def job(out_dir, *overrides):
    return to_object(load_config("tiny_cpu", [f"trainer.out_dir={out_dir}", *overrides]))


def finished_run(out_dir, step: int, *overrides, metrics: bool = False):
    """The folder a `train tiny_cpu` run leaves at `step` (checkpoint config + marker + metrics)."""
    cfg = job(out_dir, *overrides)
    write_run_config(cfg, check_resume(cfg))
    folder = out_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    write_checkpoint_config(config_text(cfg), folder)
    (out_dir / "checkpoints" / "latest").write_text(folder.name)
    if metrics:
        rows = [{"step": -1, "eval/mean@4": 0.0}] + [{"step": s, "rollout/accuracy": 0.5} for s in range(step)]
        (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cfg


@pytest.fixture
def no_server(monkeypatch):
    from megatron_rl.rollout import server

    def refuse(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(server.EngineManager, "start", refuse)
    monkeypatch.setattr(server.SGLangServer, "start", refuse)


def test_experiment_keys_and_operational_keys():
    a = as_dict(job("runs/x"))
    b = as_dict(job("runs/y", "algorithm=cispo", "optim.lr=0.5", "parallel.tp=2", "trainer.mode=train_only",
                    "trainer.steps=500", "rollout.server_urls=[http://h:1]", "eval.every=3", "data.reward_workers=4"))
    changed, operational = differences(a, b)
    keys = {line.split(":")[0] for line in changed}
    assert {"algorithm.policy_loss", "optim.lr", "parallel.tp", "trainer.mode"} <= keys
    assert not keys & {"trainer.steps", "trainer.out_dir", "rollout.server_urls", "eval.every", "data.reward_workers"}
    assert {line.split(":")[0] for line in operational} == {
        "trainer.steps", "trainer.out_dir", "rollout.server_urls", "eval.every", "data.reward_workers"}
    assert "optim.lr: 0.001 -> 0.5" in changed
    assert differences(a, as_dict(job("runs/x"))) == ([], [])
    # A configuration written before a key existed: the key at its default is no difference (the
    # default is what the code did before); set otherwise, it is one.
    old = as_dict(job("runs/x"))
    del old["optim"]["clip_grad"]
    assert differences(old, a) == ([], [])
    assert differences(old, as_dict(job("runs/x", "optim.clip_grad=0.5"))) == (
        ["optim.clip_grad: '(absent)' -> 0.5"], [])
    # Another loss kernel computes the same quantities: an operational change.
    assert differences(a, as_dict(job("runs/x", "learner.loss_kernel=triton"))) == (
        [], ["learner.loss_kernel: 'auto' -> 'triton'"])


def test_finished_run_has_nothing_to_do_and_starts_nothing(tmp_path, capsys, no_server):
    out = tmp_path / "tiny_cpu"
    finished_run(out, 60, "trainer.steps=60")
    assert cli.main(["train", "tiny_cpu", f"trainer.out_dir={out}", "trainer.steps=40"]) == 0
    printed = capsys.readouterr().out
    assert "nothing to do" in printed and "at step 60" in printed and "trainer.steps=40" in printed
    cfg = job(out, "trainer.steps=60")
    assert nothing_to_do(cfg, check_resume(cfg))  # == steps: done as well
    assert nothing_to_do(job(out, "trainer.steps=61"), check_resume(job(out, "trainer.steps=61"))) is None


def test_resuming_another_experiment_names_every_difference(tmp_path, capsys, no_server):
    out = tmp_path / "tiny_cpu"
    finished_run(out, 60)
    before = (out / "config.yaml").read_text()
    assert cli.main(["train", "tiny_cpu", f"trainer.out_dir={out}", "algorithm=cispo", "trainer.steps=40"]) == 2
    err = capsys.readouterr().err
    assert "holds a run at step 60" in err and "algorithm.policy_loss: 'dppo' -> 'cispo'" in err
    assert "trainer.steps" not in err  # operational: not a difference of the experiment
    for way in ("trainer.out_dir=", "trainer.resume=false", "trainer.allow_config_change=true"):
        assert way in err
    assert (out / "config.yaml").read_text() == before  # untouched by the refused launch
    # The torchrun TP2 line of the README in the demo's folder: the layout is part of the experiment
    with pytest.raises(ResumeMismatch, match="parallel.tp: 1 -> 2"):
        check_resume(job(out, "parallel.tp=2"))


def test_rollout_only_checkpoints_are_not_resumed_by_train_only(tmp_path):
    out = tmp_path / "split"
    finished_run(out, 2, "trainer.mode=rollout_only")
    with pytest.raises(ResumeMismatch) as e:
        check_resume(job(out, "trainer.mode=train_only", f"trainer.rollouts_dir={out / 'rollouts'}"))
    msg = str(e.value)
    assert "trainer.mode: 'rollout_only' -> 'train_only'" in msg and "hold no optimizer state" in msg
    assert f"trainer.rollouts_dir={out / 'rollouts'}" in msg


def test_allowed_change_keeps_the_config_before_and_resume_false_starts_over(tmp_path):
    out = tmp_path / "tiny_cpu"
    finished_run(out, 20)
    cfg = job(out, "optim.lr=0.5", "trainer.allow_config_change=true")
    resume = check_resume(cfg)
    assert resume.step == 20 and resume.changed == ["optim.lr: 0.001 -> 0.5"]
    notes = write_run_config(cfg, resume)
    assert "optim.lr: 0.001 -> 0.5" in notes[0] and "config.before_step_00000020.yaml" in notes[0]
    assert "lr: 0.001" in (out / "config.before_step_00000020.yaml").read_text()
    assert "lr: 0.5" in (out / "config.yaml").read_text()
    fresh = job(out, "trainer.resume=false", "algorithm=cispo")
    resume = check_resume(fresh)
    assert resume.checkpoint is None
    notes = write_run_config(fresh, resume)
    assert "starting over" in notes[0] and "step_00000020" in notes[0]
    assert not (out / "checkpoints").exists()  # the new run's checkpoints cannot mix with the old ones


def test_compare_keeps_only_runs_of_its_own_configuration(tmp_path):
    run = tmp_path / "compare" / "dppo_binary_tv" / "seed0"
    finished_run(run, 40, "algorithm=dppo_binary_tv", "trainer.steps=40", "optim.lr=1e-3", metrics=True)
    same = as_dict(job(run, "algorithm=dppo_binary_tv", "trainer.steps=40", "optim.lr=1e-3",
                       "trainer.resume=false", "rollout.server_urls=[http://other:1]"))
    assert reusable(run, 40, same) == (True, "")
    other_lr = as_dict(job(run, "algorithm=dppo_binary_tv", "trainer.steps=40", "optim.lr=0.5"))
    keep, why = reusable(run, 40, other_lr)
    assert not keep and "optim.lr: 0.001 -> 0.5" in why
    keep, why = reusable(run, 30, as_dict(job(run, "algorithm=dppo_binary_tv", "trainer.steps=30")))
    assert not keep and "trainer.steps: 40 -> 30" in why  # its metrics have 40 steps, not the 30 asked
    assert reusable(tmp_path / "nothing", 40, same) == (False, "not finished")
    from megatron_rl.tools.compare import default_out

    assert default_out("tiny_cpu") != default_out("testbed_cpu") and default_out("testbed_cpu").name == "testbed_cpu"


def test_a_second_comparison_never_replaces_the_first_ones_runs(tmp_path, capsys):
    """The same recipe compared again with other settings in the same folder is refused before any
    server starts, naming the runs and the differences (--out for a folder of its own, --replace)."""
    from megatron_rl.tools.compare import main as compare

    out = tmp_path / "cmp"
    run = out / "dppo_binary_tv" / "seed0"
    finished_run(run, 3, "algorithm=dppo_binary_tv", "trainer.steps=3", "optim.lr=1e-3", metrics=True)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    argv = ["--recipe", "tiny_cpu", "--out", str(out), "--algorithms", "dppo_binary_tv", "--seeds", "1",
            "--steps", "3", "optim.lr=0.5"]
    assert compare(argv) == 2
    err = capsys.readouterr().err
    assert f"{run} (" in err and "optim.lr: 0.001 -> 0.5" in err and "--out DIR" in err and "--replace" in err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_train_only_dry_run_checks_the_saved_steps(tmp_path, capsys):
    """A train_only run with more steps than a rollout_only run saved, or a misspelt rollouts_dir, is
    refused before anything starts (it used to train, then fail at the first missing step)."""
    saved = tmp_path / "gen" / "rollouts"
    saved.mkdir(parents=True)
    for step in range(2):
        (saved / f"step_{step:08d}.dp0.pt").touch()
    (saved / "step_00000001.dp1.pt").touch()
    base = ["dry-run", "tiny_cpu", "trainer.mode=train_only", f"trainer.out_dir={tmp_path / 'train'}"]
    assert cli.main([*base, f"trainer.rollouts_dir={saved}", "trainer.steps=2"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main([*base, f"trainer.rollouts_dir={saved}", "trainer.steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"trains steps 0..3 from {saved}, which holds no saved rollouts for step 2, 3 (it has 2 steps: 0..1)" in err
    assert cli.main([*base, f"trainer.rollouts_dir={tmp_path / 'gen' / 'rollout'}", "trainer.steps=2"]) == 2
    assert f"trainer.rollouts_dir={tmp_path / 'gen' / 'rollout'} is no folder" in capsys.readouterr().err


def test_dry_run_names_every_problem_at_once(tmp_path, capsys):
    """Independent problems come together (the model, the config, the batch, the saved rollouts), not
    one per launch; one problem alone keeps its own message."""
    argv = ["dry-run", "tiny_cpu", "rollout.prompts_per_step=1", "algorithm.mini_batches=1", "trainer.mode=train_only",
            "data.correct_threshold=inf", f"trainer.out_dir={tmp_path / 'run'}",
            f"model.hf_path={tmp_path / 'nowhere'}", "--world-size", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "4 problems, found before anything started:" in err
    for i, what in enumerate(["model.hf_path=", "data.correct_threshold=inf", "rollout.prompts_per_step=1 is fewer",
                              "trainer.mode=train_only reads"], 1):
        assert f"  {i}. {what}" in err, err
    assert cli.main(["dry-run", "tiny_cpu", "data.correct_threshold=inf"]) == 2
    assert "error: data.correct_threshold=inf: a finite reward" in capsys.readouterr().err


def test_ctrl_c_stops_at_the_step_end_then_at_once(capfd):
    before = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in an xdist worker
    stop = StopRequest(announce=True)
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.name() == "SIGINT"
        assert capfd.readouterr().err.count("Ctrl-C: stopping with a checkpoint") == 1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        stop = StopRequest(announce=True)
        try:
            os.kill(os.getpid(), sig)
            assert stop.requested() and stop.name() == signal.Signals(sig).name
        finally:
            stop.restore()
    assert "Ctrl-C" not in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) == before  # restored


def test_a_logger_asked_for_but_not_installed_is_named_before_the_start(tmp_path, monkeypatch, capsys):
    import importlib.util

    from megatron_rl.trainer.preflight import validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb")
                        else real(name, *a))
    for flag in ("tensorboard", "wandb"):
        with pytest.raises(ValueError, match=rf"trainer.{flag}=true needs the {flag} package.*\.\[loggers\]"):
            validate(job(tmp_path, f"trainer.{flag}=true"))
    assert cli.main(["dry-run", "tiny_cpu", "trainer.wandb=true"]) == 2
    assert "pip install -e '.[loggers]'" in capsys.readouterr().err
    validate(job(tmp_path))  # neither asked: nothing needed


def test_every_resume_logs_into_the_same_wandb_run(tmp_path):
    from megatron_rl.run.metrics import wandb_run_id

    first = wandb_run_id(tmp_path, fresh=True)
    assert wandb_run_id(tmp_path, fresh=False) == wandb_run_id(tmp_path, fresh=False) == first
    again = wandb_run_id(tmp_path, fresh=True)  # a run started over in the folder: a new wandb run
    assert again != first and wandb_run_id(tmp_path, fresh=False) == again


def test_the_plain_step_line_says_where_the_run_is_and_when_it_ends(tmp_path, capsys, monkeypatch):
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.run.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, TrainerConfig(progress=False, steps=60), enabled=True, start_step=10, run_name="t")
    t = [100.0]
    log.clock.now = lambda: t[0]
    log.clock.t0 = 100.0
    log.log(-1, {"eval/mean@4": 0.5})
    t[0] = 130.0  # this launch: 3 steps (10, 11, 12) in 30 s; 47 steps to go at 10 s each
    log.log(12, {"rollout/accuracy": 0.25})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step   -1  ") and "eta" not in lines[0]
    assert lines[1].startswith("step   12/60  accuracy 0.250") and lines[1].endswith("eta 7m50s")


def test_each_command_has_its_own_help(capsys):
    for command, first in (("train", "usage: megatron-rl train RECIPE"), ("dry-run", "usage: megatron-rl dry-run"),
                           ("demo", "usage: megatron-rl demo"), ("plot", "usage: megatron-rl plot RUN_DIR"),
                           ("train-lm", "usage: megatron-rl train-lm")):
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(first), out[:200]
    assert cli.main(["train", "tiny_cpu", "-h"]) == 0
    assert "tiny_moe_cpu_r3" in capsys.readouterr().out  # the recipes are listed


def test_dry_run_checks_the_run_folder_before_a_launcher_starts_anything(tmp_path, capsys):
    out = tmp_path / "tiny_cpu"
    assert cli.main(["dry-run", "tiny_cpu", f"trainer.out_dir={out}"]) == 0
    assert f"run folder: {out} starts at step 0" in capsys.readouterr().out
    finished_run(out, 60)
    assert cli.main(["dry-run", "tiny_cpu", f"trainer.out_dir={out}", "trainer.steps=100"]) == 0
    assert f"run folder: {out} resumes step_00000060" in capsys.readouterr().out
    assert cli.main(["dry-run", "tiny_cpu", f"trainer.out_dir={out}"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert cli.main(["dry-run", "tiny_cpu", f"trainer.out_dir={out}", "rollout.server_tp=2",
                     "rollout.server_urls=[http://a:1]"]) == 2
    assert "rollout.server_tp: 1 -> 2" in capsys.readouterr().err


def test_curves_are_two_rows_and_the_mismatch_stands_alone(tmp_path):
    import matplotlib.image

    from megatron_rl.run.curves import PANELS, plot_run

    rows = [{"step": -1, "eval/mean@4": 0.1}] + [
        {"step": s, "rollout/accuracy": s / 10, "eval/mean@4": s / 10, "entropy/mean": 1.0,
         "mismatch/train_vs_rollout_abs_logp": 0.002, "abs_logp_diff/mean": 0.15, "masked_frac": 0.01,
         "time/step": 3.0} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    height, width = matplotlib.image.imread(plot_run(tmp_path)).shape[:2]
    assert 0.3 < height / width < 0.7  # two rows of four, not a 1 x 5 strip (0.16)
    mismatch = next(keys for title, keys, _ in PANELS if title.startswith("train-vs-rollout"))
    assert "abs_logp_diff/mean" not in mismatch  # policy drift over the mini-batches is its own panel


def test_curves_of_a_supervised_run_have_its_own_panels(tmp_path):
    """`megatron-rl plot` of a train-lm run: its loss, eval accuracy, grad norm and throughput, not
    seven empty RL panels."""
    from megatron_rl.run.curves import LM_PANELS, PANELS, panels_for, plot_run

    rows = [{"step": s, "loss": 3.0 / s, "tokens": 512.0, "grad_norm": 1.0, "step_time": 0.5, "tokens_per_s": 900.0,
             **({"eval_accuracy": s / 10} if s % 2 else {})} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert panels_for(rows) is LM_PANELS and panels_for([{"step": 0, "loss": 1.0, "rollout/accuracy": 0.5}]) is PANELS
    assert all(any(k in r for r in rows for k in keys) for _, keys, _ in LM_PANELS)
    assert plot_run(tmp_path).stat().st_size > 10_000


def test_dry_run_prints_only_what_the_run_reads(capsys):
    assert cli.main(["dry-run", "tiny_cpu"]) == 0
    out = capsys.readouterr().out
    assert "(not used by this run, not shown: model.base, train, critic, reward_model)" in out
    assert "\ncritic:" not in out and "\nreward_model:" not in out and "tiny:" in out
    assert cli.main(["dry-run", "ppo_gae_tiny_cpu"]) == 0
    out = capsys.readouterr().out
    assert "\ncritic:" in out and "\nreward_model:" in out  # PPO's critic and reward model are shown


def test_tests_never_meet_the_users_runs(tmp_path, monkeypatch, capsys):
    """After `make demo` (a finished runs/tiny_cpu where the user works), a test's dry-run of the same
    recipe starts a folder of its own under the session's $MRL_RUNS (tests/conftest.py)."""
    monkeypatch.chdir(tmp_path)
    finished_run(tmp_path / "runs" / "tiny_cpu", 60)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    root = os.environ["MRL_RUNS"]
    assert not Path(root).resolve().is_relative_to(tmp_path.resolve())
    assert to_object(load_config("tiny_cpu")).trainer.out_dir == f"{root}/tiny_cpu"
    assert cli.main(["dry-run", "tiny_cpu", "trainer.steps=1"]) == 0, capsys.readouterr().err
    assert f"run folder: {root}/tiny_cpu starts at step 0" in capsys.readouterr().out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    monkeypatch.delenv("MRL_RUNS")  # the user's own default, ./runs: the demo's folder is met
    assert to_object(load_config("tiny_cpu")).trainer.out_dir == "runs/tiny_cpu"
