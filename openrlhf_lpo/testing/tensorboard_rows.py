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


def check_steps(tb_dir: Path, steps, exact: bool = False) -> str:
    """"" when the ``train/`` scalars under ``tb_dir`` hold every step in ``steps`` (exactly those with
    ``exact``), else what is missing."""
    logged = sorted(train_rows(Path(tb_dir)))
    want = sorted(int(s) for s in steps)
    missing = [s for s in want if s not in logged]
    if missing:
        return f"{tb_dir}: training steps {missing} are not in TensorBoard (logged: {logged or 'none'})"
    if exact and logged != want:
        return f"{tb_dir}: expected exactly the training steps {want}, TensorBoard has {logged}"
    return ""


def main(argv=None) -> int:
    """``python -m openrlhf_lpo.testing.tensorboard_rows TB_DIR --steps 1,2 [--exact]``: exit 1 naming what is missing."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m openrlhf_lpo.testing.tensorboard_rows",
                                description="check the training steps a job logged to TensorBoard")
    p.add_argument("tb_dir")
    p.add_argument("--steps", required=True, help="comma-separated steps that must be there, e.g. 1,2")
    p.add_argument("--exact", action="store_true", help="and no other step")
    a = p.parse_args(argv)
    problem = check_steps(Path(a.tb_dir), [s for s in a.steps.split(",") if s.strip()], a.exact)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"{a.tb_dir}: training steps {a.steps} logged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
