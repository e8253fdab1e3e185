"""Rotation of the HF exports (``<ckpt.path>/<tag>_hf``) that ``--ckpt.save_hf`` writes next to the
training state.

OpenRLHF 0.11.2 rotates only the DeepSpeed state under ``<ckpt.path>/_actor`` (``--ckpt.max_num``,
``--ckpt.max_mem``); its HF exports pile up (16 GB each at 8B, every ``--ckpt.save_steps``). Here the
exports follow the state: an export is kept while its tag's state directory is kept. Without state
directories (``--ckpt.disable_ds``) the newest ``max_num`` regular exports (by step) and the newest
``best*`` export are kept. ``--ckpt.hf_max_num`` overrides the count for the exports alone (-1 keeps
every export, e.g. to evaluate a learning curve after training).

A removed export is first renamed to ``.<name>.removing`` (one atomic rename), so a crash mid-removal
never leaves a half-deleted directory that looks like a checkpoint to ``lpo-eval``.

Public names (stable):
    rotate_hf_exports(ckpt_path, max_num, state_dir=None, keep=(), follow_state=True) -> removed paths
    rotate_for_args(ckpt_args, state_subdir="_actor", keep=()) -> removed paths (reads the --ckpt.* flags)
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, List, Optional

__all__ = ["rotate_hf_exports", "rotate_for_args"]

_STEP = re.compile(r"(\d+)$")
SUFFIX = "_hf"


def rotate_for_args(ckpt_args, state_subdir: str = "_actor", keep: Iterable[str] = ()) -> List[str]:
    """Rotate ``ckpt_args.path``'s exports as the flags say: ``--ckpt.hf_max_num`` when given (a count,
    -1 keeps all), else follow the state's rotation under ``<path>/<state_subdir>`` (``--ckpt.max_num``)."""
    override = getattr(ckpt_args, "hf_max_num", None)
    if override is not None:
        return rotate_hf_exports(ckpt_args.path, int(override), keep=keep, follow_state=False)
    return rotate_hf_exports(ckpt_args.path, int(getattr(ckpt_args, "max_num", 3)),
                             os.path.join(ckpt_args.path, state_subdir), keep=keep)


def _step(tag: str) -> int:
    m = _STEP.search(tag)
    return int(m.group(1)) if m else -1


def rotate_hf_exports(ckpt_path: str, max_num: int, state_dir: Optional[str] = None,
                      keep: Iterable[str] = (), follow_state: bool = True) -> List[str]:
    """Remove HF exports beyond the rotation (module doc); returns the removed directories.

    ``state_dir``: where the training state's tag directories live (``<ckpt.path>/_actor``); with
    ``follow_state`` an export is kept iff its tag is there. ``keep``: tags never removed (the one just
    saved). ``max_num`` < 0 keeps everything.
    """
    if max_num < 0 or not os.path.isdir(ckpt_path):
        return []
    keep = set(keep)
    exports = sorted(d[:-len(SUFFIX)] for d in os.listdir(ckpt_path)
                     if d.endswith(SUFFIX) and not d.startswith(".") and os.path.isdir(os.path.join(ckpt_path, d)))
    states = set()
    if follow_state and state_dir and os.path.isdir(state_dir):
        states = {d for d in os.listdir(state_dir) if os.path.isdir(os.path.join(state_dir, d))}
    if states:
        doomed = [t for t in exports if t not in states and t not in keep]
    else:
        regular = sorted((t for t in exports if not t.startswith("best")), key=lambda t: (_step(t), t))
        best = sorted((t for t in exports if t.startswith("best")), key=lambda t: (_step(t), t))
        survivors = set(regular[-max_num:] if max_num else []) | set(best[-1:]) | keep
        doomed = [t for t in exports if t not in survivors]
    removed = []
    for tag in doomed:
        path = os.path.join(ckpt_path, tag + SUFFIX)
        trash = os.path.join(ckpt_path, f".{tag}{SUFFIX}.removing")
        shutil.rmtree(trash, ignore_errors=True)  # left by a crash mid-removal
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed
