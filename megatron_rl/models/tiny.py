"""Tiny random-weight Qwen3 / Qwen3-MoE checkpoints and a locally built tokenizer.

There is no model hub on the machines the tests and the embedded default run on, so every model
they use is made here: a transformers config, random weights from a seeded init, and a
character-level tokenizer, all written with `save_pretrained` into a normal HF checkpoint folder
that mbridge, transformers and SGLang load like any other.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

# Special tokens follow Qwen's chat format so the same chat template works for real checkpoints.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_char_tokenizer():
    """A character-level fast tokenizer: specials, then printable ASCII (incl. space and newline)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c\t"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    # Every character is its own pre-token; special tokens are matched before this runs.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common_config(vocab_size: int, num_layers: int, hidden: int, heads: int, kv_heads: int,
                   head_dim: int, max_positions: int, tokenizer) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        attention_dropout=0.0,
    )


_LAYOUT_VERSION = 2  # bump when the weights made for the same arguments change (2: pad row)


def make_tiny_checkpoint(
    path: str | Path,
    *,
    moe: bool = False,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 128,
    num_experts: int = 4,
    topk: int = 2,
    moe_ffn: int = 32,
    norm_topk_prob: bool = True,
    vocab_size: int = 256,
    max_positions: int = 512,
    init_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen3 (or Qwen3-MoE) HF checkpoint with random weights to `path`; return it.

    `vocab_size` may exceed the tokenizer's length (as in real Qwen checkpoints); keep it a
    multiple of 128·TP so Megatron needs no vocabulary padding at the TP sizes the tests use.
    Idempotent: an existing checkpoint made with the same arguments is reused.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    path = Path(path)
    args = dict(moe=moe, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, ffn=ffn, num_experts=num_experts, topk=topk, moe_ffn=moe_ffn,
                norm_topk_prob=norm_topk_prob, vocab_size=vocab_size, max_positions=max_positions,
                init_std=init_std, seed=seed, layout=_LAYOUT_VERSION)
    stamp = path / "megatron_rl_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == args:
        return path

    tokenizer = build_char_tokenizer()
    assert len(tokenizer) <= vocab_size, (len(tokenizer), vocab_size)
    common = _common_config(vocab_size, num_layers, hidden, heads, kv_heads, head_dim,
                            max_positions, tokenizer)
    if moe:
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=ffn,
            moe_intermediate_size=moe_ffn,
            num_experts=num_experts,
            num_experts_per_tok=topk,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.0,
            initializer_range=init_std,
        )
    else:
        config = Qwen3Config(**common, intermediate_size=ffn, initializer_range=init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises RMSNorm weights to 1; perturb them so a mapping error on a norm is visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        # HF also zeroes the pad token's embedding row. A random model samples the pad token like
        # any other, and a zero row meets the first RMSNorm at |x| ≈ 0, whose gradient is
        # 1/sqrt(eps) (1000x) larger: one sampled pad token then dominated the gradient norm (seen:
        # 3e4, so grad clipping shrank every other gradient by that factor). The row gets a random
        # vector (drawn last: every other weight is as before).
        embed = model.get_input_embeddings().weight
        embed[config.pad_token_id].normal_(0.0, init_std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(args))
    return path
