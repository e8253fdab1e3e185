"""Training metrics read back from the TensorBoard files a job wrote (``--logger.tensorboard_dir``).

The trainer writes them itself, so they hold every step, where the "Global step N:" lines that Ray
forwards to the driver can lose the last ones when a job exits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict


def scalars(tb_dir: Path) -> Dict[str, Dict[int, float]]:
    """``{tag: {step: value}}`` for every scalar under ``tb_dir`` ({} when TensorBoard is not
    installed or nothing was written)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    out: Dict[str, Dict[int, float]] = {}
    for events in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, {}).update({int(ev.step): float(ev.value) for ev in acc.Scalars(tag)})
    return out


def train_rows(tb_dir: Path) -> Dict[int, Dict]:
    """``{step: {"step": step, name: value}}`` for every ``train/<name>`` scalar under ``tb_dir``."""
    steps: Dict[int, Dict] = {}
    for tag, values in scalars(tb_dir).items():
        if tag.startswith("train/"):
            for step, value in values.items():
                steps.setdefault(step, {"step": step})[tag[len("train/"):]] = value
    return steps
