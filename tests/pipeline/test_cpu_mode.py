"""CPU mode (openrlhf_lpo/cpu/mode.py): what it patches, that it is lazy and off-switchable, and that
the rest of the product names no device. Patching runs in subprocesses so this pytest process
keeps the real ``torch.cuda``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys, torch
from openrlhf_lpo.cpu import mode as cpu
out = {"active": cpu.enable_cpu_mode()}
out["lazy"] = "openrlhf.trainer.ray.ppo_actor" not in sys.modules
out["device"] = str(torch.cuda.current_device())
torch.cuda.synchronize(); torch.cuda.set_device(0); torch.cuda.empty_cache()
try:
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    out["triton_ce_blocked"] = False
except ImportError:
    out["triton_ce_blocked"] = True

from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
from openrlhf.trainer.ppo_utils.experience import Experience
buf = NaiveReplayBuffer(2, cpu_offload=True)
out["buffer_device"] = str(buf.target_device)
exp = Experience(sequences=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
                 action_mask=torch.ones(2, 4, dtype=torch.bool), action_log_probs=torch.zeros(2, 4),
                 advantages=torch.ones(2, 4), returns=torch.ones(2, 4), rewards=torch.ones(2), info={})
buf.append(exp)
batch = buf.collate_fn([buf[0], buf[1]])
batch.to_device(torch.cuda.current_device())
out["batch_device"] = str(batch.sequences.device)

from openrlhf.trainer.ray import ppo_actor, vllm_engine
from openrlhf_lpo.engines.cpu_engine import CPURolloutActorClass
out["sync_patched"] = ppo_actor.ActorPPOTrainer.broadcast_to_vllm is cpu.cpu_broadcast_to_engines
out["engine_patched"] = isinstance(vllm_engine.RolloutRayActor, CPURolloutActorClass)

from openrlhf.utils.deepspeed import deepspeed as ds_mod
cfg = ds_mod.get_train_ds_config(offload=False, adam_offload=False, stage=2,
                                 optim_config={"type": "AdamW", "params": {"lr": 1e-3}})
out["torch_adam"] = cfg["optimizer"]["params"].get("torch_adam")
import socket
with socket.socket() as sk:
    sk.bind(("127.0.0.1", 0)); port = sk.getsockname()[1]
torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
mesh = ds_mod.init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
out["mesh_device"] = mesh.device_type
torch.distributed.destroy_process_group()
import importlib
ds_comm = importlib.import_module("deepspeed.comm.torch")
out["shm_op"] = repr(ds_comm.build_shm_op())  # not JIT-compiled in CPU mode
print(json.dumps(out))
"""

OFF = r"""
import json, os, torch
os.environ["LPO_CPU_MODE"] = "0"
from openrlhf_lpo.cpu import mode as cpu
active = cpu.enable_cpu_mode()
try:
    torch.cuda.current_device(); raised = False
except Exception:
    raised = True
print(json.dumps({"active": active, "raised": raised}))
"""


def run_py(code, env):
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU mode is off on a GPU machine by design")
def test_cpu_mode_patches_upstream(repo_env):
    res = run_py(PROBE, repo_env)
    assert res["active"] is True and res["lazy"] is True
    assert res["device"] == "cpu" and res["triton_ce_blocked"] is True
    assert res["buffer_device"] == "cpu" and res["batch_device"] == "cpu"
    assert res["sync_patched"] and res["engine_patched"] and res["torch_adam"] is True
    assert res["mesh_device"] == "cpu" and res["shm_op"] == "None"


def test_cpu_mode_can_be_switched_off(repo_env):
    res = run_py(OFF, repo_env)
    assert res["active"] is False
    assert res["raised"] is (not __import__("torch").cuda.is_available())  # torch.cuda left untouched


def test_adjust_args_rewrites_gpu_only_settings():
    from types import SimpleNamespace

    from openrlhf_lpo.cpu.mode import adjust_args

    args = SimpleNamespace(ds=SimpleNamespace(attn_implementation="flash_attention_2", packing_samples=True,
                                              enable_sleep=True),
                           vllm=SimpleNamespace(enable_sleep=True))
    notes = adjust_args(args)
    # packing stays on: sdpa reads the packed boundaries from the position ids (tests/openrlhf packing cases)
    assert args.ds.attn_implementation == "sdpa" and args.ds.packing_samples is True
    assert args.vllm.enable_sleep is False and args.ds.enable_sleep is False and len(notes) == 3
    assert adjust_args(args) == []


def test_cpu_flag_group_registered():
    from openrlhf_lpo.cpu import mode as cpu  # noqa: F401  (registers the group)
    from openrlhf_lpo.cli import flags
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    assert "cpu" in flags.FLAG_GROUPS
    args = build_parser_and_parse(["--actor.model_name_or_path", "x", "--cpu.engine", "hf", "--reward.remote_url", "r.py",
                                   "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"])
    assert args.cpu.engine == "hf" and args.cpu.mode == "auto"


WORKER = r"""
import json, os, sys
os.environ["LPO_CPU_MODE"] = "1"  # what the CPU mode's Ray runtime env sets in every worker
from openrlhf_lpo.cpu import mode as cpu
cpu.worker_setup()
out = {"torch_at_setup": "torch" in sys.modules}
import torch
out["device"] = str(torch.cuda.current_device())
torch.cuda.synchronize()
print(json.dumps(out))
"""


def test_a_ray_worker_applies_the_cpu_mode_without_importing_torch(repo_env):
    """The worker hook of a CPU-mode Ray job: a worker Ray starts and never uses does not pay torch's import;
    torch is patched as soon as an actor's code imports it."""
    res = run_py(WORKER, repo_env)
    assert res == {"torch_at_setup": False, "device": "cpu"}


def test_the_runtime_env_carries_the_drivers_lpo_settings(monkeypatch):
    """Workers of a cluster the run joins inherit nothing from the driver: every LPO_* variable (a code reward's
    LPO_CODE_*, a reward file's own), OMP_NUM_THREADS and PYTHONPATH travel in the job's runtime env."""
    from openrlhf_lpo.cpu import mode as cpu

    monkeypatch.setenv("LPO_CODE_SANDBOX", "bwrap")
    monkeypatch.setenv("LPO_E2E_REWARD_LOG", "/tmp/x.jsonl")
    monkeypatch.setenv("LPO_CPU_MODE", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NOT_OURS", "1")
    env = cpu.ray_runtime_env({"EXTRA": "y"})
    assert env["worker_process_setup_hook"] == "openrlhf_lpo.cpu.mode.worker_setup"
    got = env["env_vars"]
    assert (got["LPO_CODE_SANDBOX"], got["LPO_E2E_REWARD_LOG"], got["OMP_NUM_THREADS"], got["EXTRA"]) == \
        ("bwrap", "/tmp/x.jsonl", "3", "y")
    assert got["LPO_CPU_MODE"] == "1" and "NOT_OURS" not in got  # the workers run the CPU mode, whatever the driver had


def test_a_local_ray_start_that_times_out_is_tried_again(monkeypatch, capsys):
    """On a busy 2-core machine Ray's raylet can miss its fixed 30 s registration wait ("The current node timed
    out during startup"): the CPU mode starts the cluster again (3 attempts), other errors stop at once. The
    timeout is injected (it cannot be provoked on demand); everything else is the real call."""
    import pytest
    import ray

    from openrlhf_lpo.cpu import mode as cpu

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if sum(c != "shutdown" for c in calls) < 3:
            raise Exception("The current node timed out during startup. This could happen because ...")
        return "ctx"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cpu.init_ray(num_cpus=2, num_gpus=1) == "ctx"
    assert [c if c == "shutdown" else (c["num_cpus"], c["num_gpus"]) for c in calls] == \
        [(2, 1), "shutdown", (2, 1), "shutdown", (2, 1)]
    assert "starting it again (3/3)" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(RuntimeError("port in use")))
    with pytest.raises(RuntimeError, match="port in use"):
        cpu.init_ray(num_cpus=2, num_gpus=1)
