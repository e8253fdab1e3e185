"""Runs a three-run matrix with openrlhf_lpo.compare.runner (one run at a time); each run's job is a real
subprocess (runner_worker.py). Arguments: OUT DELAY_OF_B SETTING_OF_C."""

import subprocess
import sys
from pathlib import Path

from openrlhf_lpo.compare.plan import RunSpec
from openrlhf_lpo.compare.runner import run_matrix

HERE = Path(__file__).resolve().parent
out, delay_b, setting_c = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]


class ScriptJob:
    def run(self, spec, attempt):
        with open(out / "invocations.log", "a") as f:
            f.write(f"{spec.key} {attempt['n']} {attempt['resume']}\n")
        delay = delay_b if spec.method == "b" else 0.0
        argv = [sys.executable, str(HERE / "runner_worker.py"), str(spec.work_dir), str(spec.metrics_path), "6",
                str(delay)] + (["--resume"] if attempt["resume"] else [])
        subprocess.run(argv, check=True)
        return {"steps": 6}

    def stop(self):
        pass


specs = [RunSpec(m, 0, out / "seed0" / "pipeline" / m, out / "seed0" / "metrics" / f"{m}.jsonl",
                 {"steps": 6, "c": setting_c if m == "c" else None}) for m in ("a", "b", "c")]
statuses = run_matrix(specs, ScriptJob(), jobs=1, policy="resume")
print({k: v["state"] for k, v in statuses.items()})
