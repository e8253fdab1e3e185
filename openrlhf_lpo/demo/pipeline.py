"""Run one demo method through the product pipeline: ``lpo-train`` (OpenRLHF 0.11.2 on Ray).

Each method is one ``python -m openrlhf_lpo.cli.train_ppo_ray`` subprocess (the ``lpo-train``
console script) in its own session, so the demo can stop it and every process it started (the
local Ray cluster included) on failure or Ctrl-C. Without a GPU the CLI switches on the CPU
mode (:mod:`openrlhf_lpo.cpu.mode`): CPU rollout engine, gloo collectives, weight hand-over through
Ray's object store.

Metrics arrive as they are produced: the PPO trainer actor logs ``Global step N: {...}`` after
every step; those lines are parsed from the subprocess output and written to the method's jsonl
at once. The TensorBoard files (``--logger.tensorboard_dir``) fill in every step whose line did
not arrive (Ray may drop a job's last forwarded lines at exit). The upstream keys map to the demo's columns
through the one table of :mod:`openrlhf_lpo.compare.metrics`.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Dict, List, Optional

from openrlhf_lpo.compare.metrics import parse_step_line, step_row
from openrlhf_lpo.demo.loop import RLConfig
from openrlhf_lpo.demo.methods import Method
from openrlhf_lpo.testing.tensorboard_rows import train_rows

REWARD_FILE = Path(__file__).with_name("reward_func.py")

_ERROR_LINE = re.compile(r"^(?:.*\] )?((?:[\w.]+Error|[\w.]+Exception)(?:\([\w]+\))?: .*)$", re.MULTILINE)


class PipelineError(RuntimeError):
    """``lpo-train`` failed; the message names the component (Ray, rollout engine, ...) and a fix.

    ``component`` is "ray", "engine", "memory", "timeout" or "other"; ``steps_done`` counts the
    training steps that finished before the failure.
    """

    def __init__(self, message: str, component: str = "other", steps_done: int = 0):
        super().__init__(message)
        self.component = component
        self.steps_done = steps_done


def _component(message: str) -> str:
    if message.startswith("Ray could not start"):
        return "ray"
    if message.startswith("the rollout engine"):
        return "engine"
    if "out of memory" in message:
        return "memory"
    return "other"


def to_row(method: str, upstream: Dict, elapsed_s: float) -> Dict:
    return step_row(method, upstream, backend="pipeline", elapsed_s=elapsed_s)


def pipeline_argv(method: Method, cfg: RLConfig, model_path: str, dataset: str, out_dir: Path,
                  max_new_tokens: int) -> List[str]:
    """The ``lpo-train`` flags of one demo method (same for every method but the estimator flags).

    With held-out evaluation on, the actor saves a checkpoint every ``cfg.eval_every`` steps (DeepSpeed
    state, and ``<out_dir>/ckpt/global_step<N>_hf``) and loads the last one at start (``--ckpt.load_enable``:
    a killed job resumes); :func:`evaluate_checkpoints`
    scores the HF ones after the job, in the demo's process, with the same code as the in-process loop.
    ``cfg.pipeline_args`` come last, so they override (e.g. data-parallel ranks).
    """
    rollout = cfg.prompts_per_step * cfg.k
    train_batch = rollout // cfg.mini_batches
    micro = min(train_batch, 4 * cfg.k)
    argv = [
        "--actor.model_name_or_path", model_path,
        "--data.prompt_dataset", dataset, "--data.input_key", "prompt", "--data.label_key", "label",
        "--data.apply_chat_template", "--data.max_samples", str(cfg.steps * cfg.prompts_per_step),
        "--data.max_len", "128",
        "--reward.remote_url", str(REWARD_FILE),
        "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
        "--algo.kl.init_coef", "0",
        "--rollout.batch_size", str(cfg.prompts_per_step), "--rollout.n_samples_per_prompt", str(cfg.k),
        "--rollout.micro_batch_size", str(micro), "--rollout.max_new_tokens", str(max_new_tokens),
        "--rollout.temperature", str(cfg.sampling_temperature),
        "--train.batch_size", str(train_batch), "--train.micro_batch_size", str(micro),
        "--train.num_episodes", "1", "--train.max_epochs", "1", "--train.seed", str(cfg.seed),
        "--actor.adam.lr", str(cfg.lr), "--actor.lr_scheduler", "constant",
        "--actor.max_norm", str(cfg.max_grad_norm), "--actor.eps_clip", str(cfg.clip_eps),
        "--actor.entropy_coef", "0",
        "--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa",
        "--logger.tensorboard_dir", str(out_dir / "tb"), "--logger.logging_steps", "1",
        "--ckpt.path", str(out_dir / "ckpt"), "--ckpt.output_dir", str(out_dir / "final"),
    ]
    if cfg.eval_every:  # every HF export stays for the held-out evaluation after the job (not rotated)
        argv += ["--ckpt.save_steps", str(cfg.eval_every), "--ckpt.save_hf", "--ckpt.hf_max_num", "-1",
                 # a killed job started again in the same directory continues from its last checkpoint (the
                 # study runner empties the directory of a run that starts from scratch)
                 "--ckpt.load_enable"]
    return argv + method.pipeline_flags() + list(cfg.pipeline_args)


def _diagnose(tail: str, returncode: int, log_path: Path) -> str:
    """Name the component that failed and what to try, from the last lines of the log."""
    low = tail.lower()
    errors = _ERROR_LINE.findall(tail)
    hint = (f"last error: {errors[-1].strip()[:300]}; " if errors else "") + f"full log: {log_path}"
    if any(s in low for s in ("ray.init", "raysystemerror", "gcs", "failed to connect to", "ray_tmpdir",
                              "could not start ray", "raylet", "address already in use")):
        return (f"Ray could not start (exit {returncode}). Try: `ray stop --force`, free memory/disk under "
                f"/tmp (or set RAY_TMPDIR), and make sure no other Ray cluster owns the ports. {hint}")
    if any(s in low for s in ("rolloutrayactor", "cpurollout", "rollout engine", "vllm", "create_vllm_engines",
                              "enginecore", "parity")):
        return (f"the rollout engine could not start or failed (exit {returncode}). Try LPO_CPU_ENGINE=hf "
                f"(the HF-generate CPU engine) or `--backend inprocess` to run the demo without the pipeline. {hint}")
    if "out of memory" in low or "killed" in low or returncode in (-9, 137):
        return f"lpo-train was killed (exit {returncode}), probably out of memory; close other jobs. {hint}"
    return f"lpo-train exited with status {returncode}. {hint}"


def recover_missing_steps(tb_dir: Path, method: str, seen: set, on_row: Optional[Callable[[Dict], None]]) -> List[int]:
    """Rows for the steps in TensorBoard whose log line never reached us (Ray forwards the trainer's
    lines asynchronously and can drop the last ones when the job exits); adds them to ``seen``."""
    recovered = []
    for step, values in sorted(train_rows(tb_dir).items()):
        if step in seen:
            continue
        if on_row is not None:
            on_row(to_row(method, values, math.nan))
        seen.add(step)
        recovered.append(step)
    return recovered


def run_pipeline(method: Method, cfg: RLConfig, model_path: str, out_dir: Path,
                 on_row: Optional[Callable[[Dict], None]] = None, progress: bool = True,
                 timeout_s: Optional[float] = None, extra_env: Optional[Dict[str, str]] = None) -> Dict:
    """Run ``lpo-train`` for one method; stream metrics rows to ``on_row``; return a summary.

    Raises :class:`PipelineError` with a diagnosis when the subprocess fails; rows already
    delivered stay delivered.
    """
    from openrlhf_lpo.demo.task import get_task, write_prompt_dataset
    from openrlhf_lpo.demo.warmup import _bar

    cfg.validate()
    task = get_task(cfg.task)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = write_prompt_dataset(str(out_dir / "prompts.jsonl"), task, cfg.steps * cfg.prompts_per_step,
                                   cfg.seed + 17, split="train")
    argv = pipeline_argv(method, cfg, model_path, dataset, out_dir, task.max_answer_chars + 2)
    (out_dir / "command.txt").write_text("lpo-train " + " ".join(argv) + "\n")
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.update(extra_env or {})
    log_path = out_dir / "lpo-train.log"
    t0 = time.time()
    seen = set()
    tail: deque = deque(maxlen=80)
    bar = _bar(cfg.steps, f"{method.name} (lpo-train)", progress)
    if bar is not None:
        bar.set_postfix(stage="starting Ray + engine")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _STOP_WITH_PARENT, str(os.getpid()), *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, bufsize=1)
        LIVE.add(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line)
                parsed = parse_step_line(line)
                if parsed is None or parsed["step"] in seen:
                    if timeout_s and time.time() - t0 > timeout_s:
                        raise PipelineError(f"lpo-train took longer than {timeout_s:.0f}s; stopped. full log: {log_path}",
                                            "timeout", len(seen))
                    continue
                seen.add(parsed["step"])
                row = to_row(method.name, parsed, time.time() - t0)
                if on_row is not None:
                    on_row(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{row.get('reward', float('nan')):.2f}")
            returncode = proc.wait()
        except BaseException:
            _kill_session(proc)
            raise
        finally:
            LIVE.discard(proc)
            if bar is not None:
                bar.close()
    if returncode != 0:
        message = _diagnose("".join(tail), returncode, log_path)
        raise PipelineError(message, _component(message), len(seen))
    recover_missing_steps(out_dir / "tb", method.name, seen, on_row)
    if not seen:
        raise PipelineError(f"lpo-train finished but logged no training step; full log: {log_path}")
    summary = {"method": method.name, "steps": len(seen), "wall_s": time.time() - t0, "log": str(log_path)}
    final = out_dir / "final"
    if (final / "model.safetensors").exists():
        summary["final_model"] = str(final)
    return summary


def checkpoint_for_step(out_dir: Path, step: int, last_step: int) -> Optional[Path]:
    """The HF model directory holding the weights after ``step`` (the final model for the last step)."""
    out_dir = Path(out_dir)
    candidates = [out_dir / "ckpt" / f"global_step{step}_hf"]
    if step == last_step:
        candidates.append(out_dir / "final")
    for path in candidates:
        if (path / "config.json").exists() and any(path.glob("*.safetensors")):
            return path
    return None


def evaluate_checkpoints(out_dir: Path, cfg: RLConfig, steps_done: int,
                         progress: bool = True) -> Dict[int, Dict[str, float]]:
    """Held-out metrics (:func:`openrlhf_lpo.demo.heldout.evaluate_checkpoint`) of every checkpoint
    a finished job saved at ``cfg.eval_steps()``; ``{step: metrics}``. Steps without a checkpoint are
    left out (a job that stopped early)."""
    from openrlhf_lpo.demo.heldout import evaluate_checkpoint
    from openrlhf_lpo.demo.task import get_task
    from openrlhf_lpo.demo.warmup import _bar

    task = get_task(cfg.task)
    steps = [s for s in cfg.eval_steps() if 0 < s <= steps_done]
    found = [(s, checkpoint_for_step(out_dir, s, steps_done)) for s in steps]
    found = [(s, p) for s, p in found if p is not None]
    bar = _bar(len(found), "held-out evaluation", progress)
    out = {}
    try:
        for s, path in found:
            out[s] = {**evaluate_checkpoint(str(path), task, cfg.heldout(), threads=cfg.threads),
                      "heldout_checkpoint": str(path)}
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return out


# ``python -m openrlhf_lpo.cli.train_ppo_ray <argv>`` that gets SIGTERM when the thread that started it dies (the
# demo or lpo-compare killed outright: Linux's prctl PR_SET_PDEATHSIG), so no job trains on unseen in a directory
# the next invocation resumes in; elsewhere it is the plain command
_STOP_WITH_PARENT = """import ctypes, os, runpy, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv.pop(1)):  # the parent died before the prctl
    sys.exit(143)
runpy.run_module("openrlhf_lpo.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
"""


LIVE: set = set()  # the lpo-train processes running now (jobs of the demo may run side by side)


def stop_all() -> None:
    """Stop every running lpo-train job and what it started (Ctrl-C in the demo's main thread)."""
    for proc in list(LIVE):
        _kill_session(proc)


def _kill_session(proc: subprocess.Popen) -> None:
    """Stop the subprocess and everything in its session (the Ray cluster it started)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
