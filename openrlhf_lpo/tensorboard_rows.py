"""Training metrics read back from the TensorBoard files a job wrote (``--logger.tensorboard_dir``).

The trainer writes them itself, so they hold every step, where the "Global step N:" lines that Ray
forwards to the driver can lose the last ones when a job exits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict


def train_rows(tb_dir: Path) -> Dict[int, Dict]:
    """``{step: {"step": step, name: value}}`` for every ``train/<name>`` scalar under ``tb_dir``
    ({} when TensorBoard is not installed or nothing was written)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    steps: Dict[int, Dict] = {}
    for events in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if not tag.startswith("train/"):
                continue
            for ev in acc.Scalars(tag):
                steps.setdefault(int(ev.step), {"step": int(ev.step)})[tag[len("train/"):]] = float(ev.value)
    return steps
