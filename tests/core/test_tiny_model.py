"""The offline tiny model builder: HF loads it, the tokenizer round-trips, the template is Qwen's."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from openrlhf_lpo.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "qwen3", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128)


def test_tokenizer_round_trip_and_chat_template(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "Using [3, 5, 7], make 22: <answer>(3*5)+7</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_model_loads_and_is_deterministic(tiny_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", num_layers=2, hidden_size=64, head_dim=16, intermediate_size=128))
    x = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(x).logits, again(x).logits, rtol=0, atol=0)
    meta = json.load(open(f"{tiny_dir}/tiny_build.json"))
    assert meta["arch"] == "qwen3" and meta["seed"] == 0


def test_qwen2_untied_and_bad_arch(tmp_path):
    d = build_tiny_model(tmp_path / "q2", arch="qwen2", num_layers=1, hidden_size=64, num_heads=4, head_dim=16, intermediate_size=96, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")
