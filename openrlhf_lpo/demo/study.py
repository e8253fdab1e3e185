"""The demo's RL runs as the runs of a paired study (:mod:`openrlhf_lpo.compare`), and the CPU presets of
``lpo-compare``.

One run is one (method, seed): ``lpo-train`` through the demo pipeline (:mod:`openrlhf_lpo.demo.pipeline`) or
the in-process loop, from the cached warm-up, then the held-out evaluation of the job's checkpoints, merged
into its metrics rows. ``lpo-demo`` runs its methods as the runs of one seed (``demo/cli.py``);
``lpo-compare --preset cpu-demo`` runs ``configs/methods/*.sh`` methods (their flags read as the recipes read
them, in place of the demo method's) x seeds with the same job, one ``<out>/seed<s>`` directory per seed.

A run's job writes ``trained.json`` once ``lpo-train`` finished, so a study killed during the held-out
evaluation does not train again; a run killed during training resumes from its last checkpoint (every
``--eval-every`` steps; the pipeline's flags carry ``--ckpt.load_enable``) and its rows before the checkpoint
come back from its TensorBoard files.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from openrlhf_lpo.compare.files import MetricsWriter, atomic_write_json, read_json
from openrlhf_lpo.compare.plan import RunSpec, matrix, method_flags
from openrlhf_lpo.compare.presets import StudyPreset, register_study_preset
from openrlhf_lpo.demo.loop import RLConfig

TRAINED = "trained.json"


def quiet_libraries() -> None:
    """Keep the demo's own progress lines readable: no per-file HF bars, no import-time warnings."""
    import os
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


@dataclass(frozen=True)
class RecipeMethod:
    """A ``configs/methods/<name>.sh`` method in the demo pipeline: its flags select the method."""

    name: str
    flags: Tuple[str, ...]

    def pipeline_flags(self) -> List[str]:
        return list(self.flags)


def run_pipeline_with_retry(method, rl: RLConfig, model_path: str, out: Path, writer, progress: bool,
                            log: Callable[[str], None]) -> Dict:
    """One ``lpo-train`` job; if Ray itself failed to start (nothing trained yet: a busy machine can time the
    GCS out), try once more before giving up."""
    from openrlhf_lpo.demo import pipeline

    try:
        return pipeline.run_pipeline(method, rl, model_path, out, on_row=writer, progress=progress)
    except pipeline.PipelineError as e:
        if getattr(e, "component", None) != "ray" or getattr(e, "steps_done", 1):
            raise
        log(f"{method.name}: {e} -- retrying once")
        return pipeline.run_pipeline(method, rl, model_path, out, on_row=writer, progress=progress)


def evaluate_pipeline_run(out_dir: Path, rl: RLConfig, steps_done: int, metrics_path: Path, progress: bool,
                          log: Callable[[str], None]) -> Dict:
    """Held-out metrics of a finished ``lpo-train`` job's checkpoints, merged into its metrics rows."""
    if not rl.eval_every:
        return {}
    from openrlhf_lpo.demo.pipeline import evaluate_checkpoints
    from openrlhf_lpo.demo.report import merge_step_metrics

    t0 = time.time()
    found = evaluate_checkpoints(out_dir, rl, steps_done, progress=progress)
    if found:
        merge_step_metrics(metrics_path, found)
    missing = [s for s in rl.eval_steps() if 0 < s <= steps_done and s not in found]
    if missing:
        log(f"no checkpoint for held-out steps {missing} in {out_dir} (see its lpo-train.log)")
    return {"heldout_eval_s": time.time() - t0, "heldout_steps": sorted(found)}


class DemoJob:
    """Runs (method, seed) specs of the demo: ``methods`` by name (demo methods or :class:`RecipeMethod`),
    ``rl`` the settings every run shares (its seed is the spec's), ``warm`` the warm-up
    (:func:`openrlhf_lpo.demo.warmup.ensure_warmup`)."""

    def __init__(self, methods: Mapping[str, object], rl: RLConfig, warm: Dict, backend: str = "pipeline",
                 progress: bool = True, log: Callable[[str], None] = print):
        self.methods, self.rl, self.warm, self.backend = dict(methods), rl, warm, backend
        self.progress, self.log = progress, log
        self._start: Dict[int, Optional[Dict]] = {}
        self._locks: Dict[int, threading.Lock] = defaultdict(threading.Lock)

    def start_eval(self, seed: int, seed_dir: Path) -> Optional[Dict]:
        """Held-out metrics of the warm-up under ``seed``'s sampling (the step-0 row of every run of the seed),
        computed once per seed and kept in ``<seed_dir>/start_eval.json``."""
        if not self.rl.eval_every:
            return None
        with self._locks[seed]:
            if seed not in self._start:
                from openrlhf_lpo.demo.heldout import evaluate_checkpoint
                from openrlhf_lpo.demo.task import get_task

                cfg = dataclasses.replace(self.rl, seed=seed)
                path = Path(seed_dir) / "start_eval.json"
                key = {"model": str(self.warm["path"]), "heldout": dataclasses.asdict(cfg.heldout())}
                saved = read_json(path)
                if saved and saved.get("key") == key:
                    self._start[seed] = saved["metrics"]
                else:
                    t0 = time.time()
                    metrics = evaluate_checkpoint(self.warm["path"], get_task(cfg.task), cfg.heldout(),
                                                  threads=cfg.threads)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_json(path, {"key": key, "metrics": metrics, "eval_s": time.time() - t0})
                    self.log(f"held-out start, seed {seed} ({cfg.eval_prompts} problems x {cfg.eval_samples} "
                             f"samples, {time.time() - t0:.0f}s): "
                             + ", ".join(f"{k.replace('heldout_', '')} {v:.3f}" for k, v in metrics.items()))
                    self._start[seed] = metrics
        return self._start[seed]

    def run(self, spec: RunSpec, attempt: Dict) -> Dict:
        method = self.methods[spec.method]
        rl = dataclasses.replace(self.rl, seed=spec.seed)
        trained = read_json(spec.work_dir / TRAINED) if attempt["resume"] else None
        if trained is None:
            start_eval = self.start_eval(spec.seed, spec.metrics_path.parent.parent)
            log_file = spec.work_dir / "lpo-train.log"
            if attempt["resume"] and log_file.exists():  # keep the killed attempt's log
                log_file.rename(spec.work_dir / f"lpo-train.attempt{attempt['n'] - 1}.log")
            writer = MetricsWriter(spec.metrics_path)
            try:
                if self.backend == "inprocess":
                    from openrlhf_lpo.demo.loop import run_inprocess

                    trained = run_inprocess(method, rl, self.warm["path"], on_row=writer, progress=self.progress,
                                            start_eval=start_eval)
                else:
                    if start_eval is not None:
                        writer({"method": spec.method, "step": 0, "backend": self.backend, **start_eval})
                    trained = run_pipeline_with_retry(method, rl, self.warm["path"], spec.work_dir, writer,
                                                      self.progress, self.log)
            finally:
                writer.close()
            if self.backend == "pipeline":  # rows recovered from TensorBoard after a resume come last: sort
                from openrlhf_lpo.demo.report import merge_step_metrics

                merge_step_metrics(spec.metrics_path, {})
            atomic_write_json(spec.work_dir / TRAINED, trained)
        info = dict(trained)
        if self.backend == "pipeline":
            info.update(evaluate_pipeline_run(spec.work_dir, rl, info["steps"], spec.metrics_path, self.progress,
                                              self.log))
        return info

    def stop(self) -> None:
        from openrlhf_lpo.demo.pipeline import stop_all

        stop_all()


# ----------------------------------------------------------------------------- lpo-compare's CPU presets


def _settings(preset: str, wu, rl: RLConfig, seed: int, method: str, flags: Sequence[str]) -> Dict:
    rl = dataclasses.replace(rl, seed=seed)
    return {"preset": preset, "backend": "pipeline", "warmup": dataclasses.asdict(wu),
            "rl": dataclasses.asdict(rl) | {"pipeline_args": list(rl.pipeline_args)}, "method": method,
            "method_flags": list(flags)}


def _cpu_preset(name: str, demo_preset: str, description: str) -> StudyPreset:
    def configs(extra_args: Sequence[str]):
        from openrlhf_lpo.demo.presets import get_preset

        preset = get_preset(demo_preset)
        rl = dataclasses.replace(preset.rl, pipeline_args=tuple(extra_args))
        rl.validate()
        return preset.warmup, rl

    def plan(methods: Sequence[str], seeds: Sequence[int], out, extra_args: Sequence[str]) -> List[RunSpec]:
        from openrlhf_lpo.demo.task import get_task

        wu, rl = configs(extra_args)
        tokens = get_task(rl.task).max_answer_chars + 2  # the pipeline's --rollout.max_new_tokens (DAPO reads it)
        flags = {m: method_flags(m, tokens) for m in methods}
        return matrix(methods, seeds, Path(out),
                      {(m, s): _settings(name, wu, rl, s, m, flags[m]) for m in methods for s in seeds})

    def job(specs: Sequence[RunSpec], extra_args: Sequence[str], progress: bool, log: Callable[[str], None]):
        from openrlhf_lpo.demo.warmup import ensure_warmup

        quiet_libraries()
        wu, rl = configs(extra_args)
        warm = ensure_warmup(wu, progress=progress)
        log(("reused the cached warm-up" if warm["cached"] else "warm-up trained") + f": {warm['steps']} steps, "
            f"sampled accuracy {warm['sampled_accuracy']:.2f}")
        methods = {s.method: RecipeMethod(s.method, tuple(s.settings["method_flags"])) for s in specs}
        return DemoJob(methods, rl, warm, "pipeline", progress, log)

    return StudyPreset(name, description, plan, job)


register_study_preset(_cpu_preset(
    "cpu-demo", "cpu-demo", "lpo-demo's pairsum task and tiny Qwen3 through lpo-train on CPU: 40 steps of 16 prompts "
    "x K=8, held-out Pass@1/4/16 every 10 steps"))
register_study_preset(_cpu_preset(
    "ci", "ci", "the demo's ci preset: a short warm-up, 2 steps of 4 prompts x K=4, held-out Pass@k at step 2"))
