"""End to end on the CPU: the real OpenRLHF Ray pipeline with LPO trains, and a killed run resumes.

Run A is the LPO-fwd job of the one demo run CI pays for (``demo_ci_run`` in tests/conftest.py):
``lpo-train --algo.advantage.estimator lpo`` with local Ray, the stock trainer/actors plus the LPO
subclasses, DeepSpeed ZeRO-2 on gloo with two data-parallel ranks, the demo's tiny Qwen3 warmed up
on pairsum (25% sampled accuracy: informative groups), the CPU rollout engine, 4 steps of 4 prompts
x K=4, micro-batches of 2 (two optimizer windows per batch: the first from s_t, the second after a
no-grad pre-pass), a checkpoint every 2 steps.

Run B is the same job (its ``command.txt``) with ``--ckpt.auto_resume 2``, preempted twice: a Ray worker
(a policy actor) is SIGKILLed in step 3, after the step-2 checkpoint, then the restarted run's driver in its
step 3. The supervisor restarts it from global_step2 both times, and it must end with run A's weights bit for
bit (same seed: seeded prompt order, per-request engine seeds, canonical group order, the window shuffle
keyed by DeepSpeed's restored step count).
"""

import re
import shlex

import pytest
import torch

from e2e_common import load_weights, max_weight_diff, read_jsonl, run_env, run_supervised, tb_scalars, tb_steps

pytestmark = pytest.mark.e2e  # the demo run, then a supervised lpo-train preempted twice


def _retarget(argv, out):
    """The job's flags with its outputs moved under ``out``."""
    argv = list(argv)
    for flag, sub in (("--ckpt.path", "ckpt"), ("--ckpt.output_dir", "final"), ("--logger.tensorboard_dir", "tb")):
        argv[argv.index(flag) + 1] = str(out / sub)
    return argv


@pytest.fixture(scope="module")
def e2e(demo_ci_run):
    proc = demo_ci_run["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = demo_ci_run["run"] / "pipeline" / "lpo-fwd"
    command = shlex.split((job / "command.txt").read_text())
    assert command[0] == "lpo-train"
    root = demo_ci_run["root"]
    args_b = _retarget(command[1:], root / "run_b") + ["--ckpt.auto_resume", "2", "--ckpt.auto_resume_delay", "0"]
    rc_b, wall_b, log_b, kills = run_supervised(args_b, run_env(shared_ray=False), root / "run_b.log",
                                                worker_class="LPOPolicyActor", kill_after="global_step2")
    assert rc_b == 0, f"run B (supervised) failed (rc={rc_b}); tail:\n{log_b[-6000:]}"
    print(f"\n[e2e] run B: {wall_b:.0f}s with kills {kills}")
    steps = demo_ci_run["steps"]
    parity = read_jsonl(demo_ci_run["parity_log"])  # the demo ran lpo-fwd first, then grpo: one sync per step
    return {"job": job, "model": command[command.index("--actor.model_name_or_path") + 1], "steps": steps,
            "log_a": (job / "lpo-train.log").read_text(errors="replace"), "tb_a": tb_scalars(job / "tb"),
            "parity_a": parity[:steps], "log_b": log_b, "kills": kills, "out_b": root / "run_b",
            "tb_b": tb_scalars(root / "run_b" / "tb")}


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


def test_auto_resume_survives_a_lost_worker_and_a_lost_driver_bit_for_bit(e2e):
    """Run B is run A's job with ``--ckpt.auto_resume 2``: a policy actor's Ray worker is SIGKILLed in step 3
    (after the step-2 checkpoint), then the restarted attempt's driver in its step 3; the supervisor restarts
    both times from global_step2 and the run ends with run A's weights, bit for bit."""
    actor_ckpt = e2e["job"] / "ckpt" / "_actor"
    assert [s for s in (1, 2, 3, 4) if (actor_ckpt / f"global_step{s}").is_dir()] == [2, 4]  # every 2 steps
    assert (actor_ckpt / "latest").read_text().strip() == "global_step4"
    log = e2e["log_b"]
    assert [k[0] for k in e2e["kills"]] == ["worker", "driver"]
    # each restart logged with its cause and the checkpoint it loads
    worker_death = re.search(r"attempt 1 died \((exit \d+: [^)]*)\); restart 1/2 from global_step2", log)
    assert worker_death and ("ActorDied" in worker_death.group(1) or "RayActorError" in worker_death.group(1)), \
        log[-4000:]
    assert "attempt 2 died (killed by SIGKILL); restart 2/2 from global_step2" in log
    assert "the run finished after 2 restarts" in log
    assert log.count("Loading the checkpoint") == 2  # attempts 2 and 3 resumed; attempt 1 started fresh
    assert (e2e["out_b"] / "ckpt" / "_actor" / "latest").read_text().strip() == "global_step4"
    assert set(tb_steps(e2e["tb_b"])) == {1, 2, 3, 4}
    a, b = load_weights(e2e["job"] / "final"), load_weights(e2e["out_b"] / "final")
    init = load_weights(e2e["model"])
    moved = max_weight_diff(a, init)
    diff = max_weight_diff(a, b)
    print(f"\n[e2e] auto-resumed vs uninterrupted: max |dw| {diff:.3g} (the run moved the weights by {moved:.3g})")
    assert moved > 1e-4
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"max |dw| {diff:.3g}"


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
