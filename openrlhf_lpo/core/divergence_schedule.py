"""Divergence schedules: which divergence each LPO update projects with, by global step and once by
the logged response entropy (App. C.6: forward KL early to explore, reverse KL late to exploit).

Pure Python (divergence names are checked against :mod:`openrlhf_lpo.listwise`); the ``lpo-train``
trainer (driver side, it knows the global step and the logged entropy) and the in-process demo loop
both drive it.

Public names (stable):
    Stage(divergence, start)      ``start``: the global step from which the stage applies; None for a
                                  stage reached only by the entropy switch
    parse_schedule(text) -> [Stage]          ``"fwd@0,rev@50"``, ``"fwd,rev"``, ``"alpha:1@0,alpha:0.5@20"``
    DivergenceSchedule(stages, switch_entropy=None, window=5)
        .divergence(step) / .stage(step)     for the update that starts after ``step`` completed updates
        .observe(step, entropy) -> bool      the response entropy logged by update ``step``; True when
                                             this observation fires the switch
        .switched_at                         the update whose entropy fired it (None before)
        .running_entropy                     mean of the last ``window`` entropies (None until there are that many)
        .metrics(step) -> {"lpo/divergence_stage", ...}
        .state_dict() / .load_state_dict(d)  what a checkpoint keeps (a resumed run stays switched)

Semantics. Step t is the update that starts after t completed updates (``train_step(samples, t)``;
TensorBoard logs it at t + 1). Without the switch the stage is the last one whose ``start <= t``. The
switch: after update t, the mean of the last ``window`` logged entropies is compared with
``switch_entropy``; the first time it is below, updates t + 1, t + 2, ... use
``max(stage by step, stage of update t + 1)``, i.e. the schedule moves on early, step boundaries
still apply, and it happens once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

__all__ = ["Stage", "parse_schedule", "DivergenceSchedule"]


@dataclass(frozen=True)
class Stage:
    divergence: str
    start: Optional[int]


def parse_schedule(text: str) -> List[Stage]:
    """``name[@step],...`` -> stages (ValueError saying what is wrong). The first stage starts at
    step 0 (``@0`` or no step); later steps strictly increase; names are any divergence names."""
    from openrlhf_lpo.listwise import parse_divergence

    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise ValueError(f"{text!r}: give comma-separated stages name[@step], e.g. fwd@0,rev@50")
    stages: List[Stage] = []
    for i, item in enumerate(items):
        name, at, step_text = item.rpartition("@") if "@" in item else (item, "", "")
        name = name.strip()
        start = None
        if at:
            try:
                start = int(step_text)
            except ValueError:
                raise ValueError(f"stage {item!r}: the step {step_text!r} is not an integer") from None
            if start < 0:
                raise ValueError(f"stage {item!r}: the step must be >= 0")
        parse_divergence(name)
        if i == 0:
            if start not in (None, 0):
                raise ValueError(f"the first stage {item!r} must start at step 0 (write {name}@0 or {name})")
            start = 0
        stages.append(Stage(name, start))
    given = [s.start for s in stages if s.start is not None]
    if any(b <= a for a, b in zip(given, given[1:])):
        raise ValueError(f"{text!r}: the stages' steps must strictly increase")
    if len(stages) < 2:
        raise ValueError(f"{text!r} has one stage; a schedule needs two or more (or use --lpo.divergence)")
    return stages


class DivergenceSchedule:
    """See the module docstring. ``stages`` from :func:`parse_schedule` (or one stage: a constant)."""

    def __init__(self, stages: List[Stage], switch_entropy: Optional[float] = None, window: int = 5):
        if not stages or stages[0].start != 0:
            raise ValueError("a schedule's first stage starts at step 0")
        unstepped = [s for s in stages[1:] if s.start is None]
        if switch_entropy is None and unstepped:
            raise ValueError(f"stage {unstepped[0].divergence!r} has no @step and no entropy switch is set: it would "
                             "never be used (give it a step or set the entropy threshold)")
        if switch_entropy is not None:
            if len(stages) < 2:
                raise ValueError("the entropy switch moves to the schedule's next divergence: give two or more stages")
            if not (math.isfinite(switch_entropy) and switch_entropy > 0):
                raise ValueError(f"the entropy threshold {switch_entropy} must be a positive number (nats per token)")
            if len(unstepped) > 1:
                raise ValueError("the entropy switch fires once: at most one stage may have no @step")
        if window < 1:
            raise ValueError(f"the entropy window must be >= 1 step, got {window}")
        self.stages = list(stages)
        self.switch_entropy = switch_entropy
        self.window = int(window)
        self.switched_at: Optional[int] = None
        self._switched_stage: Optional[int] = None
        self.history: List[float] = []

    @classmethod
    def constant(cls, divergence: str) -> "DivergenceSchedule":
        return cls([Stage(divergence, 0)])

    @property
    def names(self) -> List[str]:
        return [s.divergence for s in self.stages]

    def _by_step(self, step: int) -> int:
        return max(i for i, s in enumerate(self.stages) if s.start is not None and s.start <= step)

    def stage(self, step: int) -> int:
        i = self._by_step(step)
        if self.switched_at is not None and step > self.switched_at:
            i = max(i, self._switched_stage)
        return i

    def divergence(self, step: int) -> str:
        return self.stages[self.stage(step)].divergence

    @property
    def running_entropy(self) -> Optional[float]:
        if len(self.history) < self.window:
            return None
        return sum(self.history[-self.window:]) / self.window

    def observe(self, step: int, entropy: Optional[float]) -> bool:
        """Record update ``step``'s logged response entropy; fire the switch when due (once)."""
        if self.switch_entropy is None or self.switched_at is not None:
            return False
        if entropy is None or not math.isfinite(float(entropy)):
            raise ValueError(f"update {step} logged no finite response entropy ({entropy!r}); the entropy switch "
                             "needs it (response_entropy; --actor.entropy_coef is 0 by default, so every run logs it)")
        self.history = (self.history + [float(entropy)])[-self.window:]
        mean = self.running_entropy
        nxt = min(self.stage(step + 1) + 1, len(self.stages) - 1)
        if mean is None or mean >= self.switch_entropy or nxt == self.stage(step + 1):
            return False
        self.switched_at, self._switched_stage = int(step), nxt
        return True

    def metrics(self, step: int) -> Dict[str, float]:
        """What the update ``step`` logs: its stage, and with the switch the running entropy and the
        logged step (``switched_at + 1``) whose entropy fired it (-1 before)."""
        out = {"lpo/divergence_stage": float(self.stage(step))}
        if self.switch_entropy is not None:
            out["lpo/divergence_switched_at"] = -1.0 if self.switched_at is None else float(self.switched_at + 1)
            if self.running_entropy is not None:
                out["lpo/entropy_running_mean"] = self.running_entropy
        return out

    def state_dict(self) -> Dict:
        return {"stages": [[s.divergence, s.start] for s in self.stages], "switched_at": self.switched_at,
                "switched_stage": self._switched_stage, "history": list(self.history)}

    def load_state_dict(self, state: Dict) -> None:
        saved = [list(x) for x in state.get("stages", [])]
        mine = [[s.divergence, s.start] for s in self.stages]
        if saved and saved != mine:
            raise ValueError(f"the checkpoint's divergence schedule {saved} differs from this run's {mine}; resume "
                             "with the same --lpo.divergence_schedule")
        self.switched_at = state.get("switched_at")
        self._switched_stage = state.get("switched_stage")
        self.history = [float(x) for x in state.get("history", [])]
