"""Per-request sampling seeds on every rollout path (vLLM on GPUs, the CPU engine), from the run seed
and the position of the prompt and the sample, never from which engine or batch serves them.

OpenRLHF 0.11.2 builds one ``SamplingParams`` without a seed per dispatch and sends a prompt's K samples
to one engine in one call; an engine seeded with ``--train.seed + i`` then samples from a random state
that depends on the engine the load balancer picked and on what else that engine was running.
Here each sample gets its own seed::

    prompt seed   = H(--train.seed, "train", p)     p = prompts dispatched before it in the run
                  = H(--train.seed, "eval", r, i)   the i-th prompt of this process's r-th eval round
    sample seed   = H(prompt seed, k)               k = 0..K-1

(H: blake2b, 63 bits; p is restored from the checkpoint's ``total_consumed_prompts`` on resume, so a
resumed run seeds its prompts as the uninterrupted one did). The prompt's K samples still go to the engine
the stock balancer chose, as K single-sample calls gathered back into one list in sample order.

What this does and does not make reproducible is stated in README ("Reproducibility"): on GPUs vLLM's
kernels give batch-composition-dependent logits, so the same seed can still sample another token.

Public names (stable):
    prompt_seed(run_seed, kind, *position) -> int, sample_seed(prompt_seed, k) -> int
    SeededSamplesGenerator     subclass of openrlhf's SamplesGenerator (0.11.2)
    seeded_samples_generator() context manager: the trainer modules build SeededSamplesGenerator
"""

from __future__ import annotations

import contextlib
import copy
import hashlib

import ray

from openrlhf.trainer import ppo_trainer as _ppo_trainer_mod
from openrlhf.trainer import ppo_trainer_async as _async_mod
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

__all__ = ["prompt_seed", "sample_seed", "SeededSamplesGenerator", "seeded_samples_generator"]

_MASK = (1 << 63) - 1


def _h(*key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") & _MASK


def prompt_seed(run_seed: int, kind: str, *position: int) -> int:
    return _h("prompt", int(run_seed), kind, *(int(p) for p in position))


def sample_seed(seed_of_prompt: int, k: int) -> int:
    return _h("sample", int(seed_of_prompt), int(k))


@ray.remote(num_cpus=0)
def _gather(*outputs):
    """The K single-sample results of one prompt, as the one list the stock caller expects."""
    return [o for out in outputs for o in out]


class _SeedingCall:
    def __init__(self, handle, seeds, shared):
        self.handle, self.seeds, self.shared = handle, seeds, shared

    def remote(self, *, sampling_params, num_samples=1, **kwargs):
        base = self.seeds()
        # the tokenizer goes to the object store once, not with each of the K calls (Ray resolves the ref)
        kwargs = {k: self.shared(v) for k, v in kwargs.items()}
        refs = []
        for k in range(int(num_samples)):
            params = copy.copy(sampling_params)
            params.seed = sample_seed(base, k)
            refs.append(self.handle.generate_responses.remote(sampling_params=params, num_samples=1, **kwargs))
        return _gather.remote(*refs)


class _SeedingEngine:
    """An engine handle whose ``generate_responses.remote`` seeds every sample (everything else passes through)."""

    def __init__(self, handle, seeds, shared):
        self._handle = handle
        self.generate_responses = _SeedingCall(handle, seeds, shared)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class SeededSamplesGenerator(SamplesGenerator):
    """The stock generator; each dispatch hands the stock loop engine handles that seed every sample."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_seed = int(self.args.train.seed)
        self.prompts_dispatched = 0  # training prompts so far (restored on resume: total_consumed_prompts)
        self.eval_rounds = 0
        self._eval = False
        self._tokenizer_ref = None

    def generate_eval_samples(self, **generate_kwargs):
        self._eval, self._eval_prompt = True, 0
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            self._eval = False
            self.eval_rounds += 1

    def _next_seed(self) -> int:
        if self._eval:
            seed = prompt_seed(self.run_seed, "eval", self.eval_rounds, self._eval_prompt)
            self._eval_prompt += 1
        else:
            seed = prompt_seed(self.run_seed, "train", self.prompts_dispatched)
            self.prompts_dispatched += 1
        return seed

    def _shared(self, value):
        if value is not self.tokenizer:
            return value
        if self._tokenizer_ref is None:
            self._tokenizer_ref = ray.put(self.tokenizer)
        return self._tokenizer_ref

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        engines = self.vllm_engines
        self.vllm_engines = [_SeedingEngine(e, self._next_seed, self._shared) for e in engines]
        try:  # the stock loop calls generate_responses once per prompt, in prompt order
            return super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)
        finally:
            self.vllm_engines = engines


@contextlib.contextmanager
def seeded_samples_generator():
    """While active, the sync trainer and the async generator build :class:`SeededSamplesGenerator`."""
    saved = (_ppo_trainer_mod.SamplesGenerator, _async_mod.SamplesGenerator)
    _ppo_trainer_mod.SamplesGenerator = _async_mod.SamplesGenerator = SeededSamplesGenerator
    try:
        yield
    finally:
        _ppo_trainer_mod.SamplesGenerator, _async_mod.SamplesGenerator = saved


class SeededRollouts:
    """Trainer mixin (sync ``PPOTrainer`` subclasses): seeded rollouts, the prompt position restored on resume."""

    def __init__(self, *args, **kwargs):
        with seeded_samples_generator():
            super().__init__(*args, **kwargs)

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        if not getattr(self, "_prompt_position_restored", False):
            # once, at the start of fit: a later reader of the states (the research extensions' restore,
            # after the first rollout) must not rewind the position to the checkpoint's
            self.samples_generator.prompts_dispatched = int(states.get("total_consumed_prompts", 0))
            self._prompt_position_restored = True
        return states


class SeededGenerateSamples:
    """Async generator-actor mixin: the same, the position handed over by ``fit``."""

    def __init__(self, *args, **kwargs):
        with seeded_samples_generator():
            super().__init__(*args, **kwargs)

    def fit(self, episode: int, total_consumed_prompts: int):
        self.samples_generator.prompts_dispatched = int(total_consumed_prompts)
        return super().fit(episode, total_consumed_prompts)
