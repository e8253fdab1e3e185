"""Is ``--ckpt.path`` one storage that every node of the run sees? Checked at the start of a multi-node run.

Each actor rank writes its part of a checkpoint under ``--ckpt.path`` on its own node and, on a resume, reads
``latest`` there (DeepSpeed and Megatron alike); the driver reads it too (the preflight, the
``--ckpt.auto_resume`` supervisor, which picks the checkpoint a restart loads). On a path local to each node
(a node's own disk), ranks on different nodes would load different checkpoints, or some none and start from
the Hugging Face weights, and a restart would not see what the ranks wrote. So when the driver's node and
the nodes with GPUs are more than one node, :func:`check_or_exit` runs before any actor starts:

1. the driver writes a marker (a random token) in a new folder under ``--ckpt.path``;
2. a zero-CPU Ray task pinned to every other node with GPUs reads it, retrying for up to :data:`LOOK_S`
   seconds (a network filesystem may show a new file late), and writes a marker of its own beside it;
3. the driver reads every node's marker (the same retries).

A node that does not see the driver's marker, or whose marker the driver does not see, does not share the
storage: the run stops (exit 2) naming those nodes, before it trains a step. The folder is removed after.
A run that neither saves nor loads a checkpoint (``--ckpt.save_steps`` <= 0, no ``--ckpt.load_enable``)
skips the check.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import uuid
from typing import List, Optional, Tuple

LOOK_S = 10.0  # how long a marker may take to appear on another node
DRIVER_MARK = "driver"


def _read_within(path: str, token: str, seconds: float) -> bool:
    """True once ``path`` holds ``token`` (looked at every 0.25 s for ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with open(path) as f:
                if f.read() == token:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.25)


def look_and_mark(folder: str, token: str, node_id: str, look_s: float) -> Tuple[bool, Optional[str]]:
    """On a node: (whether it sees the driver's marker, why it could not write its own or None)."""
    saw = _read_within(os.path.join(folder, DRIVER_MARK), token, look_s)
    try:
        with open(os.path.join(folder, node_id), "w") as f:
            f.write(token)
    except OSError as e:
        return saw, f"cannot write a file there ({e.strerror or e})"
    return saw, None


def _label(node: dict) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({node.get('NodeManagerHostname', '?')}, node {node['NodeID'][:8]})"


def check_shared(path: str, look_s: float = LOOK_S, timeout_s: float = 120.0) -> Tuple[List[str], List[str], List[str]]:
    """Markers on every node with GPUs other than the driver's (Ray joined). Returns the problems
    (``"<node>: <what>"``), the nodes that did not answer within ``timeout_s``, and every node checked
    (the driver's first)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    me = ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    driver = next((_label(n) for n in alive if n["NodeID"] == me), f"node {me[:8]}")
    others = [n for n in alive if n["NodeID"] != me and float(n.get("Resources", {}).get("GPU", 0)) > 0]
    checked = [f"{driver} (the driver's)"] + [_label(n) for n in others]
    if not others:
        return [], [], checked
    token = uuid.uuid4().hex
    folder = os.path.join(os.path.abspath(path), f".lpo_shared_storage_{token[:12]}")
    os.makedirs(folder)
    problems, unanswered = [], []
    try:
        with open(os.path.join(folder, DRIVER_MARK), "w") as f:
            f.write(token)
        task = ray.remote(num_cpus=0, max_retries=0)(look_and_mark)
        refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            folder, token, n["NodeID"], look_s): n for n in others}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s + look_s)
        for ref in ready:
            node = refs[ref]
            try:
                saw, cannot_write = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the task itself failed there
                unanswered.append(f"{_label(node)} ({type(e).__name__}: {e})")
                continue
            if not saw:
                problems.append(f"{_label(node)}: does not see the marker the driver wrote in {folder}")
            elif cannot_write:
                problems.append(f"{_label(node)}: sees the driver's marker but {cannot_write}")
            elif not _read_within(os.path.join(folder, node["NodeID"]), token, look_s):
                problems.append(f"{_label(node)}: the driver does not see the marker this node wrote in {folder}")
        for ref in pending:
            unanswered.append(_label(refs[ref]))
            ray.cancel(ref, force=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return problems, unanswered, checked


def check_or_exit(args: argparse.Namespace, prog: str = "lpo-train", look_s: float = LOOK_S) -> None:
    """The run's start-up check (module docstring): exit 2 naming the nodes that do not share ``--ckpt.path``."""
    ckpt = args.ckpt
    if not ((ckpt.save_steps or 0) > 0 or ckpt.load_enable):
        return
    try:
        problems, unanswered, checked = check_shared(ckpt.path, look_s=look_s)
    except OSError as e:  # the driver cannot write there (the preflight checked it; the disk may have changed)
        print(f"{prog}: --ckpt.path {ckpt.path}: cannot write the shared-storage marker there ({e}); choose a "
              "writable path on storage every node mounts", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for node in unanswered:
        print(f"{prog}: warning: node {node} did not answer the shared-storage check of --ckpt.path {ckpt.path}; "
              "not checked", file=sys.stderr, flush=True)
    if problems:
        print(f"{prog}: --ckpt.path {ckpt.path} is not one storage that every node of the run sees (the driver's "
              f"node and every node with GPUs: {len(checked)}); ranks on different nodes would save and load "
              "different checkpoints, and a restart would not find them. Nothing was started:", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        print("  Put --ckpt.path (and --ckpt.output_dir) on a filesystem every node mounts at the same path "
              "(NFS, Lustre, a cloud file store) and pass that path.", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if len(checked) > 1:
        print(f"{prog}: --ckpt.path {ckpt.path}: one storage, seen by all {len(checked)} nodes of the run", flush=True)
