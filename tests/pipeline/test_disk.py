"""Disk: HF exports rotate with the training state (openrlhf_lpo/hf_exports.py) and ``--dry-run`` prints
what one checkpoint and the whole run need (openrlhf_lpo/cli/disk.py). The rotation inside a real run
is checked end to end in test_e2e_reward_errors.py (run A saves every step with --ckpt.max_num 1)."""

import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from openrlhf_lpo.cli import disk
from openrlhf_lpo.hf_exports import rotate_for_args, rotate_hf_exports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Qwen3-8B's config.json (the 8B recipe's model): 8,190,735,360 parameters on its model card
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False}


def _tree(root, exports, states=(), others=()):
    for name in exports:
        os.makedirs(os.path.join(root, f"{name}_hf"))
        open(os.path.join(root, f"{name}_hf", "model.safetensors"), "w").close()
    for name in states:
        os.makedirs(os.path.join(root, "_actor", name))
    for name in others:
        os.makedirs(os.path.join(root, name))


def _left(root):
    return sorted(d for d in os.listdir(root) if d.endswith("_hf") or d.startswith("."))


def test_exports_follow_the_states_that_deepspeed_kept(tmp_path):
    root = str(tmp_path)
    _tree(root, ["global_step20", "global_step40", "global_step60", "global_step80", "best_global_step40"],
          states=["global_step60", "global_step80", "best_global_step40"], others=["logs"])
    removed = rotate_hf_exports(root, 2, os.path.join(root, "_actor"), keep=["global_step80"])
    assert sorted(os.path.basename(p) for p in removed) == ["global_step20_hf", "global_step40_hf"]
    assert _left(root) == ["best_global_step40_hf", "global_step60_hf", "global_step80_hf"]
    assert os.path.isdir(os.path.join(root, "logs"))  # anything that is not an export is left alone


def test_without_states_the_newest_exports_by_step_are_kept(tmp_path):
    root = str(tmp_path)
    _tree(root, ["global_step100", "global_step20", "global_step5", "best_global_step5", "best_global_step20"])
    os.makedirs(os.path.join(root, ".global_step1_hf.removing"))  # a crash mid-removal left this
    rotate_hf_exports(root, 2, os.path.join(root, "_actor"))  # --ckpt.disable_ds: no state directories
    assert _left(root) == [".global_step1_hf.removing", "best_global_step20_hf", "global_step100_hf",
                           "global_step20_hf"]  # by step number, not by name (5 < 20 < 100)


def test_the_flags_choose_the_rule(tmp_path):
    def ckpt(root, **kw):
        return SimpleNamespace(path=root, max_num=1, **kw)

    a = str(tmp_path / "a")
    _tree(a, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(a, hf_max_num=None), keep=["global_step3"])
    assert _left(a) == ["global_step3_hf"]  # follows --ckpt.max_num's state rotation
    b = str(tmp_path / "b")
    _tree(b, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(b, hf_max_num=-1), keep=["global_step3"])
    assert len(_left(b)) == 3  # -1 keeps every export (a learning curve to evaluate later)
    c = str(tmp_path / "c")
    _tree(c, ["global_step1", "global_step2", "global_step3"], states=["global_step3"])
    rotate_for_args(ckpt(c, hf_max_num=2), keep=["global_step3"])
    assert _left(c) == ["global_step2_hf", "global_step3_hf"]  # its own count, regardless of the states


# ----------------------------------------------------------------------------- the estimate


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", True),
                                       ("mistral", False)])
def test_parameter_count_from_config_equals_the_instantiated_model(tmp_path, arch, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    from openrlhf_lpo.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / arch), arch=arch, tie_word_embeddings=tied)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    real = sum(p.numel() for p in model.parameters())  # tied weights counted once, as on disk
    assert disk.config_parameters(cfg) == real
    assert disk.model_parameters(path) == (real, "safetensors headers")


def test_qwen3_8b_checkpoint_and_run_disk(tmp_path):
    assert disk.config_parameters(QWEN3_8B) == 8_190_735_360
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": "1"}) + "\n" for i in range(7500)))
    env = dict(os.environ, LPO_PRINT_ARGS="1", MODEL=str(model), DATA=str(data), SAVE_ROOT=str(tmp_path))
    for key in ("EXTRA_ARGS", "METHOD", "BACKEND", "NNODES", "GPUS_PER_NODE"):
        env.pop(key, None)
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "train_math_qwen3_8b.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"go to {tmp_path}/math_qwen3-8b_lpo_fwd" in out.stderr  # the launcher says where
    from openrlhf_lpo.cli import plan
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    text = "\n".join(plan.plan_lines(build_parser_and_parse(out.stdout.splitlines())))  # what --dry-run prints
    n = 8_190_735_360
    state, hf = 14 * n, 2 * n  # bf16 weights + fp32 master and Adam m, v; the bf16 HF export
    assert "disk: model 8.19B parameters (config.json, dense-decoder formula), bf16" in text
    assert f"one checkpoint: {(state + hf) / 1e9:.1f} GB = state {state / 1e9:.1f} GB" in text
    # 7500 prompts / 256 = 30 batches x 10 episodes, a checkpoint every 20 steps, --ckpt.max_num 3
    total = 3 * state + (3 + 1) * hf + hf
    assert "300 steps, a checkpoint every 20 -> 15 saves" in text and f"= {total / 1e9:.1f} GB at most" in text
    assert f"under {tmp_path}/math_qwen3-8b_lpo_fwd/ckpt" in text


def test_recipes_write_outside_the_checkout_by_default():
    env = dict(os.environ, LPO_PRINT_ARGS="1")
    env.pop("SAVE_ROOT", None)
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "scripts", "train_math_qwen3_8b.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    ckpt = args[args.index("--ckpt.path") + 1]
    assert not os.path.abspath(ckpt).startswith(REPO + os.sep), ckpt
    assert ckpt == os.path.join(os.path.expanduser("~"), "lpo_runs", "math_qwen3-8b_lpo_fwd", "ckpt")
