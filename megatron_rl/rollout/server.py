"""SGLang server lifecycle: launch N servers, wait for health, capture logs, restart the dead.

Each server is one `python -m megatron_rl.rollout.launch_server ...` process (SGLang's own HTTP
server with this project's patches applied in all its processes), on its own free port (drawn
under the kernel's ephemeral range: `free_port`), with its stdout+stderr appended to
`<log_dir>/server<i>.log`. A server is stopped by SIGTERM to its main process only, then SIGKILL
to that process if it has not exited after `stop_timeout`: SGLang's main process takes its
scheduler/detokenizer children down itself, and signalling the whole process group would send it
down its crash path instead. The exception is a start whose port was taken before it could bind
it: it serves nothing, so its group is killed and it starts again on a new port (`wait_healthy`).
Processes are never looked up by name.

On CPU (`device="cpu"`) SGLang runs with `SGLANG_USE_CPU_ENGINE=1` and patches/sglang_cpu.py;
on GPU (`device="cuda"`) the same command runs with `--device cuda`, no CPU patches, and
`gpu_ids` choosing each server's GPUs through CUDA_VISIBLE_DEVICES.

A server is started by a trainer rank, but it is not a rank of the trainer's world: its
environment is the trainer's minus the variables by which a launcher (torchrun, Slurm, MPI) tells
a process which rank of which job it is (`server_environment`, rule in `is_launcher_variable`),
with loopback and the server's host in no_proxy: SGLang asks its own server for /model_info as it
starts, which a user's proxy must not carry (rollout/direct.py); health checks here go direct too.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Mapping

from .direct import direct_env, urlopen

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    pass


@dataclasses.dataclass
class ServerConfig:
    """How to launch each SGLang server (one config shared by all servers of a manager)."""

    model_path: str
    """HF checkpoint folder (or hub id where a hub is reachable)."""
    device: str = "cpu"
    """"cpu" or "cuda"."""
    dtype: str = "float32"
    """SGLang --dtype; on CPU give it explicitly ("auto" would serve fp16)."""
    tp_size: int = 1
    """Tensor-parallel size of each server."""
    dp_size: int = 1
    """Data-parallel replicas inside each server."""
    mem_fraction_static: float | None = None
    """--mem-fraction-static (weights + KV cache share of device memory); None: SGLang's default."""
    max_total_tokens: int | None = None
    """--max-total-tokens, a cap on the KV cache (keeps CPU servers small); None: from memory."""
    enable_return_routed_experts: bool = False
    """--enable-return-routed-experts (MoE router replay)."""
    enable_memory_saver: bool = False
    """--enable-memory-saver (GPU: release/resume memory around training when colocated)."""
    sleep_on_idle: bool | None = None
    """--sleep-on-idle: an idle scheduler waits on its sockets (woken at once by a request)
    instead of spinning. None: on for CPU servers, whose spinning scheduler otherwise takes about
    half a core from the learner colocated with it while it trains."""
    host: str = "127.0.0.1"
    """Address the servers listen on."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang server arguments, passed through verbatim."""
    env: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    """Extra environment variables for the server processes (set after launcher variables are
    removed, so one named here is kept)."""
    startup_timeout: float = 300.0
    """Seconds to wait for a server to become healthy."""
    stop_timeout: float = 30.0
    """Seconds to wait after SIGTERM before SIGKILL."""
    python: str = sys.executable
    """Interpreter that runs the launcher."""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


# Launcher variables a server must not inherit, by exact name and by prefix. Why each group:
# - torchrun/torchelastic (torch/distributed/elastic/agent/server/local_elastic_agent.py sets them
#   for every worker). TORCHELASTIC_USE_AGENT_STORE=True makes torch's tcp:// and env://
#   rendezvous (torch/distributed/rendezvous.py `_create_c10d_store`) open a client-only TCPStore,
#   trusting the torchrun agent to host it: SGLang's own `init_process_group(tcp://...)` then has no
#   store server and waits at "Init parallel begin" until torch's default timeout (30 min, gloo).
#   RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are what torch's env:// rendezvous reads,
#   and SGLang 0.5.23 too (`LOCAL_RANK` in init_distributed_environment for env://, `MASTER_ADDR`
#   for its NIXL TCPStore): the trainer's values would point a server at the trainer's store and
#   rank. NODE_RANK is the same for other launchers (Lightning, accelerate).
# - Slurm per-task identity (srun sets them per task): the server is not task SLURM_PROCID of
#   SLURM_NTASKS, and Slurm-aware code (like this project's distributed/context.py) reads them as
#   the process's own rank. Job-level variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, ...) stay.
# - MPI/PMI (Open MPI, MPICH/Intel MPI Hydra, MVAPICH, Slurm's --mpi=pmi2/pmix): a process that
#   finds these at MPI_Init (mpi4py, NVSHMEM's PMI bootstrap, UCX) joins the launcher's job as
#   that rank, a duplicate of the trainer rank it came from, instead of running alone.
# - Learner-only settings: CUDA_DEVICE_MAX_CONNECTIONS=1 (the sbatch sets it for the learner ranks:
#   Megatron's TP/SP overlap needs kernels issued in order) serialises SGLang's own overlapped streams.
# CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, NCCL_*/TORCH_* tuning and everything else pass through;
# ServerConfig.env is applied after this rule, so a variable set there on purpose is kept.
LAUNCHER_VARIABLES = frozenset({
    # torch.distributed.run / torchelastic (and NODE_RANK)
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
    # Slurm task identity
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_GTIDS", "SLURM_TASK_PID",
    # MPICH / Intel MPI (Hydra) local rank
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    # the learner's own CUDA setting
    "CUDA_DEVICE_MAX_CONNECTIONS",
})
LAUNCHER_PREFIXES = (
    "TORCHELASTIC_",  # agent store, run id, restart count, error file
    "PMI_", "PMIX_",  # PMI-1/2 and PMIx clients (Slurm --mpi, Hydra, Open MPI 5)
    "OMPI_COMM_WORLD_", "OMPI_MCA_orte_", "OMPI_MCA_ess_",  # Open MPI rank and job identity
    "MV2_COMM_WORLD_",  # MVAPICH
)


def is_launcher_variable(name: str) -> bool:
    """True for a variable by which torchrun, Slurm or MPI names a process's rank in its job."""
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def server_environment(environ: Mapping[str, str], extra: Mapping[str, str] | None = None, *,
                       device: str = "cpu", gpu_ids: list[int] | None = None) -> dict[str, str]:
    """The environment of a server process started from a process whose environment is `environ`:
    `environ` without launcher variables, then `extra`, then the device selection."""
    env = {k: v for k, v in environ.items() if not is_launcher_variable(k)}
    env.update(extra or {})
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # OpenMP threads that finish a parallel region sleep instead of spinning (unless chosen):
        # a CPU server's scheduler shares the cores with its own tokenizer and detokenizer
        # processes, the trainer, and, during a push, the transport's sender (docs/benchmarks.md,
        # weight sync: the push and the demo's generation faster on two shared cores). A CPU
        # server on cores of its own may want ACTIVE (ServerConfig.env).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    elif gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    return env


# Where a server's HTTP port is drawn: under the kernel's ephemeral range (Linux's default starts at
# 32768), so that no outgoing connection or bind(0) of another process takes it in the seconds the
# server imports before it binds (it did: a CI run's reward server found its port taken and died
# at warm-up), and under SGLang's own draw for its NCCL port (22000-29999).
LISTEN_PORTS = (12000, 21999)
BIND_RETRIES = 3  # starts on a new port when a server finds its own taken (`wait_healthy`)
BIND_FAILED = b"address already in use"  # uvicorn's log line when it cannot bind its port


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port free now for a server to listen on, drawn at random from LISTEN_PORTS (under the
    kernel's ephemeral range where /proc says where it starts); the kernel's choice when none of
    `attempts` draws is free."""
    low, high = LISTEN_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    if high - low + 1 >= attempts:
        for port in random.sample(range(low, high + 1), attempts):
            if _port_free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn binds: connections of a killed server left in TIME_WAIT do not block it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urlopen(url, timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class SGLangServer:
    """One SGLang server process: start, health, stop, restart (on the same port if it is free)."""

    def __init__(self, index: int, config: ServerConfig, port: int, log_path: Path,
                 gpu_ids: list[int] | None = None):
        self.index = index
        self.config = config
        self.port = port
        self.log_path = Path(log_path)
        self.gpu_ids = gpu_ids
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._log_file = None
        self._log_start = 0  # the log offset where the latest start's lines begin

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        c = self.config
        cmd = [c.python, "-m", "megatron_rl.rollout.launch_server",
               "--model-path", str(c.model_path), "--device", c.device, "--dtype", c.dtype,
               "--host", c.host, "--port", str(self.port), "--tp-size", str(c.tp_size),
               "--dp-size", str(c.dp_size)]
        if c.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if c.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(c.max_total_tokens)]
        if c.enable_return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if c.enable_memory_saver:
            cmd.append("--enable-memory-saver")
        if c.sleep_on_idle if c.sleep_on_idle is not None else c.device == "cpu":
            cmd.append("--sleep-on-idle")
        # Exits when this process (its parent) is gone, however it ended (launch_server).
        return cmd + ["--exit-with-parent"] + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        return direct_env(server_environment(os.environ, self.config.env, device=self.config.device,
                                             gpu_ids=self.gpu_ids), [self.config.host])

    def start(self) -> None:
        if self.is_alive():
            raise RuntimeError(f"server {self.index} ({self.url}) is already running")
        if not _port_free(self.config.host, self.port):
            old = self.port
            self.port = free_port(self.config.host)
            logger.warning("server %d: port %d busy, moving to %d", self.index, old, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n===== megatron-rl: start #{self.restarts} of server {self.index} "
                             f"on {self.url} at {time.strftime('%F %T')}: {' '.join(self.command())}\n"
                             .encode())
        self._log_file.flush()
        self._log_start = self._log_file.tell()  # where this start's own lines begin
        # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches
        # the trainer, which stops at the step's end and then stops its servers; a server that got
        # the SIGINT too would die under the step (`--exit-with-parent` covers the trainer's death).
        self.proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.environment(), process_group=0)
        logger.info("server %d: started pid %d on %s (log %s)", self.index, self.proc.pid, self.url,
                    self.log_path)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        return self.is_alive() and http_ok(self.url + "/health", timeout)

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until the server answers /health_generate (it has run a real forward). A server
        that finds its port taken when it binds (another process took it while it imported) is
        stopped and started again on a new port, up to BIND_RETRIES times (its URL changes)."""
        limit = self.config.startup_timeout if timeout is None else timeout
        deadline, moves = time.monotonic() + limit, 0
        while time.monotonic() < deadline:
            if moves < BIND_RETRIES and self._bind_failed():
                moves += 1
                old = self.port
                self._kill_group()  # it serves nothing; SIGTERM there waits out stop_timeout
                self.port = free_port(self.config.host)
                logger.warning("server %d: port %d was taken before it could bind it; starting it again on %d",
                               self.index, old, self.port)
                self.start()
                deadline = time.monotonic() + limit
                continue
            if not self.is_alive():
                raise ServerStartError(
                    f"server {self.index} ({self.url}) exited with code {self.proc.returncode} "
                    f"during start-up; last log lines:\n{self.log_tail()}")
            if http_ok(self.url + "/health_generate", timeout=10):
                return
            time.sleep(0.5)
        raise ServerStartError(f"server {self.index} ({self.url}) not healthy after "
                               f"{timeout or self.config.startup_timeout:.0f}s; last log lines:\n"
                               f"{self.log_tail()}")

    def _bind_failed(self) -> bool:
        """Whether this start's log says its HTTP port was taken when it bound it."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return BIND_FAILED in f.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        """Send SIGTERM to the main process only (not its process group); do not wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to the main process only; SIGKILL to it after `stop_timeout`."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(self.config.stop_timeout)
            except subprocess.TimeoutExpired:
                logger.warning("server %d (pid %d) ignored SIGTERM for %.0fs; sending SIGKILL",
                               self.index, self.proc.pid, self.config.stop_timeout)
                self.proc.kill()
                self.proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the main process (a crash, for tests); its children exit on their own."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _kill_group(self) -> None:
        """SIGKILL the server's whole process group (its own: `start`), and close its log."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._close_log()

    def restart(self, wait: bool = True) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        if wait:
            self.wait_healthy()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class EngineManager:
    """N SGLang servers: start all, wait for health, watch and restart dead ones, stop all.

        with EngineManager(ServerConfig(model_path=ckpt), num_servers=2, log_dir=d) as mgr:
            client = RolloutClient(mgr)  # mgr.urls() follows restarts
    """

    def __init__(self, config: ServerConfig, num_servers: int = 1, *, log_dir: str | Path,
                 ports: list[int] | None = None, gpu_ids: list[list[int]] | None = None,
                 watch_interval: float | None = 1.0):
        if ports is not None and len(ports) != num_servers:
            raise ValueError(f"{len(ports)} ports given for {num_servers} servers")
        if gpu_ids is not None and len(gpu_ids) != num_servers:
            raise ValueError(f"{len(gpu_ids)} GPU lists given for {num_servers} servers")
        self.config = config
        self.log_dir = Path(log_dir)
        ports = ports or self._free_ports(num_servers)
        self.servers = [
            SGLangServer(i, config, ports[i], self.log_dir / f"server{i}.log",
                         gpu_ids[i] if gpu_ids is not None else None)
            for i in range(num_servers)
        ]
        self.watch_interval = watch_interval
        self.restart_events: list[tuple[int, float, int | None]] = []
        """(server index, time, exit code) for every restart the watchdog made."""
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._atexit_registered = False

    def _free_ports(self, n: int) -> list[int]:
        ports: list[int] = []
        while len(ports) < n:
            p = free_port(self.config.host)
            # SGLang also uses a few ports above its HTTP port; keep servers apart.
            if all(abs(p - q) > 16 for q in ports):
                ports.append(p)
        return ports

    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> "EngineManager":
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        for s in self.servers:
            s.start()
        try:
            for s in self.servers:
                s.wait_healthy()
        except BaseException:
            self.stop()
            raise
        if self.watch_interval:
            self._stop_event.clear()
            self._watchdog = threading.Thread(target=self._watch, name="sglang-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def dead_servers(self) -> list[int]:
        return [s.index for s in self.servers if not s.is_alive()]

    def restart_dead(self) -> list[int]:
        """Restart every server whose process has exited; return their indices."""
        restarted = []
        with self._lock:
            for s in self.servers:
                if self._stop_event.is_set():
                    break
                if s.proc is not None and not s.is_alive():
                    code = s.proc.returncode
                    logger.error("server %d (%s, pid %d) died with exit code %s; restarting it. "
                                 "Last log lines:\n%s", s.index, s.url, s.pid, code, s.log_tail(15))
                    self.restart_events.append((s.index, time.time(), code))
                    s.restart(wait=True)
                    restarted.append(s.index)
        return restarted

    def _watch(self) -> None:
        while not self._stop_event.wait(self.watch_interval):
            try:
                self.restart_dead()
            except Exception:  # keep watching; the failure is in the server's log
                logger.exception("watchdog: restart failed")

    def stop(self) -> None:
        self._stop_event.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()
            self._watchdog = None
        for s in self.servers:  # all at once, then wait for each
            s.terminate()
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "EngineManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
