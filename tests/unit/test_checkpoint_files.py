"""The files of a checkpoint's publication and start (run/checkpoint.py), one process, no model.

- `latest` is made durable in order: megatron-core's own small files fsynced, `step_N.tmp` renamed
  to `step_N` and the folder fsynced, `latest.tmp` written with the name and fsynced, renamed to
  `latest`, the folder fsynced again. Independent reference: the kernel's own record of which path
  each fsynced descriptor is (/proc/self/fd), and the calls in the order they were made.
- At a Checkpointer's start, rank 0 removes the `step_*.tmp` folders and the `latest.tmp` a killed
  job left, saying each one's name and size; complete checkpoints and `latest` stay.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.run import checkpoint
from megatron_rl.run.checkpoint import Checkpointer, _Save, latest_checkpoint


def test_latest_is_fsynced_before_and_after_its_rename(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep=2)
    root = ckpt.root
    tmp = root / "step_00000003.tmp"
    (tmp / "critic").mkdir(parents=True)
    for folder in (tmp, tmp / "critic"):
        (folder / "metadata.json").write_text("{}")
        (folder / "common.pt").write_bytes(b"x")
    calls = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        calls.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    ckpt._publish(_Save(3, tmp, root / "step_00000003", [], 0.0, 0.0))

    final = root / "step_00000003"
    small = {("fsync", str(f / n)) for f in (tmp, tmp / "critic") for n in ("metadata.json", "common.pt")}
    assert set(calls[:4]) == small
    marker, latest = str(root / "latest.tmp"), str(root / "latest")
    assert calls[4:] == [("replace", str(tmp), str(final)), ("fsync", str(root)),
                         ("fsync", marker), ("replace", marker, latest), ("fsync", str(root))]
    assert (root / "latest").read_text() == "step_00000003" and latest_checkpoint(tmp_path) == final
    assert not (root / "latest.tmp").exists()


def test_what_an_unfinished_save_left_is_removed_at_the_start(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_00000004", "step_00000006.tmp", "step_00000008.tmp"):
        (root / name / "rng").mkdir(parents=True)
    (root / "step_00000006.tmp" / "__0_0.distcp").write_bytes(b"\0" * 3_000_000)
    (root / "step_00000006.tmp" / "rng" / "rank0.pt").write_bytes(b"\0" * 500_000)
    (root / "step_00000004" / "__0_0.distcp").write_bytes(b"\0" * 10)
    (root / "latest").write_text("step_00000004")
    (root / "latest.tmp").write_text("")  # a crash between the marker's write and its rename
    lines = []

    Checkpointer(tmp_path, log=lines.append)

    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]
    assert (root / "step_00000004" / "__0_0.distcp").exists() and latest_checkpoint(tmp_path).name == "step_00000004"
    assert len(lines) == 1, lines
    assert "step_00000006.tmp (3.5 MB)" in lines[0] and "step_00000008.tmp (0.0 MB)" in lines[0]
    assert "latest.tmp (0.0 MB)" in lines[0] and str(root) in lines[0]

    lines.clear()
    assert Checkpointer(tmp_path, log=lines.append).remove_abandoned() == [] and lines == []  # nothing left: silent
    assert Checkpointer(Path(tmp_path) / "new", log=lines.append).remove_abandoned() == []  # no folder yet
    assert not checkpoint.checkpoints_root(tmp_path / "new").exists()


def _slow_write(path: str) -> None:
    import time

    Path(path).write_text(str(os.getpid()))
    time.sleep(60)


def _rank_that_forks_a_writer(pid_file: str) -> None:
    """A rank's loop thread forking an asynchronous save's writer as Checkpointer.save does, then
    waiting (to be SIGKILLed)."""
    import multiprocessing as mp
    import time
    from types import SimpleNamespace

    fork = mp.get_context("fork")
    request = SimpleNamespace(async_fn=_slow_write, async_fn_args=(pid_file,), async_fn_kwargs={})
    fork.Process(target=checkpoint._forked_writer, args=([request], fork.Value("d", 0.0, lock=False), os.getpid())).start()
    time.sleep(60)


@pytest.mark.slow
def test_an_asynchronous_writer_dies_with_its_rank(tmp_path):
    """A rank SIGKILLed mid-save (out of memory, a lost node's srun) takes its forked writer down
    within moments, so no writer of a failed attempt fills step_N.tmp while the requeued attempt
    clears it and saves step N there anew. Without PR_SET_PDEATHSIG the writer, reparented, lives
    on for its whole write (here 60 s)."""
    import multiprocessing as mp
    import signal
    import time

    pid_file = tmp_path / "writer.pid"
    rank = mp.get_context("spawn").Process(target=_rank_that_forks_a_writer, args=(str(pid_file),))
    rank.start()
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    writer = int(pid_file.read_text())
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10)

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie waiting for its reaper is gone as a writer

    while alive(writer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(writer), "the writer outlived its rank"
