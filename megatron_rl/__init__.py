"""megatron-rl: Megatron-Core recipes for RL post-training of dense and MoE LLMs."""

__version__ = "0.1.0"
