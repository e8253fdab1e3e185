"""End to end on the CPU: the real OpenRLHF Ray pipeline with LPO trains and syncs its engine.

The run is the LPO-fwd job of the one demo run CI pays for (``demo_ci_run`` in tests/conftest.py):
``lpo-train --algo.advantage.estimator lpo`` with local Ray, the stock trainer/actors plus the LPO
subclasses, DeepSpeed ZeRO-2 on gloo with two data-parallel ranks, the demo's tiny Qwen3 warmed up
on pairsum (25% sampled accuracy: informative groups), the CPU rollout engine, 4 steps of 4 prompts
x K=4, micro-batches of 2 (two optimizer windows per batch: the first from s_t, the second after a
no-grad pre-pass), a checkpoint every 2 steps. This module starts nothing of its own: a run preempted twice
by ``--ckpt.auto_resume`` is the research job's run B (tests/pipeline/test_e2e_research.py).
"""

import shlex

import pytest
import torch

from e2e_common import read_jsonl, tb_scalars, tb_steps

pytestmark = pytest.mark.e2e  # the demo run's LPO job


@pytest.fixture(scope="module")
def e2e(demo_ci_run):
    proc = demo_ci_run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = demo_ci_run["run"] / "pipeline" / "lpo-fwd"
    command = shlex.split((job / "command.txt").read_text())
    assert command[0] == "lpo-train"
    steps = demo_ci_run["steps"]
    parity = read_jsonl(demo_ci_run["parity_log"])  # the demo ran lpo-fwd first, then grpo: one sync per step
    return {"job": job, "model": command[command.index("--actor.model_name_or_path") + 1], "steps": steps,
            "log_a": (job / "lpo-train.log").read_text(errors="replace"), "tb_a": tb_scalars(job / "tb"),
            "parity_a": parity[:steps]}


def test_every_step_trains_with_informative_groups(e2e):
    steps = list(range(1, e2e["steps"] + 1))
    assert tb_steps(e2e["tb_a"]) == steps
    assert "LPOTrainer" in e2e["log_a"] and "CPURolloutEngine" in e2e["log_a"]
    tb = e2e["tb_a"]
    for key in ("train/lpo/abs_coef_mean", "train/actor_grad_norm", "train/lpo/degenerate_frac", "train/lpo/groups"):
        assert sorted(tb[key]) == steps, key
    informative = [s for s in steps if tb["train/lpo/degenerate_frac"][s] < 1.0]
    assert len(informative) >= len(steps) - 1, "the warm-up should make almost every batch informative"
    for s in informative:  # non-zero listwise coefficients and a real gradient through DeepSpeed
        assert tb["train/lpo/abs_coef_mean"][s] > 1e-3 and tb["train/actor_grad_norm"][s] > 1e-4, s
    assert all(tb["train/lpo/groups"][s] == 4.0 for s in steps)
    assert all(tb["train/lpo/shortcut_windows"][s] == 1.0 and tb["train/lpo/pre_pass_windows"][s] == 1.0
               for s in steps)


def test_weight_sync_logprob_parity_and_the_policy_moves(e2e):
    records = e2e["parity_a"]
    assert len(records) == e2e["steps"], "one weight sync per step"
    for r in records:
        assert r["max_abs_diff"] <= 1e-4 and r["tol"] == 1e-4
        diff = max(abs(a - b) for a, b in zip(r["actor_log_probs"], r["engine_log_probs"]))
        assert diff == pytest.approx(r["max_abs_diff"], abs=1e-12)
        assert len(r["engine_log_probs"]) == r["num_tokens"] > 20
    # the updates moved the policy: the probe's log-probs change between the first and the last sync
    assert max(abs(x - y) for x, y in zip(records[0]["actor_log_probs"], records[-1]["actor_log_probs"])) > 1e-4

    # independent: the saved final model, evaluated here, gives the engine's last numbers
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
    final = probe_log_probs(str(e2e["job"] / "final"))
    initial = probe_log_probs(e2e["model"])
    assert (final - engine_last).abs().max() < 1e-4
    assert (initial - final).abs().max() > 1e-4


def test_checkpoints_every_two_steps(e2e):
    actor_ckpt = e2e["job"] / "ckpt" / "_actor"
    assert [s for s in (1, 2, 3, 4) if (actor_ckpt / f"global_step{s}").is_dir()] == [2, 4]
    assert (actor_ckpt / "latest").read_text().strip() == "global_step4"


def test_the_preflight_reads_a_real_deepspeed_checkpoint(e2e, capsys):
    """Run A's DeepSpeed checkpoint (ZeRO-2, 2 ranks): the same job's dry run resumes it, with 1 rank it cannot."""
    from openrlhf_lpo.cli.train_ppo_ray import main

    ckpt = e2e["job"] / "ckpt"
    argv = shlex.split((e2e["job"] / "command.txt").read_text())[1:] + ["--ckpt.load_enable", "--dry-run"]
    argv[argv.index("--ckpt.path") + 1] = str(ckpt)
    main(argv)
    out = capsys.readouterr().out
    assert f"resume: {ckpt / '_actor' / 'global_step4'} (DeepSpeed, 2 data-parallel ranks, ZeRO-1/2)" in out
    assert "shapes could not be read" not in out  # the parameter shapes were read and matched the model
    one_rank = [("1" if i and argv[i - 1] == "--actor.num_gpus_per_node" else a) for i, a in enumerate(argv)]
    with pytest.raises(SystemExit) as exc:
        main(one_rank)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "was written by 2 data-parallel ranks, this run has 1" in err


def test_both_jobs_log_the_metric_contract(e2e, demo_ci_run):
    """LPO-fwd and its GRPO pair (with --lpo.end_kl) log exactly the keys of docs/metrics.md, with one meaning."""
    from metric_contract import DEMO_REWARD_INFO, check_run

    check_run(e2e["tb_a"], shlex.split((e2e["job"] / "command.txt").read_text()), info=DEMO_REWARD_INFO)
    grpo_job = demo_ci_run["run"] / "pipeline" / "grpo"
    check_run(tb_scalars(grpo_job / "tb"), shlex.split((grpo_job / "command.txt").read_text()), info=DEMO_REWARD_INFO)
    tb = e2e["tb_a"]
    steps = range(1, e2e["steps"] + 1)
    for s in steps:  # one meaning: the token fraction outside the band, a mean over the update's steps
        assert 0.0 <= tb["train/clip_ratio"][s] <= 1.0 and tb["train/optimizer_steps"][s] == 2.0
        assert tb["train/response_entropy"][s] > 0.0
