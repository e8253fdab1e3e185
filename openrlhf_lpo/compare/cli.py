"""``lpo-compare``: the paired multi-seed study as one command.

    lpo-compare examples/scripts/train_math_qwen3_8b.sh --methods grpo,lpo_fwd,lpo_rev --seeds 3   # GPU cluster
    lpo-compare --preset cpu-demo --methods grpo,lpo_fwd --seeds 2                                # CPU
    lpo-compare ... --dry-run        # the run matrix, what each run would do (kept / resumed / started), no run
    lpo-compare ... --report-only    # the table and plots of what finished, no run

Methods are ``configs/methods/*.sh`` names, the first is the baseline. Every method runs once per seed with the
same ``--train.seed`` (the same prompt order and per-request sampling seeds): the pairs differ only in the
method. Each run is a normal ``lpo-train`` run under Ray: on a cluster the recipe's own Ray job, as many at
once as the cluster's GPUs allow; on CPU the demo pipeline, ``--jobs`` at once. Run the same command again to
resume: a finished run is kept, a killed one continues from its checkpoint. Writes ``<out>/table.md``,
``table.csv``, ``table.json``, ``figure5.png`` and ``paired.png`` (:mod:`openrlhf_lpo.compare.report`).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from openrlhf_lpo.compare.files import atomic_write_json, read_metrics
from openrlhf_lpo.compare.plan import PlanError, RunSpec, parse_methods, seed_list
from openrlhf_lpo.compare.presets import STUDY_PRESETS, get_study_preset
from openrlhf_lpo.compare.runner import decide, run_matrix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lpo-compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("recipe", nargs="?", help="a recipe script (examples/scripts/train_*.sh); or --preset")
    p.add_argument("--preset", help="a study without a recipe: " + ", ".join(
        f"{n} ({STUDY_PRESETS[n].description})" for n in sorted(STUDY_PRESETS)))
    p.add_argument("--methods", required=True, help="comma-separated configs/methods/*.sh names, the baseline first")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds per method (default 3)")
    p.add_argument("--first-seed", type=int, default=0, help="the seeds are first .. first + seeds - 1 (default 0)")
    p.add_argument("--out", help="study directory (default runs/compare-<recipe or preset>); rerun to resume")
    p.add_argument("--jobs", default="auto", help="runs at once (default auto: as many as the cluster's GPUs fit; "
                   "the CPU presets 2)")
    p.add_argument("--extra-args", default="", help="lpo-train flags for every run, appended last (EXTRA_ARGS of the "
                   "environment go first)")
    p.add_argument("--eval-dataset", help="recipe: held-out prompts for the in-training evaluation (--eval.dataset)")
    p.add_argument("--eval-steps", type=int, default=10, help="recipe: evaluate every N steps (default 10)")
    p.add_argument("--eval-n", type=int, default=8, help="recipe: samples per held-out prompt, Pass@k for k <= n "
                   "(default 8)")
    p.add_argument("--window", type=int, default=5, help="training steps averaged for a run's final value (default 5)")
    p.add_argument("--fresh", action="store_true", help="rerun every run from scratch (default: keep and resume)")
    p.add_argument("--dry-run", action="store_true", help="print the run matrix and each run's decision; run nothing")
    p.add_argument("--report-only", action="store_true", help="write the report of the finished runs; run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


@dataclass
class Study:
    name: str
    title: str
    methods: List[str]
    seeds: List[int]
    out: Path
    specs: List[RunSpec]
    jobs: Optional[int]                      # None: auto (recipe: from the cluster)
    make_job: Callable[[bool, Callable], object]
    auto_jobs: Callable[[], int]
    window: int = 5


def _extra_args(args, recipe: bool) -> List[str]:
    import os

    text = " ".join(x for x in (os.environ.get("EXTRA_ARGS", "") if recipe else "", args.extra_args) if x)
    try:
        extra = shlex.split(text)
    except ValueError as e:
        raise PlanError(f"--extra-args: {e}") from None
    if any(a == "--train.seed" or a.startswith("--train.seed=") for a in extra):
        raise PlanError("--extra-args sets --train.seed, which lpo-compare sets per run; choose the seeds with "
                        "--seeds N and --first-seed S")
    if recipe and any(not a or any(c.isspace() for c in a) for a in extra):
        raise PlanError("--extra-args: a recipe splits EXTRA_ARGS on whitespace, so no flag value may contain a space")
    if recipe and args.eval_dataset:
        if args.eval_steps < 1 or args.eval_n < 1:
            raise PlanError(f"--eval-steps and --eval-n must be >= 1; got {args.eval_steps}, {args.eval_n}")
        extra += ["--eval.dataset", args.eval_dataset, "--eval.steps", str(args.eval_steps),
                  "--eval.n_samples_per_prompt", str(args.eval_n)]
    return extra


def resolve(args) -> Study:
    """Check every argument (PlanError naming it) and plan the runs; starts nothing."""
    if bool(args.recipe) == bool(args.preset):
        raise PlanError("give either a recipe script (lpo-compare examples/scripts/train_math_qwen3_8b.sh ...) or "
                        "--preset NAME (" + ", ".join(sorted(STUDY_PRESETS)) + "), not " +
                        ("both" if args.recipe else "neither"))
    methods = parse_methods(args.methods)
    seeds = seed_list(args.seeds, args.first_seed)
    if args.window < 1:
        raise PlanError(f"--window must be >= 1; got {args.window}")
    jobs: Optional[int] = None
    if args.jobs != "auto":
        try:
            jobs = int(args.jobs)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise PlanError(f"--jobs must be 'auto' or a number >= 1 (runs at once); got {args.jobs!r}")
    if args.recipe:
        from openrlhf_lpo.compare import recipe as rc

        path = Path(args.recipe)
        problem = rc.recipe_problem(path)
        if problem:
            raise PlanError(problem)
        extra = _extra_args(args, recipe=True)
        name = path.stem
        out = Path(args.out or Path("runs") / f"compare-{name}")
        specs = rc.plan_recipe(path, methods, seeds, out, extra)

        def auto_jobs() -> int:
            need = rc.gpus_per_run(path, rc.run_env(methods[0], seeds[0], out / f"seed{seeds[0]}", extra))
            return rc.jobs_for_cluster(need, rc.cluster_gpus())

        def make_job(progress, log):
            return rc.RecipeJob(path, extra, progress, log)

        title = f"lpo-compare {path.name}: " + ", ".join(methods) + f"; seeds {seeds[0]}-{seeds[-1]}"
        return Study(name, title, methods, seeds, out, specs, jobs, make_job, auto_jobs, args.window)
    preset = get_study_preset(args.preset)
    if args.eval_dataset:
        raise PlanError("--eval-dataset applies to a recipe; the CPU presets evaluate held-out problems themselves")
    extra = _extra_args(args, recipe=False)
    out = Path(args.out or Path("runs") / f"compare-{preset.name}")
    specs = preset.plan(methods, seeds, out, extra)
    title = f"lpo-compare --preset {preset.name}: " + ", ".join(methods) + f"; seeds {seeds[0]}-{seeds[-1]}"
    return Study(preset.name, title, methods, seeds, out, specs, jobs,
                 lambda progress, log: preset.job(specs, extra, progress, log), lambda: preset.default_jobs,
                 args.window)


def _log(msg: str) -> None:
    print(f"[lpo-compare] {msg}", flush=True)


def print_plan(study: Study, policy: str) -> None:
    print(f"{study.title}\nstudy directory: {study.out}")
    try:
        jobs = study.jobs or study.auto_jobs()
        print(f"runs at once: {jobs}" + ("" if study.jobs else " (auto)"))
    except PlanError as e:
        print(f"runs at once: auto, unknown here ({e})")
    width = max(len(s.key) for s in study.specs)
    for s in study.specs:
        print(f"  {s.key:<{width}}  {decide(s, policy):<6}  {s.work_dir}")
    print("(skip = finished before, kept; resume = killed, continues from its checkpoint; fresh = starts from "
          "scratch)")
    env = study.specs[0].settings.get("env")
    if env:  # a recipe: how its first run starts
        print(f"first run: {' '.join(f'{k}={v!r}' for k, v in env.items())} SAVE_ROOT="
              f"{study.specs[0].work_dir.parent} bash {study.specs[0].settings['recipe']}")


def report(study: Study) -> Dict:
    """Table and figures of every finished run (its done marker holds its settings)."""
    from openrlhf_lpo.compare.report import build_table, plot_study, table_markdown, write_table

    runs = {(s.method, s.seed): read_metrics(s.metrics_path) for s in study.specs if decide(s) == "skip"}
    table = build_table(runs, study.methods, study.seeds, study.window)
    paths = write_table(study.out, table, study.title)
    if runs:
        paths.update(plot_study(runs, study.methods, study.seeds, study.out, study.title, window=study.window))
    print(table_markdown(table), end="", flush=True)
    _log("wrote " + ", ".join(str(p) for p in paths.values()))
    return table


def run(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        study = resolve(args)
    except PlanError as e:
        parser.error(str(e))
    policy = "fresh" if args.fresh else "resume"
    if args.dry_run:
        print_plan(study, policy)
        return 0
    study.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(study.out / "study.json", {"title": study.title, "methods": study.methods, "seeds": study.seeds,
                                                 "recipe": args.recipe, "preset": args.preset,
                                                 "argv": sys.argv[1:] if argv is None else argv, "time": time.time()})
    if not args.report_only:
        try:
            jobs = study.jobs or study.auto_jobs()
        except PlanError as e:
            parser.error(str(e))
        _log(f"{len(study.specs)} runs ({len(study.methods)} methods x {len(study.seeds)} seeds), {jobs} at once; "
             f"study directory {study.out}")
        status: Dict[str, Dict] = {}

        def record(spec: RunSpec, entry: Dict) -> None:  # the runner serialises its calls
            status[spec.key] = entry
            atomic_write_json(study.out / "status.json", status)

        # every run finished before: nothing to prepare (the CPU presets would load the warm-up)
        job = None if all(decide(s, policy) == "skip" for s in study.specs) else \
            study.make_job(not args.no_progress, _log)
        try:
            run_matrix(study.specs, job, jobs, policy, record=record, log=_log)
        except KeyboardInterrupt:
            _log("interrupted: run the same command again to resume")
            report(study)
            raise
    table = report(study)
    finished = len(table["runs"])
    if finished < len(study.specs):
        _log(f"{len(study.specs) - finished} of {len(study.specs)} runs did not finish (status.json); run the same "
             "command again to resume them")
        return 1
    return 0


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[List[str]] = None) -> None:
    signal.signal(signal.SIGTERM, _sigterm)  # a scheduler's stop stops the runs' jobs too
    try:
        code = run(argv)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
