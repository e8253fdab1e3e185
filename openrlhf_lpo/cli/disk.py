"""Disk a run needs, for ``lpo-train --dry-run``: one checkpoint and the whole run, from the model's
parameter count, the dtype, the optimizer state, the backend's checkpoint layout and the rotation.

With N parameters (exact from a local model's safetensors headers, else from its ``config.json``):

* HF export (``--ckpt.save_hf``, ``<ckpt.path>/<tag>_hf``, and the final model in ``--ckpt.output_dir``):
  N x bytes of ``--ds.param_dtype`` (bf16: 2) (``--megatron.params_dtype`` for Megatron);
* DeepSpeed state (``<ckpt.path>/_actor/<tag>``, any ZeRO stage, the shards of all ranks together):
  N x (2 model weights in bf16/fp16, 4 in fp32) + N x 12 (fp32 master weights, Adam m and v) =
  14 B/param in bf16; the same with optimizer offload; nothing with ``--ckpt.disable_ds``;
* Megatron state (layout-free, written once by the first replica): N x 12 (fp32 main params, Adam m, v);
* a critic (PPO with a value model) adds its own state of the same size.

Kept at once: ``--ckpt.max_num`` states (upstream deletes before saving the next), the HF exports
that follow them (openrlhf_lpo/hf_exports.py; ``--ckpt.hf_max_num`` overrides, -1 keeps all) plus the
one being written, and the final model. ``--ckpt.max_mem`` (GB) caps the states.

Public names (stable): model_parameters(path) -> (N or None, how), disk_lines(args, total_steps) -> lines
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from typing import List, Optional, Tuple

__all__ = ["model_parameters", "disk_lines", "config_parameters"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "float32": 4, "bfloat16": 2, "float16": 2}
_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
ADAM_BYTES = 12  # fp32 master weights + Adam m + v


def _model_dir(name_or_path: str) -> Optional[str]:
    """A local directory for the model: the path itself, or its snapshot in the Hugging Face cache."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if "/" not in name_or_path or name_or_path.startswith(("/", ".")):
        return None
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    snaps = sorted(glob.glob(os.path.join(cache, "models--" + name_or_path.replace("/", "--"), "snapshots", "*")))
    return next((s for s in reversed(snaps) if os.path.isfile(os.path.join(s, "config.json"))), None)


def _safetensors_parameters(folder: str) -> Optional[int]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def config_parameters(cfg: dict) -> int:
    """Parameters of a dense decoder (Qwen2/Qwen3/Llama/Mistral) from its HF config: embeddings (an
    untied LM head again), per layer q/k/v/o (+ Qwen2's q/k/v biases, Qwen3's q/k norms), the gated
    MLP (3 h I) and two norms, the final norm. A VLM's ``text_config`` is used for the language
    model; its vision tower is not counted (say so where it matters)."""
    text = cfg.get("text_config") or cfg
    h, L, V = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    d = int(text.get("head_dim") or h // heads)
    inter = int(text["intermediate_size"])
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    arch = " ".join(cfg.get("architectures") or []) + " " + str(cfg.get("model_type", ""))
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    if "Qwen2" in arch or "qwen2" in arch:
        attn += heads * d + 2 * kv * d  # q/k/v biases
    if "Qwen3" in arch or "qwen3" in arch:
        attn += 2 * d  # q/k norms
    layer = attn + 3 * h * inter + 2 * h
    return V * h * (1 if tied else 2) + L * layer + h


def model_parameters(name_or_path: str) -> Tuple[Optional[int], str]:
    folder = _model_dir(name_or_path)
    if folder is None:
        return None, f"{name_or_path} is neither a local directory nor in the Hugging Face cache"
    n = _safetensors_parameters(folder)
    if n is not None:
        return n, "safetensors headers"
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        how = "config.json, dense-decoder formula" + ("; vision tower not counted" if "vision_config" in cfg else "")
        return config_parameters(cfg), how
    except (OSError, KeyError, ValueError) as e:
        return None, f"{folder}/config.json: {type(e).__name__}: {e}"


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


def disk_lines(args, total_steps: Optional[int]) -> List[str]:
    """What ``--dry-run`` prints about disk (module doc)."""
    ckpt = args.ckpt
    n, how = model_parameters(str(args.actor.model_name_or_path))
    if n is None:
        return [f"disk: unknown ({how}; give a local model path to get the estimate)"]
    backend = getattr(args, "backend", "deepspeed")
    if backend == "megatron":
        dtype = str(getattr(args.megatron, "params_dtype", "bf16"))
        state_per, state_how = ADAM_BYTES * n, "Megatron fp32 main params + Adam m, v = 12 B/param"
    else:
        dtype = str(args.ds.param_dtype)
        w = DTYPE_BYTES.get(dtype, 2)
        state_per = 0 if ckpt.disable_ds else (w + ADAM_BYTES) * n
        state_how = ("--ckpt.disable_ds: none" if ckpt.disable_ds else
                     f"DeepSpeed ZeRO-{args.ds.zero_stage}: {w} B weights + 12 B fp32 master/Adam = {w + ADAM_BYTES} B/param")
    hf = DTYPE_BYTES.get(dtype, 2) * n
    critic = bool(getattr(args.critic, "model_name_or_path", None))
    if critic:
        state_per *= 2
        state_how += " (x2: actor and critic)"
    per = state_per + (hf if ckpt.save_hf else 0)
    lines = [f"disk: model {n / 1e9:.2f}B parameters ({how}), {dtype}",
             f"  one checkpoint: {_gb(per)} = state {_gb(state_per)} ({state_how})"
             + (f" + HF export {_gb(hf)} (N x {DTYPE_BYTES.get(dtype, 2)} B)" if ckpt.save_hf else " (no --ckpt.save_hf)")]
    save_steps = ckpt.save_steps
    if not save_steps or save_steps < 0 or save_steps == float("inf"):
        lines.append(f"  whole run: no checkpoints (--ckpt.save_steps {save_steps}); final model {_gb(hf)}")
        return lines
    if total_steps is None:
        saves_text, saves = "an unknown number of", None
    else:
        saves = total_steps // int(save_steps)
        saves_text = str(saves)
    max_num = max(int(ckpt.max_num), 1)
    states = max_num if saves is None else min(max_num, saves)
    if ckpt.max_mem != float("inf") and state_per:
        states = min(states, max(1, int(ckpt.max_mem * 1e9 // state_per)))
    hf_keep = getattr(ckpt, "hf_max_num", None)
    if not ckpt.save_hf:
        exports = 0
    elif hf_keep is not None and hf_keep < 0:
        exports = saves  # every export stays
    else:
        exports = states if hf_keep is None else (hf_keep if saves is None else min(hf_keep, saves))
    if exports is None:
        lines.append(f"  whole run: {saves_text} checkpoints; every HF export is kept (--ckpt.hf_max_num -1): "
                     f"{_gb(hf)} each, plus {states} states ({_gb(states * state_per)})")
        return lines
    peak = states * state_per + (exports + (1 if ckpt.save_hf and exports < (saves or 0) else 0)) * hf + hf
    steps = "?" if total_steps is None else str(total_steps)
    lines.append(f"  whole run: {steps} steps, a checkpoint every {int(save_steps)} -> {saves_text} saves; kept at once "
                 f"{states} state(s) + {exports} HF export(s) (+1 while the next is written) + the final model = "
                 f"{_gb(peak)} at most under {ckpt.path} and {ckpt.output_dir}")
    return lines
