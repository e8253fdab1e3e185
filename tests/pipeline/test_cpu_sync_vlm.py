"""CPU-mode weight sync of a VLM, vision tower frozen or not (the product's cpu_broadcast_to_engines,
a real Ray CPU engine, OpenRLHF's Actor; tests/pipeline/vlm_sync_worker.py in its own process).

Unfrozen: every tensor is sent. Frozen (``--actor.freeze_visual_encoder``): only the trainable
language-model tensors are sent, as upstream's broadcast_to_vllm does, and the engine keeps its
loaded tower, which equals the actor's frozen one. Either way the engine's log-probs of an image
prompt, measured here independently of the sync's own check, equal the actor's afterwards.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # Ray, a VLM actor and its CPU engines

HERE = Path(__file__).resolve().parent


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def sync_results(tiny_vlm_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vlm_sync") / "sync.json")
    env = dict(os.environ, LPO_CPU_THREADS="1", RAY_DEDUP_LOGS="0", OMP_NUM_THREADS="1",
               LPO_CPU_TRUST_REMOTE_CODE="1")  # the tiny VLM's processor is code in its folder
    env["PYTHONPATH"] = str(HERE.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    from shared_ray import shared_ray_env

    env.update(shared_ray_env())  # the test process's Ray cluster (tests/shared_ray.py), as lpo-train launches join it
    proc = subprocess.run([sys.executable, str(HERE / "vlm_sync_worker.py"), tiny_vlm_dir, out, _port()],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("freeze", [False, True])
def test_image_probe_parity_after_sync(sync_results, freeze):
    r = sync_results[str(freeze)]
    actor, before, after = (torch.tensor(r[k], dtype=torch.float64) for k in ("actor", "before", "after"))
    assert (after - actor).abs().max() < 1e-5
    assert (before - actor).abs().max() > 1e-3  # the sync carried new numbers
    records = [p for p in sync_results["parity"] if p["num_tensors"] == (r["trainable"] if freeze else r["total"])]
    assert [p.get("probe", "text") for p in records] == ["text", "image"]
    assert all(p["max_abs_diff"] <= 1e-4 for p in records)


def test_frozen_tower_is_not_sent(sync_results):
    full, frozen = sync_results["False"], sync_results["True"]
    assert full["trainable"] == full["total"] == 56
    assert 0 < frozen["trainable"] < frozen["total"]
    assert [p["num_tensors"] for p in sync_results["parity"]] == [56, 56, frozen["trainable"], frozen["trainable"]]
