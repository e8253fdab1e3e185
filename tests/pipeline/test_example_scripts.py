"""Every recipe script (x every method) parses with the lpo-train parser and keeps the paper's settings.

The scripts print their final flag list with ``LPO_PRINT_ARGS=1`` (bash evaluates the config
files exactly as a launch would); the flags then go through ``build_parser_and_parse``: the stock
OpenRLHF 0.11.2 parser and validation plus our flag groups. The Megatron scripts belong to the
Megatron backend and are parsed by its own tests.
"""

import os
import subprocess
from pathlib import Path

import pytest

from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

REPO = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = REPO / "examples" / "scripts"
RECIPES = sorted(p.name for p in SCRIPTS_DIR.glob("train_*.sh") if "lib/launch.sh" in p.read_text())
SMOKES = ["gpu_smoke.sh", "cpu_debug.sh"]
METHODS = sorted(p.stem for p in (REPO / "configs" / "methods").glob("*.sh"))

EXPECTED_METHOD = {
    "grpo": ("group_norm", None, None, None),
    "dr_grpo": ("dr_grpo", None, None, None),
    "maxrl": ("maxrl", None, None, None),
    "lpo_fwd": ("lpo", "fwd", "std", None),
    "lpo_rev": ("lpo", "rev", "std", None),
    "lpo_fwd_drgrpo": ("lpo", "fwd", "one", None),
    "lpo_rev_drgrpo": ("lpo", "rev", "one", None),
    "lpo_fwd_maxrl": ("lpo", "fwd", "mean", None),
    "lpo_rev_maxrl": ("lpo", "rev", "mean", None),
    "pointwise": ("lpo", None, "std", "pointwise"),
}
# task -> (prompts per rollout batch, prompts per mini-batch, response tokens)
EXPECTED_TASK = {
    "train_countdown_qwen3_4b.sh": (128, 64, 1024, "Qwen/Qwen3-4B-Base"),
    "train_math_qwen3_1.7b.sh": (256, 128, 4096, "Qwen/Qwen3-1.7B-Base"),
    "train_math_qwen3_8b.sh": (256, 128, 4096, "Qwen/Qwen3-8B-Base"),
}


def script_args(name, method, **env):
    run_env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA", "EXTRA_ARGS", "METHOD")}
    run_env.update(LPO_PRINT_ARGS="1", METHOD=method, **env)
    out = subprocess.run(["bash", str(SCRIPTS_DIR / name)], env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_recipes_and_methods_exist():
    assert set(EXPECTED_TASK) <= set(RECIPES)
    assert set(METHODS) == set(EXPECTED_METHOD)
    for name in RECIPES:  # one line switches the method
        lines = [l for l in (SCRIPTS_DIR / name).read_text().splitlines() if l.startswith("METHOD=")]
        assert lines == ['METHOD="${METHOD:-lpo_fwd}"']


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("script", RECIPES)
def test_recipe_parses_with_paper_settings(script, method):
    args = build_parser_and_parse(script_args(script, method))
    est, div, temp, proj = EXPECTED_METHOD[method]
    assert args.algo.advantage.estimator == est
    if est == "lpo":
        assert args.lpo.divergence == (div or "fwd") and args.lpo.temperature == temp
        assert args.lpo.projection == (proj or "listwise")
    # the paper's shared settings (Sec. 5, App. D.3)
    assert args.rollout.n_samples_per_prompt == 8
    assert args.actor.adam.lr == 1e-6 and tuple(args.actor.adam.betas) == (0.9, 0.999)
    assert args.actor.adam.weight_decay == 0.1 and tuple(args.actor.eps_clip_low_high) == (0.2, 0.2)
    assert args.rollout.temperature == 1.0 and args.rollout.top_p == 1.0
    assert args.algo.kl.init_coef == 0 and args.algo.kl.use_loss is False
    prompts, mini, tokens, model = EXPECTED_TASK[script]
    assert args.rollout.batch_size == prompts and args.train.batch_size == mini * 8
    assert args.rollout.max_new_tokens == tokens and args.actor.model_name_or_path == model
    assert args.data.max_len >= tokens


def test_extra_args_override_and_bad_method():
    argv = script_args("train_countdown_qwen3_4b.sh", "lpo_fwd", EXTRA_ARGS="--lpo.temperature 0.5")
    assert build_parser_and_parse(argv).lpo.temperature == 0.5
    bad = subprocess.run(["bash", str(SCRIPTS_DIR / "train_countdown_qwen3_4b.sh")],
                         env=dict(os.environ, LPO_PRINT_ARGS="1", METHOD="nope"), capture_output=True, text=True)
    assert bad.returncode == 2 and "METHOD=nope" in bad.stderr


@pytest.mark.parametrize("script", SMOKES)
@pytest.mark.parametrize("method", ["lpo_fwd", "grpo"])
def test_smoke_scripts_parse(script, method):
    args = build_parser_and_parse(script_args(script, method))
    assert args.algo.advantage.estimator == EXPECTED_METHOD[method][0]
    assert args.vllm.num_engines == 1 and args.ckpt.save_steps == 1
