"""The training backends (``--backend``) by name: what lpo-train's flags, plan, checks and the CPU mode need to
know of each, one table in place of tests of the backend's name (the dispatch-table pattern of
``torch.distributions.kl``).

Public names (stable):
    TrainingBackend                   one backend's entry (fields below)
    TRAINING_BACKENDS                 the table: name -> entry, filled by the backends' packages
    BUILTIN                           name -> the module that registers that built-in backend
    DEFAULT_BACKEND                   "deepspeed" (``--backend``'s default)
    register_training_backend(entry)  add an entry (a name is registered once)
    training_backend(name)            the entry; ValueError listing the valid names
    backend_of(args)                  the entry of the run's ``--backend``
    backend_names()                   every name ``--backend`` accepts

Each backend's package registers its entry when imported: ``openrlhf_lpo.openrlhf.training_backend`` (DeepSpeed,
through OpenRLHF) and ``openrlhf_lpo.megatron.training_backend``. A lookup imports the module :data:`BUILTIN` names
for a built-in backend first (as ``lpo-train`` imports its ``PLUGIN_MODULES``), so every process finds the entry:
the driver, and a Ray actor that only unpickled the run's namespace. A third backend is one more entry (and one
more line in :data:`BUILTIN`, or an import of its module before the lookup). The flag groups a backend owns are
bound to it with ``FlagGroup.backend`` (cli/flags.py): their validation, ``before_train`` and plan lines run only
with that ``--backend``. Standard library and the registry leaf only: every room may import this module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from openrlhf_lpo.registry import register_unique

__all__ = ["TrainingBackend", "TRAINING_BACKENDS", "BUILTIN", "DEFAULT_BACKEND", "register_training_backend",
           "training_backend", "backend_of", "backend_names"]

DEFAULT_BACKEND = "deepspeed"
BUILTIN = {"deepspeed": "openrlhf_lpo.openrlhf.training_backend", "megatron": "openrlhf_lpo.megatron.training_backend"}


@dataclass(frozen=True)
class TrainingBackend:
    """What differs between the training backends of the policy, as data and small functions of ``args`` (the
    hierarchised ``lpo-train`` namespace)."""

    name: str
    # (tp, pp): one model replica spans tp x pp actor GPUs (data-parallel size = actor GPUs / (tp x pp); the
    # placement plan's tensor-parallel blocks); DeepSpeed's is (ring-attention x tensor-parallel size, 1)
    model_parallel: Callable[[Any], Tuple[int, int]]
    # (args, dp) -> the actor's layout in the plan, e.g. "dp 8" or "TP 2 x PP 2 x DP 4"
    layout_note: Callable[[Any, int], str]
    # a training checkpoint also holds the module's weights in --ds.param_dtype (besides fp32 master + Adam moments)
    checkpoint_holds_weights: Callable[[Any], bool]
    # the newest checkpoint is written whole before the oldest is pruned: --ckpt.max_num + 1 exist at the peak
    # (False: the oldest is deleted first, so a kill during a save with --ckpt.max_num 1 leaves nothing to resume)
    saves_before_pruning: bool
    # the actor's optimizer is DeepSpeed's, whose C++/CUDA op every GPU node must load (cli/gpu_build.py)
    deepspeed_optimizer: bool
    # loads model.safetensors(.index.json) only (no .bin weights)
    safetensors_only: bool
    # its flag validation reads the model's config.json: a hub id is fetched even for --dry-run
    reads_model_config: bool
    # its --ds.enable_sleep / --vllm.enable_sleep offload is plain tensor copies, so it stays on in the CPU mode
    offload_on_cpu: bool


TRAINING_BACKENDS: Dict[str, TrainingBackend] = {}


def register_training_backend(entry: TrainingBackend) -> TrainingBackend:
    """Add ``entry`` under its name (ValueError if the name is taken); returns it, for module-level use."""
    return register_unique(TRAINING_BACKENDS, "training backend", entry.name, entry)


def training_backend(name: str) -> TrainingBackend:
    """The entry of backend ``name``; a built-in one is registered by importing its module first."""
    if name not in TRAINING_BACKENDS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in TRAINING_BACKENDS:  # (the message lists the built-in names too, registered or not yet)
        raise ValueError(f"unknown training backend {name!r}; valid: {', '.join(backend_names())}")
    return TRAINING_BACKENDS[name]


def backend_of(args) -> TrainingBackend:
    """The entry of the run's ``--backend`` (a namespace without the flag: the default)."""
    return training_backend(getattr(args, "backend", None) or DEFAULT_BACKEND)


def backend_names() -> List[str]:
    """Every backend name ``--backend`` accepts: the built-in ones and any registered since."""
    return sorted(set(BUILTIN) | set(TRAINING_BACKENDS))
