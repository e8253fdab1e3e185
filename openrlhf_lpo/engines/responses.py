"""One engine call per prompt with one sampling setting per sample: the rollout side of per-request seeds.

OpenRLHF 0.11.2's engines take ``generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer,
num_samples, images)`` and run its K samples with one ``SamplingParams``. ``lpo-train`` seeds every sample
(openrlhf/request_seeds.py), so it sends a list of K settings in that one call; :class:`PerSampleResponses`
is the engine method that takes it (the CPU engine has it, and ``lpo-train`` gives vLLM's ``RolloutRayActor``
it through a subclass). One call per prompt, as upstream: no per-sample Ray call, no gathering task.

Two costs the engine pays per call are made once per engine:

* the tokenizer travels as a :class:`TokenizerHandle` (an object-store reference the engine resolves once
  and keeps), not as a fresh copy to unpickle with every prompt;
* on the CPU engine the settings travel as :class:`PlainSamplingParams` (builtins only), so an engine that
  samples with HF transformers never imports vLLM to unpickle them.

Public names (stable): PerSampleResponses, TokenizerHandle, PlainSamplingParams, per_sample_params, vllm_params
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _is_plain(v) for k, v in value.items())
    return False


class PlainSamplingParams:
    """A vLLM ``SamplingParams`` in builtins only: the settings that differ from vLLM's defaults, and those
    defaults for reading (``.temperature``, ``.max_tokens``, ``.seed``, ...; an assignment changes a setting).
    :meth:`to_vllm` rebuilds the vLLM object from the settings (an engine that needs one builds it there)."""

    def __init__(self, settings: Dict[str, Any], defaults: Dict[str, Any]):
        object.__setattr__(self, "_settings", dict(settings))
        object.__setattr__(self, "_defaults", dict(defaults))

    @classmethod
    def from_vllm(cls, params) -> "PlainSamplingParams":
        defaults = type(params)()
        settings, plain_defaults = {}, {}
        for name in type(params).__struct_fields__:
            if name.startswith("_"):
                continue  # derived in __post_init__
            value, default = getattr(params, name), getattr(defaults, name)
            if _is_plain(default):
                plain_defaults[name] = default
            if value == default:
                continue
            if not _is_plain(value):
                raise ValueError(f"SamplingParams.{name}={value!r} cannot travel as plain settings")
            settings[name] = value
        return cls(settings, plain_defaults)

    def __getattr__(self, name):
        if name.startswith("_"):  # pickling and copying look up dunders before the tables exist
            raise AttributeError(name)
        for table in (self._settings, self._defaults):
            if name in table:
                return table[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        self._settings[name] = value

    def settings(self) -> Dict[str, Any]:
        return dict(self._settings)

    def to_vllm(self):
        from vllm import SamplingParams

        return SamplingParams(**self._settings)

    def __eq__(self, other):
        return isinstance(other, PlainSamplingParams) and self._settings == other._settings

    def __repr__(self):
        return f"PlainSamplingParams({self._settings})"


def vllm_params(params):
    """A private vLLM ``SamplingParams`` of ``params`` (plain settings or a vLLM object) to set fields on."""
    import copy

    return params.to_vllm() if isinstance(params, PlainSamplingParams) else copy.deepcopy(params)


class TokenizerHandle:
    """An object-store reference to the trainer's tokenizer; :class:`PerSampleResponses` resolves it once per
    engine (Ray resolves references nested in an argument only when asked)."""

    def __init__(self, ref):
        self.ref = ref

    @property
    def key(self) -> str:
        return self.ref.hex()


def per_sample_params(sampling_params, num_samples: int) -> List:
    """The K settings of one call: a list as sent by the seeded dispatch, or the stock single setting K times."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != int(num_samples):
            raise ValueError(f"generate_responses: {len(sampling_params)} sampling settings for num_samples={num_samples}")
        return list(sampling_params)
    return [sampling_params] * int(num_samples)


async def _resolve(ref):
    return await ref


class PerSampleResponses:
    """``generate_responses`` for an engine class with ``self.executor`` (an OpenRLHF agent executor) and an
    async ``generate`` (the executor calls ``llm_engine.generate``); it takes a setting per sample.
    ``PLAIN_PARAMS``: whether the engine reads :class:`PlainSamplingParams` (every engine of ours does; vLLM's
    actor needs its own objects)."""

    PLAIN_PARAMS = True
    num_calls = 0  # generate_responses calls so far (per instance once counted)
    num_tokenizers = 0  # tokenizers resolved from a handle

    def per_sample_settings(self) -> dict:
        """What a caller may send (asked once per engine: an engine without this method takes one setting)."""
        return {"plain_params": bool(self.PLAIN_PARAMS)}

    async def _tokenizer(self, hf_tokenizer):
        if not isinstance(hf_tokenizer, TokenizerHandle):
            return hf_tokenizer
        cache = self.__dict__.setdefault("_tokenizers", {})
        if hf_tokenizer.key not in cache:  # one resolution, awaited by every call that arrives meanwhile
            cache.clear()  # one trainer tokenizer at a time
            cache[hf_tokenizer.key] = asyncio.ensure_future(_resolve(hf_tokenizer.ref))
            self.num_tokenizers += 1
        return await cache[hf_tokenizer.key]

    async def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples=1,
                                 images=None):
        self.num_calls += 1
        tokenizer = await self._tokenizer(hf_tokenizer)
        tasks = [
            self.executor.execute(prompt=prompt, label=label, sampling_params=params, max_length=max_length,
                                  hf_tokenizer=tokenizer, llm_engine=self, images=images)
            for params in per_sample_params(sampling_params, num_samples)
        ]
        return await asyncio.gather(*tasks)
