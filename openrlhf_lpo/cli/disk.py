"""The disk a run writes: training checkpoints, Hugging Face exports and the final model.

Public names (stable):
    model_params(model_dir) -> int or None       parameters, from the weight files' size and dtype
    run_disk_need(args, params, rollout_batches) -> DiskNeed
    DiskNeed(parts, total)                       parts: (what, bytes, where)
    human_size(n) -> str                         12.0 MiB, 1.5 GiB, 2.3 TiB

One place for the estimate: ``lpo-train``'s preflight compares it with the free space of
``--ckpt.path`` / ``--ckpt.output_dir`` and the plan prints it. Bytes per parameter, per checkpoint:

* DeepSpeed (``ckpt.path/_actor/global_stepN``): the fp32 master copy and the two Adam moments
  (12 B, ZeRO-partitioned over the ranks) plus the module in ``--ds.param_dtype`` (2 B for bf16;
  ZeRO-3 keeps none in ``mp_rank_00_model_states.pt``). Upstream deletes the oldest before saving,
  so at most ``--ckpt.max_num`` exist;
* Megatron (``openrlhf_lpo/megatron/checkpoint.py``): fp32 parameters and Adam moments, 12 B, written
  whole before the oldest is pruned: ``--ckpt.max_num`` + 1 at the peak;
* one more when ``--eval.dataset`` keeps a best checkpoint (``--ckpt.best_metric_key`` not ``none``);
* ``--ckpt.save_hf``: one export per save (``global_stepN_hf``, ``--ds.param_dtype``). OpenRLHF 0.11.2
  never deletes them; here they rotate (``openrlhf_lpo/runtime/hf_exports.py``): the ones whose state is kept
  (``--ckpt.max_num``) or ``--ckpt.hf_max_num`` of them, each written before the oldest goes, so one
  more at the peak; ``--ckpt.hf_max_num -1`` keeps one per save;
* the final model in ``--ckpt.output_dir``.

Optimizer moments are counted for every parameter (no frozen parameters); a VLM's frozen vision tower
makes this an upper bound.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from openrlhf_lpo.core.training_backends import backend_of

__all__ = ["model_params", "run_disk_need", "DiskNeed", "DTYPE_BYTES", "human_size"]

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4}
OPTIMIZER_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class DiskNeed:
    parts: List[Tuple[str, int, str]] = field(default_factory=list)  # (what, bytes, directory)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.parts)

    def bytes_under(self, directory: str) -> int:
        return sum(b for _, b, d in self.parts if d == directory)


def model_params(model_dir: str) -> Optional[int]:
    """Parameters of the model in ``model_dir`` (weight bytes / dtype bytes), or None if unknown."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or
                (config.get("text_config") or {}).get("torch_dtype") or "bfloat16").replace("torch.", "")
    per = DTYPE_BYTES.get(dtype)
    if per is None:
        return None
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(model_dir, index)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    total = json.load(f).get("metadata", {}).get("total_size")
            except (OSError, ValueError):
                total = None
            if total:
                return int(total) // per
    sizes = [os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
             if n.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(model_dir, n))]
    return sum(sizes) // per if sizes else None


def _saves(args, rollout_batches: Optional[int]) -> Optional[int]:
    steps = args.ckpt.save_steps
    if steps is None or steps <= 0 or steps == float("inf"):
        return 0
    return None if rollout_batches is None else rollout_batches // int(steps)


def run_disk_need(args, params: int, rollout_batches: Optional[int]) -> DiskNeed:
    """What the run writes at its peak (module docstring); ``rollout_batches`` over all episodes, or None."""
    param_bytes = DTYPE_BYTES.get(str(getattr(args.ds, "param_dtype", "bf16")), 2)
    saves = _saves(args, rollout_batches)
    max_num = max(int(args.ckpt.max_num), 1)
    need = DiskNeed()
    ckpt = args.ckpt.path
    backend = backend_of(args)
    if not getattr(args.ckpt, "disable_ds", False):
        per = params * (OPTIMIZER_BYTES + (param_bytes if backend.checkpoint_holds_weights(args) else 0))
        kept = max_num + (1 if backend.saves_before_pruning else 0)  # the new one is written before the oldest goes
        best = 1 if getattr(args.eval, "dataset", None) and getattr(args.ckpt, "best_metric_key", "") != "none" else 0
        count = kept if saves is None else min(kept, saves)
        if count or best:
            need.parts.append((f"{count + best} {backend.name} checkpoint(s) of {human_size(per)}",
                               (count + best) * per, ckpt))
    if getattr(args.ckpt, "save_hf", False):
        keep = getattr(args.ckpt, "hf_max_num", None)
        keep = max_num if keep is None else int(keep)
        if keep < 0:  # every export stays
            exports = max_num if saves is None else saves
        else:  # the newest is always kept, and written before rotation removes the oldest
            exports = max(keep, 1) + 1 if saves is None else min(max(keep, 1) + 1, saves)
        if exports:
            note = "" if saves is not None or keep >= 0 else " (at least: the dataset size is unknown)"
            need.parts.append((f"{exports} Hugging Face export(s) of {human_size(params * param_bytes)}{note}",
                               exports * params * param_bytes, ckpt))
    need.parts.append((f"final model {human_size(params * param_bytes)}", params * param_bytes, args.ckpt.output_dir))
    return need


def human_size(n: int) -> str:
    """A readable size: 12.0 MiB, 1.5 GiB, 2.3 TiB, 1.8 PiB."""
    for power, unit in ((5, "PiB"), (4, "TiB"), (3, "GiB")):
        if n >= 1024**power / 10:
            return f"{n / 1024**power:.1f} {unit}"
    return f"{n / 1024**2:.1f} MiB"
