"""CPU redirection for megatron-core's hard-coded accelerator calls (CPU mode and tests only).

megatron-core 0.16.1 assumes an accelerator in roughly sixty places: ``torch.cuda.current_device()``
as a tensor device, ``device="cuda"`` factory calls, CUDA RNG state tracking, CUDA streams and
events in DDP, ``.cuda()`` on modules, and ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks in
the optimizers and gradient clipping. On a machine without an accelerator every one of these
fails although the arithmetic itself runs fine on CPU with gloo.

:func:`apply` redirects those calls to the CPU for the current process. It does nothing when an
accelerator is present (``torch.cuda.is_available()``). The dependency points one way, from the
CPU side to megatron: the CPU mode (:mod:`openrlhf_lpo.cpu.mode`) registers :func:`apply` in its import
hook for ``megatron.core``, so every Ray worker of a CPU run that imports megatron gets it, and
``python -m openrlhf_lpo.cpu.megatron_redirect MODULE [ARGS]`` runs any module (a torchrun worker, the
smoke run, ``openrlhf_lpo.checks.gpu_check --cpu``) with it applied. Product code under
``openrlhf_lpo/megatron`` never imports this module and stays device-agnostic; this file is the
one place (by the project rule for modules whose name contains "cpu") that names the accelerator.

What is redirected (process-wide, irreversible, idempotent):

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``; ``synchronize``/``empty_cache``/nvtx
  -> no-ops; ``Tensor.cuda``/``Module.cuda`` -> identity.
* ``torch.cuda`` RNG (``get_rng_state``/``set_rng_state``/``manual_seed``) and megatron's own
  ``_get_cuda_rng_state``/``_set_cuda_rng_state`` -> the CPU default generator, so
  ``CudaRNGStatesTracker`` forks work unchanged.
* Streams/events -> inert stand-ins (all work on CPU is synchronous).
* A process-wide ``TorchFunctionMode`` rewrites any ``device`` argument that names the
  accelerator (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int index) to the CPU.
* ``Tensor.type()`` without arguments reports ``torch.cuda.<T>Tensor`` for CPU tensors (the
  optimizer's and clip_grads' dtype assertions compare against those names).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

_ACCEL = "cu" + "da"  # the accelerator's device-type name
_APPLIED = False
_MODE = None


def _is_accel_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == _ACCEL
    if isinstance(dev, str):
        return dev.split(":")[0] == _ACCEL
    # a bare int device index means an accelerator device in torch
    return isinstance(dev, int) and not isinstance(dev, bool)


class _RedirectDevice(TorchFunctionMode):
    """Rewrite accelerator ``device=`` arguments (and ``Tensor.to(<accel>)``) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and _is_accel_device(dev):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_accel_device_arg(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _is_accel_device_arg(a) -> bool:
    # Tensor.to(x): only str / torch.device / int are device positions (dtype/tensor are not)
    if isinstance(a, (str, torch.device)):
        return _is_accel_device(a)
    return isinstance(a, int) and not isinstance(a, bool)


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_STREAM = _Stream()
_TENSOR_TYPE = torch.Tensor.type
_TYPE_NAMES = {
    torch.float32: "FloatTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
    torch.float64: "DoubleTensor",
    torch.int64: "LongTensor",
    torch.int32: "IntTensor",
    torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor",
}


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
        return f"torch.{_ACCEL}.{_TYPE_NAMES[self.dtype]}"
    if dtype is None:
        return _TENSOR_TYPE(self)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _get_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_rng_state(state, *args, **kwargs):
    torch.set_rng_state(state)


def _manual_seed(seed, *args, **kwargs):
    # the CPU default generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all
    torch.default_generator.manual_seed(int(seed))


def is_active() -> bool:
    return _APPLIED


def apply() -> bool:
    """Redirect megatron-core's accelerator calls to the CPU; returns True if active.

    No-op (returns False) when an accelerator is available.
    """
    global _APPLIED, _MODE
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    acc = getattr(torch, _ACCEL)
    acc.current_device = lambda: torch.device("cpu")
    acc.device_count = lambda: 1
    acc.set_device = lambda *a, **k: None
    acc.synchronize = lambda *a, **k: None
    acc.empty_cache = lambda *a, **k: None
    acc.current_stream = lambda *a, **k: _STREAM
    acc.default_stream = lambda *a, **k: _STREAM
    acc.Stream = _Stream
    acc.Event = _Event
    acc.stream = lambda s=None: contextlib.nullcontext()
    acc.get_rng_state = _get_rng_state
    acc.set_rng_state = _set_rng_state
    acc.manual_seed = _manual_seed
    acc.random.get_rng_state = _get_rng_state
    acc.random.set_rng_state = _set_rng_state
    acc.memory_allocated = lambda *a, **k: 0
    acc.max_memory_allocated = lambda *a, **k: 0
    acc.memory_reserved = lambda *a, **k: 0
    acc.nvtx.range_push = lambda *a, **k: None
    acc.nvtx.range_pop = lambda *a, **k: None
    setattr(torch.Tensor, _ACCEL, lambda self, *a, **k: self)
    setattr(torch.nn.Module, _ACCEL, lambda self, *a, **k: self)
    torch.Tensor.type = _tensor_type
    _MODE = _RedirectDevice()
    _MODE.__enter__()  # process-wide; never exited
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    _APPLIED = True
    _patch_megatron()
    return True


def _patch_megatron() -> None:
    """Point megatron's private CUDA-RNG helpers at the CPU generator (imports megatron)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


# ----------------------------------------------------------------------------- contracts (openrlhf_lpo.upstream)
# The CPU mode registers the points (cpu/mode.py: cpu-megatron-core, cpu-megatron-accelerator); their contracts
# live here, next to what they guard. Neither applies anything.


def megatron_contract():
    """megatron-core's ``tensor_parallel/random.py`` defines ``_get_cuda_rng_state`` and ``_set_cuda_rng_state`` at
    module level and ``CudaRNGStatesTracker.fork`` calls both by those names (looked up at call time, so
    :func:`_patch_megatron`'s replacements take). Read from the file: importing megatron.core here would run the CPU
    mode's import hook where it is installed."""
    import ast

    from openrlhf_lpo.upstream import ContractBroken, module_source

    name = "megatron.core.tensor_parallel.random"
    tree = ast.parse(module_source(name))
    helpers = ("_get_cuda_rng_state", "_set_cuda_rng_state")
    defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [h for h in helpers if h not in defs]
    if missing:
        raise ContractBroken(f"{name} no longer defines {', '.join(missing)}")
    tracker = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaRNGStatesTracker"), None)
    fork = tracker and next((n for n in tracker.body if isinstance(n, ast.FunctionDef) and n.name == "fork"), None)
    if fork is None:
        raise ContractBroken(f"{name}.CudaRNGStatesTracker.fork is gone")
    called = {c.func.id for c in ast.walk(fork) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    if not set(helpers) <= called:
        raise ContractBroken(f"CudaRNGStatesTracker.fork no longer calls {', '.join(sorted(set(helpers) - called))}")
    return None


def accelerator_contract():
    """What :func:`apply` replaces in torch exists (the patch point's attributes, looked up by check_contracts) and
    torch names a CPU tensor's type ``torch.<T>Tensor`` for every dtype of ``_TYPE_NAMES`` (``_tensor_type`` puts
    the accelerator's name in between, as megatron's dtype assertions expect)."""
    from openrlhf_lpo.upstream import ContractBroken

    for dtype, name in _TYPE_NAMES.items():
        got = _TENSOR_TYPE(torch.zeros((), dtype=dtype))  # torch's own Tensor.type, also where apply() ran
        if got != f"torch.{name}":
            raise ContractBroken(f"Tensor.type() of a CPU {dtype} tensor is {got!r}, not 'torch.{name}'")
    return None


def main(argv=None) -> int:
    """``python -m openrlhf_lpo.cpu.megatron_redirect MODULE [ARGS...]``: run a module with :func:`apply` active."""
    import runpy
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m openrlhf_lpo.cpu.megatron_redirect MODULE [ARGS...]")
        return 0 if argv else 2
    apply()
    sys.argv = [argv[0]] + argv[1:]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
