"""End to end on CPU: ``lpo-train --backend megatron --megatron.tp 2`` (OpenRLHF 0.11.2 on Ray,
CPU mode, CPU rollout engines) colocated the way OpenRLHF's single-node scripts run, ``--train.colocate_all
--vllm.enable_sleep --ds.enable_sleep`` (two engines on the actor's two logical GPUs), two iterations with
checkpoints, then a resumed run.

Checks: the placement check against the (CPU-mode) Ray cluster passes; both iterations finish
with activation recompute; OpenRLHF's trainer puts the actor to sleep (``offload_states`` at start-up and
after every ``fit``, ``reload_states`` before it): every sleep leaves 0 parameter bytes on the device; the
weights reach the engines after every step through the IPC route (``update_weight_bucket_ipc`` with the
shared-memory stand-in, one handle per rank keyed by its logical GPU, in buckets of ``--megatron.sync_bucket_mb
0.0125``: one call per bucket and engine, numbered on over the run) and the engines' log-probs of a probe
sequence then equal the Megatron actor's (logged by the sync); the policy checkpoint (``global_step2``, older
ones pruned by ``--ckpt.max_num 1``) and the HF export exist, saved while the actor sleeps: every save reads the
optimizer state from host memory (no tracked byte of the actor's state on the device during it), each sleep drops
the gradient buffer and the host pool holds its size once Adam's state exists; the resumed run starts from the
checkpoint (its first sync comes from a sleeping actor).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
from e2e_common import method_flags, tb_scalars, tb_steps  # noqa: E402
from shared_ray import shared_ray_env  # noqa: E402

pytestmark = pytest.mark.e2e  # lpo-train --backend megatron runs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _run(argv, env, log, timeout=1200):
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *argv], env=env, cwd=str(REPO),
                           stdout=f, stderr=subprocess.STDOUT, timeout=timeout, start_new_session=True)
    return p.returncode, Path(log).read_text()


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    from openrlhf_lpo.demo.task import get_task, write_prompt_dataset
    from openrlhf_lpo.testing.tiny import build_tiny_model

    w = tmp_path_factory.mktemp("mega_e2e")
    model = build_tiny_model(w / "model", arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=128)
    data = write_prompt_dataset(str(w / "data.jsonl"), get_task("addition"), 64, 0)
    env = dict(os.environ, OMP_NUM_THREADS="1", LPO_CPU_PARITY_LOG=str(w / "parity.jsonl"), RAY_DEDUP_LOGS="0",
               LPO_CPU_NUM_CPUS="8", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **shared_ray_env())
    base = [
        "--actor.model_name_or_path", model, "--data.prompt_dataset", data, "--data.input_key", "prompt",
        "--data.label_key", "label", "--data.apply_chat_template", "--data.max_len", "128",
        "--reward.remote_url", str(HERE / "megatron_e2e_reward.py"),
        "--vllm.num_engines", "2", "--vllm.sync_backend", "gloo",
        "--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep",  # OpenRLHF's hybrid engine
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2", "--algo.kl.init_coef", "0",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--rollout.micro_batch_size", "4",
        "--rollout.max_new_tokens", "4", "--rollout.temperature", "1.0",
        "--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.max_epochs", "1",
        "--actor.adam.lr", "1e-2", "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
        "--actor.max_norm", "1.0", "--actor.gradient_checkpointing_enable", "--ckpt.max_num", "1",
        "--actor.entropy_coef", "0", "--ds.attn_implementation", "sdpa", "--logger.logging_steps", "1",
        "--ckpt.path", str(w / "ckpt"), "--ckpt.output_dir", str(w / "final"), "--ckpt.save_steps", "1",
        "--ckpt.save_hf", "--algo.advantage.estimator", "lpo", "--lpo.end_kl",
        "--backend", "megatron", "--megatron.tp", "2", "--megatron.params_dtype", "fp32",
        "--megatron.sync_bucket_mb", "0.0125",  # 13107 bytes: buckets of several tensors, and tensors alone
    ]
    argv1 = base + ["--data.max_samples", "8", "--train.num_episodes", "1", "--logger.tensorboard_dir", str(w / "tb1")]
    rc1, log1 = _run(argv1, env, w / "run1.log")
    parity1 = [json.loads(x) for x in (w / "parity.jsonl").read_text().splitlines()] if (w / "parity.jsonl").exists() else []
    n1 = len(parity1)
    hf1 = sorted(p.name for p in (w / "ckpt").glob("*_hf"))  # HF exports after run 1 (rotated with the state)
    # the resumed run trains its two steps with the KL-Cov baseline as its method file gives it (a checkpoint holds
    # weights, optimizer and data position, no estimator state): a registered policy-loss type's steps on the
    # Megatron backend, its covariance top-k computed on both TP ranks of the last stage
    argv2 = base + ["--data.max_samples", "8", "--train.num_episodes", "2", "--ckpt.load_enable",
                    "--logger.tensorboard_dir", str(w / "tb2"), *method_flags("kl_cov")]
    rc2, log2 = _run(argv2, env, w / "run2.log")
    # steps and metrics from tensorboard: Ray may drop the trainer's last forwarded log lines at exit
    parity2 = [json.loads(x) for x in (w / "parity.jsonl").read_text().splitlines()][n1:] if (w / "parity.jsonl").exists() else []
    return dict(w=w, rc1=rc1, log1=log1, rc2=rc2, log2=log2, parity1=parity1, parity2=parity2, hf1=hf1,
                argv1=argv1, argv2=argv2,
                tb1=tb_scalars(w / "tb1"), tb2=tb_scalars(w / "tb2"))


SLEEP = re.compile(r"\[megatron\] rank (\d+) asleep: (\d+) weight bytes and (\d+) optimizer bytes moved to host "
                   r"memory, (\d+) gradient bytes dropped \(zeroed on wake\); parameter bytes on the device: (\d+); "
                   r"host pool: (\d+) bytes")
SAVED = re.compile(r"\[megatron\] rank (\d+) saved (global_step\d+): tracked state bytes on the device during the "
                   r"save (\d+) \(plan: 0 bytes of state, transients up to (\d+) bytes\)")


def _sleeps(log):
    """Per rank, the (weight bytes, optimizer bytes, parameter bytes left, gradient bytes dropped, host pool bytes)
    of each offload_states."""
    out = {}
    for rank, wb, sb, gb, left, pool in SLEEP.findall(log):
        out.setdefault(int(rank), []).append((int(wb), int(sb), int(left), int(gb), int(pool)))
    return out


def _ipc_syncs(parity):
    """The syncs' records: by IPC, one handle per rank keyed by its logical GPU, both engines fed by the node's
    leader one call per bucket (fewer than tensors), its numbers running on from sync to sync."""
    syncs = [r for r in parity if r.get("backend") == "megatron"]
    assert all(r.get("route") == "ipc" and r.get("transport") == "shared-memory" for r in syncs), syncs
    assert all(len(set(r["device_ids"])) == 2 and all(":gpu" in d for d in r["device_ids"]) for r in syncs)
    buckets = syncs[0]["buckets"]
    assert 1 < buckets < syncs[0]["num_tensors"], syncs[0]
    assert all(r["node_engines"] == 2 and r["buckets"] == buckets and r["calls"] == 2 * buckets for r in syncs)
    assert [r["seq"] for r in syncs] == [buckets * (i + 1) for i in range(len(syncs))]
    return syncs


def test_two_iterations_and_weight_sync(e2e):
    assert e2e["rc1"] == 0, e2e["log1"][-5000:]
    tb = e2e["tb1"]
    assert tb_steps(tb) == [1, 2]
    assert "MegatronPolicyModelActor" in e2e["log1"]
    fits = re.search(r"\[megatron\] placement on the Ray cluster fits: (.*)", e2e["log1"]).group(1)
    assert fits.startswith("node 0: Megatron actor TP group") and "vLLM engine x1" not in fits  # engines share GPUs
    # the actor group's ranks in node-major bundle order, the TP group on one node (openrlhf/placement.py)
    assert re.search(r"\[placement\] MegatronPolicyModelActor: node 0 \([0-9a-f]{8}\): ranks 0-1\n", e2e["log1"])
    # the weights went by IPC (one handle per rank, keyed by its logical GPU) and the engines score as the actor
    syncs = _ipc_syncs(e2e["parity1"])
    assert len(syncs) == 2 and all(r["max_abs_diff"] < 1e-4 and r["num_tensors"] > 0 for r in syncs)
    # the actor slept at start-up and after each fit: nothing of its parameters stayed on the device; the gradient
    # buffer is dropped (never copied); the host pool grows once, when Adam's moments appear, then stays the same
    sleeps = _sleeps(e2e["log1"])
    assert sorted(sleeps) == [0, 1] and all(len(v) == 3 for v in sleeps.values()), sleeps
    for rank, events in sleeps.items():
        assert all(wb > 0 and left == 0 and gb > 0 for wb, _, left, gb, _ in events), (rank, events)
        start, after_fit = events[0], events[1:]
        assert all(sb > start[1] for _, sb, _, _, _ in after_fit), (rank, events)  # Adam moments exist after a step
        pools = [pool for *_, pool in events]
        assert pools[0] < pools[1] == pools[2], (rank, pools)
        assert pools[1] - (after_fit[0][0] + after_fit[0][1]) in range(0, 4096 + 64 * 64), (rank, events)
    # every save ran asleep (after the sync) and read the optimizer state from host memory: nothing came back
    saved = SAVED.findall(e2e["log1"])
    assert sorted((int(r), tag) for r, tag, _, _ in saved) == [(r, f"global_step{s}") for r in (0, 1) for s in (1, 2)]
    assert all(int(left) == 0 and int(plan) > 0 for _, _, left, plan in saved), saved
    assert max(tb["train/actor_grad_norm"].values()) > 0  # informative groups: the policy was updated
    end_kl, groups = tb["train/lpo/kl_end"], tb["train/lpo/groups"]
    assert sorted(end_kl) == [1, 2] and all(v >= 0 for v in end_kl.values())
    assert [groups[s] for s in (1, 2)] == [4.0, 4.0]  # reduced over DP
    assert e2e["hf1"] == ["global_step2_hf"]  # step 1's export went with its state (--ckpt.max_num 1)


def test_resume_continues_from_checkpoint(e2e):
    assert e2e["rc2"] == 0, e2e["log2"][-5000:]
    assert tb_steps(e2e["tb2"]) == [3, 4]  # resumed after global step 2, trained what was left
    # with KL-Cov (configs/methods/kl_cov.sh): GRPO's advantage and KL-Cov's loss in the run's method line, a
    # policy-gradient update at both steps (its token selection: tests/openrlhf/test_cov_losses.py), the listwise
    # metrics at its paired temperature (--lpo.end_kl, std)
    assert ("method: advantage (R - mean)/std per group (paired LPO temperature std); policy loss kl_cov: token ratio "
            "unclipped; KL-Cov adds 1 x |log r| on the max(1, 0.002 x tokens) of largest covariance in each "
            "micro-batch; aggregation token-mean") in e2e["log2"]
    tb2 = e2e["tb2"]
    assert sorted(tb2["train/policy_loss"]) == [3, 4] and sorted(tb2["train/lpo/kl_end"]) == [3, 4]
    # a step whose groups all tie (reward std 0 in every group) has zero advantage and, on-policy, a zero KL-Cov
    # term (|log r| at r = 1): its gradient is exactly 0; every other step moves the policy
    informative = {s: tb2["train/group_reward_std"][s] > 0 for s in (3, 4)}
    assert any(informative.values())
    norms = tb2["train/actor_grad_norm"]
    assert all((norms[s] > 0) == informative[s] for s in (3, 4)), (norms, informative)
    # the resumed trainer syncs first (from the actor asleep since start-up), then after each of its 2 steps
    syncs = _ipc_syncs(e2e["parity2"])
    assert len(syncs) == 3 and all(r["max_abs_diff"] < 1e-4 for r in syncs)
    sleeps = _sleeps(e2e["log2"])
    assert sorted(sleeps) == [0, 1] and all(len(v) == 3 and all(e[2] == 0 for e in v) for v in sleeps.values())
    assert all(int(left) == 0 for _, _, left, _ in SAVED.findall(e2e["log2"]))
    actor = e2e["w"] / "ckpt" / "_actor"
    assert (actor / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in actor.glob("global_step*")) == ["global_step4"]  # --ckpt.max_num 1
    assert (actor / "global_step4" / "meta.json").exists()
    ck = e2e["w"] / "ckpt"
    assert sorted(p.name for p in ck.glob("*_hf")) == ["global_step4_hf"]
    assert (ck / "global_step4_hf" / "model.safetensors.index.json").exists()


def test_both_runs_log_the_metric_contract(e2e):
    """The Megatron backend's LPO run and its RLOO run (--lpo.end_kl) log exactly the keys of docs/metrics.md: the
    same contract the DeepSpeed runs check (tests/pipeline/test_e2e_cpu_pipeline.py)."""
    from metric_contract import check_run

    assert e2e["rc1"] == 0 and e2e["rc2"] == 0
    check_run(e2e["tb1"], e2e["argv1"])
    check_run(e2e["tb2"], e2e["argv2"])
    for s in (1, 2):  # the token fraction outside the band, and the per-step mean gradient norm
        assert 0.0 <= e2e["tb1"]["train/clip_ratio"][s] <= 1.0 and e2e["tb1"]["train/response_entropy"][s] > 0.0
