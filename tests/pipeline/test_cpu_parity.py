"""CPU mode's weight-sync parity check fails the run on a mismatch (openrlhf_lpo/runtime/parity.py, cpu.py).

One subprocess (CPU mode, the test process's Ray cluster, a one-process gloo group) with the real pieces: OpenRLHF's
``Actor`` inside a real DeepSpeed engine, trained-looking weights (the checkpoint perturbed), and two
real CPU rollout engines as Ray actors: one started from the actor's checkpoint, one from a copy whose
config differs (``rms_norm_eps``), as an engine started from the wrong model would. A sync hands both
the same weights; only the first then scores the probe sequence as the actor does.
"""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # Ray, a DeepSpeed actor and two CPU engines

PROBE = r"""
import json, os, socket, sys
model_dir, bad_dir, log_path = sys.argv[1:4]
from openrlhf_lpo.cpu import mode as cpu
assert cpu.enable_cpu_mode()
import ray, torch, deepspeed
from types import SimpleNamespace as NS
from openrlhf.models import Actor
from transformers import AutoTokenizer
from openrlhf_lpo.engines.cpu_engine import RemoteCPURolloutEngine
from openrlhf_lpo.runtime.parity import check_engine_parity, probe_sequence

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
cpu.init_ray(num_cpus=2, num_gpus=0)
good = RemoteCPURolloutEngine.options(num_cpus=0).remote(model_dir, seed=0)
bad = RemoteCPURolloutEngine.options(num_cpus=0).remote(bad_dir, seed=0)

actor = Actor(model_dir, attn_implementation="sdpa", param_dtype="fp32")
torch.manual_seed(3)
with torch.no_grad():  # the actor has trained: its weights left the checkpoint's
    for p in actor.model.parameters():
        p.add_(0.05 * torch.randn_like(p))
engine, *_ = deepspeed.initialize(model=actor.model, config={
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}})
actor.model = engine  # as OpenRLHF's strategy.prepare leaves it
tok = AutoTokenizer.from_pretrained(model_dir)
trainer = NS(strategy=NS(args=NS(ds=NS(zero_stage=0))), actor=actor, tokenizer=tok, vllm_engines=[good])
ids = probe_sequence(tok)
out = {"num_tokens": len(ids) - 1}
before = ray.get(good.log_probs_of.remote(ids, 1.0))

# 1. a sync into the engine built from the actor's checkpoint: parity holds
os.environ["LPO_CPU_PARITY_LOG"] = log_path
cpu.cpu_broadcast_to_engines(trainer)
actor_lp = cpu._actor_log_probs(actor, ids)
after = ray.get(good.log_probs_of.remote(ids, 1.0))
out["good_vs_actor"] = float((torch.tensor(after, dtype=torch.float64) - actor_lp).abs().max())
out["sync_moved"] = max(abs(a - b) for a, b in zip(after, before))
out["good_updates"] = ray.get(good.backend_info.remote())["num_weight_updates"]

# 2. the same sync with the mismatched engine among them: the run fails, naming the tolerance
trainer.vllm_engines = [good, bad]
try:
    cpu.cpu_broadcast_to_engines(trainer)
    out["mismatch_error"] = None
except RuntimeError as e:
    out["mismatch_error"] = str(e)
out["bad_updates"] = ray.get(bad.backend_info.remote())["num_weight_updates"]

# 3. the tolerance itself, on the engine's own log-probs shifted on one token
os.environ.pop("LPO_CPU_PARITY_LOG")
base = torch.tensor(ray.get(good.log_probs_of.remote(ids, 1.0)), dtype=torch.float64)

def check(delta, tol=None):
    if tol is not None:
        os.environ["LPO_CPU_PARITY_TOL"] = tol
    shifted = base.clone()
    shifted[len(ids) // 2] += delta
    try:
        return check_engine_parity([good], ids, shifted, 1.0)
    except RuntimeError as e:
        return str(e)
    finally:
        os.environ.pop("LPO_CPU_PARITY_TOL", None)

out["shift_5e-5"] = check(5e-5)
out["shift_2e-4"] = check(2e-4)
out["shift_5e-5_tol_1e-5"] = check(5e-5, "1e-5")
ray.shutdown()
print(json.dumps(out))
"""


def test_parity_mismatch_fails_the_sync_and_the_tolerance_holds(tiny_model_dir, repo_env, tmp_path):
    import shutil

    bad = tmp_path / "wrong-config"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5  # same weights, another model: what a wrongly started engine computes
    (bad / "config.json").write_text(json.dumps(cfg))
    log = tmp_path / "parity.jsonl"
    from shared_ray import shared_ray_env

    # the test process's Ray cluster (tests/shared_ray.py), as lpo-train launches join it
    env = dict(repo_env, LPO_CPU_THREADS="1", RAY_DEDUP_LOGS="0", **shared_ray_env())
    env.pop("LPO_CPU_PARITY_TOL", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, tiny_model_dir, str(bad), str(log)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["num_tokens"] >= 20
    # 1. the good engine received the trained weights and scores the probe as the actor does
    assert res["good_updates"] >= 1 and res["sync_moved"] > 1e-2
    assert res["good_vs_actor"] < 1e-4
    # 2. the mismatched engine got the same weights, and the sync raised, naming the tolerance
    assert res["bad_updates"] == 1
    err = res["mismatch_error"]
    assert err is not None and "differ from the actor's after the weight sync" in err
    assert "LPO_CPU_PARITY_TOL=0.0001" in err
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(entries) == 2  # one line per check, the failing one included
    assert entries[0]["max_abs_diff"] < 1e-4 and entries[0]["tol"] == 1e-4
    good, bad_diff = entries[1]["per_engine"]
    assert good < 1e-4 and bad_diff > 1e-3 and entries[1]["max_abs_diff"] == bad_diff
    # 3. max |diff| against LPO_CPU_PARITY_TOL (default 1e-4): 5e-5 passes, 2e-4 fails, a tighter tolerance fails 5e-5
    assert abs(res["shift_5e-5"] - 5e-5) < 1e-9
    assert "max |diff| 0.0002 > LPO_CPU_PARITY_TOL=0.0001" in res["shift_2e-4"]
    assert "> LPO_CPU_PARITY_TOL=1e-05" in res["shift_5e-5_tol_1e-5"]
