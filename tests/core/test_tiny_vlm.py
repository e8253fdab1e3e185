"""The offline tiny Qwen2.5-VL: transformers and OpenRLHF load it as a VLM with a processor that
expands images to the pinned number of tokens, pickles by module path (Ray), and trains end to end."""

import json
import os
import pickle
import sys

import pytest
import torch

from openrlhf_lpo.data.geometry import draw_problem
from openrlhf_lpo.testing.tiny_vlm import IMAGE_PAD, VISION_TOKENS, build_tiny_vlm

KW = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vision_hidden_size=32,
          vision_intermediate_size=64)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2.5-vl", **KW)


@pytest.fixture(scope="module")
def processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir, trust_remote_code=True)


def image_chat(proc, text="Find x."):
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_processor_template_and_token_budget(processor):
    assert type(processor).__module__ == "openrlhf_lpo.testing.tiny_vlm"
    prompt = image_chat(processor)
    assert prompt == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n<|im_start|>assistant\n"
    for size, tokens in ((56, 4), (84, 9), (112, 16), (400, 64)):  # one token per 28x28, capped at MAX_PIXELS
        out = processor(text=[prompt], images=[draw_problem("read_number", 0, size)[0]], add_special_tokens=False)
        assert out["input_ids"][0].count(processor.image_token_id) == tokens
        assert int(torch.as_tensor(out["image_grid_thw"]).prod()) == 4 * tokens
    ids = {processor.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    assert len(ids) == 5 and processor.image_token_id == processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)


def test_files_for_vllm_and_remote_code(vlm_dir):
    cfg = json.load(open(os.path.join(vlm_dir, "processor_config.json")))
    assert cfg["auto_map"]["AutoProcessor"].endswith("TinyQwen2_5_VLProcessor")
    for key in ("image_mean", "image_std", "rescale_factor", "do_normalize", "do_rescale"):  # vLLM reads the top level
        assert key in cfg
    config = json.load(open(os.path.join(vlm_dir, "config.json")))
    assert config["model_type"] == "qwen2_5_vl" and "vision_config" in config


def test_processor_pickles_by_module_path(processor):
    """OpenRLHF ships the processor to the rollout engines through Ray (pickle): the class must be
    found by an importable module path in a fresh process, not transformers' remote-code cache."""
    import pickletools

    data = pickle.dumps(processor)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE",
                                                                             "BINUNICODE", "UNICODE")]
    assert "openrlhf_lpo.testing.tiny_vlm" in names and "TinyQwen2_5_VLProcessor" in names
    assert not any(isinstance(n, str) and n.startswith("transformers_modules") for n in names)
    again = pickle.loads(data)
    assert again(text=["<|image_pad|>x"], add_special_tokens=False)["input_ids"][0] == \
        processor(text=["<|image_pad|>x"], add_special_tokens=False)["input_ids"][0]


def test_openrlhf_sees_a_vlm_and_gradients_reach_the_vision_tower(vlm_dir, processor, tmp_path):
    sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)
    from openrlhf.models import Actor
    from openrlhf.utils.utils import get_tokenizer, is_vlm_model
    from transformers import AutoModelForImageTextToText

    assert is_vlm_model(vlm_dir)
    assert hasattr(get_tokenizer(vlm_dir, None), "image_processor")
    actor = Actor(vlm_dir, attn_implementation="sdpa", param_dtype="bf16")
    assert actor.is_vlm
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).train()
    image = draw_problem("triangle_angle", 1, 112)[0]
    enc = processor(text=[image_chat(processor)], images=[image], add_special_tokens=False, return_tensors="pt")
    seq = enc["input_ids"]
    logits = model(seq, attention_mask=torch.ones_like(seq), pixel_values=enc["pixel_values"],
                   image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=(seq == processor.image_token_id).int()).logits
    logits.logsumexp(-1).sum().backward()
    visual = [(n, p) for n, p in model.named_parameters() if "visual" in n]
    assert visual and all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in visual if "bias" not in n)
    again = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(tmp_path / "again", **KW))
    x = torch.tensor([[20, 21, 22]])
    torch.testing.assert_close(model.eval()(x).logits, again(x).logits, rtol=0, atol=0)  # seeded build
