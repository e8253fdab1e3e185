"""End to end on the CPU: two iterations of the real pipeline (`lpo-train`, Ray, DeepSpeed on the CPU, the CPU
rollout engine) with the code reward from the bubblewrap sandbox, training the CISPO baseline as
``METHOD=cispo`` gives it (configs/methods/cispo.sh: the policy loss this project registers for OpenRLHF).
The reward path does not depend on the method; LPO's own pipeline runs are the other e2e modules.

A random tiny model never writes a code block, so every reward would be 0 and the gradient zero. The
fixture first teaches a tiny Qwen3 (plain torch, a few seconds) two answers to "print 2n": the right one
(``print(2*int(input()))``, passes both tests) and a wrong one (``print(int(input())+2)``, passes the
test with n = 2 only). Sampling at temperature 1 then mixes them, so the rollout rewards are 1, 0.5 or 0
(garbled samples) per response, groups have reward variance, and the update is not zero. The
rewards are computed by ``openrlhf_lpo/rewards/reward_func.py`` inside the rollout engine's Ray actor,
each program in its own sandbox.
"""

import os
import subprocess
import sys
import time

import pytest

from code_helpers import REPO, wait_no_sandbox_processes
from recipe_flags import method_flags
from shared_ray import shared_ray_env
from openrlhf_lpo.data.code import code_label
from openrlhf_lpo.data.loaders import write_jsonl
from openrlhf_lpo.rewards.code import grade_code
from openrlhf_lpo.testing.tensorboard_rows import scalars as tb_scalars

pytestmark = pytest.mark.e2e  # an lpo-train run (CISPO) with sandboxed code rewards

PROMPTS = ["Read n, print 2*n.\n", "Double the number n.\n"]
RIGHT = "```python\nprint(2*int(input()))\n```"
WRONG = "```python\nprint(int(input())+2)\n```"
TESTS = {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}
RUN_TIMEOUT_S = int(os.environ.get("LPO_E2E_TIMEOUT", "900"))


def teach(path: str) -> str:
    """Supervised steps on (prompt -> RIGHT | WRONG) so that sampling gives a mixture of both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    seqs, masks = [], []
    for p in PROMPTS:
        for t in (RIGHT, WRONG):
            pi = tok(p, add_special_tokens=False)["input_ids"]
            ti = tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(pi + ti)
            masks.append([0] * len(pi) + [1] * len(ti))
    n = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (n - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (n - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(150):
            logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logp * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.5, f"the warm-up did not learn the two answers (loss {loss.item():.3f})"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    from openrlhf_lpo.testing.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("code_e2e")
    model = teach(build_tiny_model(root / "tiny-coder", num_layers=2, hidden_size=64, num_heads=2, head_dim=32,
                                   num_kv_heads=1, intermediate_size=128))
    data = write_jsonl([{"prompt": p, "label": code_label(TESTS)} for p in PROMPTS], str(root / "code.jsonl"))
    out = root / "run"
    args = [
        "--actor.model_name_or_path", model,
        "--data.prompt_dataset", data, "--data.input_key", "prompt", "--data.label_key", "label",
        "--reward.remote_url", str(REPO / "openrlhf_lpo" / "rewards" / "reward_func.py"),
        "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
        "--algo.kl.init_coef", "0", *method_flags("cispo"),
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
        "--train.batch_size", "8", "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4",
        "--rollout.max_new_tokens", "48", "--data.max_len", "128", "--train.num_episodes", "2",
        "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa", "--actor.adam.lr", "1e-3",
        "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "final"),
        "--logger.tensorboard_dir", str(out / "tb"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LPO_CODE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false",
               LPO_CODE_SANDBOX="bwrap", LPO_CODE_REWARD="fraction", LPO_CODE_TIMEOUT_S="2", LPO_CODE_WORKERS="2")
    env.pop("RAY_ADDRESS", None)
    env.update(shared_ray_env())
    t0 = time.time()
    log_path = root / "run.log"
    with open(log_path, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *args], env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, cwd=str(REPO))
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"lpo-train failed (rc={proc.returncode}); tail:\n{log[-6000:]}"
    print(f"\n[code e2e] {time.time() - t0:.1f}s")
    return {"log": log, "scalars": tb_scalars(out / "tb"), "argv": args}


def test_the_taught_answers_grade_as_designed(box):
    assert grade_code(RIGHT, TESTS, sandbox=box).reward("fraction") == 1.0
    assert grade_code(WRONG, TESTS, sandbox=box).reward("fraction") == 0.5


def test_two_cispo_iterations_with_sandboxed_code_rewards(e2e):
    log, scalars = e2e["log"], e2e["scalars"]
    # steps from TensorBoard below (Ray may drop the trainer's last forwarded log line at exit)
    assert "LPOTrainer" in log and "CPURolloutEngine" in log
    # the method file's CISPO settings, in effect (the plan line lpo-train prints at its start)
    assert "policy loss cispo: detached token ratio clipped to [0, 4] as a weight; aggregation token-mean" in log
    # the engine's reward file probed the real sandbox when it loaded
    assert "[openrlhf_lpo] code reward sandbox: bwrap " in log
    mean, std = scalars["train/rollout/reward_mean"], scalars["train/rollout/reward_std"]
    assert sorted(mean) == [1, 2] and scalars["train/rollout/num_samples"] == {1: 8.0, 2: 8.0}
    for step, value in mean.items():  # 8 rewards in {0, 0.5, 1}: the mean is a multiple of 1/16
        assert abs(value * 16 - round(value * 16)) < 1e-5, (step, value)
    grad = scalars["train/actor_grad_norm"]
    print(f"\n[code e2e] reward mean {mean}, std {std}, grad norm {grad}")
    assert any(0.0 < v < 1.0 for v in mean.values()) and any(s > 0 for s in std.values())
    assert sorted(grad) == [1, 2] and max(grad.values()) > 0  # non-degenerate groups: a real CISPO update
    assert wait_no_sandbox_processes() == []


def test_cispo_logs_the_metric_contract(e2e):
    """CISPO (a registered policy-loss type) logs exactly the keys of docs/metrics.md, the code reward's extra logs
    included."""
    from metric_contract import PROJECT_REWARD_INFO, check_run

    check_run(e2e["scalars"], e2e["argv"], info=PROJECT_REWARD_INFO)
