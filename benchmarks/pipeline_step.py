"""CPU step time of the real pipeline (``lpo-train``: Ray, OpenRLHF's trainer and actors, the CPU rollout engine)
against the bare in-process loop (``lpo-demo --backend inprocess``), measured in the same run.

    python benchmarks/pipeline_step.py [--steps 12] [--k 8] [--prompts 16] [--method lpo-fwd] [--json FILE]

Both train the demo's warmed-up tiny Qwen3 (the ``cpu-demo`` warm-up, cached in ``~/.cache/openrlhf-lpo``)
on pairsum with the same method, seed, K and prompts per step. Printed per backend: the time to the first
finished step (imports, Ray, actors, first generation), the median of the later steps, and the whole run;
then the ratios pipeline / in-process. A regression of the pipeline (a per-sample Ray call, a worker that
imports vLLM to unpickle its requests, a batching window that no longer batches) shows as a ratio that grows.
The pipeline's step time comes from the trainer's own ``timing/step_total``; the in-process one from the
loop's ``step_s``. Wall clock: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--method", default="lpo-fwd")
    ap.add_argument("--json", default=None, help="also write the results here (atomically)")
    opts = ap.parse_args(argv)

    from dataclasses import replace

    from openrlhf_lpo.demo.loop import run_inprocess
    from openrlhf_lpo.demo.methods import parse_methods
    from openrlhf_lpo.demo.pipeline import run_pipeline
    from openrlhf_lpo.demo.presets import get_preset
    from openrlhf_lpo.demo.warmup import ensure_warmup

    preset = get_preset("cpu-demo")
    warm = ensure_warmup(preset.warmup, progress=False)
    cfg = replace(preset.rl, k=opts.k, prompts_per_step=opts.prompts, steps=opts.steps, eval_every=0)
    method = parse_methods(opts.method)[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="lpo-pipeline-step-") as tmp:
        rows = []
        t0 = time.time()
        run_pipeline(method, cfg, warm["path"], Path(tmp) / "pipeline", on_row=rows.append, progress=False)
        wall = time.time() - t0
        steps = sorted(rows, key=lambda r: r["step"])
        first = min((r["elapsed_s"] for r in steps if r["elapsed_s"] == r["elapsed_s"]), default=float("nan"))
        results["pipeline"] = {"first_step_s": first, "wall_s": wall,
                               "step_s": statistics.median(r["step_s"] for r in steps[1:] if "step_s" in r)}
        rows = []
        t0 = time.time()
        run_inprocess(method, cfg, warm["path"], on_row=rows.append, progress=False)
        wall = time.time() - t0
        steps = [r for r in sorted(rows, key=lambda r: r["step"]) if r["step"] > 0]
        results["inprocess"] = {"first_step_s": steps[0]["elapsed_s"], "wall_s": wall,
                                "step_s": statistics.median(r["step_s"] for r in steps[1:])}
    p, q = results["pipeline"], results["inprocess"]
    results["ratio"] = {key: p[key] / q[key] for key in ("first_step_s", "step_s", "wall_s")}
    results["config"] = {"method": opts.method, "k": opts.k, "prompts": opts.prompts, "steps": opts.steps,
                         "cores": os.cpu_count()}
    print(f"{opts.method}, K={opts.k}, {opts.prompts} prompts/step, {opts.steps} steps, {os.cpu_count()} cores")
    print(f"{'':12s} {'first step':>11s} {'step (median)':>14s} {'whole run':>10s}")
    for name in ("pipeline", "inprocess"):
        r = results[name]
        print(f"{name:12s} {r['first_step_s']:10.1f}s {r['step_s']:13.2f}s {r['wall_s']:9.1f}s")
    r = results["ratio"]
    print(f"{'ratio':12s} {r['first_step_s']:10.1f}x {r['step_s']:13.2f}x {r['wall_s']:9.1f}x   (pipeline / in-process)")
    if opts.json:
        tmp = opts.json + ".tmp"
        Path(tmp).write_text(json.dumps(results, indent=1))
        os.replace(tmp, opts.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
