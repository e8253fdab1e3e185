"""The Megatron backend trains with divergences named by the family registry (alpha:<a>, hellinger, tv):
``loss_spec_from_args`` keeps the name, and one ``MegatronActor.train_step`` (whole-group loss and
two-pass surrogate, gloo world 1) moves the weights by minus the float64 gradient of the listwise loss
written from the divergence's definition (divergence_family_worker.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a Megatron actor in a gloo world of its own

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_megatron_actor_trains_with_parametric_divergences(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(HERE / "divergence_family_worker.py"), port, str(out)], env=env,
                          cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == {"alpha:0.5", "alpha:-0.5", "alpha:2", "hellinger", "tv"}
    assert {r["spec"] for r in results.values()} == {"listwise", "listwise_surrogate"}
    for name, r in results.items():
        # Adam's first step with lr = eps = 1e5 is g / (1 + |g|/1e5): SGD to ~|g| x 1e-5 relative
        assert r["scale"] > 1e-2 and r["n_tensors"] >= 20, (name, r)
        assert r["rel"] < 2e-5, (name, r)
