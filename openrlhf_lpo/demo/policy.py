"""Small plain-torch helpers around a HF causal LM, shared by the warm-up and the in-process loop.

Prompts are chat-templated user messages; responses are sampled with the model's own ``generate``
(pure sampling: temperature only, no top-k/top-p), so the sampling policy is exactly
``softmax(logits / temperature)`` and the log-probs recomputed here are the behaviour log-probs.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def chat_prompt(tokenizer, question: str) -> str:
    """The chat-templated prompt text for one user question (generation prompt appended)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def encode_prompts(tokenizer, questions: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, ``[N, L]`` each."""
    ids = [tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in questions]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    out = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return out, mask


def encode_sft_batch(tokenizer, pairs: Sequence[Tuple[str, str]]):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the answer).

    The target is the answer followed by the end-of-turn token, as the reward expects.
    """
    rows: List[Tuple[List[int], int]] = []
    for question, answer in pairs:
        p = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + a, len(p)))
    width = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (r, n_prompt) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        labels[i, n_prompt: len(r)] = ids[i, n_prompt: len(r)]
    return ids, att, labels


def response_mask(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for response tokens up to and including the first end-of-turn token, else 0."""
    is_eos = responses.eq(eos_id).long()
    after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    return (~after_eos).long()


@torch.no_grad()
def sample_responses(model, tokenizer, prompt_ids, prompt_mask, k: int, max_new_tokens: int,
                     temperature: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``k`` sampled responses per prompt (rows grouped prompt-major: prompt i -> rows i*k..i*k+k-1).

    Returns ``(responses [N*k, T], mask [N*k, T])``; randomness comes from torch's global RNG.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use greedy_answers for greedy decoding)")
    ids = prompt_ids.repeat_interleave(k, dim=0)
    att = prompt_mask.repeat_interleave(k, dim=0)
    out = model.generate(
        input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    resp = out[:, ids.shape[1]:]
    if resp.shape[1] < max_new_tokens:  # every row stopped early: pad to a fixed width
        fill = torch.full((resp.shape[0], max_new_tokens - resp.shape[1]), tokenizer.pad_token_id,
                          dtype=resp.dtype)
        resp = torch.cat([resp, fill], dim=1)
    return resp, response_mask(resp, tokenizer.eos_token_id)


@torch.no_grad()
def greedy_responses(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens: int) -> torch.Tensor:
    out = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=False, max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return out[:, prompt_ids.shape[1]:]


def token_logprobs(model, prompt_ids, prompt_mask, responses, temperature: float = 1.0,
                   with_entropy: bool = False):
    """Per-token log-probs of ``responses`` under ``softmax(logits/temperature)`` (and entropies).

    ``prompt_ids`` must already be repeated to one row per response.
    """
    ids = torch.cat([prompt_ids, responses], dim=1)
    att = torch.cat([prompt_mask, torch.ones_like(responses)], dim=1)
    logits = model(input_ids=ids, attention_mask=att).logits
    t = responses.shape[1]
    logits = logits[:, -t - 1:-1, :].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def decode(tokenizer, responses: torch.Tensor) -> List[str]:
    """Response texts with special tokens kept (the reward looks for the end-of-turn token)."""
    return tokenizer.batch_decode(responses, skip_special_tokens=False)
