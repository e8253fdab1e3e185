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
the stock balancer chose, in one call carrying K settings (``PerSampleResponses``: the CPU engine, and
vLLM's ``RolloutRayActor`` through :func:`seeded_rollout_actor`, which ``lpo-train`` swaps in).

What this does and does not make reproducible is stated in README ("Reproducibility"): on GPUs vLLM's
kernels give batch-composition-dependent logits, so the same seed can still sample another token.

Public names (stable):
    prompt_seed(run_seed, kind, *position) -> int, sample_seed(prompt_seed, k) -> int
    SeededSamplesGenerator     subclass of openrlhf's SamplesGenerator (0.11.2)
    seeded_rollout_actor(current) the Ray class to create vLLM engines from: vLLM's RolloutRayActor with
                               per-sample settings (``current`` itself when it is not the stock class)
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

from openrlhf_lpo.openrlhf.dynamic_filter import InformativeGroups

from openrlhf_lpo.engines.responses import PerSampleResponses, PlainSamplingParams, TokenizerHandle

__all__ = ["prompt_seed", "sample_seed", "SeededSamplesGenerator", "seeded_samples_generator", "seeded_rollout_actor"]

_MASK = (1 << 63) - 1


def _h(*key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") & _MASK


def prompt_seed(run_seed: int, kind: str, *position: int) -> int:
    return _h("prompt", int(run_seed), kind, *(int(p) for p in position))


def sample_seed(seed_of_prompt: int, k: int) -> int:
    return _h("sample", int(seed_of_prompt), int(k))


class _SeedingCall:
    """``generate_responses.remote`` of one engine: the prompt's K seeded settings in one call (the engine's
    :class:`~openrlhf_lpo.engines.responses.PerSampleResponses`), the tokenizer as a handle it resolves once."""

    def __init__(self, handle, seeds, shared, plain: bool):
        self.handle, self.seeds, self.shared, self.plain = handle, seeds, shared, plain

    def remote(self, *, sampling_params, num_samples=1, **kwargs):
        base = self.seeds()
        kwargs = {k: self.shared(v) for k, v in kwargs.items()}
        params = []
        for k in range(int(num_samples)):
            p = copy.copy(sampling_params)
            p.seed = sample_seed(base, k)
            params.append(PlainSamplingParams.from_vllm(p) if self.plain else p)
        return self.handle.generate_responses.remote(sampling_params=params, num_samples=int(num_samples), **kwargs)


class _SeedingEngine:
    """An engine handle whose ``generate_responses.remote`` seeds every sample (everything else passes through)."""

    def __init__(self, handle, seeds, shared, plain: bool):
        self._handle = handle
        self.generate_responses = _SeedingCall(handle, seeds, shared, plain)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def engine_settings(handle) -> dict:
    """What a rollout engine takes (``PerSampleResponses.per_sample_settings``); an engine class without it
    (vLLM's stock ``RolloutRayActor``) cannot seed its samples one by one: a clear error, not K copies of one
    sample."""
    try:
        method = handle.per_sample_settings
    except AttributeError:
        raise RuntimeError(
            f"rollout engine {handle!r} takes one sampling setting per prompt: lpo-train gives vLLM's RolloutRayActor "
            "per-sample settings (openrlhf_lpo.openrlhf.request_seeds.SeededRolloutRayActor); an engine class of your "
            "own must subclass openrlhf_lpo.engines.responses.PerSampleResponses") from None
    return ray.get(method.remote())


class SeededSamplesGenerator(InformativeGroups, SamplesGenerator):
    """The stock generator; each dispatch hands the stock loop engine handles that seed every sample. Its dynamic
    filtering keeps the groups whose scores are not all equal (DAPO's criterion, openrlhf/dynamic_filter.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_seed = int(self.args.train.seed)
        self.prompts_dispatched = 0  # training prompts so far (restored on resume: total_consumed_prompts)
        self.eval_rounds = 0
        self._eval = False
        self._tokenizer = None
        self._engine_settings = {}

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
        """The tokenizer goes to the object store once and to each engine once (a handle it keeps)."""
        if value is not self.tokenizer:
            return value
        if self._tokenizer is None:
            self._tokenizer = TokenizerHandle(ray.put(self.tokenizer))
        return self._tokenizer

    def _seeding(self, engine):
        key = engine._actor_id.hex() if hasattr(engine, "_actor_id") else id(engine)
        if key not in self._engine_settings:
            self._engine_settings[key] = engine_settings(engine)
        return _SeedingEngine(engine, self._next_seed, self._shared, self._engine_settings[key]["plain_params"])

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        engines = self.vllm_engines
        self.vllm_engines = [self._seeding(e) for e in engines]
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



def seeded_rollout_actor(current):
    """The class ``create_vllm_engines`` should start: ``@ray.remote`` vLLM ``RolloutRayActor`` plus
    :class:`~openrlhf_lpo.engines.responses.PerSampleResponses` (openrlhf/seeded_vllm.py); ``current``
    unchanged when it is not the stock class (the CPU mode's engine class)."""
    plain = getattr(current, "__ray_actor_class__", None)
    if (getattr(plain, "__module__", None), getattr(plain, "__qualname__", None)) != \
            ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor"):
        return current
    from openrlhf_lpo.openrlhf.seeded_vllm import RemoteSeededRolloutRayActor

    return RemoteSeededRolloutRayActor
