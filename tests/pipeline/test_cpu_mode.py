"""CPU mode (openrlhf_lpo/cpu.py): what it patches, that it is lazy and off-switchable, and that
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
from openrlhf_lpo import cpu
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
from openrlhf_lpo import cpu
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

    from openrlhf_lpo.cpu import adjust_args

    args = SimpleNamespace(ds=SimpleNamespace(attn_implementation="flash_attention_2", packing_samples=True,
                                              enable_sleep=True),
                           vllm=SimpleNamespace(enable_sleep=True))
    notes = adjust_args(args)
    # packing stays on: sdpa reads the packed boundaries from the position ids (tests/openrlhf packing cases)
    assert args.ds.attn_implementation == "sdpa" and args.ds.packing_samples is True
    assert args.vllm.enable_sleep is False and args.ds.enable_sleep is False and len(notes) == 3
    assert adjust_args(args) == []


def test_cpu_flag_group_registered():
    from openrlhf_lpo import cpu  # noqa: F401  (registers the group)
    from openrlhf_lpo.cli import flags
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    assert "cpu" in flags.FLAG_GROUPS
    args = build_parser_and_parse(["--actor.model_name_or_path", "x", "--cpu.engine", "hf", "--reward.remote_url", "r.py",
                                   "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"])
    assert args.cpu.engine == "hf" and args.cpu.mode == "auto"
