"""Weight pushes to the rollout servers: which servers get each push, the transport, retries.

A push is a collective of every learner rank (the export gathers the shards, a few collectives per
bucket: models/weight_export.py); rank 0 (the driver) sends the full tensors with the configured
transport (`rollout.weight_sync`: distributed = an NCCL/gloo update group, tensor, disk). Before
each push rank 0 finds the servers that answer: local servers (an `EngineManager`) that died are
restarted first; disaggregated servers (the launcher's, restarted by its supervisor) that do not
answer are left out and taken back, with the current weights, at the first push after they answer.
Whenever that set changes, or a server answers with another version than the last push gave it (it
was restarted and lost the update group), the update group is formed again. A server that dies
after the check and before the push sent anything (`ServersUnreachable`) is restarted or left out
and the push is made again (three tries).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

from megatron_rl.config.schema import JobConfig
from megatron_rl.rollout import placement
from megatron_rl.weights.endpoint import ServersUnreachable
from megatron_rl.weights.push import push_weights


class WeightPushes:
    """The pushes of one job. `pushed_to`: the servers the last push reached (rank 0); `live`: the
    disaggregated servers that answered at the last push (None for local servers)."""

    def __init__(self, cfg: JobConfig, driver: bool, manager, served):
        self.cfg, self.driver, self.manager, self.served = cfg, driver, manager, served
        self.transport = None
        self.pushed_to: Optional[list[str]] = None
        self.live: Optional[list[str]] = None
        self.restarts_seen = 0
        self.weight_version: Optional[str] = None  # what the last push gave every server it reached

    def make_transport(self, learner):
        r = self.cfg.rollout
        # The update group's size comes from the servers' own tp_size (checked against
        # rollout.server_tp); a restarted server is asked again.
        servers = placement.checked_endpoints(self.pushed_to, self.cfg)
        if r.weight_sync == "distributed":
            from megatron_rl.weights.sync_distributed import DistributedWeightSync

            # Local servers reach rank 0 on loopback; remote ones on this host's address.
            addr = "127.0.0.1" if self.manager else os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
            # A fresh group name per connection: a server may still hold the group of a killed run.
            # The port is the one the group's store binds (no probe another process could race).
            t = DistributedWeightSync(servers, master_addr=addr,
                                      group_name=f"megatron_rl_{uuid.uuid4().hex[:8]}")
            t.connect()
            return t
        if r.weight_sync == "tensor":
            from megatron_rl.weights.sync_tensor import TensorWeightSync

            return TensorWeightSync(servers)
        if r.weight_sync == "disk":
            from megatron_rl.weights.sync_disk import DiskWeightSync

            return DiskWeightSync(servers, Path(self.cfg.trainer.out_dir) / "weights_for_servers")
        raise ValueError(f"rollout.weight_sync={r.weight_sync!r}; valid: distributed, tensor, disk")

    def answering(self, wait_s: float) -> dict[str, str]:
        """Rank 0, disaggregated: {url: weight version} of the configured servers that answer now;
        with none answering, waits up to `wait_s` for one (a supervisor restarting them)."""
        from megatron_rl.weights.endpoint import ServerEndpoint, WeightSyncError

        from concurrent.futures import ThreadPoolExecutor

        def version(url: str) -> Optional[str]:
            try:
                return str(ServerEndpoint(url).get("/get_model_info", timeout=10.0).get("weight_version"))
            except WeightSyncError:
                return None

        urls = list(self.cfg.rollout.server_urls)
        deadline = time.monotonic() + wait_s
        with ThreadPoolExecutor(max_workers=min(32, len(urls)) or 1) as pool:
            while True:  # all asked at once: dead servers cost one 10 s timeout, not one each
                out = {u: v for u, v in zip(urls, pool.map(version, urls)) if v is not None}
                if out or time.monotonic() > deadline:
                    return out
                time.sleep(2.0)

    def refresh(self) -> bool:
        """Rank 0, disaggregated: which servers answer (`_live`). True when one answers with another
        version than the last push gave it (restarted in between: it lost the update group and its
        weights), so the group must be formed again even if the push goes to the same servers."""
        log = logging.getLogger(__name__)
        answering = self.answering(wait_s=300.0)
        if not answering:
            raise RuntimeError(f"no rollout server answers (rollout.server_urls: {list(self.cfg.rollout.server_urls)}) "
                               "after 300 s; see the servers' logs")
        live = [u for u in self.cfg.rollout.server_urls if u in answering]
        before, self.live = self.live, live
        if before is not None:
            for u in sorted(set(before) - set(live)):
                log.warning("rollout server %s does not answer: pushing to the other %d; it is taken back, with "
                            "the current weights, at the first push after it answers", u, len(live))
            for u in sorted(set(live) - set(before)):
                log.warning("rollout server %s answers again (weight version %s): it gets this push", u, answering[u])
        restarted = [u for u in live if u in (self.pushed_to or ()) and answering[u] != self.weight_version]
        for u in restarted:
            log.warning("rollout server %s holds weight version %s, not %s: restarted since the last push; "
                        "forming the update group again", u, answering[u], self.weight_version)
        return bool(restarted)


    def push(self, learner, version: str, held: list[str]) -> tuple[dict, float]:
        """Collective over the learner ranks: send the learner's weights to every server (every
        one that answers, for disaggregated servers: `refresh`) but those in `held` (an
        evaluation's, at older weights). Returns (the transport's stats, seconds of the push
        itself)."""
        restarted = [0]
        if self.driver and self.manager is not None:
            # A server that died since the last push is restarted (and healthy) before this one:
            # the watchdog polls only every second, and a restart it is making holds the lock.
            self.manager.restart_dead()
            restarted = [len(self.manager.restart_events) - self.restarts_seen]
            self.restarts_seen += restarted[0]
        elif self.driver:  # disaggregated: the launcher's servers
            restarted = [int(self.refresh())]
        if self.driver:
            # Every server that answers, but those an evaluation holds at older weights; the
            # update group is formed again whenever that set changes.
            targets = [u for u in (self.manager.urls() if self.manager else self.live) if u not in held]
            restarted[0] = restarted[0] or int(self.transport is not None and targets != self.pushed_to)
            self.pushed_to = targets
        if self.driver and (self.transport is None or restarted[0]):
            # A restarted server lost the update group (and its weights): form it again.
            self.close()
            self.transport = self.make_transport(learner)
        if not self.driver and self.transport is None and self.cfg.rollout.weight_sync == "disk":
            from megatron_rl.weights.sync_disk import DiskWeightSync

            # Writing the HF checkpoint is a collective; only rank 0 talks to the servers.
            self.transport = DiskWeightSync([], Path(self.cfg.trainer.out_dir) / "weights_for_servers")
        start = time.perf_counter()
        for attempt in range(3):
            try:
                stats = push_weights(learner, self.transport, weight_version=version, served=self.served)
                break
            except ServersUnreachable as e:
                # A server died after the check above and before this push sent anything (the
                # driver's export has not started: the other ranks wait in its first collective):
                # restart it (local) or leave it out (disaggregated), form the update group
                # again, push again.
                if attempt == 2:
                    raise
                logging.getLogger(__name__).warning(
                    "weight push %s: a server is gone (%s); %s and pushing again", version, e,
                    "restarting it" if self.manager else "leaving it out")
                if self.manager is not None:
                    deadline = time.monotonic() + 30
                    while not self.manager.restart_dead() and time.monotonic() < deadline:
                        time.sleep(0.2)  # the killed process is not reaped yet
                    self.restarts_seen = len(self.manager.restart_events)
                else:
                    self.refresh()
                    self.pushed_to = [u for u in self.live if u not in held]
                self.close()
                self.transport = self.make_transport(learner)
        self.weight_version = version
        return stats, time.perf_counter() - start

    def close(self) -> None:
        if self.transport is not None and hasattr(self.transport, "close"):
            self.transport.close()
