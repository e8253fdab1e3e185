"""``lpo-compare --preset cpu-demo`` at 2 methods x 2 seeds: the study's wall time (target: 8 min on a 2-core
machine) and the table it printed.

    python benchmarks/compare_cpu_demo.py                     # grpo,lpo_fwd x seeds 0,1, --jobs 2
    python benchmarks/compare_cpu_demo.py --methods grpo,lpo_fwd,lpo_rev --seeds 3 --out runs/bench-compare

The demo's warm-up is trained (or found in the cache, ``$LPO_CACHE_DIR``) first and not timed: ``lpo-demo``
caches it once per machine. Then the real command runs as a subprocess in a fresh study directory, and the script
prints its wall time, each run's wall time (its done marker), their sum over the study's wall time (how much
running ``--jobs`` side by side saves against one after the other), and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="grpo,lpo_fwd")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--jobs", default="2")
    p.add_argument("--out", default=None, help="study directory (default: a fresh temporary one, removed after)")
    p.add_argument("--target-s", type=float, default=480.0)
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from openrlhf_lpo.demo.presets import get_preset
    from openrlhf_lpo.demo.warmup import ensure_warmup

    t0 = time.time()
    warm = ensure_warmup(get_preset("cpu-demo").warmup, progress=False)
    print(f"warm-up: {'cached' if warm['cached'] else 'trained'} in {time.time() - t0:.0f}s (not timed)", flush=True)

    out = Path(args.out) if args.out else Path(f"/tmp/lpo-compare-bench-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "openrlhf_lpo.cli.compare", "--preset", "cpu-demo", "--methods", args.methods,
           "--seeds", str(args.seeds), "--jobs", args.jobs, "--out", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$ lpo-compare " + " ".join(cmd[3:]), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(REPO))
    wall = time.time() - t0
    runs = {}
    for done in sorted(out.glob("seed*/pipeline/*/done.json")):
        d = json.loads(done.read_text())
        runs[f"{d['method']}/seed{d['seed']}"] = d["wall_s"]
    print(f"\nlpo-compare exit {proc.returncode}; study wall time {wall:.0f} s = {wall / 60:.2f} min "
          f"(target {args.target_s / 60:.0f} min: {'met' if wall <= args.target_s else 'NOT met'})")
    for key, s in runs.items():
        print(f"  {key}: {s:.0f} s (lpo-train job + held-out evaluation of its checkpoints)")
    if runs:
        print(f"sum of the runs' wall times / study wall time = {sum(runs.values()) / wall:.2f} "
              f"(--jobs {args.jobs}: runs side by side)")
    if (out / "table.md").exists():
        print("\n" + (out / "table.md").read_text())
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
