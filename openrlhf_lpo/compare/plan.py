"""The run matrix of a paired study: methods x seeds, one run each, and what fixes a run's result.

Methods are the files of ``configs/methods/*.sh`` (the name is the file's stem: ``grpo``, ``lpo_fwd``, ...), as
the recipes take them (``METHOD=...``, examples/scripts/lib/launch.sh). The first method is the baseline of the
paired differences. Seed ``s`` gives every method the same ``--train.seed s``: the same prompt order (the
trainer seeds torch with it before the stock dataloader shuffles) and the same sampling seed for every
rollout request (``openrlhf_lpo/openrlhf/request_seeds.py``: prompt seed ``H(s, "train", p)`` for the p-th
prompt dispatched, sample seed ``H(prompt seed, k)``), so the runs of one seed differ only in the method.

Runs are ordered seed-major (every method of seed 0, then of seed 1, ...), so a study that stops early has
whole pairs. A run's ``settings`` are everything that fixes its result (for a recipe: its full ``lpo-train``
flags); their hash decides whether a finished run can be kept (:mod:`openrlhf_lpo.compare.runner`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


class PlanError(ValueError):
    """Bad input for the matrix; the message names the argument and the fix (the CLI exits 2 with it)."""


@dataclass(frozen=True)
class RunSpec:
    """One (method, seed) run: its own directory (markers, command, log, checkpoints) and metrics file."""

    method: str
    seed: int
    work_dir: Path
    metrics_path: Path
    settings: Mapping = field(default_factory=dict, compare=False)

    @property
    def key(self) -> str:
        return f"{self.method}/seed{self.seed}"

    @property
    def settings_hash(self) -> str:
        blob = json.dumps(self.settings, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def method_names(configs: Path = CONFIGS) -> List[str]:
    """The methods a study can run: the stems of ``configs/methods/*.sh``."""
    return sorted(p.stem for p in (Path(configs) / "methods").glob("*.sh"))


def parse_methods(text: str, configs: Path = CONFIGS) -> List[str]:
    """``"grpo,lpo_fwd"`` -> names; the first is the baseline. Unknown, repeated or no names raise PlanError."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    known = method_names(configs)
    if not names:
        raise PlanError(f"--methods is empty; give a comma-separated list of configs/methods/*.sh names, the "
                        f"baseline first, e.g. --methods grpo,lpo_fwd (known: {', '.join(known)})")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PlanError(f"--methods: unknown {', '.join(repr(n) for n in unknown)}; a method is a file of "
                        f"{Path(configs) / 'methods'}: choose from {', '.join(known)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlanError(f"--methods lists {', '.join(repeated)} twice; name each method once")
    return names


def seed_list(count: int, first: int = 0) -> List[int]:
    """``count`` seeds from ``first``; PlanError naming --seeds / --first-seed when they are out of range."""
    if count < 1:
        raise PlanError(f"--seeds must be >= 1 (the number of paired seeds per method); got {count}")
    if first < 0:
        raise PlanError(f"--first-seed must be >= 0; got {first}")
    return list(range(first, first + count))


def method_flags(name: str, max_new_tokens: int, configs: Path = CONFIGS) -> List[str]:
    """The flags ``configs/methods/<name>.sh`` adds, read as the recipes read them (sourced by bash with the
    task's ``--rollout.max_new_tokens``, which DAPO's overlong buffer reads)."""
    path = Path(configs) / "methods" / f"{name}.sh"
    script = (f'TASK_ARGS=(--rollout.max_new_tokens {int(max_new_tokens)}); source "$1"; '
              'printf "%s\\n" "${METHOD_ARGS[@]}"')
    out = subprocess.run(["bash", "-c", script, "method", str(path)], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise PlanError(f"method file {path} did not set METHOD_ARGS: {out.stderr.strip()[-500:]}")
    return out.stdout.splitlines()


def matrix(methods: Sequence[str], seeds: Sequence[int], out: Path, settings: Dict[tuple, Mapping]) -> List[RunSpec]:
    """The runs, seed-major; run (m, s) lives in ``<out>/seed<s>/pipeline/<m>`` with its metrics in
    ``<out>/seed<s>/metrics/<m>.jsonl`` (each seed directory has the layout of an ``lpo-demo`` run)."""
    out = Path(out)
    return [RunSpec(m, s, out / f"seed{s}" / "pipeline" / m, out / f"seed{s}" / "metrics" / f"{m}.jsonl",
                    settings[(m, s)]) for s in seeds for m in methods]


def effective_flag(argv: Sequence[str], flag: str):
    """The value the last ``flag`` in ``argv`` sets (argparse keeps the last), None if absent."""
    value = None
    for i, a in enumerate(argv[:-1]):
        if a == flag:
            value = argv[i + 1]
    return value
