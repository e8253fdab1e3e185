"""A study on a GPU cluster: every (method, seed) run is the recipe script as its user runs it.

``METHOD=<m> SAVE_ROOT=<out>/seed<s>/pipeline RUN_NAME=<m> EXTRA_ARGS="<extra> --train.seed <s>" bash <recipe>``:
the recipe (``examples/scripts/train_*.sh``, through ``examples/scripts/lib/launch.sh``) submits one Ray job,
``ray job submit -- python3 -m openrlhf_lpo.cli.train_ppo_ray <flags>``, and waits for it, streaming its log.
``EXTRA_ARGS`` comes last, so the seed overrides the recipe's; the recipes pass ``--ckpt.load_enable`` and
``--ckpt.auto_resume``, so a run submitted again continues from its last checkpoint. Each attempt has its own
submission id (``LPO_SUBMISSION_ID``): when ``lpo-compare`` itself was killed while a job ran on, the next
invocation follows that job to its end instead of starting a second one; Ctrl-C stops the submitted jobs.

As many runs go at once as the cluster's GPUs allow: the GPUs one run needs are the ``GPUs needed`` line of the
recipe's dry run (``LPO_DRY_RUN=1``, ``lpo-train --dry-run``), the cluster's are ``ray.cluster_resources()``.

A run's metrics come from its TensorBoard files (``<run>/tb``: ``train/<key>`` per step and the in-training
evaluation's ``eval/<key>``, mapped by :mod:`openrlhf_lpo.compare.metrics`), with the streamed "Global step"
lines for any step TensorBoard lacks. The study directory must be on storage the cluster's nodes share (as
``SAVE_ROOT`` must for any multi-node recipe). A run is finished when the recipe exited 0 and the final model
(``<run>/final/config.json``) is there (``ray job submit`` also exits 0 for a stopped job).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from openrlhf_lpo.compare.files import write_metrics
from openrlhf_lpo.compare.metrics import eval_columns, parse_step_line, step_row
from openrlhf_lpo.compare.plan import PlanError, RunSpec, effective_flag, matrix

LAUNCHER = "lib/launch.sh"
_GPUS = re.compile(r"^GPUs needed: (\d+)", re.MULTILINE)
_EVAL_LINE = re.compile(r"global_step (\d+), eval_metrics: (\{.*\})")
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"  # the recipes' default RAY_ADDRESS


def recipe_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a recipe script (None when it is one)."""
    hint = "give a recipe such as examples/scripts/train_math_qwen3_8b.sh, or --preset cpu-demo on CPU"
    if not path.exists():
        return f"RECIPE {path} does not exist; {hint}"
    if not path.is_file() or path.suffix != ".sh":
        return f"RECIPE {path} is not a script (a .sh file); {hint}"
    if LAUNCHER not in path.read_text(errors="replace"):
        return (f"RECIPE {path} is not a recipe: it does not source examples/scripts/{LAUNCHER}, so it cannot take "
                f"METHOD and EXTRA_ARGS; {hint}")
    return None


def run_env(method: str, seed: int, seed_dir: Path, extra_args: Sequence[str]) -> Dict[str, str]:
    """The environment that makes the recipe run ``method`` with ``--train.seed seed`` into ``seed_dir``."""
    return {"METHOD": method, "SAVE_ROOT": str(Path(seed_dir) / "pipeline"), "RUN_NAME": method,
            "EXTRA_ARGS": " ".join([*extra_args, "--train.seed", str(seed)])}


def _recipe(recipe: Path, env: Mapping[str, str], **more) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, **more}
    return subprocess.run(["bash", str(recipe)], env=full, capture_output=True, text=True)


def recipe_flags(recipe: Path, env: Mapping[str, str]) -> List[str]:
    """The ``lpo-train`` flags the recipe runs with ``env`` (``LPO_PRINT_ARGS=1``: nothing is started)."""
    out = _recipe(recipe, env, LPO_PRINT_ARGS="1")
    if out.returncode != 0:
        raise PlanError(f"{recipe} with METHOD={env['METHOD']} could not print its flags (exit {out.returncode}): "
                        f"{out.stderr.strip()[-600:]}")
    return out.stdout.splitlines()


def plan_recipe(recipe: Path, methods: Sequence[str], seeds: Sequence[int], out: Path,
                extra_args: Sequence[str]) -> List[RunSpec]:
    """The runs; a run's settings are its full flags (the study directory written as ``<out>``)."""
    out = Path(out)
    settings = {}
    for s in seeds:
        for m in methods:
            env = run_env(m, s, out / f"seed{s}", extra_args)
            flags = recipe_flags(recipe, env)
            if effective_flag(flags, "--train.seed") != str(s):  # EXTRA_ARGS comes last in every recipe
                raise PlanError(f"{recipe}: --train.seed {s} from EXTRA_ARGS does not take effect (the recipe sets "
                                f"{effective_flag(flags, '--train.seed')} after it); a recipe must append EXTRA_ARGS "
                                "last")
            settings[(m, s)] = {"recipe": str(recipe.resolve()),
                                "env": {k: v for k, v in env.items() if k != "SAVE_ROOT"},
                                "flags": [f.replace(str(out), "<out>") for f in flags]}
    return matrix(methods, seeds, out, settings)


def gpus_per_run(recipe: Path, env: Mapping[str, str]) -> int:
    """GPUs one run of the recipe needs: the ``GPUs needed`` line of its dry run."""
    extra = (env.get("EXTRA_ARGS", "") + " --preflight off").strip()
    out = _recipe(recipe, {**env, "EXTRA_ARGS": extra}, LPO_DRY_RUN="1", PYTHON=sys.executable)
    m = _GPUS.search(out.stdout)
    if out.returncode != 0 or not m:
        raise PlanError(f"the dry run of {recipe} (LPO_DRY_RUN=1) failed (exit {out.returncode}), so the GPUs per run "
                        f"are unknown; fix the recipe or pass --jobs N: {(out.stderr or out.stdout).strip()[-600:]}")
    return int(m.group(1))


def cluster_gpus() -> float:
    """GPUs of the running Ray cluster this machine belongs to (``ray.cluster_resources()``)."""
    try:
        import ray

        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        try:
            return float(ray.cluster_resources().get("GPU", 0.0))
        finally:
            ray.shutdown()
    except Exception as e:  # no cluster here, or it cannot be reached
        raise PlanError(f"could not read the Ray cluster's GPUs ({type(e).__name__}: {e}); start it on this machine "
                        "(ray start --head ...) or pass --jobs N") from None


def jobs_for_cluster(gpus_run: int, gpus_cluster: float) -> int:
    """Runs at once: whole runs that fit the cluster's GPUs."""
    if gpus_run <= 0:
        return 1
    n = int(math.floor(gpus_cluster / gpus_run + 1e-9))
    if n < 1:
        raise PlanError(f"one run of this recipe needs {gpus_run} GPUs but the Ray cluster has {gpus_cluster:g}; "
                        "add nodes or shrink the recipe (NNODES, GPUS_PER_NODE, ...)")
    return n


def submission_id(spec: RunSpec, attempt: int) -> str:
    return f"lpo-compare-{spec.settings_hash[:10]}-{spec.method}-seed{spec.seed}-a{attempt}"


class RecipeJob:
    """Runs the specs of :func:`plan_recipe` (module docstring)."""

    def __init__(self, recipe: Path, extra_args: Sequence[str], progress: bool = True,
                 log: Callable[[str], None] = print, address: Optional[str] = None):
        self.recipe, self.extra_args, self.progress, self.log = Path(recipe), list(extra_args), progress, log
        self.address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_DASHBOARD
        self._live: Dict[int, subprocess.Popen] = {}
        self._submitted: set = set()
        self._lock = threading.Lock()

    # -- Ray jobs
    def _client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address)

    def job_state(self, sid: str) -> Optional[str]:
        """PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED; None when the cluster does not know ``sid``."""
        try:
            return str(self._client().get_job_status(sid).value)
        except Exception:
            return None

    def _stream(self, argv: List[str], env: Mapping[str, str], spec: RunSpec, live: Dict[int, Dict]) -> int:
        """Run ``argv`` in its own session, its output appended to the run's log; step lines go to ``live``."""
        with open(spec.work_dir / "recipe.log", "a") as log:
            proc = subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True, bufsize=1)
            with self._lock:
                self._live[proc.pid] = proc
            try:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    self._parse(line, spec, live)
                return proc.wait()
            finally:
                with self._lock:
                    self._live.pop(proc.pid, None)

    def _parse(self, line: str, spec: RunSpec, live: Dict[int, Dict]) -> None:
        up = parse_step_line(line)
        if up is not None:
            live.setdefault(up["step"], {}).update(step_row(spec.method, up, backend="recipe"))
            if self.progress and up["step"] % 10 == 0:
                self.log(f"{spec.key}: step {up['step']}")
            return
        m = _EVAL_LINE.search(line)
        if m:
            import ast

            try:
                logs = {k: float(v) for k, v in ast.literal_eval(m.group(2)).items() if isinstance(v, (int, float))}
            except (ValueError, SyntaxError):
                return
            step = int(m.group(1))
            live.setdefault(step, {"method": spec.method, "step": step}).update(eval_columns(logs))

    def run(self, spec: RunSpec, attempt: Dict) -> Dict:
        env = {**os.environ, **run_env(spec.method, spec.seed, spec.work_dir.parent.parent, self.extra_args)}
        live: Dict[int, Dict] = {}
        (spec.work_dir / "command.txt").write_text(
            " ".join(f"{k}={env[k]!r}" for k in ("METHOD", "SAVE_ROOT", "RUN_NAME", "EXTRA_ARGS"))
            + f" bash {self.recipe}\n")
        if attempt["resume"] and attempt["n"] > 1:
            previous = submission_id(spec, attempt["n"] - 1)
            state = self.job_state(previous)
            if state in ("PENDING", "RUNNING"):
                self.log(f"{spec.key}: the Ray job {previous} of the last attempt is still {state}: following it")
                with self._lock:
                    self._submitted.add(previous)
                self._stream(["ray", "job", "logs", "--address", self.address, "--follow", previous], env, spec, live)
                state = self.job_state(previous)
                with self._lock:
                    self._submitted.discard(previous)
            if state == "SUCCEEDED" and (spec.work_dir / "final" / "config.json").exists():
                return self.collect(spec, 0, live, previous)
        sid = submission_id(spec, attempt["n"])
        with self._lock:
            self._submitted.add(sid)
        try:
            rc = self._stream(["bash", str(self.recipe)], {**env, "LPO_SUBMISSION_ID": sid}, spec, live)
        finally:
            with self._lock:
                self._submitted.discard(sid)
        return self.collect(spec, rc, live, sid)

    def collect(self, spec: RunSpec, rc: int, live: Dict[int, Dict], sid: str) -> Dict:
        """The run's metrics rows (TensorBoard first, the streamed lines for the rest) and its result."""
        from openrlhf_lpo.testing.tensorboard_rows import scalars

        rows: Dict[int, Dict] = {}
        train: Dict[int, Dict] = {}
        evals: Dict[int, Dict] = {}
        for tag, values in scalars(spec.work_dir / "tb").items():
            kind, _, key = tag.partition("/")
            target = train if kind == "train" else evals if kind == "eval" else None
            if target is not None:
                for step, v in values.items():
                    target.setdefault(step, {"step": step})[key] = v
        for step, up in train.items():
            rows[step] = step_row(spec.method, up, backend="recipe")
        for step, logs in evals.items():
            rows.setdefault(step, {"method": spec.method, "step": step}).update(eval_columns(logs))
        for step, row in live.items():
            for k, v in row.items():
                rows.setdefault(step, {"method": spec.method, "step": step}).setdefault(k, v)
        write_metrics(spec.metrics_path, [rows[s] for s in sorted(rows)])
        log = spec.work_dir / "recipe.log"
        if rc != 0:
            raise RuntimeError(f"the recipe exited with status {rc} (Ray job {sid}); its log: {log}")
        final = spec.work_dir / "final"
        if not (final / "config.json").exists():
            raise RuntimeError(f"the Ray job {sid} ended without the final model {final} (stopped, or failed before "
                               f"the end); its log: {log}")
        return {"steps": sum(1 for r in rows.values() if r.get("reward") is not None), "submission_id": sid,
                "log": str(log), "final_model": str(final)}

    def stop(self) -> None:
        """Stop the submitted Ray jobs and the local processes (Ctrl-C)."""
        with self._lock:
            procs, sids = list(self._live.values()), list(self._submitted)
        for sid in sids:
            try:
                self._client().stop_job(sid)
            except Exception:
                pass
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
