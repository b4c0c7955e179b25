"""Suite-wide set-up.

Device check: every process a test starts (spawned ranks, trainer subprocesses, torchrun and Slurm
ranks) runs under patches/device_check.py: on this CPU-only machine it fails any code that would
put a host tensor into an NCCL collective or mix host and device tensors on a GPU node. It
installs only where CUDA is absent.

Tiers (docs/testing.md): a test is in the unit tier unless it is marked `slow`. The unit tier
(`make test-fast`, `pytest -m "not slow"`) starts no process: no server, no spawned rank, no
subprocess. That is enforced here, in every run: a test without the `slow` mark (its fixtures'
set-up included) that starts a process fails with the reason, so the edit-run loop stays fast and
a new test lands in the tier it belongs to.

Runs: a session's runs go under a temporary $MRL_RUNS, never the checkout's runs/.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("MRL_DEVICE_CHECK", "1")

# Tests never meet the user's own runs (a `make demo` leaves runs/tiny_cpu, which a test's dry-run
# would resume, or refuse): every run folder, comparison and base-model cache a test session makes
# without naming a folder goes under one temporary root ($MRL_RUNS, the runs root, config/schema.py).
# The controller makes it; xdist workers and every process a test starts inherit it.
if "PYTEST_XDIST_WORKER" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _RUNS = tempfile.mkdtemp(prefix="mrl-test-runs-")
    os.environ["MRL_RUNS"] = _RUNS
    atexit.register(shutil.rmtree, _RUNS, ignore_errors=True)


class ProcessInUnitTier(AssertionError):
    """A test of the unit tier (not marked `slow`) started a process."""


def _refuse(nodeid: str):
    def refuse(*args, **kwargs):
        raise ProcessInUnitTier(
            f"{nodeid} starts a process, which the unit tier does not allow (`make test-fast` must stay "
            "under 3 minutes): mark the test `@pytest.mark.slow` (docs/testing.md, 'Adding a test')")
    return refuse


_TARGETS = ((subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"), (os, "fork"),
            (os, "posix_spawn"), (os, "posix_spawnp"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


GPU_SUITE = Path(__file__).resolve().parent / "gpu"  # its own suite (docs/gpu.md), run only when named


def _guarded(item):
    if item.get_closest_marker("slow") is not None or Path(item.path).is_relative_to(GPU_SUITE):
        return (yield)
    saved = [(owner, name, getattr(owner, name)) for owner, name in _TARGETS if hasattr(owner, name)]
    refuse = _refuse(item.nodeid)
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        return (yield)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


# Running side by side (`make test` runs pytest-xdist with two workers): a test that uses a module- or
# class-scoped fixture (a server, a set of spawned runs) runs on the same worker as the rest of its
# module, so that the fixture is built once, and so does a test marked `xdist_group(NAME)` with the
# rest of NAME; every other test is scheduled on its own. Work goes out longest first
# (tests/durations.json, the seconds each test took in a measured run; a test not in it counts as
# UNKNOWN_S), which keeps the two workers' finishing times close.
#
# The groups are made here rather than by xdist's `--dist loadgroup`, which renames the grouped tests'
# ids and cannot on pytest 9 (there nodeid derives from the structured id): worker gw0 writes
# {nodeid: group} to a file the controller names, and the controller's scheduler (a LoadScope
# scheduler whose scope is that group) reads it once every worker has collected.
DURATIONS = Path(__file__).resolve().parent / "durations.json"
UNKNOWN_S = 30.0


def _shared_scope(item) -> str | None:
    """The module whose fixtures this test shares (module-, class- or package-scoped), or None."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for defs in info.name2fixturedefs.values():
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if any(Path(i.path).is_relative_to(GPU_SUITE) for i in items):
        return  # the GPU suite runs alone, in its own order
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    units: dict[str, list] = {}
    for item in items:
        explicit = next((m.args[0] if m.args else m.kwargs.get("name") for m in item.iter_markers("xdist_group")),
                        None)
        units.setdefault(explicit or _shared_scope(item) or item.nodeid, []).append(item)
    cost = {key: sum(seconds.get(i.nodeid, UNKNOWN_S) for i in unit) for key, unit in units.items()}
    # Longest first; ties keep collection order (sorted is stable). Within a unit, collection order.
    items[:] = [i for key in sorted(units, key=lambda k: -cost[k]) for i in units[key]]
    workerinput = getattr(config, "workerinput", None)
    if workerinput and workerinput.get("workerid") == "gw0" and workerinput.get("mrl_groups_file"):
        path = Path(workerinput["mrl_groups_file"])
        path.with_suffix(".tmp").write_text(json.dumps({i.nodeid: key for key, unit in units.items() for i in unit}))
        path.with_suffix(".tmp").replace(path)


def pytest_sessionstart(session):
    """First-use caches that a library builds by starting a process are built here, before any test
    runs: matplotlib's font list (it runs fc-list the first time; a unit-tier test that plots would
    otherwise fail with ProcessInUnitTier on a machine with a fresh $HOME, and pass wherever a
    slower test had built the cache first). A user's first plot builds it the same way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401 - builds (or reads) the font cache


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist"):
        import tempfile

        config._mrl_groups_file = Path(tempfile.mkdtemp(prefix="mrl-xdist-")) / "groups.json"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["mrl_groups_file"] = str(node.config._mrl_groups_file)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """LoadScope whose scope is the group tests/conftest.py gave each test."""

        groups: dict[str, str] = {}

        def schedule(self):
            path = config._mrl_groups_file
            self.groups = json.loads(path.read_text()) if path.exists() else {}
            super().schedule()

        def _split_scope(self, nodeid):
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


# MRL_DURATIONS_OUT=FILE: write each test's seconds (set-up + call + tear-down) as JSON, the format of
# tests/durations.json (`MRL_DURATIONS_OUT=tests/durations.json make test` refreshes it).
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    out = os.environ.get("MRL_DURATIONS_OUT")
    if out and not hasattr(session.config, "workerinput") and _seconds:  # the controller, not a worker
        Path(out).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_seconds.items())}, indent=0) + "\n")
