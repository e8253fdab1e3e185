"""megatron-core GPTModel for HF Qwen2 / Qwen3 configs.

``transformer_config_from_hf`` maps an HF ``Qwen2Config``/``Qwen3Config`` (object or dict) onto a
megatron-core ``TransformerConfig``: grouped-query attention (``num_query_groups``), per-head
q/k RMSNorm for Qwen3 (``qk_layernorm``), SwiGLU (``gated_linear_unit`` + SiLU), RMSNorm, RoPE
(non-interleaved, matching HF ``rotate_half``), Qwen2's q/k/v bias (``add_qkv_bias``), and an
explicit ``kv_channels = head_dim`` (Qwen3's head_dim differs from hidden/heads).

``layer_spec`` picks the Transformer Engine spec when TE is importable and an accelerator is
present, the local (pure megatron-core) spec otherwise. The two specs name the pre-attention
and pre-MLP norms differently; :mod:`openrlhf_lpo.megatron.convert` handles both.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")


def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def model_type(hf_config) -> str:
    mt = _get(hf_config, "model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={mt!r} is not supported by --backend megatron; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return mt


def rope_theta(hf_config) -> float:
    """RoPE base from ``rope_theta`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type")) or scaling.get("rope_type", scaling.get("type"))
    if rope_type not in (None, "default"):
        raise ValueError(
            f"rope type {rope_type!r} in the HF config is not supported by --backend megatron (only default RoPE)"
        )
    theta = params.get("rope_theta", _get(hf_config, "rope_theta"))
    if theta is None:
        raise ValueError("HF config has neither rope_theta nor rope_parameters['rope_theta']")
    return float(theta)


def head_dim(hf_config) -> int:
    hd = _get(hf_config, "head_dim")
    return int(hd) if hd else _get(hf_config, "hidden_size") // _get(hf_config, "num_attention_heads")


def num_kv_heads(hf_config) -> int:
    return _get(hf_config, "num_key_value_heads") or _get(hf_config, "num_attention_heads")


def te_available() -> bool:
    """Transformer Engine importable and an accelerator present."""
    from openrlhf_lpo.megatron.device import accelerator_available

    return importlib.util.find_spec("transformer_engine") is not None and accelerator_available()


def transformer_config_from_hf(
    hf_config,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: Optional[bool] = None,
    **overrides: Any,
):
    """Build a megatron-core ``TransformerConfig`` equivalent to a Qwen2/Qwen3 HF config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    mt = model_type(hf_config)
    if _get(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True in the HF config is not supported by --backend megatron")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Qwen2/Qwen3 use silu)")
    if use_cpu_initialization is None:
        from openrlhf_lpo.megatron.device import accelerator_available

        use_cpu_initialization = not accelerator_available()
    kwargs = dict(
        num_layers=_get(hf_config, "num_hidden_layers"),
        hidden_size=_get(hf_config, "hidden_size"),
        num_attention_heads=_get(hf_config, "num_attention_heads"),
        num_query_groups=num_kv_heads(hf_config),
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=_get(hf_config, "intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=(mt == "qwen2"),
        qk_layernorm=(mt == "qwen3"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        sequence_parallel=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(hf_config, use_te: Optional[bool] = None):
    """Layer spec by availability: Transformer Engine on an accelerator, local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    qk_norm = model_type(hf_config) == "qwen3"
    if use_te is None:
        use_te = te_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    return specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")


def build_gpt_model(
    hf_config,
    config=None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    **config_kwargs,
):
    """Build the local GPTModel stage for the current (TP, PP) rank of ``parallel_state``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if config is None:
        config = transformer_config_from_hf(
            hf_config,
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            **config_kwargs,
        )
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf_config, use_te),
        vocab_size=_get(hf_config, "vocab_size"),
        max_sequence_length=_get(hf_config, "max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        rotary_percent=1.0,
        vp_stage=vp_stage,
    )
