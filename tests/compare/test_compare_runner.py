"""The runner's bookkeeping with real processes: a finished run is never rerun, a killed one resumes from its
checkpoint, a run whose settings changed starts from scratch, and ``--jobs`` runs go at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from openrlhf_lpo.compare.plan import RunSpec
from openrlhf_lpo.compare.runner import decide, run_matrix, start_attempt

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _driver(out, delay_b, setting_c, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(HERE / "runner_driver.py"), str(out), str(delay_b), setting_c],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _invocations(out):
    return (out / "invocations.log").read_text().splitlines()


def test_finished_runs_are_kept_a_killed_run_resumes_changed_settings_restart(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    b = out / "seed0" / "pipeline" / "b"
    # 1. run a, then b slowly; the whole session (runner and b's training process) is killed after b's step 2
    proc = _driver(out, 0.4, "x", start_new_session=True)
    deadline = time.time() + 60
    while not ((b / "ckpt").exists() and int((b / "ckpt").read_text()) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = int((b / "ckpt").read_text())
    assert (out / "seed0" / "pipeline" / "a" / "done.json").exists() and not (b / "done.json").exists()
    assert json.loads((b / "attempt.json").read_text())["n"] == 1
    assert _invocations(out) == ["a/seed0 1 False", "b/seed0 1 False"]

    # 2. the same command again: a kept, b resumed from its checkpoint (attempt 2), c started
    done = _driver(out, 0.0, "x")
    assert done.wait(60) == 0, done.stdout.read()
    assert _invocations(out)[2:] == ["b/seed0 2 True", "c/seed0 1 False"]
    assert [int(x) for x in (b / "starts.log").read_text().split()] == [0, killed_at]
    rows = [json.loads(x) for x in (out / "seed0" / "metrics" / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {json.loads((out / "seed0" / "pipeline" / m / "done.json").read_text())["attempts"] for m in "ab"} == {1, 2}

    # 3. c's settings changed: only c runs, from scratch (its old directory is gone first)
    (out / "seed0" / "pipeline" / "c" / "stale").write_text("from the run with other settings")
    again = _driver(out, 0.0, "y")
    assert again.wait(60) == 0, again.stdout.read()
    assert _invocations(out)[4:] == ["c/seed0 1 False"]
    assert not (out / "seed0" / "pipeline" / "c" / "stale").exists()
    assert (out / "seed0" / "pipeline" / "c" / "starts.log").read_text().split() == ["0"]


def _spec(tmp_path, name, **settings):
    return RunSpec(name, 1, tmp_path / name, tmp_path / f"{name}.jsonl", settings)


def test_decisions(tmp_path):
    spec = _spec(tmp_path, "m", lr=1.0)
    assert decide(spec) == "fresh"
    start_attempt(spec, "fresh")
    assert decide(spec) == "resume" and decide(_spec(tmp_path, "m", lr=2.0)) == "fresh"
    assert decide(spec, "fresh") == "fresh"
    (spec.work_dir / "done.json").write_text(json.dumps({"settings_hash": spec.settings_hash}))
    assert decide(spec) == "fresh"  # done, but its metrics file is gone: run again
    spec.metrics_path.write_text("{}\n")
    assert decide(spec) == "skip" and decide(spec, "fresh") == "fresh"
    assert decide(_spec(tmp_path, "m", lr=2.0)) == "fresh"
    with pytest.raises(ValueError, match="policy"):
        decide(spec, "keep")


def test_jobs_run_side_by_side_and_a_failure_is_recorded(tmp_path):
    lock, live = threading.Lock(), {"now": 0, "max": 0}

    class Job:
        def run(self, spec, attempt):
            with lock:
                live["now"] += 1
                live["max"] = max(live["max"], live["now"])
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)
            with lock:
                live["now"] -= 1
            if spec.method == "bad":
                raise RuntimeError("lpo-train exited with status 1")
            spec.metrics_path.write_text('{"step": 1}\n')
            return {"steps": 1}

        def stop(self):
            pass

    specs = [_spec(tmp_path, n) for n in ("x", "y", "bad")]
    seen = []
    st = run_matrix(specs, Job(), jobs=2, record=lambda s, e: seen.append((s.key, e["state"])))
    assert live["max"] == 2
    assert {k: v["state"] for k, v in st.items()} == {"x/seed1": "done", "y/seed1": "done", "bad/seed1": "failed"}
    assert "exited with status 1" in st["bad/seed1"]["error"] and ("bad/seed1", "running") in seen
    with pytest.raises(ValueError, match="--jobs"):
        run_matrix(specs, Job(), jobs=0)


def test_recipe_job_reads_tensorboard_and_the_streamed_lines(tmp_path):
    """A recipe run's rows: TensorBoard's train/ and eval/ scalars (as OpenRLHF's logger writes them), the
    "Global step" lines for a step TensorBoard lacks; the recipe's environment carries the run's seed and
    submission id; a run without its final model, or a failed recipe, is not finished."""
    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_lpo.compare.recipe import RecipeJob, submission_id

    spec = RunSpec("lpo_fwd", 2, tmp_path / "seed2" / "pipeline" / "lpo_fwd", tmp_path / "seed2" / "metrics" /
                   "lpo_fwd.jsonl", {"x": 1})
    script = tmp_path / "recipe.sh"
    script.write_text(
        'set -e; d="$SAVE_ROOT/$RUN_NAME"; mkdir -p "$d/final"\n'
        'echo "(PPOTrainer pid=1) Global step 3: {\'rollout/reward_mean\': 0.75, \'actor_grad_norm\': 0.5}"\n'
        'echo "$METHOD|$EXTRA_ARGS|$LPO_SUBMISSION_ID" > "$d/env.txt"\n'
        '[ "${FAIL:-0}" = 1 ] && exit 3\n'
        'touch "$d/final/config.json"\n')
    start_attempt(spec, "fresh")
    tb = SummaryWriter(str(spec.work_dir / "tb" / "run"))
    for step, (r, e) in {1: (0.25, 0.875), 2: (0.5, 0.625)}.items():  # exact in float32
        tb.add_scalar("train/rollout/reward_mean", r, step)
        tb.add_scalar("train/response_entropy", e, step)
    tb.add_scalar("eval/eval_pass1", 0.375, 2)
    tb.add_scalar("eval/eval_math_pass1", 0.375, 2)
    tb.add_scalar("eval/eval_math_pass8", 0.875, 2)
    tb.close()
    job = RecipeJob(script, ["--train.num_episodes", "1"], progress=False, log=lambda m: None)
    result = job.run(spec, {"n": 1, "resume": False})
    rows = [json.loads(x) for x in spec.metrics_path.read_text().splitlines()]
    assert [(r["step"], r.get("reward"), r.get("entropy")) for r in rows] == [(1, 0.25, 0.875), (2, 0.5, 0.625),
                                                                            (3, 0.75, None)]
    assert (rows[1]["heldout_pass@1"], rows[1]["heldout_pass@8"]) == (0.375, 0.875)
    assert rows[2]["grad_norm"] == 0.5 and result["steps"] == 3
    assert (spec.work_dir / "env.txt").read_text().strip() == \
        f"lpo_fwd|--train.num_episodes 1 --train.seed 2|{submission_id(spec, 1)}"
    assert "Global step 3" in (spec.work_dir / "recipe.log").read_text()
    (spec.work_dir / "final" / "config.json").unlink()
    os.environ["FAIL"] = "1"
    try:
        with pytest.raises(RuntimeError, match="exited with status 3"):
            job.run(spec, {"n": 2, "resume": True})  # the cluster knows no attempt 1: submitted again
    finally:
        del os.environ["FAIL"]
    with pytest.raises(RuntimeError, match="without the final model"):
        job.collect(spec, 0, {}, "sid")
