"""A stand-in training process for the runner's bookkeeping test: ``STEPS`` steps, one metrics row and one
checkpoint (the step number, written atomically) per step; ``--resume`` continues after the checkpoint."""

import json
import os
import sys
import time
from pathlib import Path

work, metrics, steps, delay = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
resume = "--resume" in sys.argv
ckpt = work / "ckpt"
start = int(ckpt.read_text()) if resume and ckpt.exists() else 0
with open(work / "starts.log", "a") as f:
    f.write(f"{start}\n")
rows = [json.loads(x) for x in metrics.read_text().splitlines()] if resume and metrics.exists() else []
rows = [r for r in rows if r["step"] <= start]  # steps after the checkpoint are trained again
metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
for step in range(start + 1, steps + 1):
    time.sleep(delay)
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": step, "reward": step / steps}) + "\n")
    (work / "ckpt.tmp").write_text(str(step))
    os.replace(work / "ckpt.tmp", ckpt)
