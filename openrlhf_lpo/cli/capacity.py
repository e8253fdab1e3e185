"""Has the Ray cluster the GPUs this run's layout needs, free? A restart after a lost node waits until it has.

``lpo-train`` calls :func:`check_or_wait` once Ray is joined, before any actor starts:

* the first attempt (and every run without ``--ckpt.auto_resume``) compares the layout with the GPUs of the
  alive nodes and stops at once when it cannot fit: exit :data:`EXIT_CLUSTER_TOO_SMALL` (5), naming the
  GPUs per role and what the cluster has. A cluster too small from the start is a mistake, not a preemption;
* a restart of ``--ckpt.auto_resume`` waits, up to ``--ckpt.auto_resume_wait`` seconds (default 30 min),
  until the layout fits the GPUs that are there AND free: Ray has handed them back (the previous attempt's
  actors are gone) and, on a node with NVIDIA devices, their memory is released (``nvidia-smi`` in a zero-CPU
  task pinned to each node; a GPU with more than :data:`FREE_MIB` MiB in use is taken: a dead vLLM engine or
  actor that has not let go yet). A node that comes back within the budget lets the run go on; the wait is
  not a failure (the supervisor counts an attempt only when it dies). After the budget: exit 5, naming the
  free GPUs per node, which the supervisor does not retry.

Whether a layout fits GPUs per node is a registry per backend (:func:`register_layout_fit`): DeepSpeed's
placement groups (PACK) may span nodes, so the total counts (:func:`openrlhf_lpo.cli.plan.check_cluster`);
Megatron's tensor-parallel groups and vLLM engines each need one node (registered by
``openrlhf_lpo.megatron.flags``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from openrlhf_lpo.cli.plan import ClusterTooSmall
from openrlhf_lpo.registry import lookup, register_unique

EXIT_CLUSTER_TOO_SMALL = 5  # not a preemption: the supervisor (cli/auto_resume.py) does not restart it
FREE_MIB = 2048  # a GPU with more memory in use is taken (a CUDA context alone is a few hundred MiB)
PAUSE_S = (1.0, 10.0)  # the first and the longest pause between two looks at the cluster
LOG_EVERY_S = 60.0

# backend -> fit(args, GPUs per node) -> (None when the layout fits, else why not, naming the flags;
#                                         a line for the run's log when it fits, or None)
Fit = Tuple[Optional[str], Optional[str]]
LAYOUT_FITS: Dict[str, Callable[[argparse.Namespace, List[float]], Fit]] = {}


def register_layout_fit(backend: str, fit: Callable[[argparse.Namespace, List[float]], Fit]):
    return register_unique(LAYOUT_FITS, "layout fit of backend", backend, fit)


def _deepspeed_fit(args: argparse.Namespace, node_gpus: List[float]) -> Fit:
    from openrlhf_lpo.cli import plan

    try:
        plan.check_cluster(args, {"GPU": float(sum(node_gpus))})
    except ClusterTooSmall as e:
        return str(e), None
    return None, None


register_layout_fit("deepspeed", _deepspeed_fit)


def layout_fit(args: argparse.Namespace, node_gpus: Sequence[float]) -> Fit:
    """The registered fit of the run's backend on ``node_gpus`` (GPUs per node)."""
    return lookup(LAYOUT_FITS, "backend", getattr(args, "backend", "deepspeed"))(args, list(node_gpus))


def shortfall(args: argparse.Namespace, node_gpus: Sequence[float]) -> Optional[str]:
    """None when the run's layout fits ``node_gpus`` (GPUs per node), else the reason."""
    return layout_fit(args, node_gpus)[0]


@dataclass
class NodeGPUs:
    node: str                        # "ip (node id prefix)"
    total: float                     # GPUs the node declares to Ray
    free: float                      # of them, not handed out by Ray now
    memory_free: Optional[int] = None  # NVIDIA GPUs of the node with <= FREE_MIB in use (None: not probed)

    @property
    def usable(self) -> float:
        return self.free if self.memory_free is None else min(self.free, float(self.memory_free))

    def describe(self) -> str:
        held = "" if self.memory_free is None or self.memory_free >= self.free else \
            f", memory in use on {self.free - self.memory_free:g} of the free ones"
        return f"{self.node}: {self.usable:g} of {self.total:g} free{held}"


def describe(nodes: Sequence[NodeGPUs]) -> str:
    return "; ".join(n.describe() for n in nodes) or "no node with GPUs"


def parse_memory_used(text: str) -> List[int]:
    """MiB in use per GPU from ``nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits``."""
    return [int(float(line.strip())) for line in text.splitlines() if line.strip()]


def gpu_memory_used() -> Optional[List[int]]:
    """MiB in use on each NVIDIA GPU of this node (``nvidia-smi`` reads every GPU, whatever the process may
    use); None on a node without NVIDIA devices (logical GPUs) or where ``nvidia-smi`` does not answer."""
    from openrlhf_lpo.cli.gpu_build import nvidia_devices

    if nvidia_devices() == 0:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return parse_memory_used(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _label(node: dict) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"


def cluster_gpus(probe_memory: bool, timeout_s: float = 60.0) -> List[NodeGPUs]:
    """Every alive node with GPUs: declared, not handed out by Ray, and (``probe_memory``) with free memory."""
    import ray
    from ray._private import state
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get("GPU", 0)) > 0]
    available = state.available_resources_per_node()
    out = {n["NodeID"]: NodeGPUs(_label(n), float(n["Resources"]["GPU"]),
                                 float(available.get(n["NodeID"], {}).get("GPU", 0.0))) for n in nodes}
    if probe_memory and any(g.free > 0 for g in out.values()):
        task = ray.remote(num_cpus=0, max_retries=0)(gpu_memory_used)
        refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(): node
                for node, g in out.items() if g.free > 0}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                used = ray.get(ref)
            except Exception:  # noqa: BLE001 - the probe failed there: Ray's count stands
                continue
            if used is not None:
                out[refs[ref]].memory_free = sum(1 for mib in used if mib <= FREE_MIB)
        for ref in pending:
            ray.cancel(ref, force=True)
    return list(out.values())


def wait_for_gpus(args: argparse.Namespace, budget_s: float, look: Callable[[], List[NodeGPUs]],
                  log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> float:
    """Look at the cluster (``look``) until the layout fits the usable GPUs; returns the seconds waited.
    Logs at the first look that does not fit and every :data:`LOG_EVERY_S` after; raises
    :class:`ClusterTooSmall` once ``budget_s`` has passed."""
    start, pause, logged = clock(), PAUSE_S[0], None
    while True:
        nodes = look()
        reason = shortfall(args, [n.usable for n in nodes])
        waited = clock() - start
        if reason is None:
            return waited
        if waited >= budget_s:
            raise ClusterTooSmall(
                f"the GPUs the run needs did not come back within --ckpt.auto_resume_wait {budget_s:g} s: {reason}. "
                f"Free GPUs per node: {describe(nodes)}. Bring the lost nodes back (or free their GPUs) and start "
                "the same command again (it resumes from the last checkpoint), or give a longer "
                "--ckpt.auto_resume_wait")
        if logged is None or clock() - logged >= LOG_EVERY_S:
            log(f"waiting for the GPUs (free per node: {describe(nodes)}): {reason}; up to "
                f"{budget_s - waited:.0f} s more (--ckpt.auto_resume_wait); waiting is not a failed attempt")
            logged = clock()
        sleep(max(0.0, min(pause, budget_s - waited)))
        pause = min(pause * 2, PAUSE_S[1])


def restart_number() -> int:
    """0 outside the supervisor; else which restart this attempt is (attempt 1 is restart 0)."""
    from openrlhf_lpo.cli.auto_resume import SUPERVISED_ENV

    return max(int(os.environ.get(SUPERVISED_ENV) or 1) - 1, 0)


def check_or_wait(args: argparse.Namespace) -> None:
    """The run's start-up check (module docstring); raises :class:`ClusterTooSmall` (``openrlhf_lpo.cli.plan``)."""
    from openrlhf_lpo.cli.auto_resume import PREFIX

    def log(text: str) -> None:
        print(f"{PREFIX} {text}", file=sys.stderr, flush=True)

    if restart_number() == 0:
        nodes = cluster_gpus(probe_memory=False)
        gpus = [n.total for n in nodes]
        reason = shortfall(args, gpus)
        if reason:
            raise ClusterTooSmall(reason)
    else:
        cpu_mode = getattr(getattr(args, "cpu", None), "active", False)  # logical GPUs: no memory to probe
        waited = wait_for_gpus(args, float(args.ckpt.auto_resume_wait),
                               lambda: cluster_gpus(probe_memory=not cpu_mode), log)
        if waited >= PAUSE_S[0]:
            log(f"the GPUs the run needs are there after {waited:.0f} s of waiting")
        gpus = [n.usable for n in cluster_gpus(probe_memory=False)]
    line = layout_fit(args, gpus)[1]
    if line:
        print(line, file=sys.stderr, flush=True)
