"""Can every GPU node load the C++/CUDA op DeepSpeed's optimizer needs? Checked at the start of a run.

Public names (stable):
    OPS, SKIP_ENV
    needed_op(backend, adam_offload, critic) -> op name or None
    op_for_args(args) -> op name or None                  the same, read from lpo-train's namespace
    NodeFacts                                             what one node has (plain data, picklable)
    build_problems(op, facts) -> list of str              the check: pure, one message per problem
    is_prebuilt(op, facts), toolkit_home(env, which_nvcc, usr_local_cuda), nvcc_release(text),
    compiler_name(env)                                    its pure helpers
    gather_facts() -> NodeFacts                           this process's node (no torch/deepspeed import)
    gather_cluster(timeout_s) -> (facts by node, unanswered nodes)   gather_facts on every GPU node (Ray)
    cluster_problems(op, facts_by_node) -> list of str    build_problems per node, identical ones merged
    check_run_or_exit(args, prog, gather)                 the run-start check: exits 3 naming the fix

Why: OpenRLHF hands DeepSpeed an AdamW config and DeepSpeed picks the implementation: ``FusedAdam``
(op ``fused_adam``) or, with ``--ds.adam_offload``, ``DeepSpeedCPUAdam`` (op ``cpu_adam``). deepspeed
0.19.6 installed from its sdist has no compiled op, so each actor compiles it at its first
``deepspeed.initialize`` (torch's JIT ``load``). On a node with a GPU both ops go through DeepSpeed's
CUDA builder, which needs, in the worker's environment:

* ``ninja`` on PATH (torch runs ``ninja --version``) and a C++ compiler (``$CXX``, else ``c++``);
* a CUDA toolkit found the way torch finds it (``CUDA_HOME``, else ``CUDA_PATH``, else the folder
  above the ``bin/`` of ``nvcc`` on PATH, else ``/usr/local/cuda``) whose ``bin/nvcc`` runs;
* ``fused_adam``: nvcc of torch's CUDA major (torch refuses another major when it builds extensions
  ahead of time; a JIT build with a 12.x nvcc would link CUDA 12's runtime into a CUDA 13 process);
* ``cpu_adam``: nvcc of torch's exact CUDA major.minor: DeepSpeed reads nvcc's version for this op too
  and refuses a different minor for CUDA 13 (``CUDAMismatchException``) unless
  ``DS_SKIP_CUDA_CHECK=1``; CUDA 11/12 minors are accepted.

An op compiled into deepspeed at install time (``DS_BUILD_FUSED_ADAM=1`` / ``DS_BUILD_CPU_ADAM=1``,
docs/install.md) needs none of this: deepspeed records it in ``deepspeed/git_version_info_installed.py``
(``installed_ops``, ``accelerator_name``, ``torch_info``) and loads the compiled module when the
accelerator is DeepSpeed's GPU one and torch's version and CUDA version equal the recorded ones (else
it raises). The Megatron backend trains with megatron-core's optimizer (torch AdamW, or Transformer
Engine's / apex's, which ship compiled): no DeepSpeed op, unless a critic trains on DeepSpeed. ROCm
builds of torch are not checked. CPU mode (``openrlhf_lpo.cpu.mode``) runs torch's AdamW: nothing to check.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from openrlhf_lpo.core.training_backends import backend_of, training_backend

__all__ = ["OPS", "SKIP_ENV", "needed_op", "op_for_args", "NodeFacts", "build_problems", "is_prebuilt",
           "toolkit_home", "nvcc_release", "compiler_name", "gather_facts", "gather_cluster", "cluster_problems",
           "check_run_or_exit"]

# op name -> the optimizer that loads it
OPS = {
    "fused_adam": "DeepSpeed's FusedAdam, the Adam of runs without --ds.adam_offload",
    "cpu_adam": "DeepSpeedCPUAdam, the Adam of --ds.adam_offload",
}
SKIP_ENV = "LPO_SKIP_BUILD_CHECK"
DEFAULT_CUDA_HOME = "/usr/local/cuda"  # torch's last guess
ENV_KEYS = ("CUDA_HOME", "CUDA_PATH", "CXX", "DS_SKIP_CUDA_CHECK")
# names as data (no device is chosen from them): DeepSpeed's accelerator name for NVIDIA GPUs, the key its
# recorded build info gives the toolkit version under, and the fields of torch/version.py read here
BUILD_NAMES = {"accelerator": "cuda", "ds_toolkit_key": "cuda_version", "torch_fields": ("__version__", "cuda", "hip")}
DS_GPU_ACCELERATOR = BUILD_NAMES["accelerator"]
PREBUILD_HINT = ("or pre-build the ops into deepspeed once (docs/install.md, \"DeepSpeed's optimizer ops\": "
                 "DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 TORCH_CUDA_ARCH_LIST=9.0 pip install "
                 "deepspeed==0.19.6 --no-build-isolation --no-cache-dir --force-reinstall --no-deps, on a GPU node, "
                 "9.0 being H100/H200's capability)")


def needed_op(backend: str, adam_offload: bool, critic: bool) -> Optional[str]:
    """The DeepSpeed op the run's optimizer loads: ``cpu_adam`` with ``--ds.adam_offload``, else
    ``fused_adam``; None when nothing trains on DeepSpeed (a backend with its own optimizer, ``--backend
    megatron``, without a critic)."""
    if not training_backend(backend).deepspeed_optimizer and not critic:
        return None
    return "cpu_adam" if adam_offload else "fused_adam"


def op_for_args(args) -> Optional[str]:
    """:func:`needed_op` for lpo-train's hierarchised namespace."""
    ds = getattr(args, "ds", None)
    critic = getattr(getattr(args, "critic", None), "model_name_or_path", None)
    return needed_op(backend_of(args).name, bool(getattr(ds, "adam_offload", False)), bool(critic))


@dataclass(frozen=True)
class NodeFacts:
    """What one node offers a DeepSpeed op build (every field plain data: it travels through Ray)."""

    host: str = ""
    nvidia_gpus: Optional[int] = None    # NVIDIA devices the node exposes (/proc/driver/nvidia/gpus); None: unknown
    env: Mapping[str, str] = field(default_factory=dict)           # the ENV_KEYS that are set
    which: Mapping[str, Optional[str]] = field(default_factory=dict)  # "nvcc", "ninja", compiler -> path
    usr_local_cuda: bool = False                                   # /usr/local/cuda exists
    nvcc_text: Optional[str] = None      # `<CUDA home>/bin/nvcc --version` output; None: it did not run
    torch_version: Optional[str] = None
    torch_cuda: Optional[str] = None     # torch.version.cuda
    torch_hip: Optional[str] = None      # torch.version.hip
    ds_version: Optional[str] = None     # None: deepspeed not installed
    ds_installed_ops: Mapping[str, bool] = field(default_factory=dict)
    ds_accelerator: Optional[str] = None
    ds_torch_info: Mapping[str, str] = field(default_factory=dict)
    ds_built: Tuple[str, ...] = ()       # ops whose compiled module is in deepspeed/ops/adam/


def compiler_name(env: Mapping[str, str]) -> str:
    """The C++ compiler torch's JIT build calls: ``$CXX`` (its first word), else ``c++``."""
    words = (env.get("CXX") or "").split()
    return words[0] if words else "c++"


def toolkit_home(env: Mapping[str, str], which_nvcc: Optional[str], usr_local_cuda: bool) -> Tuple[Optional[str], str]:
    """``(folder, how it was found)`` in torch's search order, or ``(None, "")``."""
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(key):
            return env[key], f"${key}"
    if which_nvcc:
        return os.path.dirname(os.path.dirname(which_nvcc)), f"the nvcc on PATH, {which_nvcc}"
    if usr_local_cuda:
        return DEFAULT_CUDA_HOME, "torch's default; CUDA_HOME unset"
    return None, ""


def nvcc_release(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` from ``nvcc --version``'s ``release X.Y`` line, or None."""
    m = re.search(r"release (\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _major_minor(version: Optional[str]) -> Optional[Tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _fmt(v: Tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def is_prebuilt(op: str, facts: NodeFacts) -> bool:
    """deepspeed holds ``op`` compiled for its GPU accelerator (it then loads it instead of compiling)."""
    return bool(facts.ds_installed_ops.get(op)) and facts.ds_accelerator == DS_GPU_ACCELERATOR \
        and op in facts.ds_built


def build_problems(op: Optional[str], facts: NodeFacts) -> List[str]:
    """Why this node cannot load DeepSpeed's ``op`` (see the module docstring), one message per problem
    naming the variable, package or command that fixes it; ``[]`` when it can (or ``op`` is None)."""
    if op is None or facts.torch_hip:
        return []
    what = f"{op} ({OPS.get(op, op)})"
    if facts.ds_version is None:
        return []  # no deepspeed here: the import fails first, with its own message
    torch_cuda = _major_minor(facts.torch_cuda)
    if torch_cuda is None:
        return [f"torch {facts.torch_version} is a CPU build (torch.version.cuda is None): DeepSpeed's GPU ops need "
                "torch's CUDA build (docs/install.md: pip install torch==2.13.0 --index-url "
                "https://download.pytorch.org/whl/cu130)"]
    if is_prebuilt(op, facts):
        built_torch = facts.ds_torch_info.get("version")
        built_cuda = facts.ds_torch_info.get(BUILD_NAMES["ds_toolkit_key"])
        here_torch = ".".join((facts.torch_version or "").split("+")[0].split(".")[:2])
        if (built_torch, built_cuda) != (here_torch, _fmt(torch_cuda)):
            return [f"deepspeed {facts.ds_version}'s pre-built {op} was compiled for torch {built_torch} / CUDA "
                    f"{built_cuda}, this node has torch {here_torch} / CUDA {_fmt(torch_cuda)}: DeepSpeed refuses "
                    f"to load it; reinstall deepspeed with the pre-build line of docs/install.md under this torch"]
        return []
    out = []
    if not facts.which.get("ninja"):
        out.append(f"ninja is not on PATH: torch needs it to JIT-compile {what}; pip install ninja in this venv "
                   "and put the venv's bin/ on the PATH the Ray workers see, " + PREBUILD_HINT)
    cxx = compiler_name(facts.env)
    if not facts.which.get(cxx):
        via = "$CXX" if facts.env.get("CXX") else "the default C++ compiler"
        out.append(f"no C++ compiler: {via} `{cxx}` is not on PATH; install g++ (e.g. apt-get install g++) "
                   "or set CXX, " + PREBUILD_HINT)
    home, how = toolkit_home(facts.env, facts.which.get("nvcc"), facts.usr_local_cuda)
    exact = op == "cpu_adam" and torch_cuda[0] >= 13  # DeepSpeed accepts other minors only for CUDA <= 12
    want = f"a CUDA {_fmt(torch_cuda)} toolkit" if exact else f"a CUDA {torch_cuda[0]}.x toolkit"
    if home is None:
        out.append(f"CUDA_HOME is not set, no nvcc is on PATH and {DEFAULT_CUDA_HOME} does not exist: "
                   f"JIT-compiling {what} needs nvcc from {want} (torch {facts.torch_version} is built for CUDA "
                   f"{facts.torch_cuda}); install it and export CUDA_HOME=/usr/local/cuda-{_fmt(torch_cuda)} on "
                   "every node, " + PREBUILD_HINT)
        return out
    nvcc = os.path.join(home, "bin", "nvcc")
    if facts.nvcc_text is None:
        out.append(f"CUDA home {home} (from {how}) has no runnable bin/nvcc (a runtime-only CUDA image?): "
                   f"JIT-compiling {what} needs nvcc from {want}; point CUDA_HOME at one, " + PREBUILD_HINT)
        return out
    release = nvcc_release(facts.nvcc_text)
    if release is None:
        out.append(f"`{nvcc} --version` printed no 'release X.Y' line: cannot tell its CUDA version; point "
                   f"CUDA_HOME at {want}")
    elif release[0] != torch_cuda[0]:
        other = "" if exact else f" (or another {torch_cuda[0]}.x toolkit)"
        out.append(f"{nvcc} (CUDA home from {how}) is CUDA {_fmt(release)} but torch {facts.torch_version} "
                   f"is built for CUDA {facts.torch_cuda}: JIT-compiling {what} needs {want}; export "
                   f"CUDA_HOME=/usr/local/cuda-{_fmt(torch_cuda)}{other}, " + PREBUILD_HINT)
    elif exact and release != torch_cuda and facts.env.get("DS_SKIP_CUDA_CHECK") != "1":
        out.append(f"{nvcc} (CUDA home from {how}) is CUDA {_fmt(release)} but torch {facts.torch_version} is "
                   f"built for CUDA {facts.torch_cuda}: deepspeed {facts.ds_version} compiles {what} only with the "
                   "same CUDA major.minor; "
                   f"export CUDA_HOME=/usr/local/cuda-{_fmt(torch_cuda)}, or DS_SKIP_CUDA_CHECK=1 to let it try, "
                   + PREBUILD_HINT)
    return out


# ----------------------------------------------------------------------------- gathering


def _module_dir(name: str) -> Optional[str]:
    """The folder of installed package ``name``, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _literals(path: str) -> Dict[str, object]:
    """The module-level ``NAME = <literal>`` (and annotated) assignments of a Python file."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return {}
    out: Dict[str, object] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        for t in targets:
            if isinstance(t, ast.Name):
                try:
                    out[t.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


def _torch_facts() -> Dict[str, Optional[str]]:
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        info = {k: getattr(torch.version, k, None) for k in BUILD_NAMES["torch_fields"]}
    else:
        folder = _module_dir("torch")
        info = _literals(os.path.join(folder, "version.py")) if folder else {}
    version, toolkit, hip = (info.get(k) for k in BUILD_NAMES["torch_fields"])
    return {"torch_version": version, "torch_cuda": toolkit, "torch_hip": hip}


def _deepspeed_facts() -> Dict[str, object]:
    folder = _module_dir("deepspeed")
    if folder is None:
        return {}
    info = _literals(os.path.join(folder, "git_version_info_installed.py"))
    built = tuple(op for op in OPS if glob.glob(os.path.join(folder, "ops", "adam", f"{op}_op*.so")))
    version = info.get("version")
    if version is None:
        version = (_literals(os.path.join(folder, "version.py")).get("__version__") or "?")
    return {"ds_version": str(version), "ds_installed_ops": dict(info.get("installed_ops") or {}),
            "ds_accelerator": info.get("accelerator_name"), "ds_torch_info": dict(info.get("torch_info") or {}),
            "ds_built": built}


def run_nvcc(home: str, timeout_s: float = 60.0) -> Optional[str]:
    """``<home>/bin/nvcc --version``'s output, or None when it does not run or fails."""
    try:
        p = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def nvidia_devices() -> int:
    """NVIDIA GPUs this machine exposes, from the driver's /proc entries or /dev nodes (a Ray task that
    asks for no GPU sees CUDA_VISIBLE_DEVICES="", so torch cannot be asked)."""
    return len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))


def gather_facts() -> NodeFacts:
    """This process's node: its NVIDIA devices, environment and PATH, its nvcc, and the installed torch
    and deepspeed (read from their files: neither is imported)."""
    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    which = {name: shutil.which(name) for name in ("nvcc", "ninja", compiler_name(env))}
    usr = os.path.exists(DEFAULT_CUDA_HOME)
    home, _ = toolkit_home(env, which["nvcc"], usr)
    return NodeFacts(host=socket.gethostname(), nvidia_gpus=nvidia_devices(), env=env, which=which, usr_local_cuda=usr,
                     nvcc_text=run_nvcc(home) if home else None, **_torch_facts(), **_deepspeed_facts())


def gather_cluster(timeout_s: float = 180.0) -> Tuple[Dict[str, NodeFacts], List[str]]:
    """:func:`gather_facts` on every alive Ray node with GPUs (a zero-CPU task pinned to each node, so it
    sees what the actors there will see). Returns facts by node (``ip (hostname, node id prefix)``: several
    Ray nodes may share a host) and the nodes that did not answer within ``timeout_s``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get("GPU", 0)) > 0]
    task = ray.remote(num_cpus=0, max_retries=0)(gather_facts)
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote():
            f"{n.get('NodeManagerAddress', '?')} ({n.get('NodeManagerHostname', '?')}, {n['NodeID'][:8]})"
            for n in nodes}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    facts = {}
    for ref in ready:
        try:
            facts[refs[ref]] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the task itself failed on that node
            pending.append(ref)
            print(f"[gpu_build] node {refs[ref]}: the check failed to run ({type(e).__name__}: {e})",
                  file=sys.stderr)
    for ref in pending:
        ray.cancel(ref, force=True)
    return facts, [refs[r] for r in pending]


def cluster_problems(op: Optional[str], facts_by_node: Mapping[str, NodeFacts]) -> List[str]:
    """``node A, node B: <problem>`` for every problem of :func:`build_problems`, nodes with the same
    message merged (paths and versions are usually the same on every node). A node that declares Ray GPUs
    but has no NVIDIA device (a CPU cluster's logical GPUs) is not checked: nothing compiles CUDA there."""
    nodes_of: Dict[str, List[str]] = {}
    for node in sorted(facts_by_node):
        if facts_by_node[node].nvidia_gpus == 0:
            continue
        for problem in build_problems(op, facts_by_node[node]):
            nodes_of.setdefault(problem, []).append(node)
    return [f"{', '.join(nodes)}: {problem}" for problem, nodes in nodes_of.items()]


def _summary(op: str, facts_by_node: Mapping[str, NodeFacts]) -> str:
    gpu = {n: f for n, f in facts_by_node.items() if f.nvidia_gpus != 0}
    pre = [n for n, f in gpu.items() if is_prebuilt(op, f)]
    jit = [nvcc_release(f.nvcc_text) for n, f in gpu.items() if n not in pre]
    parts = [f"pre-built on {len(pre)}"] if pre else []
    if jit:
        versions = sorted({_fmt(v) for v in jit if v})
        parts.append(f"JIT-compiled on {len(jit)} with nvcc {', '.join(versions) or '?'} and ninja")
    return f"DeepSpeed {op}: {'; '.join(parts)} GPU node(s)"


def check_run_or_exit(args, prog: str = "lpo-train",
                      gather: Callable[[], Tuple[Dict[str, NodeFacts], Sequence[str]]] = gather_cluster) -> None:
    """Run start (Ray joined): exit 3 when a GPU node cannot load the op the run's DeepSpeed optimizer
    needs. Skipped when no op is needed, in CPU mode (``args.cpu.active``, set by the CPU mode's start) and with
    ``LPO_SKIP_BUILD_CHECK=1``."""
    op = op_for_args(args)
    if op is None:
        return
    if os.environ.get(SKIP_ENV) == "1":
        print(f"{prog}: {SKIP_ENV}=1: not checking that the GPU nodes can build DeepSpeed's {op}", flush=True)
        return
    if getattr(getattr(args, "cpu", None), "active", False):
        return  # CPU mode (decided by openrlhf_lpo.cpu.mode before this check): DeepSpeed runs torch's AdamW
    facts, unanswered = gather()
    for node in unanswered:
        print(f"{prog}: warning: GPU node {node} did not answer the DeepSpeed {op} build check; not checked",
              file=sys.stderr, flush=True)
    problems = cluster_problems(op, facts)
    gpu = [f for f in facts.values() if f.nvidia_gpus != 0]
    if not problems:
        if gpu:
            print(f"{prog}: {_summary(op, facts)}", flush=True)
        return
    bad = sum(1 for f in gpu if build_problems(op, f))
    print(f"{prog}: {bad} of {len(gpu)} GPU node(s) cannot load {op} ({OPS[op]}), which every "
          "actor loads at its first deepspeed.initialize, compiling it unless it was pre-built into deepspeed; "
          "nothing was started:", file=sys.stderr)
    for p in problems:
        print("  " + p, file=sys.stderr)
    print(f"  (python scripts/check_gpu_install.py --node checks one node; {SKIP_ENV}=1 starts anyway)",
          file=sys.stderr, flush=True)
    raise SystemExit(3)
