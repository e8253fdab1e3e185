"""Generation: stop strings (the template's end-of-turn tokens by default, --stop), truncation, and no
remote code unless asked. Real transformers engine on a tiny random model, seeded sampling."""

import json
import shutil
from pathlib import Path

import pytest

from evaluation.engines import HFEngine, Sampling, stop_token_ids
from evaluation.templates import default_stop, render_prompt

IM_END, ENDOFTEXT = "<|im_end|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def base_ckpt(tiny_ckpt, tmp_path_factory) -> str:
    """The tiny model as a 'base checkpoint' whose config lists only <|endoftext|> as eos."""
    d = tmp_path_factory.mktemp("base") / "base_model"
    shutil.copytree(tiny_ckpt, d)
    for name in ("config.json", "generation_config.json"):
        f = d / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = 0  # <|endoftext|>
            f.write_text(json.dumps(cfg))
    return str(d)


def test_default_stop_ends_the_turn_when_eos_is_only_endoftext(base_ckpt):
    eng = HFEngine(base_ckpt)
    assert eng.eos_ids == {0}
    tok = eng.tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    stops = default_stop("qwen-boxed", tok)
    assert stops == [IM_END, ENDOFTEXT] and stop_token_ids(tok, stops) == [im_end, 0]
    # Sampled (seeded) continuations of the random model: find one that writes <|im_end|> mid-answer and
    # then goes on, as base models invent new turns when nothing stops them at the end of theirs.
    import torch

    prompt = render_prompt("qwen-boxed", "What is 2+3?", "math")
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16, pad_token_id=0, eos_token_id=[0])
    found = None
    for seed in range(200):
        torch.manual_seed(seed)  # as the engine seeds each prompt
        with torch.no_grad():
            toks = eng.model.generate(**enc, **sampling)[0, enc["input_ids"].shape[1]:].tolist()
        if im_end in toks and 1 <= toks.index(im_end) < len(toks) - 1 and 0 not in toks[: toks.index(im_end)]:
            found = (seed, toks)
            break
    assert found, "no seed made the random model write <|im_end|> mid-answer"
    seed, toks = found
    j = toks.index(im_end)
    s = Sampling(temperature=1.0, top_p=1.0, max_tokens=16, stop=())
    (before,) = eng.generate([prompt], 1, s, [seed])[0]
    assert before.n_tokens > j + 1  # without the default stop it ran on past the end of its turn
    s = Sampling(temperature=1.0, top_p=1.0, max_tokens=16, stop=tuple(stops))
    (stopped,) = eng.generate([prompt], 1, s, [seed])[0]
    assert stopped.finish_reason == "stop" and stopped.n_tokens == j + 1
    assert stopped.text == tok.decode(toks[:j], skip_special_tokens=True)


def test_text_stop_strings_and_truncation(tiny_ckpt):
    eng = HFEngine(tiny_ckpt)
    tok = eng.tokenizer
    prompt = render_prompt("none", "Say something", "math")
    s = dict(temperature=1.0, top_p=1.0, max_tokens=12)
    full = next(c for seed in range(50) for c in eng.generate([prompt], 1, Sampling(**s), [seed])[0]
                if len(c.text) >= 8 and c.finish_reason == "length")
    seed = next(seed for seed in range(50) if eng.generate([prompt], 1, Sampling(**s), [seed])[0][0] == full)
    text = full.text
    stop = text[3:5]  # a two-character stop string taken from the sampled output itself
    first = text.find(stop)
    (cut,) = eng.generate([prompt], 1, Sampling(**s, stop=(stop,)), [seed])[0]
    assert cut.text == text[:first] and cut.finish_reason == "stop"
    import torch

    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        toks = eng.model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12,
                                  pad_token_id=0, eos_token_id=sorted(eng.eos_ids))[0, enc["input_ids"].shape[1]:].tolist()
    # tokens up to and including the one that completes the stop string (linear scan; specials are invisible)
    assert cut.n_tokens == next(i for i in range(1, len(toks) + 1) if stop in tok.decode(toks[:i], skip_special_tokens=True))
    assert full.n_tokens == 12  # truncated: it hit max_tokens


def test_stop_string_never_matches_into_the_prompt(tiny_ckpt):
    """A stop string is searched in the completion only (as vLLM does): "\\n" + the first character, after a
    prompt that ends in "\\n", does not stop the completion at its first token."""
    eng = HFEngine(tiny_ckpt)
    prompt = render_prompt("qwen-boxed", "Say something", "math")
    assert prompt.endswith("\n")
    s = dict(temperature=1.0, top_p=1.0, max_tokens=12)
    seed, full = next((seed, c) for seed in range(50) for c in eng.generate([prompt], 1, Sampling(**s), [seed])[0]
                      if len(c.text) >= 8 and c.finish_reason == "length" and "\n" not in c.text)
    stop = "\n" + full.text[0]  # spans the prompt's last character and the completion's first
    (kept,) = eng.generate([prompt], 1, Sampling(**s, stop=(stop,)), [seed])[0]
    assert kept == full


def _remote_code_model(src: str, dst: Path, marker: Path) -> str:
    shutil.copytree(src, dst)
    code = (
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3Config\n"
        "class EvilConfig(Qwen3Config):\n    model_type = 'qwen3'\n"
    )
    (dst / "configuration_evil.py").write_text(code)
    (dst / "modeling_evil.py").write_text(
        "from transformers import Qwen3ForCausalLM\nfrom .configuration_evil import EvilConfig\n"
        "class EvilModel(Qwen3ForCausalLM):\n    config_class = EvilConfig\n")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_no_remote_code_unless_asked(tiny_ckpt, tmp_path):
    marker = tmp_path / "remote_code_ran"
    model = _remote_code_model(tiny_ckpt, tmp_path / "m", marker)
    try:  # transformers either refuses or falls back to its own Qwen3 class; it never runs the folder's code
        HFEngine(model)
    except ValueError as e:
        assert "trust_remote_code" in str(e)
    assert not marker.exists()
    HFEngine(model, trust_remote_code=True)
    assert marker.read_text() == "ran"
