#!/usr/bin/env python
"""A real ``lpo-eval`` report from the tiny model, on CPU, offline (the README's evaluation example).

    python scripts/eval_tiny_report.py --out /tmp/tiny-eval            # ~5 min on 2 busy cores

1. Trains the CPU demo's tiny Qwen3 (0.4M parameters, ``openrlhf_lpo.demo.warmup``) on 2-digit addition
   for each of ``--steps`` SFT steps and saves it where OpenRLHF saves HF checkpoints:
   ``OUT/ckpts/addition_sft/ckpt/global_step<S>_hf``. Training is deterministic, so the step-S model is
   the first S steps of one run.
2. Writes a held-out addition benchmark (``OUT/addition.jsonl``, ``problem``/``answer`` rows) and runs
   ``lpo-eval run`` on every checkpoint (a custom benchmark through ``--data``, the chat template with
   the bare question, the template's default stop strings, the transformers engine), then
   ``lpo-eval compare`` of the first and last checkpoints (``OUT/compare.md``, ``OUT/compare.html``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="50,100,200,300")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    steps = [int(s) for s in args.steps.split(",")]

    from openrlhf_lpo.demo.warmup import WarmupConfig, train_warmup

    for s in steps:
        d = out / "ckpts" / "addition_sft" / "ckpt" / f"global_step{s}_hf"
        if (d / "warmup.json").exists():
            continue
        d.mkdir(parents=True, exist_ok=True)
        summary = train_warmup(WarmupConfig(max_steps=s, eval_every=s, target_accuracy=1.0), d, progress=False)
        print(f"trained step {s}: sampled accuracy {summary['sampled_accuracy']:.2f} ({summary['wall_s']:.0f}s)", flush=True)

    rng = random.Random(12345)  # disjoint from the warm-up's training and held-out streams
    data = out / "addition.jsonl"
    rows = []
    for _ in range(args.problems):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"problem": f"{a}+{b}", "answer": str(a + b)})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    from evaluation.cli import main as lpo_eval

    runs = out / "runs"
    code = lpo_eval(["--no-progress", "run", "--ckpts", str(out / "ckpts" / "addition_sft"), "--benchmarks", "addition",
                     "--data", f"addition={data}", "--template", "chat-plain", "--engine", "hf", "--temperature", "1.0",
                     "--top-p", "1.0", "--n", str(args.n), "--k", str(args.n), "--max-tokens", "8", "--workers", "2",
                     "--out", str(runs)])
    if code:
        return code
    first, last = f"global_step{steps[0]}_hf", f"global_step{steps[-1]}_hf"
    return lpo_eval(["compare", "--runs", str(runs), "--a", first, "--b", last, "--md", str(out / "compare.md"),
                     "--html", str(out / "compare.html")])


if __name__ == "__main__":
    sys.exit(main())
