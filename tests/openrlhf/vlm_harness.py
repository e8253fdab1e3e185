"""Image batches for the LPO tests on OpenRLHF 0.11.2's vision-language path (see lpo_fixtures.py).

A tiny random Qwen2.5-VL built offline (:mod:`openrlhf_lpo.testing.tiny_vlm`) and rollout samples made
the way OpenRLHF's engines make them: the chat template renders ``<image>`` as the vision tokens,
``openrlhf.utils.vlm_utils.process_prompt_with_images`` expands them and returns the
``mm_train_inputs`` (``pixel_values``, ``image_grid_thw``) that ride along with each sample.
Every group asks the same text ("Find x.") about a different synthetic diagram, with diagram
sizes that give 4, 9 and 16 image tokens; the last group is text only (a mixed batch).
"""

from __future__ import annotations

import os

import torch

from openrlhf_lpo.data.geometry import KINDS, draw_problem, image_to_data_uri
from openrlhf_lpo.testing.tiny_vlm import VISION_TOKENS, build_tiny_vlm

VLM_KW = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
              vision_depth=2, vision_hidden_size=32, vision_heads=2, vision_intermediate_size=64)
SIZES = (56, 84, 112)  # 4, 9, 16 image tokens


def tiny_vlm(root: str) -> str:
    return build_tiny_vlm(os.path.join(root, "tiny-qwen2.5-vl-h32"), seed=0, **VLM_KW)


_PROCESSORS = {}


def processor_of(model_dir: str):
    if model_dir not in _PROCESSORS:
        from transformers import AutoProcessor

        _PROCESSORS[model_dir] = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    return _PROCESSORS[model_dir]


def group_prompt(model_dir: str, g: int, seed: int = 0, text_only: bool = False):
    """(prompt text, image refs, prompt ids, mm_train_inputs) of group ``g`` via OpenRLHF's processing."""
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    proc = processor_of(model_dir)
    kinds = list(KINDS)
    if text_only:
        chat = [{"role": "user", "content": "Find x."}]
        images = None
    else:
        image, question, _ = draw_problem(kinds[g % len(kinds)], seed * 101 + g, SIZES[g % len(SIZES)])
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
        images = [image_to_data_uri(image)]
    prompt = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids, mm, _ = process_prompt_with_images(proc, prompt, images)
    return prompt, images, ids, mm


def response_vocab(model_dir: str):
    """Token ids a response may hold: characters only (no specials, no vision tokens)."""
    tok = processor_of(model_dir).tokenizer
    banned = {tok.convert_tokens_to_ids(t) for t in VISION_TOKENS} | set(tok.all_special_ids) | {0, 1, 2, 3}
    return [i for i in range(len(tok)) if i not in banned]


def make_vlm_rollout_samples_for(model_dir: str):
    """``samples_fn(G, K, seed)`` for ``lpo_matrix.gradient_matrix`` on image batches."""

    def samples_fn(G, K, seed=0):
        from lpo_fixtures import group_rewards, rollout_sample

        vocab = torch.tensor(response_vocab(model_dir))
        gen = torch.Generator().manual_seed(seed)
        samples = []
        for gi in range(G):
            _, images, ids, mm = group_prompt(model_dir, gi, seed, text_only=(gi == G - 1 and G > 2))
            prompt = torch.tensor(ids)
            rewards = group_rewards(gi, K, gen)
            for k in range(K):
                rlen = int(torch.randint(1, 10, (1,), generator=gen))
                resp = vocab[torch.randint(0, len(vocab), (rlen,), generator=gen)]
                samples.append(rollout_sample(prompt, resp, rewards[k], "Find x.", images=images, mm=mm))
        return samples

    return samples_fn


def vlm_matrix_cases(K: int, dp: int):
    """(name, kwargs) cases of ``lpo_matrix.gradient_matrix`` on image batches: no packing (OpenRLHF
    0.11.2 packs no VLM batch, and dynamic batching forces packing); dp 1: micro-batches 1, K/2, K, 2K
    x fwd/rev/js, off-policy data with the token clip and mask corrections, and the stock KL loss + entropy
    bonus composed with the listwise loss (groups split: the pre-pass path); dp 2: 1, K/2, K x fwd."""
    micros = (1, K // 2, K, 2 * K) if dp == 1 else (1, K // 2, K)
    divs = ("fwd", "rev", "js") if dp == 1 else ("fwd",)
    cases = [(f"packing=0,micro={m},div={d}", dict(packing=False, micro=m, div=d)) for m in micros for d in divs]
    if dp == 1:
        cases += [(f"offpolicy={mode},micro={K // 2},div=fwd",
                   dict(packing=False, micro=K // 2, div="fwd", behaviour_noise=0.3, correction=(mode, 0.5, 1.5)))
                  for mode in ("clip", "mask")]
        cases += [(f"composed=kl+entropy,micro={K // 2}", dict(packing=False, micro=K // 2, div="fwd", composed=True))]
    return cases


def vlm_matrix_kwargs(model_dir: str, dp: int, K: int = 4) -> dict:
    """``gradient_matrix(model_dir, dp=dp, K=K, **vlm_matrix_kwargs(...))``: image samples, VLM cases."""
    return dict(samples_fn=make_vlm_rollout_samples_for(model_dir), cases=vlm_matrix_cases(K, dp), K=K)
