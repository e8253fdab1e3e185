"""lpo-demo orchestration without training: step-line parsing, flags, failure handling."""

import json
import math

import pytest

from openrlhf_lpo.demo import cli, pipeline
from openrlhf_lpo.demo.loop import RLConfig
from openrlhf_lpo.demo.methods import METHODS
from openrlhf_lpo.demo.pipeline import PipelineError, _diagnose, parse_step_line, pipeline_argv, to_row

LINE = ("\x1b[36m(PPOTrainer pid=23119)\x1b[0m INFO 11-29 22:50:27 ppo_trainer.py:551] \u2728 Global step 2: "
        "{'actor_lr': 0.0001, 'ppo_kl': -2.806633710861206e-05, 'actor_grad_norm': 0.25, 'policy_loss': 0.0, "
        "'entropy_loss': 1.5, 'lpo/kl_end': 0.012, 'rollout/reward_mean': 0.625, 'timing/step_total': 66.45}")


def test_parse_step_line_real_format():
    up = parse_step_line(LINE)
    assert up["step"] == 2 and up["rollout/reward_mean"] == 0.625 and up["ppo_kl"] == -2.806633710861206e-05
    row = to_row("lpo-fwd", up, 12.0)
    assert (row["reward"], row["grad_norm"], row["entropy"], row["kl_target"], row["step_s"]) == (0.625, 0.25, 1.5, 0.012, 66.45)
    assert row["upstream"]["actor_lr"] == 0.0001
    assert parse_step_line("Episode [1/1]: 50%") is None


def test_parse_step_line_non_literal_values():
    up = parse_step_line("Global step 7: {'a': tensor(0.5000), 'b': np.float64(1e-3), 'c': 3}")
    assert up == {"step": 7, "a": 0.5, "b": 1e-3, "c": 3.0}


def test_pipeline_argv_is_accepted_by_lpo_train_parser(tmp_path):
    """The demo's flags for every method parse and validate in the real lpo-train CLI."""
    from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse

    cfg = RLConfig(k=8, prompts_per_step=16, steps=40, eval_every=10)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    upstream = {"grpo": "group_norm", "dr-grpo": "dr_grpo", "maxrl": "maxrl", "rloo": "rloo",
                "reinforce-pp": "reinforce_baseline"}
    for name, m in METHODS.items():
        args = build_parser_and_parse(pipeline_argv(m, cfg, str(tmp_path), str(tmp_path / "p.jsonl"), tmp_path / name, 5))
        assert args.algo.advantage.estimator == ("lpo" if m.is_lpo else upstream[name])
        assert str(args.lpo.temperature) == m.temperature and args.lpo.end_kl
        assert args.ckpt.save_steps == 10 and args.ckpt.save_hf and not args.ckpt.disable_ds  # jobs can resume
        # 4 exports for the held-out evaluation, more than --ckpt.max_num 3: none rotated away
        assert args.ckpt.hf_max_num == -1
    extra = RLConfig(k=8, prompts_per_step=16, steps=40, pipeline_args=("--actor.num_gpus_per_node", "2"))
    assert build_parser_and_parse(pipeline_argv(METHODS["lpo-fwd"], extra, str(tmp_path), str(tmp_path / "p.jsonl"),
                                                tmp_path / "x", 5)).actor.num_gpus_per_node == 2  # appended last
    for name in ("lpo-fwd", "grpo"):
        argv = pipeline_argv(METHODS[name], cfg, str(tmp_path), str(tmp_path / "p.jsonl"), tmp_path / name, 5)
        args = build_parser_and_parse(argv)
        assert args.rollout.n_samples_per_prompt == 8 and args.rollout.batch_size == 16
        assert args.train.batch_size == 64  # two optimizer steps per rollout
        assert args.train.seed == cfg.seed and args.actor.adam.lr == cfg.lr
        assert args.algo.advantage.estimator == ("lpo" if name == "lpo-fwd" else "group_norm")
        if name == "lpo-fwd":
            assert args.lpo.divergence == "fwd" and str(args.lpo.temperature) == "std"


@pytest.mark.parametrize("tail,word", [
    ("RuntimeError: Failed to start the GCS server\n", "Ray could not start"),
    ("ray.exceptions.ActorDiedError: CPURolloutEngine died\n", "rollout engine"),
    ("Killed\n", "out of memory"),
    ("ValueError: something else\n", "exited with status 1"),
])
def test_diagnose_names_component(tmp_path, tail, word):
    assert word in _diagnose(tail, 1, tmp_path / "log")


def test_diagnose_quotes_last_error_line(tmp_path):
    tail = ("Traceback (most recent call last):\n  File x\nValueError: first\n"
            "\x1b[36m(LPOPolicyActor pid=1)\x1b[0m noise\n"
            "RuntimeError: CPU rollout engine log-probs differ from the actor's after the weight sync\n")
    msg = _diagnose(tail, 1, tmp_path / "log")
    assert "rollout engine" in msg
    assert "last error: RuntimeError: CPU rollout engine log-probs differ" in msg and str(tmp_path / "log") in msg


def test_failed_method_keeps_finished_ones(tmp_path, monkeypatch, capsys):
    """GRPO 'fails to start Ray': LPO-fwd's metrics, the plot and the summary survive."""
    monkeypatch.setattr("openrlhf_lpo.demo.warmup.ensure_warmup",
                        lambda cfg, progress=True, force=False: {"path": "/nowhere", "cached": True, "steps": 3,
                                                                 "sampled_accuracy": 0.5, "greedy_accuracy": 0.5})

    def fake_run(method, cfg, model_path, out_dir, on_row=None, progress=True):
        if method.name == "grpo":
            raise PipelineError("Ray could not start (exit 1). Try: `ray stop --force`")
        for s in range(1, cfg.steps + 1):
            on_row({"method": method.name, "step": s, "reward": 0.5 + 0.1 * s, "entropy": 1.0, "grad_norm": 0.1,
                    "kl_target": 0.01, "elapsed_s": float(s)})
        return {"steps": cfg.steps}

    monkeypatch.setattr(pipeline, "run_pipeline", fake_run)
    rc = cli.run_demo(["--preset", "ci", "--run-dir", str(tmp_path / "run"), "--no-progress", "--steps", "3",
                       "--eval-every", "0"])  # the faked warm-up has no model to evaluate
    assert rc == 1
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert status["lpo-fwd"]["state"] == "done"
    assert status["grpo"]["state"] == "failed" and "Ray could not start" in status["grpo"]["error"]
    rows = [json.loads(x) for x in (run / "metrics" / "lpo-fwd.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == pytest.approx([0.6, 0.7, 0.8])
    assert (run / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    summary = (run / "summary.txt").read_text()
    assert "lpo-fwd" in summary and "grpo: failed" in summary and "ray stop --force" in summary


def test_bad_flags_exit_with_message(tmp_path, capsys):
    for argv, msg in ([["--k", "1"], "--k"], [["--methods", "ppo"], "--methods"], [["--preset", "gpu"], "--preset"],
                      [["--task", "chess"], "--task"], [["--eval-samples", "0"], "--eval-samples"],
                      [["--eval-every", "-1"], "--eval-every"], [["--jobs", "0"], "--jobs"]):
        with pytest.raises(SystemExit) as e:
            cli.run_demo(argv + ["--run-dir", str(tmp_path / "r")])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_ray_start_failure_is_retried_once_and_resume_keeps_finished(tmp_path, monkeypatch):
    monkeypatch.setattr("openrlhf_lpo.demo.warmup.ensure_warmup",
                        lambda cfg, progress=True, force=False: {"path": "/nowhere", "cached": True, "steps": 3,
                                                                 "sampled_accuracy": 0.5, "greedy_accuracy": 0.5})
    calls, attempts = [], {"lpo-fwd": 0, "grpo": 0}

    def fake_run(method, cfg, model_path, out_dir, on_row=None, progress=True):
        calls.append(method.name)
        attempts[method.name] += 1
        if method.name == "lpo-fwd" and attempts["lpo-fwd"] == 1:
            raise PipelineError("Ray could not start (exit 1).", "ray", 0)
        if method.name == "grpo" and attempts["grpo"] == 1:
            on_row({"method": "grpo", "step": 1, "reward": 0.5})
            raise PipelineError("the rollout engine failed (exit 1).", "engine", 1)  # not retried
        for s in range(1, cfg.steps + 1):
            on_row({"method": method.name, "step": s, "reward": 0.25 * s, "elapsed_s": float(s)})
        return {"steps": cfg.steps}

    monkeypatch.setattr(pipeline, "run_pipeline", fake_run)
    argv = ["--preset", "ci", "--run-dir", str(tmp_path / "run"), "--no-progress", "--eval-every", "0", "--steps", "2"]
    assert cli.run_demo(argv) == 1
    assert sorted(calls) == ["grpo", "lpo-fwd", "lpo-fwd"]  # the two jobs run side by side (--jobs 2)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["lpo-fwd"]["state"] == "done" and status["grpo"]["state"] == "failed"

    calls.clear()
    assert cli.run_demo(argv + ["--resume"]) == 0
    assert calls == ["grpo"]  # lpo-fwd kept from the first run
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert {n: s["state"] for n, s in status.items()} == {"lpo-fwd": "done", "grpo": "done"}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "lpo-fwd.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in rows] == [0.25, 0.5]

    calls.clear()  # everything finished: nothing runs, status keeps both
    assert cli.run_demo(argv + ["--resume"]) == 0
    assert calls == []
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert {n: s["state"] for n, s in status.items()} == {"lpo-fwd": "done", "grpo": "done"}

    calls.clear()  # other settings: nothing is resumed
    assert cli.run_demo(argv[:-1] + ["3", "--resume", "--jobs", "1"]) == 0
    assert calls == ["lpo-fwd", "grpo"]  # one after the other, in --methods order


def test_pipeline_jobs_run_side_by_side_and_one_at_a_time_with_jobs_1(tmp_path, monkeypatch):
    """--jobs 2 (the default) starts both methods' lpo-train jobs at once, --jobs 1 one after the other;
    each method's metrics go to its own file either way."""
    import threading
    import time

    monkeypatch.setattr("openrlhf_lpo.demo.warmup.ensure_warmup",
                        lambda cfg, progress=True, force=False: {"path": "/nowhere", "cached": True, "steps": 3,
                                                                 "sampled_accuracy": 0.5, "greedy_accuracy": 0.5})
    lock, live = threading.Lock(), {"now": 0, "max": 0}

    def fake_run(method, cfg, model_path, out_dir, on_row=None, progress=True):
        with lock:
            live["now"] += 1
            live["max"] = max(live["max"], live["now"])
        time.sleep(0.5)
        for s in range(1, cfg.steps + 1):
            on_row({"method": method.name, "step": s, "reward": 0.25 * s if method.name == "grpo" else 0.5})
        with lock:
            live["now"] -= 1
        return {"steps": cfg.steps}

    monkeypatch.setattr(pipeline, "run_pipeline", fake_run)
    for jobs, most in (("2", 2), ("1", 1)):
        live["max"] = 0
        run = tmp_path / f"run{jobs}"
        assert cli.run_demo(["--preset", "ci", "--run-dir", str(run), "--no-progress", "--eval-every", "0",
                             "--steps", "2", "--jobs", jobs]) == 0
        assert live["max"] == most
        rewards = {m: [json.loads(x)["reward"] for x in (run / "metrics" / f"{m}.jsonl").read_text().splitlines()]
                   for m in ("lpo-fwd", "grpo")}
        assert rewards == {"lpo-fwd": [0.5, 0.5], "grpo": [0.25, 0.5]}


def test_wants_preset():
    assert cli.wants_preset(["--preset", "cpu-demo"]) and cli.wants_preset(["--k", "4", "--preset=ci"])
    assert not cli.wants_preset(["--actor.model_name_or_path", "x", "--presetx"])


def test_steps_whose_log_line_was_lost_come_from_tensorboard(tmp_path):
    """Ray can drop the trainer's last forwarded lines: the final step's row is read from TensorBoard."""
    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_lpo.demo.pipeline import recover_missing_steps

    w = SummaryWriter(str(tmp_path / "tb"))
    for step in (1, 2, 3):
        w.add_scalar("train/actor_grad_norm", 0.5 * step, step)
        w.add_scalar("train/rollout/reward_mean", 0.1 * step, step)
    w.close()
    rows, seen = [], {1, 2}
    assert recover_missing_steps(tmp_path / "tb", "lpo-fwd", seen, rows.append) == [3]
    assert seen == {1, 2, 3} and [r["step"] for r in rows] == [3]
    assert rows[0]["grad_norm"] == 1.5 and abs(rows[0]["reward"] - 0.3) < 1e-6
    assert recover_missing_steps(tmp_path / "tb", "lpo-fwd", seen, rows.append) == []  # nothing twice
