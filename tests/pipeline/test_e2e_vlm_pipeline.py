"""End to end on the CPU with images: the real OpenRLHF Ray pipeline trains a tiny Qwen2.5-VL with the Clip-Cov
baseline (configs/methods/clip_cov.sh, the policy loss this project registers; arXiv 2505.22617) and the listwise
metrics of its paired target.

One module-scoped run of ``python -m openrlhf_lpo.cli.train_ppo_ray <clip_cov.sh's flags> --lpo.end_kl
--data.max_images_per_prompt 1`` on the synthetic PIL geometry task (data URIs in the prompt file):
Ray, OpenRLHF 0.11.2's trainer and actors with the LPO subclasses (``--lpo.end_kl``), DeepSpeed ZeRO-2 on the CPU,
the processor in the rollout executor, the CPU engine's ``hf-vlm`` backend, the geometry reward (plus a
small shaping term, tests/pipeline/vlm_e2e_reward.py, so groups are not degenerate). Two iterations
of 2 prompts x K=4, micro-batches of 2: the stock update with Clip-Cov's loss (a random tiny model's token
log-probs spread little, so the covariance band starts at 0 here: every micro-batch detaches one token), then the
end-of-update no-grad pass of KL(w*||P) that must see the images, a weight sync with text and image parity probes
after each, a checkpoint (DeepSpeed and HF, the HF one with the processor) after each. The vision tower trains (not
frozen), so the synced tower changes too. LPO's own image passes (the pre-pass of a window whose micro-batches split
groups): tests/openrlhf/test_lpo_vlm_exactness.py.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from e2e_common import method_flags, tb_scalars, tb_steps
from shared_ray import shared_ray_env
from openrlhf_lpo.data.geometry import generate_geometry_problems
from openrlhf_lpo.data.loaders import write_jsonl

pytestmark = pytest.mark.e2e  # an lpo-train run of a vision-language model

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = int(os.environ.get("LPO_E2E_TIMEOUT", "900"))


def vlm_args(model: str, data: str, out: Path):
    return [
        "--actor.model_name_or_path", model,
        "--data.prompt_dataset", data, "--data.input_key", "prompt", "--data.label_key", "label",
        "--data.image_key", "images", "--data.max_images_per_prompt", "1", "--data.apply_chat_template",
        "--cpu.trust_remote_code",  # the tiny VLM's processor is code in its folder
        "--reward.remote_url", str(REPO / "tests" / "pipeline" / "vlm_e2e_reward.py"),
        "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--algo.kl.init_coef", "0", *method_flags("clip_cov"), "--actor.clip_cov_lb", "0", "--lpo.end_kl",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
        "--train.batch_size", "4", "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "4",
        "--rollout.max_new_tokens", "12", "--data.max_len", "256", "--data.max_samples", "4",
        "--train.num_episodes", "1", "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa",
        "--actor.adam.lr", "0.01", "--actor.adam.weight_decay", "0.5",
        "--ckpt.save_steps", "1", "--ckpt.save_hf", "--ckpt.path", str(out / "ckpt"),
        "--ckpt.output_dir", str(out / "final"),
        "--logger.tensorboard_dir", str(out / "tb"),
    ]


@pytest.fixture(scope="module")
def vlm_e2e(tiny_vlm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_e2e")
    data = write_jsonl(generate_geometry_problems(4, seed=0, template="geometry-short"), str(root / "geo.jsonl"))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false",
               LPO_CPU_PARITY_LOG=str(root / "parity.jsonl"))
    env.pop("RAY_ADDRESS", None)
    env.update(shared_ray_env())
    out = root / "run"
    t0 = time.time()
    with open(root / "run.log", "w") as f:
        proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *vlm_args(tiny_vlm_dir, data, out)],
                              env=env, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, cwd=str(REPO))
    wall = time.time() - t0
    log = (root / "run.log").read_text(errors="replace")
    assert proc.returncode == 0, f"VLM run failed (rc={proc.returncode}); tail:\n{log[-6000:]}"
    print(f"\n[vlm e2e] two Clip-Cov iterations with images: {wall:.1f}s")
    parity = [json.loads(line) for line in (root / "parity.jsonl").read_text().splitlines() if line.strip()]
    return {"root": root, "out": out, "model": tiny_vlm_dir, "log": log, "parity": parity, "wall": wall}


def test_two_clip_cov_iterations_with_images(vlm_e2e):
    log = vlm_e2e["log"]
    assert "LPOTrainer" in log and "CPURolloutEngine" in log
    # the method file's Clip-Cov settings in effect (the band's lower end as this run sets it)
    assert ("policy loss clip_cov: token ratio clipped to [1-1, 1+1]; Clip-Cov detaches max(1, 0.0002 x tokens) of "
            "each micro-batch, drawn among those with covariance in (0, 5)") in log
    s = tb_scalars(vlm_e2e["out"] / "tb")
    assert tb_steps(s) == [1, 2]
    for key in ("train/lpo/groups", "train/lpo/kl_end", "train/lpo/kl_start", "train/actor_grad_norm",
                "train/clip_ratio", "train/policy_loss"):
        assert sorted(s.get(key, {})) == [1, 2], f"{key} not logged per step; keys: {sorted(s)}"
    assert set(s["train/lpo/groups"].values()) == {2.0}
    assert set(s["train/rollout/num_samples"].values()) == {8.0}
    # a real gradient through the image forward at both steps (Clip-Cov's token selection itself:
    # tests/openrlhf/test_cov_losses.py), the token fraction outside the band (docs/metrics.md), and the
    # end-of-update KL from a no-grad pass over the images
    assert min(s["train/actor_grad_norm"].values()) > 0
    assert all(0.0 <= v <= 1.0 for v in s["train/clip_ratio"].values())
    assert all(v >= 0.0 for v in s["train/lpo/kl_end"].values())


def test_weight_sync_parity_text_and_image_probes(vlm_e2e):
    records = vlm_e2e["parity"]
    assert [r.get("probe", "text") for r in records] == ["text", "image"] * 2, "two probes per sync, two syncs"
    for r in records:
        assert r["max_abs_diff"] <= 1e-4 and r["tol"] == 1e-4
        assert r["num_tensors"] == 56  # the vision tower trains, so every tensor is synced
    image = [r for r in records if r.get("probe") == "image"]
    assert image[0]["num_tokens"] > 16 and image[0]["probe_ids"] == image[1]["probe_ids"]
    moved = torch.tensor(image[0]["engine_log_probs"]) - torch.tensor(image[1]["engine_log_probs"])
    assert moved.abs().max() > 1e-4, "the weights changed between the syncs: the check compared new numbers"


def test_final_checkpoint_loads_with_its_processor_and_matches_the_engine(vlm_e2e):
    """Independent: the saved final model and processor (AutoProcessor, AutoModelForImageTextToText),
    evaluated here on the image probe, give the engine's last numbers; the initial model does not."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    last = [r for r in vlm_e2e["parity"] if r.get("probe") == "image"][-1]
    ids = last["probe_ids"]
    final_dir = str(vlm_e2e["out"] / "final")
    processor = AutoProcessor.from_pretrained(final_dir, trust_remote_code=True)
    from openrlhf_lpo.runtime.parity import image_probe

    probe_ids, images, mm = image_probe(processor)
    assert probe_ids == ids

    def probe_log_probs(path):
        model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa").eval()
        seq = torch.tensor([ids])
        with torch.no_grad():
            logits = model(seq, attention_mask=torch.ones_like(seq), mm_token_type_ids=(seq == model.config.image_token_id).int(),
                           **mm).logits[0].double()
        return torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0]

    engine_last = torch.tensor(last["engine_log_probs"], dtype=torch.float64)
    final, initial = probe_log_probs(final_dir), probe_log_probs(vlm_e2e["model"])
    print(f"[vlm e2e] image parity per sync {[r['max_abs_diff'] for r in vlm_e2e['parity']]}; final-model vs engine "
          f"{(final - engine_last).abs().max():.3g}; initial vs final {(initial - final).abs().max():.3g}")
    assert (final - engine_last).abs().max() < 1e-3
    assert (initial - final).abs().max() > 5e-3
    for step in (1, 2):  # --ckpt.save_hf step checkpoints load with their processor too (lpo-eval's input)
        hf_dir = vlm_e2e["out"] / "ckpt" / f"global_step{step}_hf"
        assert type(AutoProcessor.from_pretrained(hf_dir, trust_remote_code=True)).__name__ == "TinyQwen2_5_VLProcessor"
