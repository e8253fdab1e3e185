"""End to end on the CPU: the real OpenRLHF Ray pipeline with LPO, two iterations, then a resume.

One module-scoped run shared by the assertions (it is the expensive part of tests/pipeline):

* run A: ``python -m openrlhf_lpo.cli.train_ppo_ray --algo.advantage.estimator lpo`` with local
  Ray, the stock trainer/actors plus the LPO subclasses, DeepSpeed ZeRO-2 on the CPU, a tiny
  random Qwen3 built offline, the Countdown reward file and the CPU rollout engine. Two
  iterations; a checkpoint after each; weights synced to the engine after each.
* run B: the same command with ``--ckpt.load_enable``: it must load the step-2 checkpoint,
  push the restored weights to a fresh engine and finish.

The tiny model earns no Countdown reward (it is random), so the LPO gradient is zero; a large
AdamW weight decay moves the weights anyway, so every weight sync carries new numbers and the
log-prob parity check between actor and engine is not trivially met.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openrlhf_lpo.data.countdown import generate_problems
from openrlhf_lpo.data.loaders import write_jsonl

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = int(os.environ.get("LPO_E2E_TIMEOUT", "900"))


def e2e_args(model: str, data: str, out: Path, extra=()):
    return [
        "--actor.model_name_or_path", model,
        "--data.prompt_dataset", data, "--data.input_key", "prompt", "--data.label_key", "label",
        "--reward.remote_url", str(REPO / "openrlhf_lpo" / "rewards" / "reward_func.py"),
        "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
        "--algo.kl.init_coef", "0",
        "--algo.advantage.estimator", "lpo", "--lpo.divergence", "fwd",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
        "--train.batch_size", "8", "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4",
        "--rollout.max_new_tokens", "12", "--data.max_len", "640", "--data.max_samples", "4",
        "--train.num_episodes", "1", "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa",
        "--actor.adam.lr", "0.05", "--actor.adam.weight_decay", "0.5",
        "--ckpt.save_steps", "1", "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "final"),
        "--logger.tensorboard_dir", str(out / "tb"),
        *extra,
    ]


def run_cli(args, env, log: Path):
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *args],
            env=env, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, cwd=str(REPO),
        )
    return proc.returncode, time.time() - t0, log.read_text(errors="replace")


def read_jsonl(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def e2e(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = write_jsonl(generate_problems(4, seed=0, num_counts=(3,)), str(root / "countdown.jsonl"))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    out = root / "run"
    env_a = dict(env, LPO_CPU_PARITY_LOG=str(root / "parity_a.jsonl"))
    rc_a, wall_a, log_a = run_cli(e2e_args(tiny_model_dir, data, out), env_a, root / "run_a.log")
    assert rc_a == 0, f"run A failed (rc={rc_a}); tail:\n{log_a[-6000:]}"
    env_b = dict(env, LPO_CPU_PARITY_LOG=str(root / "parity_b.jsonl"))
    rc_b, wall_b, log_b = run_cli(
        e2e_args(tiny_model_dir, data, out, ["--ckpt.load_enable"]), env_b, root / "run_b.log"
    )
    assert rc_b == 0, f"run B (resume) failed (rc={rc_b}); tail:\n{log_b[-6000:]}"
    print(f"\n[e2e] run A {wall_a:.1f}s, run B (resume) {wall_b:.1f}s")
    return {
        "root": root, "out": out, "model": tiny_model_dir, "log_a": log_a, "log_b": log_b,
        "parity_a": read_jsonl(root / "parity_a.jsonl"),
        "parity_b": read_jsonl(root / "parity_b.jsonl") if (root / "parity_b.jsonl").exists() else [],
        "wall": (wall_a, wall_b),
    }


def tb_scalars(tb_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in tb_dir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def test_two_lpo_iterations_log_lpo_metrics(e2e):
    assert "Global step 1:" in e2e["log_a"] and "Global step 2:" in e2e["log_a"]
    assert "Global step 3:" not in e2e["log_a"]
    assert "LPOTrainer" in e2e["log_a"] and "CPURolloutEngine" in e2e["log_a"]
    scalars = tb_scalars(e2e["out"] / "tb")
    lpo = {k: v for k, v in scalars.items() if k.startswith("train/lpo/")}
    for key in ("train/lpo/kl_start", "train/lpo/abs_coef_mean", "train/lpo/groups", "train/lpo/tau_mean"):
        assert key in lpo, f"{key} not logged; LPO keys: {sorted(lpo)}"
        assert sorted(lpo[key]) == [1, 2]
    # 2 prompts x 4 samples per step: every group is seen once per step
    assert lpo["train/lpo/groups"][1] == pytest.approx(2.0) and lpo["train/lpo/groups"][2] == pytest.approx(2.0)
    assert set(scalars["train/rollout/num_samples"].values()) == {8.0}


def test_weight_sync_logprob_parity(e2e):
    records = e2e["parity_a"]
    assert len(records) == 2, "one weight sync per iteration"
    for r in records:
        assert r["max_abs_diff"] <= 1e-4 and r["tol"] == 1e-4
        diff = max(abs(a - b) for a, b in zip(r["actor_log_probs"], r["engine_log_probs"]))
        assert diff == pytest.approx(r["max_abs_diff"], abs=1e-12)
        assert len(r["engine_log_probs"]) == r["num_tokens"] > 20
    # the weights moved between syncs, so the check compared new numbers each time
    assert records[0]["weights_abs_sum"] != records[1]["weights_abs_sum"]

    # independent: the saved final model, evaluated here, gives the engine's last numbers,
    # and the initial model does not
    from transformers import AutoModelForCausalLM

    ids = records[-1]["probe_ids"]

    def probe_log_probs(path):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
        finally:
            torch.set_num_threads(threads)
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return lp.double()

    engine_last = torch.tensor(records[-1]["engine_log_probs"], dtype=torch.float64)
    final = probe_log_probs(str(e2e["out"] / "final"))
    initial = probe_log_probs(e2e["model"])
    print(f"[e2e] parity max|diff| per sync {[r['max_abs_diff'] for r in records]}; "
          f"final-model vs engine {(final - engine_last).abs().max():.3g}; "
          f"initial vs final {(initial - final).abs().max():.3g}")
    assert (final - engine_last).abs().max() < 1e-3
    assert (initial - final).abs().max() > 5e-3


def test_checkpoint_saved_and_resumed(e2e):
    actor_ckpt = e2e["out"] / "ckpt" / "_actor"
    assert (actor_ckpt / "global_step1").is_dir() and (actor_ckpt / "global_step2").is_dir()
    assert (actor_ckpt / "latest").read_text().strip() == "global_step2"
    assert "Loading the checkpoint" in e2e["log_b"]
    # the resumed run continues after step 2 (it never repeats steps 1-2) ...
    assert "Global step 1:" not in e2e["log_b"] and "Global step 2:" not in e2e["log_b"]
    # ... and its first weight sync carries exactly the restored step-2 weights
    restored = e2e["parity_b"][0]
    assert restored["max_abs_diff"] <= 1e-4
    assert restored["weights_abs_sum"] == pytest.approx(e2e["parity_a"][-1]["weights_abs_sum"], rel=1e-12)
    a_last = torch.tensor(e2e["parity_a"][-1]["actor_log_probs"])
    assert (torch.tensor(restored["actor_log_probs"]) - a_last).abs().max() < 1e-6
