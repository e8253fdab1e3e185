"""lpo-train end to end with rewards that cannot be computed (the project's reward file, real Ray, the
stock trainer and actors with our subclasses, the CPU engine, a tiny Qwen3).

Run A (LPO): one prompt's label names a task that does not exist, so its K samples' rewards raise inside
the reward function: before the per-sample catch that ended the run ("reward_model_group is required
when rewards are not precomputed"). Now the run trains both steps and TensorBoard counts the error
samples. It also saves every step with HF exports and --ckpt.max_num 1: the exports rotate with the
DeepSpeed state (upstream keeps every export).

Run B (the REINFORCE++-baseline method file, configs/methods/reinforce_pp.sh; the stock trainer with the
runtime safety nets): half the labels are bad. The first rollout batch fills half the 32-sample error window
and trains (whatever its share of bad prompts: a window that is not full never stops a run); the second
fills it with 16 errors, more than --reward.error_stop_frac 0.4 of it, and the run stops naming the task and
the exception, before training on that batch.
"""

import json

import pytest

from e2e_common import REPO, base_args, method_flags, run_cli, run_env, tb_scalars, tb_steps

pytestmark = pytest.mark.e2e  # lpo-train runs with failing rewards

REWARD_FILE = REPO / "openrlhf_lpo" / "rewards" / "reward_func.py"
GOOD = json.dumps({"task": "countdown", "nums": [1, 2], "target": 3})
BAD = json.dumps({"task": "chess"})


def _data(path, labels):
    path.write_text("".join(json.dumps({"prompt": f"Say something {i}:", "label": lab}) + "\n"
                            for i, lab in enumerate(labels)))
    return str(path)


def _args(model, data, out, extra=(), **kw):
    # the preflight refuses an unknown task before Ray starts; here the label stands in for the failures it
    # cannot see (the sandbox's Popen hitting EAGAIN, a grader pool that fails to start mid-run)
    args = base_args(model, data, out, extra=["--reward.error_window", "16", "--reward.error_stop_frac", "0.5",
                                              "--preflight", "off", *extra], **kw)
    args[args.index("--reward.remote_url") + 1] = str(REWARD_FILE)
    return args


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_errors")
    # 8 prompts in 2 batches of 4 (K=4): one bad prompt = 4 of the 16 samples of its batch
    once = _data(root / "once.jsonl", [GOOD] * 3 + [BAD] + [GOOD] * 4)
    # run a trains with the GSPO baseline (configs/methods/gspo.sh): OpenRLHF's sequence-level ratio loss
    gspo = ("group_norm", "--actor.policy_loss_type", "gspo", "--actor.eps_clip_low_high", "3e-4", "4e-4")
    argv_a = _args(tiny_model_dir, once, root / "a", ["--ckpt.save_hf", "--ckpt.max_num", "1"], estimator=gspo)
    rc_a, wall_a, log_a = run_cli(argv_a, run_env(), root / "a.log")
    persistent = _data(root / "persistent.jsonl", [GOOD, BAD] * 4)
    rc_b, wall_b, log_b = run_cli(_args(tiny_model_dir, persistent, root / "b",
                                        ["--ckpt.save_steps", "-1", "--reward.error_window", "32",
                                         "--reward.error_stop_frac", "0.4"],
                                        estimator=tuple(method_flags("reinforce_pp")[1:])), run_env(), root / "b.log")
    print(f"\n[e2e reward errors] one bad prompt {wall_a:.0f}s (rc {rc_a}), all bad {wall_b:.0f}s (rc {rc_b})")
    return {"a": (rc_a, log_a, root / "a"), "b": (rc_b, log_b, root / "b"), "argv_a": argv_a}


def test_a_failing_reward_costs_its_samples_not_the_run(runs):
    rc, log, out = runs["a"]
    assert rc == 0, f"the run died (rc={rc}); tail:\n{log[-6000:]}"
    tb = tb_scalars(out / "tb")
    assert tb_steps(tb) == [1, 2]
    frac = tb["train/reward/error_frac"]
    assert sorted(frac) == [1, 2]
    # the bad prompt's 4 samples out of its batch's 16; the other batch has none (seeded prompt order)
    assert sorted(frac.values()) == [0.0, 0.25]
    assert (out / "final" / "config.json").exists()
    # a GSPO update ran: OpenRLHF's sequence-level loss through the one update loop logged its policy loss at both steps
    assert "LPOTrainer" in log and sorted(tb["train/policy_loss"]) == [1, 2]
    from metric_contract import PROJECT_REWARD_INFO, check_run

    check_run(tb, runs["argv_a"], info=PROJECT_REWARD_INFO)


def test_hf_exports_rotate_with_the_training_state(runs):
    rc, log, out = runs["a"]
    assert rc == 0
    ckpt = out / "ckpt"
    assert sorted(p.name for p in (ckpt / "_actor").iterdir() if p.is_dir()) == ["global_step2"]  # upstream's rotation
    assert sorted(p.name for p in ckpt.iterdir() if p.name.endswith("_hf")) == ["global_step2_hf"]  # ours
    assert (ckpt / "global_step2_hf" / "config.json").exists()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # nothing half-removed left behind


def test_persistent_reward_errors_stop_the_run_naming_the_cause(runs):
    rc, log, out = runs["b"]
    assert rc == 4, f"expected the reward-error stop (rc 4), got rc={rc}; tail:\n{log[-6000:]}"
    assert "lpo-train: rewards could not be computed for 16 of the last 32 samples" in log
    assert "x task chess: ValueError: label task 'chess' is unknown" in log
    assert "--reward.error_stop_frac" in log
    assert "LPOTrainer" in log  # every estimator's trainer class (the safety nets included)
    assert "advantage R - group mean, whitened over the rollout batch" in log  # the method file's estimator
    tb = tb_scalars(out / "tb")
    assert tb_steps(tb) == [1]  # the first batch trained; the run stopped before training on the second
    assert sorted(tb["train/policy_loss"]) == [1] and sorted(tb["train/reward/error_frac"]) == [1]
