"""The research-agenda flags of lpo-train (divergence family and schedules, entropy switch, temperature
scale, listwise replay) through the real CLI: values reach the namespace, every bad value or
combination exits 2 naming the flag, the Megatron backend refuses what it cannot honour, and the
dry-run plan shows the effective tau, the schedule and the replay."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse, main

REPO = Path(__file__).resolve().parents[2]
BASE = ["--actor.model_name_or_path", "unused", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
        "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4", "--train.batch_size", "16",
        "--train.micro_batch_size", "2", "--vllm.num_engines", "1", "--reward.remote_url", "http://unused",
        "--algo.advantage.estimator", "lpo"]


def test_values_and_defaults():
    a = build_parser_and_parse(BASE)
    assert (a.lpo.divergence, a.lpo.temperature_scale, a.lpo.replay_batches, a.lpo.divergence_schedule) == \
        ("fwd", 1.0, 0, None)
    a = build_parser_and_parse(BASE + ["--lpo.divergence", "alpha:-0.25", "--lpo.temperature", "one",
                                       "--lpo.temperature_scale", "0.5"])
    assert (a.lpo.divergence, a.lpo.temperature, a.lpo.temperature_scale) == ("alpha:-0.25", "one", 0.5)
    a = build_parser_and_parse(BASE + ["--lpo.divergence_schedule", "fwd@0,alpha:0.5@10,rev",
                                       "--lpo.divergence_switch_entropy", "0.4", "--lpo.divergence_switch_window", "3"])
    assert a.lpo.divergence == "fwd"  # the schedule's first stage: what the actors start with
    assert (a.lpo.divergence_switch_entropy, a.lpo.divergence_switch_window) == (0.4, 3)
    a = build_parser_and_parse(BASE + ["--lpo.replay_batches", "4", "--lpo.replay_max_abs_s", "0.3"])
    assert (a.lpo.replay_batches, a.lpo.replay_ratio, a.lpo.replay_max_abs_s) == (4, 1.0, 0.3)


BAD = [
    (["--lpo.divergence", "kl"], "--lpo.divergence: unknown divergence 'kl'; valid: fwd, hellinger, js, rev, tv or "
                                 "alpha:<a> (any real a)"),
    (["--lpo.divergence", "alpha:nan"], "--lpo.divergence: divergence 'alpha:nan': a = nan must be a finite real number"),
    (["--lpo.divergence", "alpha:abc"], "--lpo.divergence: divergence 'alpha:abc': the parameter 'abc' is not a number"),
    (["--lpo.divergence_schedule", "fwd@0,alpha:nan@5"], "--lpo.divergence_schedule: divergence 'alpha:nan'"),
    (["--lpo.divergence_schedule", "fwd@2,rev@5"], "--lpo.divergence_schedule: the first stage 'fwd@2' must start"),
    (["--lpo.divergence_schedule", "fwd@0,rev"], "--lpo.divergence_schedule: stage 'rev' has no @step"),
    (["--lpo.divergence_schedule", "rev@0"], "--lpo.divergence_schedule: 'rev@0' has one stage"),
    (["--lpo.divergence", "rev", "--lpo.divergence_schedule", "fwd@0,rev@5"],
     "--lpo.divergence and --lpo.divergence_schedule both choose the divergence"),
    (["--lpo.divergence_schedule", "fwd@0,rev", "--lpo.divergence_switch_entropy", "-0.5"],
     "--lpo.divergence_switch_entropy -0.5: the threshold is a response entropy in nats per token"),
    (["--lpo.divergence_schedule", "fwd@0,rev", "--lpo.divergence_switch_entropy", "nan"],
     "--lpo.divergence_switch_entropy nan"),
    (["--lpo.divergence_switch_entropy", "0.5"], "--lpo.divergence_switch_entropy moves to the schedule's next"),
    (["--lpo.divergence_schedule", "fwd@0,rev@4", "--lpo.divergence_switch_window", "3"],
     "--lpo.divergence_switch_window only applies with --lpo.divergence_switch_entropy"),
    (["--lpo.divergence_schedule", "fwd@0,rev", "--lpo.divergence_switch_entropy", "0.5",
      "--lpo.divergence_switch_window", "0"], "--lpo.divergence_switch_window: the entropy window must be >= 1"),
    (["--lpo.temperature_scale", "0"], "--lpo.temperature_scale 0.0: must be a positive finite number"),
    (["--lpo.temperature_scale", "inf"], "--lpo.temperature_scale inf: must be a positive finite number"),
    (["--lpo.replay_ratio", "0.5"], "--lpo.replay_ratio needs a replay buffer: add --lpo.replay_batches N"),
    (["--lpo.replay_max_abs_s", "0.5"], "--lpo.replay_max_abs_s needs a replay buffer"),
    (["--lpo.replay_batches", "0", "--lpo.replay_ratio", "1"], "--lpo.replay_ratio needs a replay buffer"),
    (["--lpo.replay_batches", "-1"], "--lpo.replay_batches -1: must be >= 0"),
    (["--lpo.replay_batches", "2", "--lpo.replay_ratio", "-1"], "--lpo.replay_ratio -1.0: must be a positive"),
    (["--lpo.replay_batches", "2", "--lpo.replay_max_abs_s", "0"], "--lpo.replay_max_abs_s 0.0: must be a positive"),
    (["--lpo.projection", "pointwise", "--lpo.divergence_schedule", "fwd@0,rev@3"],
     "--lpo.divergence has no effect with --lpo.projection pointwise"),
]


@pytest.mark.parametrize("extra, needle", BAD, ids=[n[:60] for _, n in BAD])
def test_bad_values_exit_2_naming_the_flag(extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(BASE + extra)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--lpo.divergence_schedule", "fwd@0,rev@3"], ["--lpo.temperature_scale", "2"],
                                  ["--lpo.replay_batches", "2"]])
def test_other_estimators_refuse_the_flags(flag, capsys):
    argv = [x if x != "lpo" else "group_norm" for x in BASE] + flag
    with pytest.raises(SystemExit) as e:
        build_parser_and_parse(argv)
    assert e.value.code == 2 and f"{flag[0]} only apply with --algo.advantage.estimator lpo" in capsys.readouterr().err


def test_megatron_takes_the_research_flags(capsys, tiny_model_dir):
    """A schedule with the entropy switch, the temperature scale and replay parse under --backend megatron,
    and the dry run states them as it does for DeepSpeed."""
    argv = [x if x != "unused" else tiny_model_dir for x in BASE] + ["--backend", "megatron", "--actor.lr_scheduler",
                                                                     "constant", "--actor.lr_warmup_ratio", "0"]
    args = build_parser_and_parse(argv + ["--lpo.divergence_schedule", "fwd@0,alpha:0.5@2,rev",
                                          "--lpo.divergence_switch_entropy", "0.4", "--lpo.temperature_scale", "0.5",
                                          "--lpo.replay_batches", "2", "--lpo.replay_ratio", "0.5"])
    assert (args.lpo.divergence, args.lpo.temperature_scale, args.lpo.replay_batches) == ("fwd", 0.5, 2)
    main(argv + ["--lpo.divergence_schedule", "fwd@0,rev@3", "--lpo.replay_batches", "2", "--preflight", "off",
                 "--dry-run"])
    out = capsys.readouterr().out
    assert "divergence schedule: fwd from update 0, rev from update 3" in out and "listwise replay" in out


def test_dry_run_shows_effective_tau_schedule_and_replay(capsys):
    main(BASE + ["--lpo.temperature", "mean", "--lpo.temperature_scale", "0.5", "--lpo.divergence_schedule",
                 "alpha:1@0,alpha:0.5@20,rev", "--lpo.divergence_switch_entropy", "0.3",
                 "--lpo.replay_batches", "3", "--lpo.replay_ratio", "0.5", "--lpo.replay_max_abs_s", "0.25",
                 "--preflight", "off", "--dry-run"])
    out = capsys.readouterr().out
    assert "estimator lpo (divergence alpha:1, temperature mean, projection listwise)" in out
    assert "effective tau = 0.5 x group mean per group (--lpo.temperature_scale)" in out
    assert "divergence schedule: alpha:1 from update 0, alpha:0.5 from update 20, rev by the entropy switch" in out
    assert "entropy switch: once the mean response entropy of the last 5 step(s) < 0.3, move to the next stage" in out
    assert ("listwise replay: buffer of the last 3 rollout batch(es); up to 2 replayed group(s) (8 samples) per step "
            "beside 4 fresh; groups with |s_t| > 0.25 dropped") in out
    main(BASE + ["--lpo.temperature", "0.8", "--lpo.temperature_scale", "2", "--preflight", "off", "--dry-run"])
    assert "effective tau = 2 x 0.8 = 1.6 (--lpo.temperature_scale)" in capsys.readouterr().out


def test_the_installed_command_exits_2(tmp_path):
    """``python -m openrlhf_lpo.cli.train_ppo_ray`` (= lpo-train) as a process: exit status 2, the flag named."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *BASE, "--lpo.replay_ratio", "2"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 2 and "--lpo.replay_ratio needs a replay buffer" in proc.stderr
