"""Every recipe script (x every method) parses with the lpo-train parser and keeps the paper's settings.

The scripts print their final flag list with ``LPO_PRINT_ARGS=1`` (bash evaluates the config
files exactly as a launch would); the flags then go through ``build_parser_and_parse``: the stock
OpenRLHF 0.11.2 parser and validation plus our flag groups. The Megatron recipes
(``BACKEND=megatron``) are parsed against a tiny offline model with Qwen3-8B/14B's head layout
(8 query and 8 KV heads), because the Megatron layout check reads the model's HF config.
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
ALL_METHODS = sorted(p.stem for p in (REPO / "configs" / "methods").glob("*.sh"))
# the 2026 baselines and their LPO pairs (docs/methods.md): parsed on the 8B DeepSpeed and 14B Megatron recipes
# -> (estimator, lpo temperature, eps_clip_low_high, policy_loss_type, loss_agg_mode)
EXPECTED_BASELINE = {
    "rloo": ("rloo", None, (0.2, 0.2), "ppo", None),
    "reinforce_pp": ("reinforce_baseline", None, (0.2, 0.2), "ppo", None),
    "gspo": ("group_norm", None, (3e-4, 4e-4), "gspo", None),
    "dapo": ("group_norm", None, (0.2, 0.28), "ppo", "token-mean"),
    "cispo": ("group_norm", None, (1.0, 3.0), "cispo", "token-mean"),
    "lpo_fwd_rloo": ("lpo", "loo", (0.2, 0.2), None, None),
    "lpo_rev_rloo": ("lpo", "loo", (0.2, 0.2), None, None),
    "lpo_fwd_reinforce_pp": ("lpo", "batch_std", (0.2, 0.2), None, None),
    "lpo_rev_reinforce_pp": ("lpo", "batch_std", (0.2, 0.2), None, None),
    "lpo_fwd_dapo": ("lpo", "std", (0.2, 0.28), None, None),
    "lpo_rev_dapo": ("lpo", "std", (0.2, 0.28), None, None),
    "clip_cov": ("group_norm", None, (1.0, 1.0), "clip_cov", "token-mean"),
    "kl_cov": ("group_norm", None, (0.2, 0.2), "kl_cov", "token-mean"),
    "tpo": ("lpo", "pop_std", (0.2, 0.2), None, None),
    "lpo_fwd_tpo": ("lpo", "pop_std", (0.2, 0.2), None, None),
    "lpo_rev_tpo": ("lpo", "pop_std", (0.2, 0.2), None, None),
}
# the covariance types' options and TPO's score / anchor as the method files set them (the paper's values)
EXPECTED_OPTIONS = {
    "clip_cov": {"actor.clip_cov_ratio": 2e-4, "actor.clip_cov_lb": 1.0, "actor.clip_cov_ub": 5.0},
    "kl_cov": {"actor.kl_cov_ratio": 2e-3, "actor.kl_cov_coef": 1.0},
    "tpo": {"lpo.score": "sum", "lpo.anchor": "old", "lpo.divergence": "fwd"},
    "lpo_fwd_tpo": {"lpo.score": "mean_clip", "lpo.anchor": "none", "lpo.divergence": "fwd"},
    "lpo_rev_tpo": {"lpo.score": "mean_clip", "lpo.anchor": "none", "lpo.divergence": "rev"},
}
METHODS = [m for m in ALL_METHODS if m not in EXPECTED_BASELINE]

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
    "train_code_qwen3_1.7b.sh": (256, 128, 4096, "Qwen/Qwen3-1.7B-Base"),
    "train_math_qwen3_8b.sh": (256, 128, 4096, "Qwen/Qwen3-8B-Base"),
    "train_math_qwen3_8b_long_context.sh": (256, 128, 4096, "Qwen/Qwen3-8B-Base"),
    "train_math_qwen3_8b_async.sh": (256, 128, 4096, "Qwen/Qwen3-8B-Base"),
    "train_math_qwen3_8b_megatron.sh": (256, 128, 4096, None),
    "train_math_qwen3_14b_megatron.sh": (256, 128, 4096, None),
    "train_math_qwen3_32b_megatron.sh": (256, 128, 4096, None),
    "train_math_r1_distill_llama_70b_megatron.sh": (256, 128, 4096, None),
    "train_geometry_qwen2.5_vl_3b.sh": (128, 64, 1024, "Qwen/Qwen2.5-VL-3B-Instruct"),
}
# image recipes: OpenRLHF 0.11.2's VLM flags
EXPECTED_IMAGES = {"train_geometry_qwen2.5_vl_3b.sh"}
EXPECTED_DEFAULT_MODEL = {
    "train_math_qwen3_8b_megatron.sh": "Qwen/Qwen3-8B-Base",
    "train_math_qwen3_14b_megatron.sh": "Qwen/Qwen3-14B-Base",
    "train_math_qwen3_32b_megatron.sh": "Qwen/Qwen3-32B",
    "train_math_r1_distill_llama_70b_megatron.sh": "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
}
# Megatron recipes: (tp, pp, actor GPUs, colocated with the vLLM engines); every recipe shares every GPU with its
# engines: 8B and 14B on one 8-GPU node, 32B on two nodes and 70B on four (docs/megatron.md)
EXPECTED_MEGATRON = {
    "train_math_qwen3_8b_megatron.sh": (2, 1, 8, True),
    "train_math_qwen3_14b_megatron.sh": (4, 1, 8, True),
    "train_math_qwen3_32b_megatron.sh": (8, 2, 16, True),
    "train_math_r1_distill_llama_70b_megatron.sh": (8, 4, 32, True),
}


def script_args(name, method, **env):
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("MODEL", "DATA", "EXTRA_ARGS", "METHOD", "BACKEND", "MEGATRON_TP", "MEGATRON_PP", "NNODES",
                            "GPUS_PER_NODE", "VLLM_ENGINES", "VLLM_TP", "ACTOR_NODES", "ACTOR_GPUS", "TASK")}
    run_env.update(LPO_PRINT_ARGS="1", METHOD=method, **env)
    out = subprocess.run(["bash", str(SCRIPTS_DIR / name)], env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_recipes_and_methods_exist():
    assert set(EXPECTED_TASK) <= set(RECIPES)
    assert set(METHODS) == set(EXPECTED_METHOD) and set(ALL_METHODS) == set(METHODS) | set(EXPECTED_BASELINE)
    for name in RECIPES:  # one line switches the method
        lines = [l for l in (SCRIPTS_DIR / name).read_text().splitlines() if l.startswith("METHOD=")]
        assert lines == ['METHOD="${METHOD:-lpo_fwd}"']


@pytest.mark.parametrize("method", sorted(EXPECTED_BASELINE))
@pytest.mark.parametrize("script", ["train_math_qwen3_8b.sh", "train_math_qwen3_14b_megatron.sh"])
def test_baseline_methods_parse_on_both_backends(script, method, request):
    """METHOD=<each 2026 baseline or its LPO pair> on the 8B DeepSpeed and the 14B Megatron recipe."""
    env = {"MODEL": request.getfixturevalue("megatron_layout_model")} if script in EXPECTED_MEGATRON else {}
    args = build_parser_and_parse(script_args(script, method, **env))
    est, temp, eps, loss_type, agg = EXPECTED_BASELINE[method]
    assert args.algo.advantage.estimator == est and tuple(args.actor.eps_clip_low_high) == eps
    if est == "lpo":
        assert args.lpo.temperature == temp
    else:
        assert args.actor.policy_loss_type == loss_type
    if agg:
        assert args.actor.loss_agg_mode == agg
    for dotted, value in EXPECTED_OPTIONS.get(method, {}).items():
        group, name = dotted.split(".")
        assert getattr(getattr(args, group), name) == value, (method, dotted)
    if method.endswith("dapo"):  # dynamic sampling and overlong shaping over the last fifth of the response budget
        assert args.algo.dynamic_filtering_enable and tuple(args.algo.dynamic_filtering_range) == (0.0, 1.0)
        assert args.reward.overlong_buffer_len == args.rollout.max_new_tokens // 5


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("script", RECIPES)
def test_recipe_parses_with_paper_settings(script, method, request):
    env = {}
    if script in EXPECTED_MEGATRON:
        env["MODEL"] = request.getfixturevalue("megatron_layout_model")
    args = build_parser_and_parse(script_args(script, method, **env))
    if script in EXPECTED_MEGATRON:
        tp, pp, gpus, colocated = EXPECTED_MEGATRON[script]
        assert (args.backend, args.megatron.tp, args.megatron.pp) == ("megatron", tp, pp)
        assert args.actor.num_nodes * args.actor.num_gpus_per_node == gpus
        assert (args.train.colocate_all, args.vllm.enable_sleep, args.ds.enable_sleep) == (colocated,) * 3
    elif script.endswith("_async.sh"):  # async engines cannot sleep: actor and engines on separate GPUs
        assert args.backend == "deepspeed" and not args.train.colocate_all and args.train.async_enable
        assert args.train.partial_rollout_enable and args.algo.advantage.is_correction_level == "token"
        assert args.actor.num_gpus_per_node + args.vllm.num_engines == 8
    else:
        assert args.backend == "deepspeed" and args.train.colocate_all
    if script.endswith("_long_context.sh"):
        assert args.train.dynamic_batch_enable and args.ds.packing_samples and args.train.micro_batch_size == 1
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
    # long runs restart on their own after a preemption, from checkpoints every save_steps, >= 2 kept
    assert args.ckpt.auto_resume == 3 and args.ckpt.load_enable and args.ckpt.save_steps > 0 and args.ckpt.max_num >= 2
    prompts, mini, tokens, model = EXPECTED_TASK[script]
    assert args.rollout.batch_size == prompts and args.train.batch_size == mini * 8
    assert args.rollout.max_new_tokens == tokens and args.actor.model_name_or_path == (model or env["MODEL"])
    assert args.data.max_len >= tokens
    if script in EXPECTED_IMAGES:
        assert (args.data.image_key, args.data.max_images_per_prompt) == ("images", 1)
        assert args.data.apply_chat_template and not args.ds.packing_samples
        assert args.data.max_len >= tokens + 1024  # room for the prompt with its image tokens
    else:
        assert args.data.max_images_per_prompt == 0


def test_extra_args_override_and_bad_method():
    argv = script_args("train_countdown_qwen3_4b.sh", "lpo_fwd", EXTRA_ARGS="--lpo.temperature 0.5")
    assert build_parser_and_parse(argv).lpo.temperature == 0.5
    bad = subprocess.run(["bash", str(SCRIPTS_DIR / "train_countdown_qwen3_4b.sh")],
                         env=dict(os.environ, LPO_PRINT_ARGS="1", METHOD="nope"), capture_output=True, text=True)
    assert bad.returncode == 2 and "METHOD=nope" in bad.stderr
    bad = subprocess.run(["bash", str(SCRIPTS_DIR / "train_countdown_qwen3_4b.sh")],
                         env=dict(os.environ, LPO_PRINT_ARGS="1", BACKEND="fsdp"), capture_output=True, text=True)
    assert bad.returncode == 2 and "BACKEND=fsdp" in bad.stderr


def test_megatron_recipe_rejects_a_layout_the_model_cannot_split(megatron_layout_model, capsys):
    argv = script_args("train_math_qwen3_8b_megatron.sh", "lpo_fwd", MODEL=megatron_layout_model, MEGATRON_TP="1",
                       MEGATRON_PP="8", ACTOR_GPUS="8")
    with pytest.raises(SystemExit):
        build_parser_and_parse(argv)
    assert "num_hidden_layers=4" in capsys.readouterr().err


def test_image_recipe_refuses_the_megatron_backend(tmp_path, capsys):
    """BACKEND=megatron on the Geometry3k recipe: the parse stops with the VLM refusal (a tiny offline
    Qwen2.5-VL stands in for the hub model, whose config the Megatron check reads)."""
    from openrlhf_lpo.testing.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm")
    argv = script_args("train_geometry_qwen2.5_vl_3b.sh", "lpo_fwd", BACKEND="megatron", MODEL=model)
    with pytest.raises(SystemExit):
        build_parser_and_parse(argv)
    assert "does not support vision-language models" in capsys.readouterr().err


@pytest.mark.parametrize("script", SMOKES)
@pytest.mark.parametrize("method", ["lpo_fwd", "grpo"])
def test_smoke_scripts_parse(script, method):
    args = build_parser_and_parse(script_args(script, method))
    assert args.algo.advantage.estimator == EXPECTED_METHOD[method][0]
    assert args.vllm.num_engines == 1 and args.ckpt.save_steps == 1


def test_cpu_debug_geometry_task_parses():
    args = build_parser_and_parse(script_args("cpu_debug.sh", "lpo_fwd", TASK="geometry"))
    assert args.data.max_images_per_prompt == 1 and args.data.image_key == "images"
    assert args.actor.model_name_or_path.endswith("tiny-qwen2.5-vl")


@pytest.mark.parametrize("script", sorted(EXPECTED_DEFAULT_MODEL))
def test_megatron_recipe_default_models(script):
    argv = script_args(script, "lpo_fwd")  # printed flags only: the hub model is not read here
    assert argv[argv.index("--actor.model_name_or_path") + 1] == EXPECTED_DEFAULT_MODEL[script]
    assert argv[argv.index("--backend") + 1] == "megatron"


def test_code_recipe_sends_the_sandbox_settings_to_every_ray_worker():
    """The code reward runs in the rollout workers: its LPO_CODE_* settings travel in the job's runtime env."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("LPO_CODE_") and k not in ("METHOD", "EXTRA_ARGS")}
    run = lambda script, **extra: subprocess.run(  # noqa: E731
        ["bash", str(SCRIPTS_DIR / script)], env=dict(env, LPO_PRINT_RUNTIME_ENV="1", **extra),
        capture_output=True, text=True, check=True).stdout
    runtime = json.loads(run("train_code_qwen3_1.7b.sh"))
    assert runtime["working_dir"] == str(REPO)
    assert runtime["env_vars"] == {"LPO_CODE_SANDBOX": "bwrap", "LPO_CODE_REWARD": "fraction",
                                   "LPO_CODE_TIMEOUT_S": "5", "LPO_CODE_MEMORY_MB": "1024",
                                   "LPO_CODE_ENGINES_PER_NODE": "8", "LPO_CODE_WORKERS": "auto"}
    assert json.loads(run("train_code_qwen3_1.7b.sh", GPUS_PER_NODE="4"))["env_vars"]["LPO_CODE_ENGINES_PER_NODE"] == "4"
    assert json.loads(run("train_code_qwen3_1.7b.sh", LPO_CODE_REWARD="all"))["env_vars"]["LPO_CODE_REWARD"] == "all"
    assert json.loads(run("train_math_qwen3_1.7b.sh")) == {"working_dir": str(REPO)}  # other tasks: unchanged
    args = build_parser_and_parse(script_args("train_code_qwen3_1.7b.sh", "grpo"))
    assert args.data.apply_chat_template and args.reward.remote_url[0].endswith("openrlhf_lpo/rewards/reward_func.py")
    assert args.data.prompt_dataset == "data/prime_code_train.jsonl"


ONE_NODE_RECIPES = ["train_math_qwen3_1.7b.sh", "train_math_qwen3_8b.sh", "train_countdown_qwen3_4b.sh",
                    "train_code_qwen3_1.7b.sh"]  # (long_context: --train.dynamic_batch_enable, see docs/megatron.md)


@pytest.mark.parametrize("script", ONE_NODE_RECIPES)
def test_any_single_node_recipe_runs_on_megatron_with_the_defaults(script, megatron_layout_model):
    """README: "any recipe: BACKEND=megatron". With the backend's defaults on one 8-GPU node the actor takes all
    8 GPUs (TP 4, DP 2) and 8 engines x TP1 share them (colocated, as on DeepSpeed); COLOCATE=0 gives the engines
    4 GPUs and the actor the other 4 (TP 4, DP 1). Either way the placement needs 8 GPUs."""
    from openrlhf_lpo.cli import plan

    args = build_parser_and_parse(script_args(script, "lpo_fwd", BACKEND="megatron", MODEL=megatron_layout_model))
    assert (args.backend, args.megatron.tp) == ("megatron", 4)
    assert args.actor.num_nodes * args.actor.num_gpus_per_node == 8 and args.vllm.num_engines == 8
    assert args.train.colocate_all and args.vllm.enable_sleep and args.ds.enable_sleep
    assert plan.gpus_needed(args) == 8
    split = build_parser_and_parse(script_args(script, "lpo_fwd", BACKEND="megatron", MODEL=megatron_layout_model,
                                               COLOCATE="0"))
    assert split.actor.num_nodes * split.actor.num_gpus_per_node == 4 and split.vllm.num_engines == 4
    assert not split.train.colocate_all and plan.gpus_needed(split) == 8


def test_megatron_defaults_say_what_to_set_when_the_node_is_full():
    run_env = {k: v for k, v in os.environ.items() if k not in ("ACTOR_GPUS", "VLLM_ENGINES", "NNODES", "BACKEND")}
    out = subprocess.run(["bash", str(SCRIPTS_DIR / "train_math_qwen3_1.7b.sh")], capture_output=True, text=True,
                         env=dict(run_env, LPO_PRINT_ARGS="1", BACKEND="megatron", VLLM_ENGINES="8", COLOCATE="0"))
    assert out.returncode == 2 and "leave no GPU for the actor; lower VLLM_ENGINES or set ACTOR_GPUS" in out.stderr
