"""Typed configuration: Hydra structured configs, one docstring line per field.

YAML files in configs/ and recipes/ only select and override these; an unknown key is an error
naming the valid keys (megatron_rl.config.load). Megatron's own TransformerConfig / OptimizerConfig
/ DistributedDataParallelConfig are built *from* these in one adapter each (models/, learner/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
class ModelConfig:
    """Which model the learner builds, and how."""

    hf_path: Optional[str] = None  # HF checkpoint folder; None = build `tiny` into the run dir
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # used when hf_path is None
    dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
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

    micro_batch_size: int = 1  # sequences per micro-batch (per data-parallel rank)
    pad_to_multiple_of: int = 8  # pad sequence length (x TP when sequence parallel)


@dataclass
class TrainConfig:
    """The supervised warm-up demo (the embedded default until the RL loop lands)."""

    steps: int = 60  # optimizer steps
    global_batch_size: int = 16  # sequences per step, across data-parallel ranks
    seed: int = 0  # data seed
    operand_digits: int = 1  # synthetic addition task: digits per operand
    log_every: int = 5  # print a metrics line every N steps
    out_dir: str = "runs/${name}"  # run directory (metrics, plots, tiny model)


@dataclass
class JobConfig:
    """A complete job: every group the launchers and the CLI read."""

    name: str = "run"  # run name (used in paths)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
