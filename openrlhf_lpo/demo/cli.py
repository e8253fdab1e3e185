"""``lpo-demo``: see Listwise Policy Optimization (LPO) work on a CPU-only machine in minutes.

    lpo-demo                         # = lpo-demo --preset cpu-demo
    lpo-demo --task addition         # the 2-digit addition task (one right answer per prompt)
    lpo-demo --steps 60 --k 4 --methods lpo-fwd,lpo-rev,grpo
    lpo-demo --backend inprocess     # same comparison without Ray/OpenRLHF (debugging)

Stages, each with a progress bar:

1. build a tiny Qwen3 + character tokenizer offline and warm it up with supervised steps on the
   task until its sampled accuracy reaches the preset's target (cached under
   ``$LPO_CACHE_DIR``/``~/.cache/openrlhf-lpo``; the next run starts at once);
2. run each method (default LPO-fwd and the matched GRPO baseline: same seed, same prompts, same
   group-std temperature, same steps) through the ``lpo-train`` pipeline (Ray, OpenRLHF actors
   with the LPO loss, CPU rollout engine, rule-based reward);
3. evaluate the warm-up and every ``--eval-every`` steps' checkpoint on held-out problems (Pass@k,
   distinct correct answers per prompt, coverage, greedy accuracy);
4. write ``<run_dir>/metrics/<method>.jsonl`` as steps finish, then ``comparison.png`` and
   ``summary.txt``.

A method that fails (Ray or the rollout engine cannot start, a crash) is recorded in
``status.json`` with the reason; the methods that finished keep their metrics and plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

# torch.cuda imports the deprecated pynvml package on import; nothing the demo's user can act on.
warnings.filterwarnings("ignore", message=".*pynvml.*")

from openrlhf_lpo.demo.methods import METHODS, parse_methods
from openrlhf_lpo.demo.presets import PRESETS, get_preset
from openrlhf_lpo.demo.report import atomic_write_json, atomic_write_text, load_run, plot_run, summarize
from openrlhf_lpo.demo.study import quiet_libraries as _quiet_libraries

BACKENDS = ("pipeline", "inprocess")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lpo-demo", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"presets: {', '.join(f'{n} ({PRESETS[n].description})' for n in PRESETS)}",
    )
    p.add_argument("--preset", default="cpu-demo", help=f"one of {sorted(PRESETS)} (default cpu-demo)")
    p.add_argument("--task", help="toy task: pairsum (default; 4 right answers per prompt) or addition")
    p.add_argument("--k", type=int, help="responses per prompt (group size K)")
    p.add_argument("--steps", type=int, help="RL steps per method")
    p.add_argument("--prompts-per-step", type=int, help="prompts per RL step")
    p.add_argument("--lr", type=float, help="RL learning rate")
    p.add_argument("--mini-batches", type=int,
                   help="optimizer steps per rollout (each over whole groups; >1 makes later ones off-policy)")
    p.add_argument("--seed", type=int, help="seed shared by every method (prompts, sampling)")
    p.add_argument("--eval-every", type=int,
                   help="held-out evaluation every N RL steps, plus the warm-up and the last step (0 = off)")
    p.add_argument("--eval-prompts", type=int, help="held-out problems per evaluation")
    p.add_argument("--eval-samples", type=int, help="responses per held-out problem (Pass@k for k <= this)")
    p.add_argument("--methods", help=f"comma-separated, from {sorted(METHODS)} (default lpo-fwd,grpo)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="pipeline: lpo-train with Ray/OpenRLHF (default); inprocess: plain-torch loop")
    p.add_argument("--run-dir", help="output directory (default runs/demo-<time>)")
    p.add_argument("--warmup-max-steps", type=int, help="cap on supervised warm-up steps")
    p.add_argument("--warmup-target", type=float, help="stop the warm-up at this sampled accuracy")
    p.add_argument("--force-warmup", action="store_true", help="retrain the warm-up even if cached")
    p.add_argument("--resume", action="store_true",
                   help="with --run-dir of an earlier run with the same settings: keep its finished methods, "
                        "run only the others")
    p.add_argument("--pipeline-args", help="extra lpo-train flags for every pipeline job, appended last, e.g. "
                   "\"--actor.num_gpus_per_node 2 --train.micro_batch_size 2\" (data-parallel ranks, layouts)")
    p.add_argument("--jobs", type=int, default=2,
                   help="pipeline methods run side by side (default 2: their start-ups overlap; 1 = one after "
                        "the other)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def resolve(args: argparse.Namespace):
    """Preset + command-line overrides -> (warmup config, RL config, methods, backend)."""
    preset = get_preset(args.preset)
    wu, rl = preset.for_task(args.task) if args.task else (preset.warmup, preset.rl)
    rl_over = {k: v for k, v in dict(k=args.k, steps=args.steps,
                                     prompts_per_step=args.prompts_per_step, lr=args.lr,
                                     mini_batches=args.mini_batches, seed=args.seed,
                                     eval_every=args.eval_every, eval_prompts=args.eval_prompts,
                                     eval_samples=args.eval_samples,
                                     pipeline_args=tuple(shlex.split(args.pipeline_args)) if args.pipeline_args
                                     else None).items() if v is not None}
    rl = dataclasses.replace(rl, **rl_over)
    wu_over = {k: v for k, v in dict(max_steps=args.warmup_max_steps,
                                     target_accuracy=args.warmup_target).items() if v is not None}
    wu = dataclasses.replace(wu, **wu_over)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1 (methods run side by side); got {args.jobs}")
    rl.validate()
    rl.heldout().validate()
    wu.validate()
    methods = parse_methods(args.methods) if args.methods else [METHODS[n] for n in preset.methods]
    return wu, rl, methods, args.backend or preset.backend


def _log(msg: str) -> None:
    print(f"[lpo-demo] {msg}", flush=True)


def run_demo(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        wu, rl, methods, backend = resolve(args)
    except ValueError as e:
        parser.error(str(e))
    progress = not args.no_progress
    _quiet_libraries()
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    config = {"preset": args.preset, "backend": backend, "methods": [m.name for m in methods],
              "warmup": dataclasses.asdict(wu), "rl": dataclasses.asdict(rl) | {"pipeline_args": list(rl.pipeline_args)},
              "argv": argv or sys.argv[1:]}
    atomic_write_json(run_dir / "config.json", config)
    _log(f"run directory: {run_dir}")

    from openrlhf_lpo.demo.warmup import cached_path, ensure_warmup

    _log(f"warm-up: {wu.task}, cache {cached_path(wu)}")
    t0 = time.time()
    warm = ensure_warmup(wu, progress=progress, force=args.force_warmup)
    warm_s = time.time() - t0
    _log(("reused cached warm-up" if warm["cached"] else f"warm-up trained in {warm_s:.0f}s")
         + f": {warm['steps']} steps, sampled accuracy {warm['sampled_accuracy']:.2f}, "
           f"greedy {warm['greedy_accuracy']:.2f}")
    atomic_write_json(run_dir / "warmup.json", {k: v for k, v in warm.items() if k != "history"}
                      | {"load_s": warm_s})

    from openrlhf_lpo.compare.plan import RunSpec
    from openrlhf_lpo.compare.runner import run_matrix
    from openrlhf_lpo.demo.study import DemoJob

    # the demo is a paired study of one seed (openrlhf_lpo.compare): one run per method, markers in its directory
    job = DemoJob({m.name: m for m in methods}, rl, warm, backend, progress, _log)
    job.start_eval(rl.seed, run_dir)  # the warm-up's held-out metrics: every method's step-0 row
    rl_settings = dataclasses.asdict(rl) | {"pipeline_args": list(rl.pipeline_args)}
    specs = [RunSpec(m.name, rl.seed, run_dir / backend / m.name, run_dir / "metrics" / f"{m.name}.jsonl",
                     {"preset": args.preset, "backend": backend, "warmup": dataclasses.asdict(wu), "rl": rl_settings,
                      "method": m.name, "flags": m.pipeline_flags()}) for m in methods]
    status = {}

    def record(spec, entry: dict) -> None:  # the runner serialises its calls
        status[spec.method] = {**entry, "backend": backend}
        atomic_write_json(run_dir / "status.json", status)

    # pipeline jobs side by side (--jobs): their start-up (imports, Ray, actors) overlaps; the in-process
    # loop runs one method at a time
    jobs = 1 if backend == "inprocess" else args.jobs
    try:
        run_matrix(specs, job, jobs, policy="resume" if args.resume else "fresh", record=record, log=_log)
    except KeyboardInterrupt:
        _finish(run_dir, status, args, wu, rl, backend, warm, warm_s, t_start)
        raise
    ok = _finish(run_dir, status, args, wu, rl, backend, warm, warm_s, t_start)
    return 0 if ok else 1


def _finish(run_dir, status, args, wu, rl, backend, warm, warm_s, t_start) -> bool:
    runs = load_run(run_dir)
    total = time.time() - t_start
    header = (f"lpo-demo --preset {args.preset}: task {rl.task}, K={rl.k}, {rl.prompts_per_step} prompts/step, "
              f"{rl.steps} steps, lr {rl.lr}, seed {rl.seed}, backend {backend}\n"
              f"warm-up: {'cached' if warm['cached'] else f'trained in {warm_s:.0f}s'} "
              f"({warm['steps']} SFT steps, sampled accuracy {warm['sampled_accuracy']:.2f}, "
              f"greedy held-out {warm['greedy_accuracy']:.2f}); "
              f"total wall time {total:.0f}s")
    summary = summarize(runs, status, header=header)
    atomic_write_text(Path(run_dir) / "summary.txt", summary)
    if runs:
        from openrlhf_lpo.compare.report import build_table, write_table

        # lpo-compare's table of this one seed: the Figure-5 quantities, each LPO method minus the baseline
        names = sorted(runs, key=lambda n: METHODS[n].is_lpo if n in METHODS else True)  # a baseline first
        table = build_table({(n, rl.seed): runs[n] for n in names}, names, [rl.seed], window=5)
        write_table(run_dir, table, title=f"lpo-demo --preset {args.preset}: {rl.task}, seed {rl.seed}")
        png = plot_run(runs, Path(run_dir) / "comparison.png",
                       title=f"{rl.task}: " + " vs ".join(runs) + f" (K={rl.k}, {rl.prompts_per_step} prompts/step, "
                             f"seed {rl.seed}, {backend})")
        _log(f"plot: {png}")
    print(summary, end="", flush=True)
    _log(f"summary: {Path(run_dir) / 'summary.txt'}")
    return bool(status) and all(s.get("state") == "done" for s in status.values())


def wants_preset(argv: Optional[List[str]] = None) -> bool:
    """True when ``argv`` asks for a demo preset (``--preset NAME`` / ``--preset=NAME``).

    ``lpo-train`` can hand such a command line to :func:`main`, so that
    ``lpo-train --preset cpu-demo`` and ``lpo-demo`` are the same command.
    """
    argv = sys.argv[1:] if argv is None else argv
    return any(a == "--preset" or a.startswith("--preset=") for a in argv)


def main(argv: Optional[List[str]] = None) -> None:
    try:
        code = run_demo(argv)
    except KeyboardInterrupt:
        _log("interrupted; what finished is in the run directory")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
