"""Launching ``lpo-train`` end to end on the CPU (Ray, OpenRLHF's trainer and actors, DeepSpeed on
gloo, the CPU rollout engine) and reading what a run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from recipe_flags import method_flags  # noqa: F401  (the e2e modules import it from here)
from shared_ray import shared_ray_env

REPO = Path(__file__).resolve().parents[2]
TOY_REWARD = REPO / "tests" / "pipeline" / "toy_reward.py"
RUN_TIMEOUT_S = int(os.environ.get("LPO_E2E_TIMEOUT", "900"))


def write_prompts(path: Path, n: int) -> str:
    """``n`` distinct prompts (the toy reward ignores labels)."""
    path.write_text("".join(json.dumps({"prompt": f"Say something {i}:", "label": "x"}) + "\n" for i in range(n)))
    return str(path)


def base_args(model: str, data: str, out: Path, *, dp: int = 1, k: int = 4, rollout: int = 4, train: int = 8,
              micro: int = 2, episodes: int = 1, estimator=("lpo", "--lpo.divergence", "fwd"), extra=()) -> List[str]:
    return [
        "--actor.model_name_or_path", model,
        "--data.prompt_dataset", data, "--data.input_key", "prompt", "--data.label_key", "label",
        "--reward.remote_url", str(TOY_REWARD),
        "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(dp),
        "--algo.kl.init_coef", "0", "--algo.advantage.estimator", *estimator,
        "--rollout.batch_size", str(rollout), "--rollout.n_samples_per_prompt", str(k),
        "--train.batch_size", str(train), "--train.micro_batch_size", str(micro), "--rollout.micro_batch_size", "2",
        "--rollout.max_new_tokens", "8", "--data.max_len", "256", "--train.num_episodes", str(episodes),
        "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa", "--actor.adam.lr", "0.002",
        "--actor.lr_scheduler", "constant", "--actor.lr_warmup_ratio", "0",
        "--train.seed", "7", "--ckpt.save_steps", "1", "--ckpt.path", str(out / "ckpt"),
        "--ckpt.output_dir", str(out / "final"), "--logger.tensorboard_dir", str(out / "tb"),
        *extra,
    ]


def run_env(extra: Optional[Dict[str, str]] = None, shared_ray: bool = True) -> Dict[str, str]:
    """The environment of an ``lpo-train`` launch: it joins this test process's Ray cluster
    (tests/shared_ray.py), or with ``shared_ray=False`` starts its own, which then dies with the launch's
    process group (a run killed like a node: its actors are not left to finish the step)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0", TOKENIZERS_PARALLELISM="false")
    for key in ("RAY_ADDRESS", "LPO_CPU_MODE"):
        env.pop(key, None)
    if shared_ray:
        env.update(shared_ray_env())
    env.update(extra or {})
    return env


def run_cli(args: List[str], env: Dict[str, str], log: Path):
    """Run ``python -m openrlhf_lpo.cli.train_ppo_ray``. Returns (returncode, seconds, log text)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *args], env=env,
                                stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"lpo-train did not finish in {RUN_TIMEOUT_S} s") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, time.time() - t0, log.read_text(errors="replace")


def run_supervised(args: List[str], env: Dict[str, str], log: Path, events: List[Callable]):
    """Run ``lpo-train`` with ``--ckpt.auto_resume`` and preempt it as a cluster would: ``events`` are called in
    turn, each polled (every 0.2 s, with the run's log text so far and the seconds since the start) until it
    acts and returns what it did (a tuple); then the next one. The supervisor must restart the run and finish.
    Returns (returncode, seconds, log text, what the events did, each with the second it happened)."""
    t0 = time.time()
    done = []
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "openrlhf_lpo.cli.train_ppo_ray", *args], env=env,
                                stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
        try:
            while proc.poll() is None:
                now = time.time() - t0
                if now > RUN_TIMEOUT_S:
                    raise TimeoutError(f"lpo-train did not finish in {RUN_TIMEOUT_S} s; events so far: {done}")
                if len(done) < len(events):
                    record = events[len(done)](log.read_text(errors="replace"), now)
                    if record:
                        done.append((*record, round(now, 1)))
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, time.time() - t0, log.read_text(errors="replace"), done


def after(text: str, marker: str) -> Optional[str]:
    """The log text after the last ``marker`` (None when it is not there yet)."""
    return text[text.rindex(marker):] if marker in text else None


def tb_scalars(tb_dir: Path) -> Dict[str, Dict[int, float]]:
    """``{tag: {step: value}}`` of a run's TensorBoard files (the product's reader)."""
    from openrlhf_lpo.testing.tensorboard_rows import scalars

    return scalars(tb_dir)


def tb_steps(scalars: Dict[str, Dict[int, float]]) -> List[int]:
    """The training steps logged to tensorboard (any ``train/`` scalar), sorted."""
    return sorted({s for tag, values in scalars.items() if tag.startswith("train/") for s in values})


def read_jsonl(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_weights(model_dir: Path):
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    assert files, f"no safetensors in {model_dir}"
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def max_weight_diff(a, b) -> float:
    """Max |a - b| over the tensors both hold (a saved model may add a tied lm_head the source lacks)."""
    common = a.keys() & b.keys()
    assert len(common) >= 0.9 * max(len(a), len(b)), (sorted(a.keys() ^ b.keys())[:5])
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in common)


# ----------------------------------------------------------------------------- recipe families, two episodes


def family_flags(family: str, **env) -> List[str]:
    """The flags a recipe family's config file adds (configs/families/<family>.sh), as the scripts get them."""
    out = subprocess.run(["bash", "-c", f'NNODES=1 GPUS_PER_NODE=2 source configs/families/{family}.sh; '
                                        'printf "%s\\n" "${FAMILY_ARGS[@]}"'],
                         cwd=str(REPO), env=dict(os.environ, **env), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def run_family(model: str, root: Path, name: str, *, dp: int, extra=(), estimator=("lpo", "--lpo.divergence", "fwd"),
               env: Optional[Dict[str, str]] = None, micro: int = 2, train: int = 16) -> Dict:
    """6 prompts in batches of 4, two episodes: steps of 4, 2, 4, 2 groups; an optimizer window holds
    4 groups, so each episode's partial last batch (2 groups) is smaller than a window."""
    data = write_prompts(root / "prompts6.jsonl", 6)
    out = root / name
    args = base_args(model, data, out, dp=dp, micro=micro, train=train, episodes=2, estimator=estimator, extra=extra)
    rc, wall, log = run_cli(args, run_env(env), root / f"{name}.log")
    assert rc == 0, f"{name} failed (rc={rc}); tail:\n{log[-6000:]}"
    print(f"\n[e2e family] {name}: {wall:.0f}s")
    return {"log": log, "tb": tb_scalars(out / "tb"), "argv": args}
