"""A shortened ``lpo-demo`` through the real pipeline: warm-up, LPO-fwd and GRPO via lpo-train
(Ray, OpenRLHF actors, CPU rollout engine, the demo's reward file), metrics, plot, summary.

The ``ci`` preset: a micro Qwen3 warmed up for 20 steps (a fresh private cache), K=4, 4 prompts per
step, 2 RL steps per method. A few minutes on a quiet 2-core machine.
"""

import json
import math
import os
import struct
import subprocess
import sys

import pytest


@pytest.mark.timeout(1500)
def test_ci_preset_end_to_end(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, LPO_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.demo.cli", "--preset", "ci", "--run-dir", str(run),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=1450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    config = json.loads((run / "config.json").read_text())
    assert config["backend"] == "pipeline" and config["methods"] == ["lpo-fwd", "grpo"]
    k, g = config["rl"]["k"], config["rl"]["prompts_per_step"]
    warm = json.loads((run / "warmup.json").read_text())
    assert warm["cached"] is False and warm["steps"] == 20
    status = json.loads((run / "status.json").read_text())
    assert {n: s["state"] for n, s in status.items()} == {"lpo-fwd": "done", "grpo": "done"}

    for name in ("lpo-fwd", "grpo"):
        rows = [json.loads(x) for x in (run / "metrics" / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["method"] == name and r["backend"] == "pipeline"
            # 0/1 rewards over G*K samples
            assert 0.0 <= r["reward"] <= 1.0 and r["reward"] * g * k == pytest.approx(round(r["reward"] * g * k))
            assert r["upstream"]["rollout/num_samples"] == g * k
            assert 0.0 < r["entropy"] <= math.log(128) + 1e-6
            assert math.isfinite(r["grad_norm"]) and r["grad_norm"] >= 0.0
            # both methods log KL(w*||P) after the update against the same std-temperature target
            assert 0.0 <= r["kl_target"] <= r["upstream"]["lpo/kl_start"] + 0.5
            assert r["upstream"]["lpo/groups"] == g
            up = r["upstream"]  # on-policy start: P uniform, so KL(w*||U) = log K - H(w*)
            assert up["lpo/kl_start"] == pytest.approx(math.log(k) - up["lpo/entropy_target"], abs=1e-6)  # float32 logs
        assert (run / "pipeline" / name / "command.txt").read_text().startswith("lpo-train ")

    png = (run / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    assert w > 500 and h > 400
    summary = (run / "summary.txt").read_text()
    assert "lpo-fwd" in summary and "grpo" in summary and "steps to reach GRPO's final reward" in summary
