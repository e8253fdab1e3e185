"""megatron-core GPTModel for HF Qwen2 / Qwen3 / Llama / Mistral configs.

``transformer_config_from_hf`` maps an HF config (object or dict) of a registered architecture
(``ARCHITECTURES``) onto a megatron-core ``TransformerConfig``: grouped-query attention
(``num_query_groups``), per-head q/k RMSNorm for Qwen3 (``qk_layernorm``), SwiGLU
(``gated_linear_unit`` + SiLU), RMSNorm, RoPE (non-interleaved, matching HF ``rotate_half``; Llama
3.x frequency scaling), Qwen2's q/k/v bias (``add_qkv_bias``), and an explicit
``kv_channels = head_dim`` (Qwen3's head_dim differs from hidden/heads). ``recompute=True`` maps
``--actor.gradient_checkpointing_enable`` onto megatron's full-layer recompute; with pipeline
parallelism the config allows a different packed length per micro-batch.

``layer_spec`` picks the Transformer Engine spec when TE is importable and an accelerator is
present, the local (pure megatron-core) spec with the packed-sequence attention of
:mod:`openrlhf_lpo.megatron.attention` otherwise. The two specs name the pre-attention and pre-MLP
norms differently; :mod:`openrlhf_lpo.megatron.convert` handles both.

Sequence parallelism (``--megatron.sequence_parallel``, TP > 1): the norms, residuals and dropout
of each layer hold ``T/tp`` of the packed row's tokens per TP rank (megatron's all-gather before
the column-parallel QKV / fc1 and reduce-scatter after the row-parallel proj / fc2). TE's norms
support it; megatron-core's torch norm of the local spec asserts it off, so the local spec uses
:class:`SequenceParallelRMSNorm` (torch RMSNorm whose weight is marked ``sequence_parallel``: its
gradient is partial per TP rank and ``finalize_model_grads`` sums it over TP).

Virtual pipeline stages (``--megatron.vpp V``): each PP rank builds ``V`` model chunks
(``vp_stage`` 0..V-1); chunk ``v`` of PP rank ``p`` holds layers ``[(v*pp+p)*L/(pp*V), ...)``
(:func:`chunk_layer_offset`), the interleaved 1F1B schedule runs them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from openrlhf_lpo.registry import register_unique


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes a supported HF architecture in the Megatron model and the converter."""

    qk_layernorm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    qkv_bias: bool = False  # bias on q/k/v projections only (Qwen2)


ARCHITECTURES: Dict[str, ArchSpec] = {}


def register_architecture(model_type: str, spec: ArchSpec) -> ArchSpec:
    return register_unique(ARCHITECTURES, "architecture", model_type, spec)


register_architecture("qwen2", ArchSpec(qkv_bias=True))  # also DeepSeek-R1-Distill-Qwen
register_architecture("qwen3", ArchSpec(qk_layernorm=True))
register_architecture("llama", ArchSpec())  # Llama 2 / 3.x
register_architecture("mistral", ArchSpec())

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# Llama 3.x RoPE scaling as megatron-core implements it (RotaryEmbedding._apply_scaling): only
# the factor is a parameter there, the other three are fixed to these values.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def model_type(hf_config) -> str:
    mt = _get(hf_config, "model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(
            f"model_type={mt!r} is not supported by --backend megatron; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return mt


def arch_spec(hf_config) -> ArchSpec:
    return ARCHITECTURES[model_type(hf_config)]


def _rope_params(hf_config) -> dict:
    params = dict(_get(hf_config, "rope_scaling") or {})
    params.update(_get(hf_config, "rope_parameters") or {})
    return params


def rope_theta(hf_config) -> float:
    """RoPE base from ``rope_theta`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
    theta = _rope_params(hf_config).get("rope_theta", _get(hf_config, "rope_theta"))
    if theta is None:
        raise ValueError("HF config has neither rope_theta nor rope_parameters['rope_theta']")
    return float(theta)


def rope_scaling(hf_config) -> Optional[float]:
    """None for default RoPE, the factor for Llama 3.x scaling; anything else raises."""
    params = _rope_params(hf_config)
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        for key, want in _LLAMA3_FIXED.items():
            if float(params.get(key, want)) != want:
                raise ValueError(
                    f"rope_parameters[{key!r}]={params.get(key)} in the HF config: --backend megatron implements "
                    f"Llama 3 RoPE scaling with {key}={want} only (megatron-core's RotaryEmbedding)"
                )
        return float(params["factor"])
    raise ValueError(
        f"rope type {rope_type!r} in the HF config is not supported by --backend megatron (default or llama3 only)"
    )


def attention_span(hf_config) -> Optional[int]:
    """Tokens a position may attend back to when the model uses a sliding window, else None.

    Sequences up to this length are computed exactly by full causal attention; the actor refuses
    longer ones (sliding-window attention is not implemented)."""
    window = _get(hf_config, "sliding_window")
    if model_type(hf_config) in ("qwen2", "qwen3") and not _get(hf_config, "use_sliding_window", False):
        return None
    return int(window) if window else None


def head_dim(hf_config) -> int:
    hd = _get(hf_config, "head_dim")
    return int(hd) if hd else _get(hf_config, "hidden_size") // _get(hf_config, "num_attention_heads")


def num_kv_heads(hf_config) -> int:
    return _get(hf_config, "num_key_value_heads") or _get(hf_config, "num_attention_heads")


def chunk_layer_offset(num_layers: int, pp: int, pp_rank: int, vpp: int = 1, vp_stage: int = 0) -> int:
    """Global index of the first layer of model chunk ``vp_stage`` on pipeline rank ``pp_rank``
    (uniform stages: megatron's interleaved assignment, ``L % (pp*vpp) == 0``)."""
    return (vp_stage * pp + pp_rank) * (num_layers // (pp * vpp))


class SequenceParallelRMSNorm:
    """Local-spec norm that also runs under sequence parallelism: ``torch.nn.RMSNorm`` whose weight
    carries ``sequence_parallel = config.sequence_parallel`` (each TP rank sees ``T/tp`` tokens,
    so ``finalize_model_grads`` sums the weight's gradient over TP). Without SP it is exactly
    megatron-core's ``WrappedTorchNorm`` for RMSNorm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: the Megatron actor builds RMSNorm models only")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


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
    recompute: bool = False,
    sequence_parallel: bool = False,
    vpp: int = 1,
    **overrides: Any,
):
    """Build a megatron-core ``TransformerConfig`` equivalent to a registered HF config.

    ``sequence_parallel`` (needs ``tp > 1``) and ``vpp`` (virtual pipeline stages per PP rank)
    are megatron's. ``recompute``: ``--actor.gradient_checkpointing_enable`` -> full recompute of every layer
    (granularity ``full``, method ``uniform``, 1 layer per checkpoint): only each layer's input
    is kept for the backward pass."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = arch_spec(hf_config)
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU models use silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf_config, flag, False) and not (flag == "attention_bias" and arch.qkv_bias):
            raise ValueError(f"{flag}=True in the HF config is not supported by --backend megatron")
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
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
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
        sequence_parallel=bool(sequence_parallel),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
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
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if pp > 1 and vpp == 1:
        # every micro-batch is one packed row of its own length: the pipeline exchanges shapes
        # first (0.16.1 accepts that only with the alltoall dispatcher, unused by dense models)
        kwargs.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if vpp > 1:
        # interleaved 1F1B sends activations forward and gradients backward in one call, at pp 2 to
        # the same peer: batched p2p matches them by order and swaps them (garbage gradients on
        # gloo, measured), megatron's unbatched p2p sends the two directions on different groups (as
        # Megatron-LM runs interleaving: batch_p2p_comm = not overlap_p2p_comm). Its blocking shape
        # exchange is batched too, so shapes are fixed: the actor pads a pass's rows to one length
        kwargs.update(batch_p2p_comm=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(hf_config, use_te: Optional[bool] = None):
    """Layer spec by availability: Transformer Engine on an accelerator (its attention takes
    packed sequences), else the local spec with :class:`PackedDotProductAttention`."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from openrlhf_lpo.megatron.attention import PackedDotProductAttention

    qk_norm = arch_spec(hf_config).qk_layernorm
    if use_te is None:
        use_te = te_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    sub = spec.submodules
    sub.self_attention.submodules.core_attention = PackedDotProductAttention
    sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    if qk_norm:
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
    return spec


def block_spec(hf_config, config, use_te: Optional[bool] = None, vp_stage: Optional[int] = None):
    """The decoder block of one stage: the layer spec, and for the local spec the final norm as
    :class:`SequenceParallelRMSNorm` (megatron's default there is the torch norm, which refuses SP)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te is None:
        use_te = te_available()
    spec = layer_spec(hf_config, use_te)
    if use_te:
        return spec
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=SequenceParallelRMSNorm)


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
        transformer_layer_spec=block_spec(hf_config, config, use_te, vp_stage),
        vocab_size=_get(hf_config, "vocab_size"),
        max_sequence_length=_get(hf_config, "max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        rotary_percent=1.0,
        rope_scaling=rope_scaling(hf_config) is not None,
        rope_scaling_factor=rope_scaling(hf_config) or 8.0,
        vp_stage=vp_stage,
    )
