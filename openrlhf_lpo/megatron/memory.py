"""Per-GPU memory of the Megatron actor at a recipe's shapes (the tables of docs/megatron.md).

Static memory of the pipeline stage with the most parameters (``P_s``: its layers, plus the
embedding on the first stage and the output layer on the last; vocab-parallel, so divided by TP
like the layers; norms replicated):

* bf16 weights ``2 P_s / tp``; fp32 gradient buffer ``4 P_s / tp`` (``grad_reduce_in_fp32``);
* fp32 main params + Adam moments ``12 P_s / (tp * dp)`` with the distributed optimizer, ``12 P_s / tp``
  without.

Activations of one packed micro-batch of ``T`` tokens (``A`` of them action positions), bf16, per
layer and token (``h`` hidden, ``q = heads * head_dim``, ``k = kv_heads * head_dim``, ``f`` FFN):

* full recompute (``--actor.gradient_checkpointing_enable``): the layer input only, ``2 h`` bytes,
  divided by ``tp`` under sequence parallelism; plus the working set of the one layer being
  recomputed (its activations below, for one layer);
* without recompute, what a layer keeps for backward with flash attention (no score matrix):
  the norm/residual-side tensors ``4 h`` (two norm inputs, QKV and fc1 inputs; sharded by ``tp``
  only under sequence parallelism: megatron keeps the SP shard and re-gathers in backward) and the
  TP-sharded ``(2q + 2k + 3f) / tp`` (q, k, v, attention output, fc1 output gate+up, SwiGLU output),
  times 2 bytes.

Under 1F1B the first stage holds ``pp`` micro-batches in flight (``L/pp`` layers each), i.e. ``L``
layers' worth. Logits: the packed row ``[T, V/tp]`` in bf16 and the ``[A, V/tp]`` action rows in fp32
(the vocab-parallel cross-entropy input).

Transients (cluster review 2, N9):

* CE / entropy: the training step computes the (detached) entropy of the fp32 action rows before the CE
  (``actor.vocab_parallel_entropy``), which holds three more fp32 ``[A, V/tp]`` tensors at once (``x - m``,
  ``exp(x - m)`` and their product); megatron's vocab-parallel CE then works in place on the rows.
  ``12 A V / tp`` bytes (with ``--actor.entropy_coef != 0`` the differentiable entropy holds one more and
  keeps its log-softmax for backward: not counted).
* optimizer step: without Transformer Engine or apex, megatron-core steps ``torch.optim.AdamW``, whose
  default multi-tensor (foreach) path allocates ``sqrt(v)`` for every main parameter of a parameter group
  at once (nearly all of them sit in the weight-decay group): one fp32 temporary per main-param element on
  this rank, ``4 P_s / dp`` bytes with the distributed optimizer
  (``4 P_s`` without). It exists after the schedule has freed its activations, so it is compared with,
  not added to, them.
* an allowance for what torch's allocator does not see: the CUDA context and NCCL's communicator buffers
  (TP, PP, DP and embedding groups, the weight-sync group), :data:`OVERHEAD_GB` = 3 GB by default
  (``--overhead-gb``). A stated allowance, not a computation; allocator fragmentation is not counted.

``peak`` = ``max(forward/backward peak, optimizer step peak)`` + the allowance, with forward/backward peak
= static + activations + recomputed layer + logits + action rows + CE / entropy temporaries and optimizer
step peak = static + the AdamW temporaries. On the one GPU measurement (1.72B params, TP1, no distributed
optimizer, ``gpu_check.sh``'s first step) the step peak is 22 bytes per parameter: 35.2 GiB vs 35.4 GiB
measured. ``python -m openrlhf_lpo.megatron.memory MODEL --tp 8 --pp 2 --dp 1 --sp`` prints the table for
a model folder or config.json (recompute on unless ``--no-recompute``; ``examples/model_configs/`` holds
the real models' configs).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

GB = 1e9
OVERHEAD_GB = 3.0  # CUDA context + NCCL communicator buffers: an allowance (module docstring)


def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qk_norm: bool
    qkv_bias: bool

    @classmethod
    def of(cls, hf_config) -> "Shape":
        heads = _get(hf_config, "num_attention_heads")
        hidden = _get(hf_config, "hidden_size")
        mt = _get(hf_config, "model_type")
        return cls(hidden=hidden, layers=_get(hf_config, "num_hidden_layers"), heads=heads,
                   kv_heads=_get(hf_config, "num_key_value_heads") or heads,
                   head_dim=_get(hf_config, "head_dim") or hidden // heads, ffn=_get(hf_config, "intermediate_size"),
                   vocab=_get(hf_config, "vocab_size"), tied=bool(_get(hf_config, "tie_word_embeddings", False)),
                   qk_norm=mt == "qwen3", qkv_bias=mt == "qwen2")

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        attn = self.hidden * (self.q + 2 * self.k) + self.q * self.hidden
        if self.qkv_bias:
            attn += self.q + 2 * self.k
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * self.hidden * self.ffn + norms

    @property
    def parameters(self) -> int:
        """Parameters of the HF model (the output layer counted once when tied)."""
        embed = self.vocab * self.hidden
        return self.layers * self.layer_parameters + embed * (1 if self.tied else 2) + self.hidden


def stage_parameters(shape: Shape, pp: int, stage: int) -> int:
    """Parameters a pipeline stage holds (a tied embedding has its own output copy on the last
    stage when pp > 1)."""
    n = shape.layers // pp * shape.layer_parameters
    embed = shape.vocab * shape.hidden
    if stage == 0:
        n += embed
    if stage == pp - 1:
        n += shape.hidden  # final norm
        if not shape.tied or pp > 1:
            n += embed
    return n


def rank_parameters(shape: Shape, tp: int, pp: int, stage: int) -> int:
    """Elements one TP rank of ``stage`` holds: everything sharded by TP except the norms (and
    Qwen3's q/k norms), which are replicated."""
    norms = shape.layers // pp * (2 * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0))
    if stage == pp - 1:
        norms += shape.hidden
    return (stage_parameters(shape, pp, stage) - norms) // tp + norms


def largest_layer_tensor_elements(shape: Shape) -> int:
    """Elements of a layer's largest unsharded matrix: the fused QKV, the projection or an MLP matrix."""
    h = shape.hidden
    return max(h * (shape.q + 2 * shape.k), shape.q * h, 2 * shape.ffn * h, shape.ffn * h)


def largest_tensor_elements(shape: Shape, pp: int = 1, stage: int = 0) -> int:
    """Elements of the largest unsharded parameter pipeline stage ``stage`` holds: a layer's matrix, or the
    embedding / output layer on the first and last stages."""
    largest = largest_layer_tensor_elements(shape)
    if stage == 0 or (stage == pp - 1 and (not shape.tied or pp > 1)):
        largest = max(largest, shape.vocab * shape.hidden)
    return largest


def node_layout(world: int, gpus_per_node: int, tp: int, pp: int) -> List[Tuple[int, int, int, List[int]]]:
    """(node, first rank, last rank, pipeline stages) per node: ranks sit node-major (rank r on node ``r // G``,
    ``openrlhf/placement.py``) and megatron's rank order is ``tp-cp-ep-pp-dp`` (rank r in stage ``(r // tp) % pp``),
    so each node holds whole TP groups of known stages."""
    out = []
    for node in range(-(-world // gpus_per_node)):
        first, last = node * gpus_per_node, min((node + 1) * gpus_per_node, world) - 1
        out.append((node, first, last, sorted({(r // tp) % pp for r in range(first, last + 1)})))
    return out


def layer_activation_bytes_per_token(shape: Shape, tp: int, sequence_parallel: bool, recompute: bool) -> float:
    """Bytes per token one layer keeps for the backward pass (bf16; see the module docstring)."""
    side = shape.hidden / (tp if sequence_parallel else 1)
    if recompute:
        return 2 * side
    return 2 * (4 * side + (2 * shape.q + 2 * shape.k + 3 * shape.ffn) / tp)


def entropy_ce_temporary_bytes(shape: Shape, tp: int, action_tokens: int) -> float:
    """Three fp32 ``[A, V/tp]`` tensors the detached entropy holds at once (``x - m``, ``exp``, product)."""
    return 3 * 4.0 * action_tokens * shape.vocab / tp


def adam_step_temporary_bytes(main_param_elements: float) -> float:
    """torch AdamW (foreach): one fp32 ``sqrt(v)`` per main-param element this rank steps."""
    return 4.0 * main_param_elements


def actor_memory(hf_config, tp: int, pp: int, dp: int, tokens: int, action_tokens: int,
                 sequence_parallel: bool = False, recompute: bool = True,
                 distributed_optimizer: bool = True, overhead_gb: float = OVERHEAD_GB,
                 stage: Optional[int] = None) -> Dict[str, float]:
    """Per-GPU memory (bytes) of the most loaded stage of the Megatron actor (or of pipeline stage ``stage``: its
    own parameters, the activation terms of the most loaded stage, an upper bound); keys in table order
    (the transients and ``peak``: module docstring)."""
    shape = Shape.of(hf_config)
    p = max(rank_parameters(shape, tp, pp, s) for s in range(pp)) if stage is None \
        else rank_parameters(shape, tp, pp, stage)
    out: Dict[str, float] = {"parameters": float(shape.parameters), "parameters per GPU": float(p)}
    out["bf16 weights"] = 2.0 * p
    out["fp32 gradient buffer"] = 4.0 * p
    out["fp32 main params + Adam moments"] = 12.0 * p / (dp if distributed_optimizer else 1)
    out["static total"] = out["bf16 weights"] + out["fp32 gradient buffer"] + out["fp32 main params + Adam moments"]
    per_token = layer_activation_bytes_per_token(shape, tp, sequence_parallel, recompute)
    out["activations kept for backward"] = per_token * tokens * shape.layers  # pp in flight x L/pp layers
    if recompute:
        out["one recomputed layer"] = layer_activation_bytes_per_token(shape, tp, sequence_parallel, False) * tokens
    out["logits, bf16 [T, V/tp]"] = 2.0 * tokens * shape.vocab / tp
    out["action rows, fp32 [A, V/tp]"] = 4.0 * action_tokens * shape.vocab / tp
    out["CE / entropy temporaries, fp32 3 x [A, V/tp]"] = entropy_ce_temporary_bytes(shape, tp, action_tokens)
    out["forward/backward peak"] = sum(v for k, v in out.items()
                                       if k not in ("parameters", "parameters per GPU", "static total"))
    main = p / (dp if distributed_optimizer else 1)
    out["optimizer step temporaries (AdamW foreach sqrt(v), fp32)"] = adam_step_temporary_bytes(main)
    out["optimizer step peak"] = out["static total"] + out["optimizer step temporaries (AdamW foreach sqrt(v), fp32)"]
    out["CUDA context + NCCL buffers (allowance)"] = overhead_gb * GB
    out["peak"] = max(out["forward/backward peak"], out["optimizer step peak"]) + overhead_gb * GB
    return out


def format_table(rows: Dict[str, float]) -> List[str]:
    lines = []
    for k, v in rows.items():
        if k.startswith("parameters"):
            lines.append(f"{k}: {v / 1e9:.2f}B")
        else:
            lines.append(f"{k}: {v / GB:.2f} GB")
    return lines


def load_config(path: str) -> dict:
    """A model folder's (or a file's) ``config.json`` as a dict."""
    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(f) as fh:
        return json.load(fh)


def shape_parser(description: str) -> argparse.ArgumentParser:
    """The command-line options of a memory table: the model, its layout and one micro-batch's tokens."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model", help="model folder with a config.json, or the config.json")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=5120, help="tokens of one packed micro-batch")
    ap.add_argument("--actions", type=int, default=4096, help="action (response) tokens of the micro-batch")
    ap.add_argument("--sp", action="store_true", help="--megatron.sequence_parallel")
    ap.add_argument("--no-recompute", action="store_true", help="without --actor.gradient_checkpointing_enable")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    ap = shape_parser(__doc__.splitlines()[0])
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--overhead-gb", type=float, default=OVERHEAD_GB,
                    help="allowance for the CUDA context and NCCL buffers (GB = 1e9 bytes)")
    a = ap.parse_args(argv)
    rows = actor_memory(load_config(a.model), a.tp, a.pp, a.dp, a.tokens, a.actions, a.sp, not a.no_recompute,
                        not a.no_distributed_optimizer, a.overhead_gb)
    print("\n".join(format_table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
