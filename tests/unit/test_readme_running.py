"""README "Running": after `make demo`, every command of the block does its own thing.

Each `train` line (one process or torchrun) has a run folder of its own, none of them the demo's
(runs/tiny_cpu), so none resumes another run, says "nothing to do" or is refused; each passes the
same line's dry-run (config, layout, run folder) in a folder where the demo has finished;
train_only reads the rollouts rollout_only writes; plot draws a folder a command wrote; the two
`compare` lines write to folders of their own. (Running the whole block verbatim takes hours on
this CPU; each command's behaviour is tested where it lives: tests/e2e/test_trainer.py,
test_torchrun.py, test_router_replay_e2e.py, test_testbed_smoke.py, test_lm_demo.py.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from megatron_rl import cli
from megatron_rl.config.load import load_config, to_object

REPO = Path(__file__).resolve().parents[2]


def running_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Running\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _train_args(words: list[str]) -> tuple[list[str], int]:
    """(recipe and overrides, world size) of a train line, or ([], 0) for another command."""
    if words[0].endswith("torchrun"):
        nproc = int(words[words.index("--nproc-per-node") + 1])
        i = words.index("train")
        return words[i + 1:], nproc
    if words[0].endswith("megatron-rl") and words[1] == "train":
        return words[2:], 1
    return [], 0


def out_dir(args: list[str]) -> str:
    given = [a.split("=", 1)[1] for a in args if a.startswith("trainer.out_dir=")]
    return given[-1] if given else f"runs/{args[0]}"


def test_every_running_command_has_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    from tests.unit.test_run_dir import finished_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MRL_RUNS")  # the user's default: ./runs (tests/conftest.py points it elsewhere)
    finished_run(tmp_path / "runs" / "tiny_cpu", 60)  # `make demo` done
    commands = running_commands()
    folders, wrote = {}, set()
    for words in commands:
        args, world = _train_args(words)
        if not args:
            continue
        folder = out_dir(args)
        assert folder not in folders and folder != "runs/tiny_cpu", (words, folders)
        folders[folder] = args
        if "trainer.mode=train_only" in args:  # the README's rollout_only command ran first
            saved = Path([a.split("=", 1)[1] for a in args if a.startswith("trainer.rollouts_dir=")][0])
            saved.mkdir(parents=True, exist_ok=True)
            for step in range(to_object(load_config(args[0], args[1:])).trainer.steps):
                (saved / f"step_{step:08d}.dp0.pt").touch()
        assert cli.main(["dry-run", *args, "--world-size", str(world)]) == 0, capsys.readouterr().err
        assert f"run folder: {folder} starts at step 0" in capsys.readouterr().out, words
        wrote.add(folder)
        rollouts = [a.split("=", 1)[1] for a in args if a.startswith("trainer.rollouts_dir=")]
        if "trainer.mode=train_only" in args:
            producer = [f for f, a in folders.items() if "trainer.mode=rollout_only" in a]
            assert rollouts and producer and rollouts[0] == f"{producer[0]}/rollouts", words
    assert len(folders) >= 6
    plots = [w[-1] for w in commands if w[1:2] == ["plot"]]
    assert plots and all(p in wrote for p in plots)
    compares = [w for w in commands if w[1:2] == ["compare"]]
    recipes = [w[w.index("--recipe") + 1] if "--recipe" in w else "tiny_cpu" for w in compares]
    assert len(compares) == 2 and len(set(recipes)) == 2 and "--out" not in sum(compares, [])

