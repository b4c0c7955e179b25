"""Fixes to mbridge 0.15.1 (HF <-> Megatron-Core conversion) that megatron-rl relies on.

- Qwen3-MoE routing (always applied; a real bug on GPU too): mbridge hard-codes
  `moe_router_pre_softmax=False`, i.e. Megatron takes the top-k of the logits and softmaxes over
  those k, which equals HF's routing only when `norm_topk_prob=True`. With `norm_topk_prob=False`
  HF softmaxes over all experts and keeps the top-k probabilities unnormalised, which is
  Megatron's `pre_softmax=True`. So: `moe_router_pre_softmax = not norm_topk_prob`.
- transformers 5 moved `rope_theta` into `rope_parameters`; mbridge reads `hf_config.rope_theta`.
- The layer spec is chosen, not guessed: mbridge hard-codes the TE spec; a bridge whose
  `layer_spec` attribute is "local" (set from `model.spec` by megatron_rl.models.bridge) gets
  megatron-core's local (torch) spec instead, "torch" the local spec with torch's fused attention
  and grouped experts (megatron_rl.models.torch_spec; its parameters are the local spec's, names
  included), and any other bridge keeps upstream's TE spec. TE failing to import is never a
  reason to switch specs. The local spec names parameters differently (`input_layernorm`, `pre_mlp_layernorm`,
  `experts.local_experts.E.linear_fc*`), so local names are translated to the TE-spec names
  mbridge's mapping tables know, in the one function that maps local names to global names.
- `load_weights` decides expert-vs-dense from the *local* name and so scatters local-spec expert
  weights over the TP group instead of the expert-TP group; it is replaced by a version that
  decides from the translated global name and keeps upstream's value-model case (a one-row
  output layer: every TP rank loads it, and a causal LM's lm_head is not loaded into it).
- `export_weights` with EP=1 sends expert weights down the dense path, which all-gathers them
  over the TP group; with expert-TP=1 those copies are replicas, and the merge asserted on their
  count. The merge now takes the single replica.
- `export_weights` runs several collectives per parameter (object all-gathers and broadcasts of
  each name and shape over the pipeline group, then a gather per tensor): ~60-100 k per push at
  Qwen3-30B-A3B. It is replaced by megatron_rl.models.weight_export's bucketed export (the same
  tensors in the same order, a fixed number of collectives per bucket); upstream's stays as
  `Bridge.export_weights_per_parameter`, the reference the tests and the benchmark compare with.
"""

from __future__ import annotations

import re

import torch

from patches._guard import pinned, require_version

SUPPORTED = pinned("mbridge")
_applied = False

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_style_name(name: str, moe_layer_norm_kept: bool) -> str:
    """Translate a local-spec parameter name to the TE-spec name mbridge's tables use.

    `moe_layer_norm_kept`: the bridge maps `pre_mlp_layernorm` itself (MoE bridges do, because
    TE's MoE layer keeps a separate pre-MLP norm); dense bridges expect it fused into fc1.
    """
    name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if not moe_layer_norm_kept:
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return _LOCAL_EXPERT.sub(r".mlp.experts.\2.weight\1", name)


def _is_expert(global_name: str) -> bool:
    return ".mlp.experts.linear_fc" in global_name


def apply(version: str | None = None) -> None:
    global _applied
    require_version("mbridge", SUPPORTED, "mbridge_fixes", version)
    if _applied:
        return
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    # --- Qwen3-MoE routing: honour norm_topk_prob -------------------------------------------
    orig_qwen3moe_build = Qwen3MoEBridge._build_config

    def qwen3moe_build_config(self):
        norm_topk_prob = getattr(self.hf_config, "norm_topk_prob", True)
        self.extra_args.setdefault("moe_router_pre_softmax", not norm_topk_prob)
        return orig_qwen3moe_build(self)

    Qwen3MoEBridge._build_config = qwen3moe_build_config

    # --- rope_theta under transformers 5 ------------------------------------------------------
    orig_gpt_args = LLMBridge._get_gptmodel_args

    def get_gptmodel_args(self):
        cfg = self.hf_config
        if not hasattr(cfg, "rope_theta") and getattr(cfg, "rope_parameters", None):
            cfg.rope_theta = cfg.rope_parameters["rope_theta"]
        return orig_gpt_args(self)

    LLMBridge._get_gptmodel_args = get_gptmodel_args

    # --- local layer spec when Transformer Engine is absent --------------------------------------
    orig_spec = LLMBridge._get_transformer_layer_spec

    def get_transformer_layer_spec(self, vp_stage=None):
        spec = getattr(self, "layer_spec", "te")
        if spec not in ("local", "torch"):
            return orig_spec(self, vp_stage)
        self.has_vp_stage = True
        if spec == "torch":
            from megatron_rl.models.torch_spec import get_torch_decoder_block_spec

            return get_torch_decoder_block_spec(self.config, vp_stage=vp_stage)
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                          vp_stage=vp_stage)

    LLMBridge._get_transformer_layer_spec = get_transformer_layer_spec

    orig_local_to_global = Bridge._weight_name_mapping_mcore_local_to_global

    def local_to_global(self, model, consider_ep=True):
        kept = "pre_mlp_layernorm" in self._MLP_MAPPING
        # Translate before the EP renumbering, which parses TE-style `.weight{E}` names.
        ret = orig_local_to_global(self, model, consider_ep=False)
        ret = {k: te_style_name(v, kept) for k, v in ret.items()}
        if consider_ep and self.mpu.ep_size > 1:
            per_rank = self.config.num_moe_experts // self.mpu.ep_size
            for k, v in ret.items():
                if _is_expert(v):
                    prefix, local_id = v.split(".weight")
                    ret[k] = f"{prefix}.weight{int(local_id) + per_rank * self.mpu.ep_rank}"
        return ret

    Bridge._weight_name_mapping_mcore_local_to_global = local_to_global

    orig_merge = Bridge._weight_merge_across_tp

    def weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        if _is_expert(mcore_weights_name) and self.mpu.etp_size == 1:
            return mcore_weights[0]  # experts are not TP-sharded: every gathered copy is the same
        return orig_merge(self, mcore_weights_name, mcore_weights, param)

    Bridge._weight_merge_across_tp = weight_merge_across_tp
    Bridge.load_weights = _load_weights
    Bridge.export_weights_per_parameter = Bridge.export_weights
    Bridge.export_weights = _export_weights
    _applied = True


def _export_weights(self, models, bucket_bytes: int | None = None):
    """(HF name, full tensor) for every weight, gathered bucket by bucket; a collective."""
    from megatron_rl.models.weight_export import BUCKET_BYTES, export_buckets

    for bucket in export_buckets(self, models, bucket_bytes or BUCKET_BYTES):
        yield from bucket


_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # output layer, untied or tied


def _load_weights(self, models, weights_path, memory_efficient=False):
    """mbridge's Bridge.load_weights, deciding expert-vs-dense from the global (TE-style) name.

    Rank 0 of the TP group (expert-TP group for expert weights) reads from disk, converts to the
    Megatron layout, splits and scatters; PP/EP/VPP placement comes from the name mapping.
    """
    self.safetensor_io = self._get_safetensor_io(weights_path)
    for model in models:
        local_to_global = self._weight_name_mapping_mcore_local_to_global(model)
        state = model.state_dict()
        plan = []  # (local name, global name, hf names, group, group rank, group size)
        for local_name, global_name in local_to_global.items():
            if "_extra_state" in local_name:
                continue
            hf_names = self._weight_name_mapping_mcore_to_hf(global_name)
            if _is_expert(global_name):
                group, rank, size = self.mpu.etp_group, self.mpu.etp_rank, self.mpu.etp_size
            else:
                group, rank, size = self.mpu.tp_group, self.mpu.tp_rank, self.mpu.tp_size
            plan.append((local_name, global_name, hf_names, group, rank, size))
        # A value model's one-row output layer (mbridge's make_value_model) is not vocab-parallel:
        # every rank reads it; a causal LM's lm_head does not fit it and is skipped (as upstream).
        value_head = {local for local, _, hf, *_ in plan
                      if hf[0] in _HEAD_NAMES and state[local].shape[0] == 1}
        to_read = sorted({n for local, _, hf, _, rank, _ in plan if rank == 0 or local in value_head
                          for n in hf})
        hf_weights = {} if memory_efficient else self.safetensor_io.load_some_hf_weight(to_read)
        for local_name, global_name, hf_names, group, rank, size in plan:
            param = state[local_name]
            if local_name in value_head:
                (head,) = [hf_weights[n] if not memory_efficient
                           else self.safetensor_io.load_one_hf_weight(n) for n in hf_names]
                if head.shape == param.shape:
                    param.copy_(head.to(param.device, dtype=param.dtype))
                continue
            chunks = None
            if rank == 0:
                tensors = [hf_weights[n] if not memory_efficient
                           else self.safetensor_io.load_one_hf_weight(n) for n in hf_names]
                full = self._weight_to_mcore_format(global_name, tensors)
                chunks = [t.to(param.device, dtype=param.dtype).contiguous()
                          for t in self._weight_split_across_tp(global_name, full, param, size)]
            if size == 1:
                param.copy_(chunks[0])
                continue
            buf = torch.empty_like(param)
            torch.distributed.scatter(buf, chunks, src=torch.distributed.get_global_rank(group, 0),
                                      group=group)
            param.copy_(buf)
