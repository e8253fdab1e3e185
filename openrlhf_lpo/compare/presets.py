"""Named study presets of ``lpo-compare`` (``--preset NAME``): a study that runs without a recipe script.

The CPU presets (``cpu-demo``, ``ci``) are the demo's pipeline on its tiny model (``openrlhf_lpo/demo/study.py``
registers them); the ``lpo-compare`` console script imports that module first (``openrlhf_lpo/cli/compare.py``),
so this room never imports the demo.

A preset has two steps, so that ``--dry-run`` costs nothing: ``plan(methods, seeds, out, extra_args)`` returns
the run specs (their settings fix each run's result), and ``job(specs, extra_args, progress, log)`` prepares
what the runs share (the demo: its warm-up) and returns the job that runs them
(:class:`openrlhf_lpo.compare.runner.Job`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

from openrlhf_lpo.compare.plan import PlanError, RunSpec
from openrlhf_lpo.registry import register_unique


@dataclass(frozen=True)
class StudyPreset:
    name: str
    description: str
    plan: Callable[[Sequence[str], Sequence[int], object, Sequence[str]], List[RunSpec]]
    job: Callable[..., object]
    default_jobs: int = 2


STUDY_PRESETS: Dict[str, StudyPreset] = {}


def register_study_preset(preset: StudyPreset) -> StudyPreset:
    return register_unique(STUDY_PRESETS, "study preset", preset.name, preset)


def get_study_preset(name: str) -> StudyPreset:
    try:
        return STUDY_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(STUDY_PRESETS)) or "none registered"
        raise PlanError(f"--preset: unknown {name!r}; choose one of {known}, or give a recipe script "
                        "(examples/scripts/train_*.sh) instead of --preset") from None
