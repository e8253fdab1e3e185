"""What LPO adds to OpenRLHF 0.11.2's vision-language path (Qwen2.5-VL, Geometry3k).

OpenRLHF already carries a VLM sample's images (``Experience.images``: the raw references) and
its processor outputs (``Experience.mm_train_inputs``: ``pixel_values``, ``image_grid_thw``) through
splitting, batching and the gradient pass. Two LPO places need them too:

* :func:`mm_forward_kwargs`: the image inputs of a (micro-)batch for an ``Actor`` forward. LPO's
  no-grad passes (a later window's pre-pass s, ``--lpo.end_kl``: ``LPOActorTrainer._log_ratio``)
  call the actor themselves; without these kwargs a VLM embeds ``<|image_pad|>`` as text and s is
  wrong;
* :func:`group_key`: what the K members of a prompt group must share, the prompt text *and* its
  images (Geometry3k repeats "Find x." across different diagrams), and so the key of the canonical
  group order (``LPOExperienceMaker.split_rollout_samples``).

Also here: which parameters the CPU-mode weight sync of a VLM sends (:func:`syncs_param`:
trainable ones only, as upstream; the image parity probe is in :mod:`openrlhf_lpo.runtime.parity`) and
:func:`save_processor_files` (checkpoints a VLM can be evaluated from).

``mm_forward_kwargs`` is the one place LPO batches images for an actor forward (the trainer's
no-grad passes and the exactness harness use it).
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Tuple

__all__ = ["mm_forward_kwargs", "group_key", "image_fingerprint", "syncs_param", "save_processor_files"]


def mm_forward_kwargs(actor, experience, device=None) -> Dict:
    """``pixel_values`` / ``image_grid_thw`` of ``experience`` for ``actor(...)`` (empty for text).

    ``device`` defaults to the device of ``experience.sequences``; the concatenation follows the
    batch order, as the stock ``training_step`` does (``merge_mm_train_inputs``).
    """
    mm = getattr(experience, "mm_train_inputs", None)
    if not mm or not getattr(actor, "is_vlm", False) or all(m is None for m in mm):
        return {}
    from openrlhf.utils.vlm_utils import merge_mm_train_inputs

    return merge_mm_train_inputs(mm, device if device is not None else experience.sequences.device)


def image_fingerprint(image) -> str:
    """A stable identity for one image reference (string, bytes, PIL image, ``{"bytes","path"}``, None)."""
    if image is None:
        return ""
    if isinstance(image, str):
        return image if len(image) < 256 else "sha256:" + hashlib.sha256(image.encode()).hexdigest()
    if isinstance(image, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(bytes(image)).hexdigest()
    if isinstance(image, dict):
        return image_fingerprint(image.get("bytes") or image.get("path"))
    if isinstance(image, (list, tuple)):
        return "[" + ",".join(image_fingerprint(i) for i in image) + "]"
    if hasattr(image, "tobytes"):  # PIL image
        h = hashlib.sha256(repr((image.mode, image.size)).encode())
        h.update(image.tobytes())
        return "pil:" + h.hexdigest()
    return repr(image)


def group_key(sample) -> Tuple:
    """Prompt text and image references of a single-sample experience (equal within a group)."""
    images = getattr(sample, "images", None) or []
    return tuple(sample.prompts), tuple(image_fingerprint(i) for i in images)


# ----------------------------------------------------------------------------- CPU-mode weight sync


def syncs_param(actor, param) -> bool:
    """Whether the weight sync sends ``param``: for a VLM only trainable ones (upstream's rule in
    ``broadcast_to_vllm``; a frozen vision tower stays as loaded on both sides), else all."""
    return bool(param.requires_grad) or not getattr(actor, "is_vlm", False)


# ----------------------------------------------------------------------------- checkpoints

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def save_processor_files(pretrain: str, output_dir: str) -> list:
    """Put the VLM processor of ``pretrain`` next to saved weights in ``output_dir``.

    OpenRLHF 0.11.2's policy actor saves only the text tokenizer with a checkpoint, so
    ``AutoProcessor`` (``lpo-eval``, vLLM) cannot load a trained VLM from it. A local model
    directory's processor files (and remote-code ``processing_*.py``) that are missing are copied; a hub model's
    processor is saved with ``save_pretrained``. Returns the file names written.
    """
    import shutil

    if not os.path.isdir(output_dir):
        return []
    written = []
    if os.path.isdir(pretrain):
        for name in sorted(os.listdir(pretrain)):
            if name in PROCESSOR_FILES or (name.startswith("processing_") and name.endswith(".py")):
                if not os.path.exists(os.path.join(output_dir, name)):
                    shutil.copy(os.path.join(pretrain, name), os.path.join(output_dir, name))
                    written.append(name)
        return written
    from transformers import AutoProcessor

    before = set(os.listdir(output_dir))
    AutoProcessor.from_pretrained(pretrain, trust_remote_code=True).save_pretrained(output_dir)
    return sorted(set(os.listdir(output_dir)) - before)
