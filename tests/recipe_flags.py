"""The flags a recipe's config files add, read by running them as the launch scripts do (tests of every directory
use it: ``tests/`` is on ``sys.path``)."""

import subprocess
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]


def method_flags(method: str, **task) -> List[str]:
    """The flags a method file adds (configs/methods/<method>.sh), as the scripts get them; ``task`` gives the
    task flags a method reads (``rollout.max_new_tokens=8`` for DAPO's overlong buffer)."""
    task_args = " ".join(f"--{k} {v}" for k, v in task.items())
    out = subprocess.run(["bash", "-c", f"TASK_ARGS=({task_args}); source configs/methods/{method}.sh; "
                                        'printf "%s\\n" "${METHOD_ARGS[@]}"'],
                         cwd=str(REPO), capture_output=True, text=True, check=True)
    flags = out.stdout.splitlines()
    assert flags[:1] == ["--algo.advantage.estimator"], flags
    return flags
