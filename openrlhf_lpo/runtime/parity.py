"""Weight-sync parity: after a sync, the rollout engines must score a probe sequence as the actor does.

Neutral ground for every trainer backend (the DeepSpeed CPU mode in :mod:`openrlhf_lpo.cpu.mode`, the
Megatron actor in :mod:`openrlhf_lpo.megatron.ray_actor`, the GPU check script): nothing here names
a device or imports a backend.

Public names (stable):
    PROBE_TEXT, probe_sequence(tokenizer, length=48) -> token ids
    check_engine_parity(engines, ids, actor_log_probs, temperature, images=None, **record) -> max |diff|
        engines expose ``log_probs_of.remote(ids, temperature[, images=])`` (the CPU rollout engines
        do); tolerance ``LPO_CPU_PARITY_TOL`` (default 1e-4), a failure raises; one JSON line per
        check is appended to ``LPO_CPU_PARITY_LOG`` when set.
    image_probe(processor) -> (ids, [PIL image], mm)      a VLM's probe through its vision tower
    actor_image_log_probs(actor, ids, mm) -> float64 log-probs of ids[1:] with the probe's image
    check_image_parity(trainer, **record) -> max |diff|    the image probe after a VLM's sync
"""

from __future__ import annotations

import json
import os
import time
from typing import List

PROBE_TEXT = "Using the numbers [3, 5, 7], make 22: <answer> 3 * 5 + 7 </answer>"


def probe_sequence(tokenizer, length: int = 48) -> List[int]:
    """A fixed token sequence on which the actor and the engines must agree after a sync."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor: its text tokenizer
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return list(ids)[:length]


def check_engine_parity(engines, ids: List[int], actor_log_probs, temperature: float, images=None,
                        **record) -> float:
    """After a weight sync: every engine's log-probs of the probe sequence ``ids`` must equal the
    actor's (max |diff| <= ``LPO_CPU_PARITY_TOL``, default 1e-4; a failure raises). The result
    is appended as one JSON line to ``LPO_CPU_PARITY_LOG`` when set. Returns the max |diff|."""
    import ray
    import torch

    mm = {"images": images} if images else {}  # a VLM's image probe (image_probe below)
    engine_lps = ray.get([engine.log_probs_of.remote(ids, temperature, **mm) for engine in engines])
    tol = float(os.environ.get("LPO_CPU_PARITY_TOL", "1e-4"))
    diffs = [float((torch.tensor(lp, dtype=torch.float64) - actor_log_probs).abs().max()) for lp in engine_lps]
    log_path = os.environ.get("LPO_CPU_PARITY_LOG")
    if log_path:
        entry = {"time": time.time(), "max_abs_diff": max(diffs), "per_engine": diffs, "tol": tol,
                 "num_tokens": len(ids) - 1, **record, "probe_ids": ids,
                 "actor_log_probs": actor_log_probs.tolist(), "engine_log_probs": engine_lps[0]}
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    if max(diffs) > tol:
        raise RuntimeError(
            f"CPU rollout engine log-probs differ from the actor's after the weight sync: max |diff| "
            f"{max(diffs):.3g} > LPO_CPU_PARITY_TOL={tol:g} ({record.get('probe', 'text')} probe, "
            f"engine {os.environ.get('LPO_CPU_ENGINE', 'hf')}, "
            f"{record.get('backend', 'deepspeed')} actor)"
        )
    return max(diffs)


# ----------------------------------------------------------------------------- vision-language models

PROBE_QUESTION = "Find x."


def image_probe(processor, size: int = 112):
    """A fixed image prompt for the actor/engine parity check of a VLM: ``(ids, [PIL image], mm)``,
    the ids expanded by ``processor`` exactly as OpenRLHF's rollout executor does."""
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    from openrlhf_lpo.data.geometry import draw_problem

    image, _, _ = draw_problem("triangle_angle", 0, size)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROBE_QUESTION}]}]
    prompt = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids, mm, images = process_prompt_with_images(processor, prompt + "x = 34", [image])
    return ids, images, mm


def actor_image_log_probs(actor, ids, mm):
    """The actor's log-probs of ``ids[1:]`` with the probe's image (eval mode, no grad), float64."""
    import torch

    device = next(actor.parameters()).device
    seq = torch.tensor([ids], dtype=torch.long, device=device)
    action_mask = torch.ones((1, len(ids) - 1), dtype=torch.bool, device=device)
    was_training = actor.training
    actor.eval()
    with torch.no_grad():
        out = actor(seq, action_mask, attention_mask=torch.ones_like(seq),
                    **{k: v.to(device) for k, v in mm.items()})
    if was_training:
        actor.train()
    return out[0].double().cpu()


def check_image_parity(trainer, **record) -> float:
    """After a CPU-mode weight sync of a VLM: the engines' log-probs of :func:`image_probe` (through
    their vision tower) must equal the actor's; :func:`check_engine_parity` raises otherwise."""
    processor = trainer.tokenizer
    if not hasattr(processor, "image_processor"):  # the policy actor holds the text tokenizer
        processor = getattr(trainer, "_lpo_probe_processor", None)
        if processor is None:
            from transformers import AutoProcessor

            # the actor's process: stock OpenRLHF loads this model with remote code already
            processor = AutoProcessor.from_pretrained(trainer.strategy.args.actor.model_name_or_path,
                                                      trust_remote_code=True)
            trainer._lpo_probe_processor = processor
    ids, images, mm = image_probe(processor)
    return check_engine_parity(trainer.vllm_engines, ids, actor_image_log_probs(trainer.actor, ids, mm),
                               float(trainer.actor.temperature), images=images, probe="image", **record)
