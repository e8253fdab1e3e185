"""lpo-train's CLI: stock flags unchanged, lpo/maxrl added, invalid combinations fail at parse time."""

import sys
from unittest import mock

import pytest

from openrlhf_lpo.cli import flags
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse, get_parser, main

BASE = [
    "--actor.model_name_or_path", "unused", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
    "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4", "--train.batch_size", "16",
    "--train.micro_batch_size", "2", "--vllm.num_engines", "1", "--reward.remote_url", "http://unused",
]


def _with(**over):
    argv = list(BASE)
    for flag, value in over.items():
        flag = "--" + flag.replace("__", ".")
        if flag in argv:
            i = argv.index(flag)
            argv[i + 1] = value
        else:
            argv += [flag, value]
    return argv


def test_stock_parser_options_are_unchanged():
    stock, ours = get_parser(extended=False), get_parser(extended=True)
    stock_actions = {a.dest: a for a in stock._actions}
    our_actions = {a.dest: a for a in ours._actions}
    assert len(stock_actions) > 150
    for dest, a in stock_actions.items():
        b = our_actions[dest]
        assert b.option_strings == a.option_strings and b.default == a.default and b.type == a.type, dest
        if dest == "actor.policy_loss_type":  # the stock choices, in order, then the ones we register (cispo)
            assert list(b.choices[: len(a.choices)]) == list(a.choices) and "cispo" in b.choices
        elif dest != "algo.advantage.estimator":
            assert b.choices == a.choices, dest
    est = our_actions["algo.advantage.estimator"].choices
    assert list(est[: len(stock_actions["algo.advantage.estimator"].choices)]) == list(
        stock_actions["algo.advantage.estimator"].choices)
    assert "lpo" in est and "maxrl" in est
    added = set(our_actions) - set(stock_actions)
    assert {"lpo.divergence", "lpo.temperature", "lpo.projection", "lpo.force_two_pass", "lpo.end_kl"} <= added


def test_lpo_defaults_and_values():
    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "lpo"])
    assert (args.lpo.divergence, args.lpo.temperature, args.lpo.projection) == ("fwd", "std", "listwise")
    assert args.actor.entropy_coef == 0.0  # response entropy is logged
    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "lpo", "--lpo.divergence", "js",
                                          "--lpo.temperature", "0.5", "--lpo.projection", "listwise"])
    assert args.lpo.divergence == "js" and args.lpo.temperature == 0.5
    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "lpo", "--lpo.projection", "pointwise",
                                          "--lpo.temperature", "mean"])
    assert args.lpo.projection == "pointwise" and args.lpo.temperature == "mean"


def test_non_lpo_namespace_keeps_its_flags_and_trains_through_the_one_update():
    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "group_norm"])
    assert args.algo.advantage.estimator == "group_norm"
    assert args.actor.entropy_coef == 0.0  # every method logs the response entropy (docs/metrics.md)
    assert args.lpo.divergence is None
    from openrlhf.trainer import ppo_trainer

    from openrlhf_lpo.openrlhf.ray_classes import LPOTrainer
    from openrlhf_lpo.upstream import ray_class

    with flags._lpo_before_train(args):  # every estimator: the LPO classes (one update loop, one metric set)
        assert ray_class(ppo_trainer.PPOTrainer) is LPOTrainer


BAD = [
    (_with(rollout__n_samples_per_prompt="1", train__batch_size="4") + ["--algo.advantage.estimator", "lpo"],
     "--rollout.n_samples_per_prompt"),
    (_with(rollout__n_samples_per_prompt="1", train__batch_size="4") + ["--algo.advantage.estimator", "maxrl"],
     "--rollout.n_samples_per_prompt"),
    (_with(rollout__batch_size="3", train__batch_size="12") + ["--algo.advantage.estimator", "lpo"],
     "--rollout.batch_size 3 must be divisible"),
    (_with(train__batch_size="12", rollout__batch_size="6") + ["--algo.advantage.estimator", "lpo"],
     "--train.batch_size 12 must be a multiple of dp x --rollout.n_samples_per_prompt"),
    (_with(train__micro_batch_size="16") + ["--algo.advantage.estimator", "lpo"],
     "--train.micro_batch_size"),
    (_with(rollout__batch_size="2", train__batch_size="16") + ["--algo.advantage.estimator", "lpo"],
     "whole optimizer steps per rollout batch"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--ds.ring_attn_size", "2"], "--ds.ring_attn_size > 1"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--ds.tensor_parallel_size", "2"],
     "--ds.tensor_parallel_size > 1"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--algo.advantage.is_correction_level", "seq"],
     "--algo.advantage.is_correction_level seq"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--algo.advantage.is_correction_level", "token",
             "--algo.advantage.is_correction_gating", "tv"], "--algo.advantage.is_correction_gating tv"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--algo.advantage.is_correction_level", "token",
             "--algo.advantage.is_correction_threshold", "2.0"], "--algo.advantage.is_correction_threshold"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--actor.eps_clip_low_high", "1.0", "0.2"],
     "--actor.eps_clip_low_high"),
    (BASE + ["--algo.advantage.estimator", "group_norm", "--lpo.force_two_pass"], "--lpo.force_two_pass"),
    (BASE + ["--algo.advantage.estimator", "reinforce", "--lpo.end_kl"], "--lpo.end_kl"),
    (BASE + ["--algo.advantage.estimator", "group_norm", "--lpo.temperature", "one"], "--lpo.temperature"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--actor.dual_clip", "3"], "--actor.dual_clip"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.temperature", "-1"], "--lpo.temperature"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.temperature", "warm"], "--lpo.temperature"),
    (BASE + ["--algo.advantage.estimator", "group_norm", "--lpo.divergence", "rev"], "--lpo.divergence"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.projection", "pointwise", "--lpo.divergence", "rev"],
     "--lpo.projection pointwise"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.divergence", "chi2"], "--lpo.divergence: unknown divergence"),
    # no reward source: the stock CLI would split a missing reward model's path (AttributeError)
    (BASE[:-2], "no reward: give --reward.remote_url"),
    (BASE[:-2] + ["--algo.advantage.estimator", "lpo"], "no reward: give --reward.remote_url"),
    # the stock CLI's own asserts come out as flag errors with today's flag names, not as tracebacks
    (BASE + ["--algo.advantage.estimator", "lpo", "--data.max_images_per_prompt", "1", "--ds.packing_samples"],
     "refuses this combination of flags: VLM training does not support --ds.packing_samples."),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[n for _, n in BAD])
def test_invalid_combinations_fail_at_parse_time(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser_and_parse(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_main_swaps_classes_only_around_train(monkeypatch):
    """main() runs the stock train() with the LPO classes in place for lpo, with the stock classes' runtime
    subclasses for other estimators (train stops at ray.init here)."""
    monkeypatch.setenv("LPO_CPU_MODE", "0")  # the CPU-mode flag group would start Ray itself
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(*a, **k):
        caller = sys._getframe(1).f_globals  # the stock train()'s module namespace
        seen["actor"] = caller["PolicyModelActor"]
        seen["trainer"] = ppo_trainer.PPOTrainer
        raise Stop

    stock_actor, stock_trainer = ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer
    no_check = mock.patch("openrlhf_lpo.cli.train_ppo_ray._check_cluster")  # tested on its own
    with no_check, mock.patch("ray.is_initialized", return_value=False), mock.patch("ray.init", fake_init):
        with pytest.raises(Stop):
            main(BASE + ["--algo.advantage.estimator", "lpo", "--preflight", "off"])
    from openrlhf_lpo.openrlhf.ray_classes import RemoteLPOPolicyActor, RemoteLPOTrainer

    assert seen == {"actor": RemoteLPOPolicyActor, "trainer": RemoteLPOTrainer}
    assert ppo_actor.PolicyModelActor is stock_actor and ppo_trainer.PPOTrainer is stock_trainer  # restored
    with no_check, mock.patch("ray.is_initialized", return_value=False), mock.patch("ray.init", fake_init):
        with pytest.raises(Stop):
            main(BASE + ["--algo.advantage.estimator", "group_norm", "--preflight", "off"])
    # other estimators too: the same classes (core/update.py's loop, the metric set, the seeded prompt order)
    assert seen == {"actor": RemoteLPOPolicyActor, "trainer": RemoteLPOTrainer}
    assert ppo_actor.PolicyModelActor is stock_actor and ppo_trainer.PPOTrainer is stock_trainer  # restored


def test_async_trainer_is_swapped_for_lpo(monkeypatch):
    """--train.async_enable under lpo: the stock train() builds our PPOTrainerAsync subclass."""
    monkeypatch.setenv("LPO_CPU_MODE", "0")
    import openrlhf.trainer.ppo_trainer_async as async_mod

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(*a, **k):
        seen["async"] = async_mod.PPOTrainerAsync
        raise Stop

    stock = async_mod.PPOTrainerAsync
    with mock.patch("openrlhf_lpo.cli.train_ppo_ray._check_cluster"), \
            mock.patch("ray.is_initialized", return_value=False), mock.patch("ray.init", fake_init):
        with pytest.raises(Stop):
            main(BASE + ["--algo.advantage.estimator", "lpo", "--train.async_enable",
                         "--algo.advantage.is_correction_level", "token", "--preflight", "off"])
    from openrlhf_lpo.openrlhf.ray_classes import RemoteLPOTrainerAsync

    assert seen["async"] is RemoteLPOTrainerAsync and async_mod.PPOTrainerAsync is stock


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    import ray

    data = tmp_path / "math.jsonl"
    data.write_text("".join('{"prompt": "p", "label": "1"}\n' for _ in range(76 + 2 * 8)))
    argv = _with(rollout__batch_size="8") + ["--algo.advantage.estimator", "lpo", "--data.input_key", "prompt",
                                             "--data.label_key", "label", "--ckpt.path", str(tmp_path / "ckpt"),
                                             "--data.prompt_dataset", str(data), "--dry-run"]
    main(argv)
    out = capsys.readouterr().out
    assert not ray.is_initialized()
    assert "flags are valid" in out
    assert "GPUs needed: 11" in out and "actor: 2" in out and "ref: 8" in out and "vLLM engines: 1" in out
    # 92 prompts = 11 x 8 + 4: the last batch of 4 prompts gives each of the 2 ranks 2 groups
    assert "92 prompts -> 12 rollout batches per episode" in out
    assert "last batch of each episode: 4 prompts: 2 groups per rank" in out
    assert "first window: c from s_t, no extra forward; 1 later window(s)" in out  # micro 2 < K: split groups

    with pytest.raises(SystemExit) as exc:  # a missing data file is an error
        main(argv[:-3] + ["--data.prompt_dataset", str(tmp_path / "missing.jsonl"), "--dry-run"])
    assert exc.value.code == 2 and "missing.jsonl: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # invalid flags still fail
        main(_with(train__batch_size="12", rollout__batch_size="6") + ["--algo.advantage.estimator", "lpo",
                                                                        "--dry-run"])
    assert exc.value.code == 2


def test_cluster_check_names_gpus_needed_per_role():
    from openrlhf_lpo.cli import plan

    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "lpo", "--algo.kl.init_coef", "0"])
    assert plan.gpus_needed(args) == 3  # actor 2 + 1 engine
    plan.check_cluster(args, {"GPU": 3.0})
    with pytest.raises(plan.ClusterTooSmall, match=r"needs 3 GPUs \(actor 2, vLLM engines 1\) but the Ray "
                                                   r"cluster has 2"):
        plan.check_cluster(args, {"GPU": 2.0, "CPU": 64.0})
    colocated = build_parser_and_parse(_with(vllm__num_engines="2") + [
        "--algo.advantage.estimator", "lpo", "--train.colocate_all", "--algo.kl.init_coef", "0.01",
        "--ref.num_gpus_per_node", "2"])
    assert plan.gpus_needed(colocated) == 2  # actor, ref and the engines share one placement group


def test_stock_assertion_messages_use_todays_flag_names():
    from openrlhf_lpo.cli.train_ppo_ray import stock_assertion_message

    msg = stock_assertion_message("Use --advantage_estimator other than 'gae'. No --packing_samples.")
    assert "--algo.advantage.estimator other" in msg and "--ds.packing_samples." in msg
    assert "--ds.--" not in msg and stock_assertion_message("").endswith("(its assertion gives no message)")


def test_runtime_assertions_after_validation_are_not_flag_errors(monkeypatch):
    """An assert raised inside training (past the stock checks) stays an AssertionError."""
    from openrlhf_lpo.cli import train_ppo_ray as cli

    def boom(args):
        assert False, "inside training"

    with pytest.raises(AssertionError, match="inside training"):
        cli._run_stock(BASE + ["--algo.advantage.estimator", "lpo"], boom)
