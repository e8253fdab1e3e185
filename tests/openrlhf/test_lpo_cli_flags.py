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
        if dest != "algo.advantage.estimator":
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


def test_non_lpo_namespace_is_stock():
    args = build_parser_and_parse(BASE + ["--algo.advantage.estimator", "group_norm"])
    assert args.algo.advantage.estimator == "group_norm"
    assert args.actor.entropy_coef is None  # untouched
    assert args.lpo.divergence is None and flags._lpo_before_train(args) is None  # nothing patched


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
    (BASE + ["--algo.advantage.estimator", "lpo", "--train.dynamic_batch_enable", "--ds.packing_samples"],
     "--train.dynamic_batch_enable"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--train.async_enable"], "--train.async_enable"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--actor.policy_loss_type", "gspo"], "--actor.policy_loss_type"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--actor.dual_clip", "3"], "--actor.dual_clip"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.temperature", "-1"], "--lpo.temperature"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.temperature", "warm"], "--lpo.temperature"),
    (BASE + ["--algo.advantage.estimator", "group_norm", "--lpo.divergence", "rev"], "--lpo.divergence"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.projection", "pointwise", "--lpo.divergence", "rev"],
     "--lpo.projection pointwise"),
    (BASE + ["--algo.advantage.estimator", "lpo", "--lpo.divergence", "hellinger"], "--lpo.divergence"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[n for _, n in BAD])
def test_invalid_combinations_fail_at_parse_time(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser_and_parse(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_main_swaps_classes_only_around_train(monkeypatch):
    """main() runs the stock train() with the LPO classes in place (train stops at ray.init here)."""
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
    with mock.patch("ray.is_initialized", return_value=False), mock.patch("ray.init", fake_init):
        with pytest.raises(Stop):
            main(BASE + ["--algo.advantage.estimator", "lpo"])
    from openrlhf_lpo.openrlhf.ray_classes import RemoteLPOPolicyActor, RemoteLPOTrainer

    assert seen == {"actor": RemoteLPOPolicyActor, "trainer": RemoteLPOTrainer}
    assert ppo_actor.PolicyModelActor is stock_actor and ppo_trainer.PPOTrainer is stock_trainer  # restored
    with mock.patch("ray.is_initialized", return_value=False), mock.patch("ray.init", fake_init):
        with pytest.raises(Stop):
            main(BASE + ["--algo.advantage.estimator", "group_norm"])
    assert seen == {"actor": stock_actor, "trainer": stock_trainer}
