"""The DeepSpeed LPO trainer check (``openrlhf_lpo/checks/trainer_check.py``, the
``deepspeed_lpo_trainer_zero{2,3}`` rows of ``examples/scripts/gpu_check.sh``) in its CPU mode.

The real ``LPOActorTrainer.ppo_train`` with OpenRLHF's real ``DeepspeedStrategy`` (gloo, one rank),
ZeRO-2 and ZeRO-3, micro-batches of K/2 samples (every group split): each window's gradient, read
from DeepSpeed's fp32 master weights, against the float64 window-by-window reference. vLLM is made
unimportable in the subprocess, as on a GPU machine without it: any import of it would end the run.
The second test breaks the trainer (pre-pass coefficients from s_t instead of a fresh forward) and
the check must FAIL. ``tests/megatron/test_megatron_gpu_check.py`` runs the rows through
``gpu_check.sh --cpu`` (fp32 and bf16).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN = """
import sys, json
sys.modules["vllm"] = None  # as on a GPU machine without vLLM: importing it raises
from openrlhf_lpo.checks import trainer_check as tc
{patch}
code = tc.main({argv!r})
print("VLLM_IMPORTED", sys.modules.get("vllm") is not None)
sys.exit(code)
"""

STALE = """
import torch
from openrlhf_lpo.cpu.mode import enable_cpu_mode
enable_cpu_mode()
at = tc.import_trainer()
# the bug this check must catch: later windows' coefficients from s_t instead of a fresh pre-pass
at.LPOActorTrainer._log_ratios = lambda self, items, batches, prev, extra=0: torch.zeros(sum(map(len, batches)), dtype=torch.float64)
"""


def run_check(tmp_path, zero, patch=""):
    out = tmp_path / "result.json"
    argv = ["--cpu", "--zero", zero, "--dtype", "fp32", "--work_dir", str(tmp_path / "w"), "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LPO_TRAINER_CHECK_MODEL", None)
    p = subprocess.run([sys.executable, "-c", RUN.format(patch=patch, argv=argv)], env=env, cwd=str(REPO),
                       capture_output=True, text=True, timeout=600)
    return p, (json.loads(out.read_text()) if out.exists() else [])


def test_deepspeed_trainer_matches_the_float64_reference_without_vllm(tmp_path):
    p, results = run_check(tmp_path, "2,3")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "VLLM_IMPORTED False" in p.stdout
    assert [r["zero_stage"] for r in results] == [2, 3]
    for r in results:
        assert r["engine_stage"] == r["zero_stage"] and r["partitioned"] == (r["zero_stage"] == 3)
        assert r["modes"] == ["shortcut", "pre_pass", "pre_pass", "pre_pass"] and r["steps"] == 4
        assert r["gas"] == 4  # DeepSpeed divides each micro-batch's loss by 4; the trainer compensates
        assert max(r["rel_errors"]) < 1e-4, r["rel_errors"]  # measured ~8e-6 (fp32 forward vs float64)
        assert min(r["ref_scales"]) > 1e-3 and r["kl_moved"] > 1e-3  # a non-trivial, moving reference
        assert r["problems"] == []


def test_check_fails_when_pre_pass_coefficients_are_stale(tmp_path):
    p, results = run_check(tmp_path, "2", patch=STALE)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = results
    assert r["rel_errors"][0] < 1e-4  # the shortcut window is right: s = s_t there
    assert max(r["rel_errors"][1:]) > 1e-2, r["rel_errors"]  # measured 4.3 (window 3)
    assert any("float64 reference" in x for x in r["problems"])
