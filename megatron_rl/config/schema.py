"""Typed configuration: Hydra structured configs, one docstring line per field.

YAML files in configs/ and recipes/ only select and override these; an unknown key is an error
naming the valid keys (megatron_rl.config.load). Megatron's own TransformerConfig / OptimizerConfig
/ DistributedDataParallelConfig are built *from* these in one adapter each (models/, learner/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TinyModelConfig:
    """A random-weight Qwen3 / Qwen3-MoE made locally (no model hub): see models/tiny.py."""

    moe: bool = False  # Qwen3-MoE instead of dense Qwen3
    num_layers: int = 2  # decoder layers
    hidden: int = 64  # hidden size
    heads: int = 4  # attention heads
    kv_heads: int = 2  # key/value heads (GQA)
    head_dim: int = 16  # per-head dimension
    ffn: int = 128  # dense MLP width
    num_experts: int = 4  # MoE experts per layer
    topk: int = 2  # experts per token
    moe_ffn: int = 32  # expert MLP width
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities (Qwen3-MoE option)
    vocab_size: int = 256  # embedding rows (>= tokenizer length; a multiple of 128·TP needs no padding)
    max_positions: int = 512  # rotary table length
    init_std: float = 0.02  # std of the random init
    seed: int = 0  # init seed


@dataclass
class BaseModelConfig:
    """A supervised base stage (models/base.py): `tiny` trained on data.synthetic's solutions until
    its greedy held-out accuracy reaches `target_accuracy`, exported as a HF checkpoint and cached
    by this config; RL starts from it (as the DPPO paper starts from a base model)."""

    sft_steps: int = 0  # most supervised steps; 0 = no base stage (RL starts from `tiny` or hf_path)
    target_accuracy: float = 1.0  # stop at the first eval whose greedy held-out accuracy reaches this
    eval_every: int = 25  # steps between those evals
    batch_size: int = 64  # problems per supervised step
    lr: float = 3e-3  # Adam learning rate (constant after warm-up)
    warmup_steps: int = 10  # linear warm-up steps
    seed: int = 0  # data seed of the supervised problems
    cache_dir: str = "${oc.env:MRL_RUNS,runs}/base_models"  # cache root: <cache_dir>/<hash of the rest>/hf ($MRL_RUNS: where runs go, default ./runs)


@dataclass
class ModelConfig:
    """Which model the learner builds, and how."""

    hf_path: Optional[str] = None  # HF checkpoint folder; None = build `tiny` into the run dir
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when hf_path is None
    base: BaseModelConfig = field(default_factory=BaseModelConfig)  # supervised base stage of `tiny` (when hf_path is None)
    dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    spec: str = "auto"  # layer spec: auto (te on CUDA with Transformer Engine, torch on CUDA without, local on CPU) | te (Transformer Engine; an error without it) | torch (local modules + torch SDPA attention and grouped expert GEMMs) | local (torch modules, no fused kernels)
    recompute: str = "none"  # activation recompute: none | full (every layer, uniform)
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocab to a multiple of this·TP
    seed: int = 1234  # parameter-init and dropout seed (Megatron's model-parallel RNG)


@dataclass
class ParallelConfig:
    """Megatron parallel layout; data parallelism is world_size / (tp·pp) (experts: /(etp·ep))."""

    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule), None = off
    ep: int = 1  # expert parallel size
    etp: Optional[int] = None  # expert tensor parallel size; None = 1
    sequence_parallel: Optional[bool] = None  # None = on whenever tp > 1
    world_size: Optional[int] = None  # learner ranks the recipe is laid out for (dry-run's default; a launch uses its real one)


@dataclass
class OptimConfig:
    """Megatron optimizer (Adam) and its learning-rate schedule."""

    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the decay schedule
    lr_warmup_steps: int = 0  # linear warm-up steps
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_decay_steps: Optional[int] = None  # None = the run's total steps
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9  # Adam β1
    adam_beta2: float = 0.999  # Adam β2
    adam_eps: float = 1e-8  # Adam ε
    clip_grad: float = 1.0  # global grad-norm clip (0 = off)
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks


@dataclass
class LearnerConfig:
    """How the learner cuts a global batch."""

    micro_batch_size: int = 1  # sequences per micro-batch (per data-parallel rank) when max_tokens_per_micro_batch is 0
    max_tokens_per_micro_batch: int = 0  # token budget per micro-batch (sequences x its longest, padded); 0 = micro_batch_size sequences each
    pad_to_multiple_of: int = 8  # pad sequence length (x TP when sequence parallel)
    memory_limit: float = 0.95  # share of the GPU's memory one learner rank's estimated peak may take: dry-run and train refuse a layout above it, naming what to change (models/memory.py); 0 = no check
    pack_sequences: bool = False  # each micro-batch's sequences end to end in one row, no padding between them (THD, cumulative lengths; batch/packing.py): token-budget micro-batches stop paying for padding in every layer; model.spec=torch; not with algorithm.router_replay=r2; the critic and reward models keep padded rows
    loss_kernel: str = "auto"  # auto (triton on CUDA where it imports, else torch) | torch (chunked torch ops, the reference) | triton (fused Triton kernels over the vocab shard: one read forward, one read + gradient write backward; CUDA, vocab_parallel/triton_kernels.py)


@dataclass
class TrainConfig:
    """The supervised warm-up command (`train-lm`)."""

    steps: int = 60  # optimizer steps
    global_batch_size: int = 16  # sequences per step, across data-parallel ranks
    seed: int = 0  # data seed (the task is data.synthetic; the supervised target is each problem's solution)
    chat: bool = False  # prompts in the chat template, as the RL rollouts see them
    target_accuracy: Optional[float] = None  # stop at the first eval whose greedy held-out accuracy reaches this
    log_every: int = 5  # print a metrics line every N steps
    out_dir: str = "${oc.env:MRL_RUNS,runs}/${name}"  # run directory (metrics, plots, tiny model); $MRL_RUNS: the runs root, default ./runs


@dataclass
class SyntheticTaskConfig:
    """The built-in verifiable task (data/synthetic.py): one problem per prompt, exact-match answer."""

    op: str = "add"  # add (a+b...) | max (max(a,b...))
    operand_digits: int = 1  # digits per operand
    num_operands: int = 2  # operands per problem
    modulo: Optional[int] = None  # answer modulo this (add only); None = the plain sum
    max_answer: Optional[int] = None  # keep only problems whose answer is <= this (9 = one-token answers)
    balance_answers: bool = False  # every possible answer equally likely (draw the answer, then a problem)
    num_train: int = 100000  # training problems drawn per epoch of the prompt stream
    seed: int = 0  # problem-generation seed (eval problems use seed + 1)


@dataclass
class DataConfig:
    """Where prompts and answers come from, and how responses are scored."""

    source: str = "synthetic"  # synthetic | files
    train_files: list[str] = field(default_factory=list)  # .jsonl / .parquet (DAPO-Math layout) when source=files
    eval_files: list[str] = field(default_factory=list)  # held-out prompts; empty = synthetic eval / none
    messages_field: Optional[str] = "prompt"  # row field holding the chat messages
    text_field: Optional[str] = None  # or: a row field holding the plain prompt text
    answer_field: Optional[str] = "reward_model.ground_truth"  # row field holding the ground truth; null = none (reward model only)
    reward: str = "synthetic"  # reward function: synthetic | math | none (0: a learned reward model scores) | my_pkg.my_module:my_fn | path/to/file.py:my_fn
    reward_workers: int = 2  # processes scoring rewards while responses arrive (rewards/pool.py); >= 1
    reward_timeout: float = 10.0  # seconds per reward call; a call past it is killed, scores 0 and counts in reward/timeouts
    reward_on_error: str = "fail"  # a reward function that raises: fail (stop, naming the sample) | zero (score 0, counted in reward/errors)
    correct_threshold: float = 1.0  # what rollout/accuracy and eval/pass@k count as correct: the reward function's own verdict where it gives one (built-ins synthetic / scratchpad / math: the answer matched; a user's function returning {"reward": r, "correct": bool}), else a reward >= this (1.0: the built-in rules' score for a right answer, so a 0.1 for a well-formed wrong answer is not counted); the mean reward is rollout/reward_mean and eval/mean@k
    shuffle_seed: int = 0  # prompt order seed (reshuffled every epoch)
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)


@dataclass
class RolloutConfig:
    """SGLang servers and sampling. Placements are described in megatron_rl/rollout/placement.py."""

    placement: str = "auto"  # local (rank 0 starts num_servers on its node) | disaggregated (servers at server_urls) | auto (disaggregated iff server_urls)
    server_urls: list[str] = field(default_factory=list)  # running servers, one per data-parallel replica (dp_size 1 each); sbatch ROLLOUT_NODES sets them
    num_servers: int = 1  # local: servers rank 0 starts on its node
    gpu_ids: list[int] = field(default_factory=list)  # local on CUDA: server_tp GPUs per server, in order (rank 0's visible-device indices; no learner rank's GPU)
    device: str = "auto"  # auto (cuda if present) | cpu | cuda
    dtype: str = "auto"  # SGLang --dtype of local servers; auto = the learner's dtype
    server_tp: int = 1  # tensor-parallel size of each server (sbatch: ROLLOUT_TP); must equal each server's own tp_size
    max_total_tokens: Optional[int] = None  # local: KV-cache cap per server (keeps CPU servers small)
    mem_fraction_static: Optional[float] = None  # local: GPU memory share of each server
    extra_server_args: list[str] = field(default_factory=list)  # local: passed verbatim to SGLang (sbatch servers: ROLLOUT_ARGS)
    prompts_per_step: int = 32  # prompt groups per training step
    n_samples: int = 8  # responses per prompt (the group for GRPO-style advantages)
    temperature: float = 1.0  # sampling temperature (log-probs use logits / temperature)
    top_p: float = 1.0  # nucleus sampling
    max_new_tokens: int = 16  # response budget
    generate: Optional[str] = None  # a user's episode function (multi-turn, tools): my_pkg.my_module:my_fn | path/to/file.py:my_fn; null = one sampled response per sample
    top_k_logprobs: int = 0  # rollout top-K log-probs per token (20 for top-K divergences)
    seeded: bool = True  # per-sample sampling seeds derived from trainer.seed and the step (servers need --enable-deterministic-inference)
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups and generate more
    max_generation_rounds: int = 4  # bound on generation rounds per step with dynamic sampling
    weight_sync: str = "distributed"  # distributed (process group: NCCL / gloo) | tensor (CPU servers on the learner's machine) | disk
    release_memory: bool = False  # colocation on shared GPUs (release server memory while training): not implemented, true is refused
    request_timeout: Optional[float] = None  # seconds per generation request, queueing included, before it is aborted and retried elsewhere; None = no total timeout while stall_timeout watches the servers (else 300 + max_new_tokens / 8, rollout/client.py request_timeout_s)
    stall_timeout: Optional[float] = 600.0  # seconds a server with this producer's requests in flight may give no sign of life (its scheduler answering /v1/loads) before it is marked down and they are retried elsewhere; a request waiting in a busy server's queue is never timed out; must exceed the longest weight push (a scheduler loading weights answers nothing); null = no watchdog
    max_inflight_per_server: int = 0  # generation requests the whole job (every producer together) keeps in flight on each server, the rest waiting in their producers for the next free slot anywhere (rollout/admission.py); 0 = from each server's KV pool (/server_info): the first step at max_total_num_tokens / (0.7 x max_new_tokens), then following the responses' lengths (KV pool / the KV of a running request), at most its max_running_requests; an evaluation has a budget of its own
    quantization: str = "none"  # none | fp8: rollout servers hold the learner's weights in block-scaled e4m3 (128x128 blocks; CUDA: SGLang's FP8 serving from an FP8 copy of the checkpoint; CPU: weights rounded through e4m3 and served in full precision -- the weights' quantization error only); the learner trains in its own precision
    partial_rollouts: bool = False  # at a weight push, cut generation in flight (pause, abort) and continue it under the new weights, each token's version recorded (needs trainer.max_staleness > 0); false: the push waits for generation admitted before it


@dataclass
class AlgorithmConfig:
    """The RL objective: advantages, policy loss and its trust region, extra terms."""

    advantage: str = "dr_grpo"  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (builds the critic)
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)  # extra arguments of the estimator (gae: gamma, lam, whiten)
    policy_loss: str = "dppo"  # dppo | cppo | drpo | ppo | pg_is | cispo | aspo | atr | gspo
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # extra arguments of the policy loss (e.g. delta)
    divergence: Optional[str] = "binary_tv"  # DPPO / CPPO divergence: binary_tv | binary_kl | topk_tv | topk_kl
    agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    mini_batches: int = 1  # optimizer steps per rollout batch (the batch is split in this many)
    epochs: int = 1  # passes over the rollout batch
    recompute_old_logp: bool = False  # recompute log pi_old before training (needed by corrections)
    correction: Optional[str] = None  # tis | icepop (needs recompute_old_logp)
    correction_kwargs: dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0  # KL-to-reference coefficient (> 0 builds a frozen reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # the KL penalty goes into the per-token rewards (before GAE), not the loss
    entropy_coef: float = 0.0  # entropy bonus coefficient
    router_replay: str = "none"  # MoE: none | r2 (replay the old-log-prob pass) | r3 (replay the engine's routes)
    overlong_buffer: int = 0  # DAPO soft overlong punishment buffer (0 = off)
    overlong_penalty: float = 1.0  # its factor: -overlong_penalty at max_new_tokens
    overlong_filter: bool = False  # DAPO overlong filtering: truncated responses (finish_reason length) get no loss


@dataclass
class CriticConfig:
    """The PPO value model, built when algorithm.advantage = gae. It shares the policy's parallel
    layout and micro-batch size, and trains on the same mini-batches, with its own optimizer."""

    hf_path: Optional[str] = None  # HF checkpoint of its trunk; None = the policy's, with a fresh value head
    head_init_std: Optional[float] = None  # value-head init std; None = the checkpoint's initializer_range
    value_loss: str = "clipped"  # clipped | mse
    value_clip: float = 0.2  # ε of the clipped value loss
    loss_agg_mode: str = "token-mean"  # aggregation of the per-token value loss
    warmup_steps: int = 0  # first steps train only the critic (the policy waits for useful values)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # the critic's optimizer


@dataclass
class RewardModelConfig:
    """A learned (Bradley–Terry) reward model scoring prompt+response: forward-only on Megatron-Core
    with the policy's layout, or served by SGLang (large models, own GPUs). It must share the
    policy's tokenizer (token ids are passed as is)."""

    enabled: bool = False  # score every response with the reward model
    backend: str = "megatron"  # megatron (in the learner processes) | sglang (reward-model servers, /classify)
    hf_path: Optional[str] = None  # *ForSequenceClassification checkpoint; None = build `tiny` in the run dir
    server_urls: list[str] = field(default_factory=list)  # sglang: running servers; empty = rank 0 launches num_servers
    num_servers: int = 1  # sglang: servers rank 0 launches (rollout.device / dtype)
    server_tp: int = 1  # sglang: tensor-parallel size of each server
    max_total_tokens: Optional[int] = None  # sglang: token cap per server (keeps CPU servers small)
    mem_fraction_static: Optional[float] = None  # sglang: GPU memory share of each server
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when hf_path is None (dense fields only)
    weight: float = 1.0  # reward = rule_weight · rule reward + weight · (normalised) model score
    rule_weight: float = 1.0  # 0: the reward model alone
    normalize: str = "none"  # none | batch (whiten the scores over the rollout batch)
    clip: Optional[float] = None  # clip the (normalised) score to [-clip, clip]; None = off


@dataclass
class EvalConfig:
    """Held-out evaluation: mean@k (the mean reward of the k samples) and pass@k (the share of
    prompts with a correct sample among their k: data.correct_threshold says what is correct)."""

    every: int = 0  # evaluate every N steps (0 = only at the start and the end)
    num_prompts: int = 64  # held-out prompts
    k: int = 4  # samples per prompt
    temperature: float = 1.0  # eval sampling temperature
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # None = rollout.max_new_tokens
    timeout: Optional[float] = None  # seconds an evaluation may take (the other ranks wait for it): then what finished is scored, the rest aborted and counted in eval/missing_samples; None = no limit (keep it below trainer.rollout_wait_timeout)
    servers: int = 0  # 0: evaluate on every server between steps (training waits); N > 0: evaluate beside training (eval.share says how); the metrics join the row of the step it ends in, with eval/step
    share: Optional[float] = None  # beside training (eval.servers > 0): the share of every server's slots / KV pool the evaluation takes while training generates on the rest, at the pushed weights, the next push waiting for it (rollout/evaluation.py); 0: hold eval.servers whole servers at its weights instead; None: whole servers when eval.servers is at most a fifth of the fleet, else 0.2


@dataclass
class TrainerConfig:
    """The RL loop: length, checkpoints, logs, modes."""

    steps: int = 100  # training steps (one rollout batch each)
    seed: int = 0  # sampling and data-order seed
    out_dir: str = "${oc.env:MRL_RUNS,runs}/${name}"  # run directory: metrics.jsonl, checkpoints/, plots, server logs; $MRL_RUNS: the runs root (default ./runs)
    mode: str = "train"  # train | rollout_only (save rollouts, no training) | train_only (from saved rollouts)
    rollouts_dir: Optional[str] = None  # rollout_only writes / train_only reads here (default out_dir/rollouts)
    save_every: int = 0  # checkpoint every N steps (0 = only at the end and on SIGTERM/SIGUSR1)
    keep_checkpoints: int = 2  # newest checkpoints kept
    async_save: bool = False  # write checkpoints while training goes on (shards staged in host memory, a forked writer per rank; run/checkpoint.py); false: the step waits for the write
    time_limit: Optional[float] = None  # seconds this run may take from its start; before a step (plus a save) that would not finish in time it checkpoints and exits with code 75 (the sbatch requeues); None: the Slurm job's end time (squeue, re-read as it changes), no limit outside Slurm; 0: off
    time_limit_margin: float = 180.0  # seconds kept free before the time limit (exit, server stop, requeue)
    resume: bool = True  # resume from the newest checkpoint in out_dir/checkpoints (false: start over, replacing them)
    allow_config_change: bool = False  # resume a checkpoint written with other experiment settings (algorithm, model, data, layout, mode, ...); false: such a resume is an error naming them (run/run_dir.py)
    progress: bool = True  # live progress display on rank 0 (a plain line per step when not a TTY)
    plot: bool = True  # write out_dir/curves.png at the end
    tensorboard: bool = False  # also log to TensorBoard (out_dir/tb)
    wandb: bool = False  # also log to Weights & Biases (offline unless configured)
    wandb_project: str = "megatron-rl"
    rollout_wait_timeout: float = 7200.0  # seconds a rank waits for its group leader's rollouts before failing
    rollout_wait_log_every: float = 300.0  # seconds between a waiting rank's log lines (time waited, leader's progress)
    collective_timeout: float = 1800.0  # seconds a collective may wait before the process group fails it (NCCL's watchdog, gloo's timeout); what can legitimately take longer on one rank (rollouts, eval, a late data-parallel producer) is awaited on the c10d store under rollout_wait_timeout instead
    token_log_every: int = 0  # every N steps, write each mini-batch's loss tokens (ids, log μ, log π, advantage) to out_dir/tokens/ for token-level analysis (benchmarks/testbed_report.py); 0 = off
    max_staleness: int = 0  # asynchronous training: step t's rollouts may come from weights up to this many steps old (generation runs ahead while the learner trains); 0 = synchronous


@dataclass
class JobConfig:
    """A complete job: every group the launchers and the CLI read."""

    name: str = "run"  # run name (used in paths)
    hardware: str = "cpu"  # what the recipe is meant for, e.g. "cpu" or "4x8 H100 80GB"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
