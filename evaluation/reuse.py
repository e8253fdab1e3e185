"""Samples reused instead of generated: a job asks the engine only for samples no earlier run holds.

Each sample has its own seed (problem id, sample index; :func:`evaluation.generate.sample_seed`), so
sample j of a problem is the same draw in every run whose generation settings agree apart from ``n``
and the problem selection. Sources, for a job that is not finished yet:

* a finished job of the same checkpoint x benchmark whose ``config.json`` equals this job's except
  :data:`FREE_KEYS` (``n``, ``k``, ``--limit``'s problem count and the data / prompt hashes that follow
  from it); per row, the prompt hash, the gold and the choices must match this job's problem too. For
  image benchmarks (whose images no row records) the data hash must match as well: only ``n`` may differ.
  A run with ``--n 16`` after one with ``--n 8`` generates only samples 8..15; ``--n 4`` generates none;
* this job's own shard files, finished or partial, of any shard count (:mod:`evaluation.shards`): a
  job started with ``--dp 4`` and resumed with ``--dp 2`` keeps what was drawn.

Only jobs with per-sample seeds reuse (``seeding: sample`` and vLLM's per-request seeds): without them,
two runs draw correlated samples and a reused one could repeat a new one.
"""

from __future__ import annotations

import json
from pathlib import Path

from .io import read_json
from .shards import GEN_FILE, PARTIAL_SUFFIX, SHARD_DIR, Key

SEEDING = "sample"  # config "seeding": every sample has its own seed
# recorded beside the key (config_sha, versions, data_notes: subset / GPQA-ordering notes for reports) or
# following from n and the problem selection; each reused row is checked against its problem anyway
FREE_KEYS = frozenset({"n", "k", "n_problems", "data_sha", "prompts_sha", "config_sha", "versions", "data_notes"})


def per_sample_seeds(cfg: dict) -> bool:
    return cfg.get("seeding") == SEEDING and cfg.get("per_request_seed", True) is True


def _same_generation(a: dict, b: dict, free: frozenset) -> bool:
    keys = (set(a) | set(b)) - free
    return all(a.get(k) == b.get(k) for k in keys)


def _rows(path: Path):
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    return  # a torn last line
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    return
    except FileNotFoundError:
        return


def sources(job_dir: Path, cfg: dict, images: bool = False) -> list[Path]:
    """Files whose rows this job may reuse (see module doc), best first; ``images``: the problems have images."""
    if not per_sample_seeds(cfg):
        return []
    free = FREE_KEYS - {"data_sha", "n_problems", "prompts_sha"} if images else FREE_KEYS
    out = []
    shard_dir = job_dir / SHARD_DIR
    if shard_dir.is_dir():
        out += sorted(shard_dir.glob("*.jsonl")) + sorted(shard_dir.glob("*.jsonl" + PARTIAL_SUFFIX))
    for other in sorted(job_dir.parent.glob(f"{cfg['benchmark']}-*/{GEN_FILE}")):
        if other.parent == job_dir or not (other.parent / "config.json").exists():
            continue
        try:
            ocfg = read_json(other.parent / "config.json")
        except (OSError, ValueError):
            continue
        if ocfg.get("benchmark") == cfg["benchmark"] and _same_generation(ocfg, cfg, free):
            out.append(other)
    return out


def reusable_rows(job_dir: Path, cfg: dict, problems: dict[str, dict],
                  images: bool = False) -> tuple[dict[Key, dict], list[Path]]:
    """Rows (``response``, ``finish_reason``, ``n_tokens``) of this job's samples that earlier runs hold.

    ``problems``: problem id -> the fields its rows must carry (``prompt_sha``, ``gold`` and ``choices``
    when it has them); ``images``: the problems have images. Returns the rows by ``(problem_id,
    sample_idx)`` and the files they came from.
    """
    n = cfg["n"]
    found: dict[Key, dict] = {}
    used: list[Path] = []
    for path in sources(job_dir, cfg, images):
        before = len(found)
        for row in _rows(path):
            pid, j = str(row.get("problem_id")), row.get("sample_idx")
            want = problems.get(pid)
            if want is None or not isinstance(j, int) or not 0 <= j < n or (pid, j) in found:
                continue
            if any(row.get(k) != v for k, v in want.items()) or ("choices" in row) != ("choices" in want):
                continue
            if not all(isinstance(row.get(k), t) for k, t in (("response", str), ("finish_reason", str), ("n_tokens", int))):
                continue
            found[(pid, j)] = {"response": row["response"], "finish_reason": row["finish_reason"],
                               "n_tokens": row["n_tokens"]}
        if len(found) > before:
            used.append(path)
    return found, used
