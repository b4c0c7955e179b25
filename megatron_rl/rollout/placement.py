"""Where the SGLang rollout servers run, and the checks that keep a layout honest.

Placements (`rollout.placement`):

- **local**: rank 0 starts `rollout.num_servers` servers on its own node (`EngineManager`, which
  also restarts dead ones). On CPU they share the machine with the learner. On GPUs each server
  takes `rollout.server_tp` GPUs, in order, from `rollout.gpu_ids` (indices into rank 0's visible
  devices), and none of them may be a GPU that a learner rank on that node uses: without GPUs of
  their own the servers would land on the learner's GPU 0.. and the NCCL weight-update group
  would hold a learner rank and a server rank on one GPU.
- **disaggregated**: the servers run elsewhere and are passed as `rollout.server_urls`. The sbatch
  script starts one server per data-parallel replica on each rollout node: GPUS_PER_NODE /
  ROLLOUT_TP servers, server k of a node on GPUs [k·TP, (k+1)·TP) and port ROLLOUT_PORT +
  k·PORT_STRIDE (`slot_on_node`, applied by `launch_server --slurm-slot`). Any running servers
  given by URL work the same way.
- **auto** (the default): disaggregated when `rollout.server_urls` is given, else local.

Every server runs with dp_size 1: SGLang 0.5.23 refuses weight updates on a server with
data-parallel replicas (`tokenizer_control_mixin.py` asserts dp_size == 1 in every
update/init-group path), so a replica is a server of its own. The weight-update group is the
learner's rank 0 plus every TP rank of every server (a server joins at rank_offset + tp_rank), so
its size comes from the servers' own `tp_size` (their /server_info), which must equal
`rollout.server_tp`.

Not implemented, and refused with a message: colocation on shared GPUs (servers and learner
taking turns on the same GPUs, server memory released while the learner trains:
`rollout.release_memory`), and the tensor-handle weight sync on GPUs (`weight_sync=tensor`: the
CUDA IPC handles would point at learner rank 0's GPU, not at each server rank's).

This module imports no torch at import time: `launch_server` uses it before CUDA is touched.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.config.schema import JobConfig

PORT_STRIDE = 16  # ports between servers on one node (SGLang binds a few beside its HTTP port)
PLACEMENTS = ("auto", "local", "disaggregated")


# ---------------------------------------------------------------------------------------------
# placement and config checks (no process group, no server needed)
# ---------------------------------------------------------------------------------------------
def server_device(cfg: JobConfig) -> str:
    """rollout.device with "auto" resolved: cuda if this process sees a GPU."""
    r = cfg.rollout
    if r.device != "auto":
        return r.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_placement(cfg: JobConfig) -> str:
    """"local" or "disaggregated" (see the module docstring)."""
    r = cfg.rollout
    if r.placement not in PLACEMENTS:
        raise ValueError(f"rollout.placement={r.placement!r}; valid: {', '.join(PLACEMENTS)}")
    if r.placement == "auto":
        return "disaggregated" if r.server_urls else "local"
    if r.placement == "local" and r.server_urls:
        raise ValueError("rollout.placement=local starts servers on rank 0's node, but rollout.server_urls "
                         "names running servers: give one or the other")
    return r.placement


_TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
_DP_FLAGS = ("--dp-size", "--data-parallel-size")
_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size")
_EP_FLAGS = ("--ep-size", "--expert-parallel-size", "--ep")


def quiet_http(argv: list[str]) -> list[str]:
    """A server's arguments with its HTTP access log at warning level unless they set one
    (launch_server applies it to every server): at info, every request is a line (25k lines per
    server in a 30-step testbed run), burying what matters."""
    if any(a == "--log-level-http" or a.startswith("--log-level-http=") for a in argv):
        return argv
    return [*argv, "--log-level-http", "warning"]


def flag_value(args: Sequence[str], names: Sequence[str]) -> Optional[str]:
    """The value of the last of `names` in an argument list (`--x v` or `--x=v`), else None."""
    value = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


def server_ep(args: Sequence[str]) -> int:
    v = flag_value(args, _EP_FLAGS)
    return int(v) if v is not None else 1


def check_server_args(args: Sequence[str], where: str) -> None:
    """Server arguments that would break the weight updates or contradict rollout.server_tp."""
    if flag_value(args, _TP_FLAGS) is not None:
        raise ValueError(f"{where} sets the server's TP size; set it with rollout.server_tp "
                         "(sbatch: ROLLOUT_TP), which the weight-update group is sized from")
    for names, what in ((_DP_FLAGS, "data-parallel replicas"), (_PP_FLAGS, "pipeline stages")):
        v = flag_value(args, names)
        if v is not None and int(v) != 1:
            raise ValueError(f"{where}: {names[0]} {v}: SGLang updates weights only on servers with one "
                             f"replica and no pipeline stages (dp_size = pp_size = 1); start one server per "
                             f"replica instead ({what} are not supported)")
    if "--enable-dp-attention" in args:
        raise ValueError(f"{where}: --enable-dp-attention needs dp_size > 1, and SGLang refuses weight "
                         "updates with dp_size > 1")


def check_placement(cfg: JobConfig, device: Optional[str] = None) -> str:
    """Config checks of the rollout placement; returns the resolved placement. `device` is the
    servers' device (default: rollout.device, auto resolved in this process)."""
    r, rm = cfg.rollout, cfg.reward_model
    placement = resolve_placement(cfg)
    device = device or server_device(cfg)
    if r.server_tp < 1 or r.num_servers < 1:
        raise ValueError(f"rollout.server_tp={r.server_tp}, rollout.num_servers={r.num_servers}: both must be >= 1")
    if r.weight_sync not in ("distributed", "tensor", "disk"):
        raise ValueError(f"rollout.weight_sync={r.weight_sync!r}; valid: distributed, tensor, disk")
    if r.release_memory:
        raise ValueError(
            "rollout.release_memory=true: colocation on shared GPUs (servers releasing their memory "
            "while the learner trains on the same GPUs) is not implemented. Supported: on GPUs, servers "
            "on GPUs of their own -- disaggregated (sbatch ROLLOUT_NODES=N ROLLOUT_TP=T, or "
            "rollout.server_urls) or rank 0's servers on rollout.gpu_ids that no learner rank uses; on "
            "CPU, servers sharing the machine with the learner (nothing to release)")
    if r.weight_sync == "tensor" and device == "cuda":
        raise ValueError(
            "rollout.weight_sync=tensor on GPUs would send CUDA IPC handles of learner rank 0's GPU to "
            "every server TP rank, which run on other GPUs (per-GPU handles are not implemented): use "
            "rollout.weight_sync=distributed (NCCL) on GPUs; tensor is for CPU servers on the learner's "
            "machine")
    check_server_args(r.extra_server_args, "rollout.extra_server_args")
    if placement == "local":
        if device == "cuda":
            n = r.num_servers * r.server_tp
            if not r.gpu_ids:
                raise ValueError(
                    f"rank 0 would start rollout.num_servers={r.num_servers} SGLang server(s) on CUDA with no "
                    "GPUs of their own: they would land on the learner's GPUs. Run them disaggregated "
                    "(sbatch ROLLOUT_NODES=N ROLLOUT_TP=T, or rollout.server_urls=[...]), or give "
                    f"rollout.gpu_ids=[...]: {n} GPU indices (num_servers x server_tp) that no learner rank "
                    "on rank 0's node uses")
            if len(r.gpu_ids) != n or len(set(r.gpu_ids)) != n or min(r.gpu_ids) < 0:
                raise ValueError(f"rollout.gpu_ids={list(r.gpu_ids)}: need {n} distinct GPU indices "
                                 f"(num_servers={r.num_servers} x server_tp={r.server_tp})")
        elif r.gpu_ids:
            raise ValueError("rollout.gpu_ids places servers on GPUs; these servers run on CPU "
                             "(rollout.device): drop rollout.gpu_ids")
    elif r.gpu_ids:
        raise ValueError("rollout.gpu_ids places the servers rank 0 starts; with rollout.server_urls "
                         "(disaggregated) the servers' launcher places them: drop rollout.gpu_ids")
    if rm.enabled and rm.backend == "sglang" and not rm.server_urls and device == "cuda":
        raise ValueError(
            "reward_model.backend=sglang: the reward-model servers rank 0 would start on CUDA get no GPUs "
            "of their own and would land on the learner's GPUs; start them yourself and pass "
            "reward_model.server_urls=[...], or use reward_model.backend=megatron")
    return placement


# ---------------------------------------------------------------------------------------------
# the model against the servers' TP / EP
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What SGLang shards across a server's TP ranks."""

    heads: int
    kv_heads: int
    ffn: int  # dense MLP width (0: none)
    experts: int  # routed experts per layer (0: dense)
    moe_ffn: int  # expert MLP width
    source: str  # where it was read


def model_shape(cfg: JobConfig) -> ModelShape:
    m = cfg.model
    if not m.hf_path:
        t = m.tiny
        return ModelShape(t.heads, t.kv_heads, 0 if t.moe else t.ffn, t.num_experts if t.moe else 0,
                          t.moe_ffn if t.moe else 0, "model.tiny")
    path = Path(m.hf_path) / "config.json"
    hf = json.loads(path.read_text())
    if "num_attention_heads" not in hf:
        raise ValueError(f"{path} has no num_attention_heads: not the config of a causal LM that "
                         "SGLang serves, so the server layout cannot be checked against it")
    heads = int(hf["num_attention_heads"])
    experts = next((int(hf[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if hf.get(k)), 0)
    return ModelShape(heads, int(hf.get("num_key_value_heads") or heads),
                      int(hf.get("intermediate_size") or 0) if not experts else 0, experts,
                      int(hf.get("moe_intermediate_size") or 0), str(path))


def check_model_fits_server(shape: ModelShape, tp: int, ep: int = 1) -> str:
    """SGLang's own sharding rules for Qwen3 / Qwen3-MoE on one server (models/qwen3*.py,
    runtime_context.derive_parallel_widths); returns a one-line summary."""
    problems = []
    if shape.heads % tp:
        problems.append(f"{shape.heads} attention heads are not divisible by TP {tp}")
    # KV heads are split when there are at least TP of them, else replicated (TP a multiple).
    if shape.kv_heads >= tp and shape.kv_heads % tp:
        problems.append(f"{shape.kv_heads} KV heads are not divisible by TP {tp}")
    if shape.kv_heads < tp and tp % shape.kv_heads:
        problems.append(f"TP {tp} is not a multiple of the {shape.kv_heads} KV heads (replicated below TP)")
    if shape.ffn and shape.ffn % tp:
        problems.append(f"MLP width {shape.ffn} is not divisible by TP {tp}")
    if shape.experts:
        if tp % ep:
            problems.append(f"expert-parallel size {ep} does not divide TP {tp}")
        elif shape.experts % ep:
            problems.append(f"{shape.experts} experts are not divisible by the server's EP {ep}")
        elif shape.moe_ffn and shape.moe_ffn % (tp // ep):
            problems.append(f"expert MLP width {shape.moe_ffn} is not divisible by the expert TP {tp // ep}")
    elif ep != 1:
        problems.append(f"--ep-size {ep} on a dense model")
    if problems:
        raise ValueError(f"a server of TP {tp}" + (f", EP {ep}" if ep != 1 else "") + " cannot hold this "
                         f"model ({shape.source}): " + "; ".join(problems))
    moe = f", {shape.experts} experts / EP {ep}" if shape.experts else ""
    return f"{shape.heads} heads, {shape.kv_heads} KV heads{moe}: fit TP {tp}"


# ---------------------------------------------------------------------------------------------
# the launcher's servers on a node
# ---------------------------------------------------------------------------------------------
def slot_on_node(slot: int, tp: int, base_port: int,
                 visible: Optional[Sequence[str]] = None) -> tuple[int, list[str]]:
    """Server `slot` of a node: its port and its GPUs (entries of `visible`, the node's visible
    devices, or plain indices when None): GPUs [slot·tp, (slot+1)·tp)."""
    ids = [str(g) for g in range(slot * tp, (slot + 1) * tp)]
    if visible is not None:
        if (slot + 1) * tp > len(visible):
            raise ValueError(f"server slot {slot} needs GPUs {slot * tp}..{(slot + 1) * tp - 1} but only "
                             f"{len(visible)} are visible ({','.join(visible)})")
        ids = list(visible[slot * tp:(slot + 1) * tp])
    return base_port + slot * PORT_STRIDE, ids


def take_slurm_slot(argv: list[str], environ=os.environ) -> list[str]:
    """`launch_server --slurm-slot`: this process is server k = SLURM_LOCALID of its node. Returns
    SGLang's arguments with its port (`--port` is the node's base) and narrows
    CUDA_VISIBLE_DEVICES in `environ` to its GPUs (`slot_on_node`; not on CPU). Arguments
    without the flag come back untouched."""
    if "--slurm-slot" not in argv:
        return argv
    argv = [a for a in argv if a != "--slurm-slot"]
    if "SLURM_LOCALID" not in environ:
        raise SystemExit("launch_server --slurm-slot: SLURM_LOCALID is not set (run it as an srun task)")
    slot = int(environ["SLURM_LOCALID"])
    tp = int(flag_value(argv, _TP_FLAGS) or 1)
    cpu = flag_value(argv, ("--device",)) == "cpu"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    port, gpus = slot_on_node(slot, tp, int(flag_value(argv, ("--port",)) or 30000),
                              None if cpu or visible is None else [v.strip() for v in visible.split(",") if v.strip()])
    argv = [a for i, a in enumerate(argv)
            if not (a == "--port" or a.startswith("--port=") or (i and argv[i - 1] == "--port"))]
    argv += ["--port", str(port)]
    if not cpu:
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    print(f"[megatron-rl] server slot {slot} of node {environ.get('SLURMD_NODENAME', '?')}: "
          f"{'CPU' if cpu else 'GPUs ' + ','.join(gpus)}, TP {tp}, port {port}", flush=True)
    return argv


@dataclass(frozen=True)
class ServerSlot:
    index: int  # position in rollout.server_urls
    node: str
    addr: str
    slot: int  # server k of its node
    port: int
    gpus: Optional[tuple[str, ...]]  # None on CPU

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"


def plan_servers(nodes: Sequence[tuple[str, str]], gpus_per_node: int, tp: int, base_port: int,
                 device: str = "cuda") -> list[ServerSlot]:
    """The sbatch script's servers: GPUS_PER_NODE / TP per node, node by node (Slurm's block
    distribution of the server step's tasks, whose ids name the server logs)."""
    if tp < 1 or gpus_per_node % tp:
        raise ValueError(f"ROLLOUT_TP={tp} (rollout.server_tp) does not divide GPUS_PER_NODE={gpus_per_node}: "
                         "every server lives on one node, and a node's GPUs split into whole servers")
    out = []
    for node, addr in nodes:
        for k in range(gpus_per_node // tp):
            port, gpus = slot_on_node(k, tp, base_port)
            out.append(ServerSlot(len(out), node, addr, k, port, None if device == "cpu" else tuple(gpus)))
    return out


def parse_nodes(spec: str) -> list[tuple[str, str]]:
    """"name=addr,name2=addr2" (or bare names, which are their own address)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, addr = item.partition("=")
        out.append((name, addr or name))
    return out


def implied_server_args(cfg: JobConfig, args: list[str], device: Optional[str] = None) -> list[str]:
    """The SGLang flags the recipe needs and `args` lacks: deterministic inference for seeded sampling
    (SGLang ignores the seeds without it), routed experts for R3 replay, FP8 serving for FP8 rollouts
    on CUDA servers (`device`: theirs; default the config's; CPU servers get rounded weights instead,
    weights/fp8.py)."""
    out = []
    device = device or server_device(cfg)
    if cfg.rollout.quantization == "fp8" and device == "cuda" and "--quantization" not in args:
        out += ["--quantization", "fp8"]
    if cfg.rollout.seeded and "--enable-deterministic-inference" not in args:
        out.append("--enable-deterministic-inference")
    if cfg.algorithm.router_replay == "r3" and "--enable-return-routed-experts" not in args:
        out.append("--enable-return-routed-experts")
    return out


def layout_report(cfg: JobConfig, *, gpus_per_node: Optional[int] = None,
                  rollout_nodes: Optional[str] = None, rollout_port: int = 30000,
                  rollout_args: Optional[str] = None) -> list[str]:
    """dry-run: check the rollout servers' layout against the config, the launcher's plan and the
    model; return the lines to print (all start with "rollout server"). `rollout_nodes` (the
    launcher's rollout nodes, "name=addr,..."; "" = it starts none), `rollout_port` and
    `rollout_args` describe the servers the sbatch script starts; None = not launched by it."""
    r = cfg.rollout
    device = server_device(cfg)
    args = (rollout_args or "").split()
    if rollout_nodes:  # the launcher's servers: their device is in their own arguments
        device = flag_value(args, ("--device",)) or "cuda"
    placement = check_placement(cfg, device)
    shape = model_shape(cfg)

    def sync(n: int) -> str:
        if r.weight_sync != "distributed":
            return f"weight sync {r.weight_sync}"
        return (f"weight sync distributed (group of {1 + n * r.server_tp}: learner rank 0 + {n} servers "
                f"x TP {r.server_tp})")

    lines = []
    if placement == "local":
        if rollout_nodes:
            raise ValueError("the launcher starts servers on its rollout nodes but rollout.placement=local")
        fit = check_model_fits_server(shape, r.server_tp, server_ep(r.extra_server_args))
        where = device.upper() if device == "cpu" else "GPUs"
        lines.append(f"rollout servers: local -- rank 0 starts {r.num_servers} on its node ({where}), "
                     f"TP {r.server_tp}, dp 1 each; {sync(r.num_servers)}; model: {fit}")
        for i in range(r.num_servers):
            gpus = r.gpu_ids[i * r.server_tp:(i + 1) * r.server_tp] if device == "cuda" else None
            if gpus and gpus_per_node is not None and min(gpus) < gpus_per_node:
                raise ValueError(f"rollout.gpu_ids={list(r.gpu_ids)}: GPUs below {gpus_per_node} are the learner "
                                 f"ranks' (GPUS_PER_NODE={gpus_per_node} ranks per node, rank k on GPU k)")
            lines.append(f"rollout server {i}: rank 0's node, "
                         + (f"GPUs {','.join(map(str, gpus))}" if gpus else "CPU") + ", a free port")
        return lines
    # disaggregated
    if rollout_nodes is not None:
        nodes = parse_nodes(rollout_nodes)
        if not nodes and not r.server_urls:
            raise ValueError("the recipe's rollout servers are disaggregated (rollout.placement=disaggregated) "
                             "but none are given: submit with ROLLOUT_NODES=N ROLLOUT_MODEL=<HF dir> "
                             "(or a heterogeneous job), or pass rollout.server_urls=[...] of running servers")
    else:
        nodes = []
    if nodes:
        check_server_args(args, "ROLLOUT_ARGS")
        if gpus_per_node is None:
            raise ValueError("the rollout layout needs GPUS_PER_NODE (--gpus-per-node)")
        ep = server_ep(args)
        fit = check_model_fits_server(shape, r.server_tp, ep)
        slots = plan_servers(nodes, gpus_per_node, r.server_tp, rollout_port, device)
        planned = [s.url for s in slots]
        if list(r.server_urls) != planned:
            raise ValueError(f"rollout.server_urls={list(r.server_urls)} are not the servers the launcher "
                             f"starts ({planned}); do not override rollout.server_urls with ROLLOUT_NODES > 0")
        added = implied_server_args(cfg, args, device)
        lines.append(f"rollout servers: disaggregated -- {len(slots)} on {len(nodes)} node(s), "
                     f"{len(slots) // len(nodes)} per node (GPUS_PER_NODE {gpus_per_node} / TP {r.server_tp}), "
                     f"dp 1 each; {sync(len(slots))}; model: {fit}")
        for s in slots:
            lines.append(f"rollout server {s.index}: node {s.node} ({s.addr}), "
                         + (f"GPUs {','.join(s.gpus)}" if s.gpus else "CPU") + f", port {s.port} -> {s.url}")
        # What the launcher reads back (slurm/megatron_rl.sbatch): the flags the recipe implies, and the
        # model the learner starts from (ROLLOUT_MODEL, when given, must be a copy of it).
        if added:
            lines.append("rollout servers' added args: " + " ".join(added))
        if cfg.model.hf_path:
            lines.append(f"rollout servers' model: {cfg.model.hf_path}")
        if r.quantization == "fp8" and device == "cuda":
            # FP8 servers start from a block-scaled copy (the launcher makes it once per run folder:
            # `megatron-rl fp8-checkpoint`); every weight push then sends e4m3 blocks and scales.
            lines.append("rollout servers' quantization: fp8")
        return lines
    fit = check_model_fits_server(shape, r.server_tp)
    if r.server_urls:
        lines.append(f"rollout servers: {len(r.server_urls)} running at rollout.server_urls, TP {r.server_tp} each "
                     f"(placed by their launcher; the trainer checks each one's /server_info); model: {fit}")
        lines += [f"rollout server {i}: {u}" for i, u in enumerate(r.server_urls)]
    else:
        lines.append(f"rollout servers: disaggregated, started by the launcher (sbatch ROLLOUT_NODES=N sets "
                     f"rollout.server_urls and rollout.server_tp); model: {fit}")
    return lines


# ---------------------------------------------------------------------------------------------
# run time: rank 0's local GPUs, the servers' own view of their layout
# ---------------------------------------------------------------------------------------------
def local_server_gpus(cfg: JobConfig, learner_gpus: set[str], visible: Sequence[str]) -> list[list[str]]:
    """GPUs of each server rank 0 starts on CUDA: rollout.gpu_ids (indices into `visible`, rank
    0's visible devices), server_tp per server; none may be in `learner_gpus` (the devices of the
    learner ranks on rank 0's node, as entries of `visible`)."""
    r = cfg.rollout
    if max(r.gpu_ids) >= len(visible):
        raise ValueError(f"rollout.gpu_ids={list(r.gpu_ids)}: rank 0 sees {len(visible)} GPUs "
                         f"({','.join(visible)})")
    ids = [visible[g] for g in r.gpu_ids]
    clash = sorted(set(ids) & learner_gpus)
    if clash:
        raise ValueError(f"rollout.gpu_ids={list(r.gpu_ids)}: GPU(s) {','.join(clash)} run learner ranks on "
                         "rank 0's node; give the servers GPUs of their own (or run them disaggregated)")
    return [ids[i * r.server_tp:(i + 1) * r.server_tp] for i in range(r.num_servers)]


def checked_endpoints(urls: Sequence[str], cfg: JobConfig):
    """Ask every server its layout (/server_info) and check it against the config; return the
    `ServerEndpoint`s the weight transports use (tp_size from the server itself)."""
    from megatron_rl.weights.endpoint import ServerEndpoint

    r, a = cfg.rollout, cfg.algorithm
    out = []
    for url in urls:
        info = ServerEndpoint(url).server_info()
        tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
        if dp != 1 or info.get("enable_dp_attention"):
            raise ValueError(f"rollout server {url} runs dp_size={dp} data-parallel replicas: SGLang updates "
                             "weights only with dp_size 1; start one server per replica (the sbatch "
                             "script does)")
        if pp != 1:
            raise ValueError(f"rollout server {url} runs pp_size={pp}: the weight-update group holds one rank "
                             "per TP rank (SGLang joins rank_offset + tp_rank); pipeline stages are not supported")
        if tp != r.server_tp:
            raise ValueError(f"rollout server {url} runs tp_size={tp} (its /server_info) but "
                             f"rollout.server_tp={r.server_tp}: the weight-update group is sized from it; set "
                             f"rollout.server_tp={tp} (sbatch: ROLLOUT_TP={tp})")
        if r.seeded and not info.get("enable_deterministic_inference"):
            raise ValueError(f"rollout server {url} runs without --enable-deterministic-inference, so SGLang "
                             "ignores the sampling seeds of rollout.seeded=true; restart it with that flag "
                             "(sbatch: in ROLLOUT_ARGS) or set rollout.seeded=false")
        if a.router_replay == "r3" and not info.get("enable_return_routed_experts"):
            raise ValueError(f"rollout server {url} runs without --enable-return-routed-experts, which "
                             "algorithm.router_replay=r3 needs")
        out.append(ServerEndpoint(url, tp_size=tp))
    import torch  # here, not at import: launch_server imports this module before CUDA is set up

    if r.weight_sync == "distributed" and torch.cuda.is_available():
        from megatron_rl.weights.endpoint import check_nccl

        check_nccl(out)  # the update group's NCCL: one version on both sides
    return out


def visible_devices() -> Optional[list[str]]:
    """CUDA_VISIBLE_DEVICES as a list, None when unset."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if v is None else [x.strip() for x in v.split(",") if x.strip()]
