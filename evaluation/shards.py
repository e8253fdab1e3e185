"""Shards of a job's samples (``--shard i/n``, and the ``--dp`` engines of one node) and their merge.

A job's samples are units ``(problem p, sample j)`` in benchmark order, ``u = p * n + j``; shard ``i``
of ``count`` draws the units with ``u % count == i`` (round robin: every shard gets a share of every
benchmark's long and short problems, and a shard's requests of one problem still share its prompt).
Every sample has its own seed (:func:`evaluation.generate.sample_seed`), so which process draws a sample
does not change it: merged shards are byte-identical to an unsharded run (with the hf engine; vLLM
only where its kernels are batch-invariant, since a shard's batches differ).

Files of a job directory::

    generations.jsonl(.partial), .lock      unsharded (count 1)
    shards/<i>-of-<count>.jsonl(.partial)   shard i, finished (or still being written)
    shards/.<i>-of-<count>.lock             held while shard i is generated
    shards/.merge.lock                      held while a shard is finished or the shards are merged

A finished shard is renamed into place and the shards are merged under ``.merge.lock``, so the last
shard to finish always sees the others. The merge takes each unit once (from the finished shard files
of any count: the samples are the same), writes ``generations.jsonl`` atomically only when every unit
is there, then removes the shard files (a partial one only when no process holds its lock).
``lpo-eval score`` merges what is complete and names the jobs that are not: part of a job is never
scored, and no sample is counted twice.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .io import atomic_write_bytes, read_json, read_jsonl
from .locks import JobBusy, JobLock

GEN_FILE = "generations.jsonl"
PARTIAL_SUFFIX = ".partial"
SHARD_DIR = "shards"
MERGE_LOCK = ".merge.lock"
_SHARD_RE = re.compile(r"^(\d+)-of-(\d+)\.jsonl$")

Key = tuple[str, int]  # (problem_id, sample_idx)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``0/1``: the whole job)."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"--shard {self.index}/{self.count}: expected i/n with 0 <= i < n")

    @classmethod
    def parse(cls, spec: str) -> "Shard":
        i, sep, n = spec.partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(i), int(n))
        except ValueError:
            raise ValueError(f"--shard {spec!r}: expected i/n with 0 <= i < n (e.g. 0/4 ... 3/4)") from None

    @property
    def whole(self) -> bool:
        return self.count == 1

    def compose(self, rank: int, size: int) -> "Shard":
        """Rank ``rank`` of ``size`` local engines within this shard: shard ``index * size + rank`` of ``count * size``."""
        return Shard(self.index * size + rank, self.count * size)

    def units(self, n_problems: int, n: int) -> list[tuple[int, int]]:
        """``(problem index, sample index)`` of this shard's samples, in benchmark order."""
        return [(p, j) for p in range(n_problems) for j in range(n) if (p * n + j) % self.count == self.index]

    def output(self, job_dir: Path) -> Path:
        return job_dir / GEN_FILE if self.whole else job_dir / SHARD_DIR / f"{self.index}-of-{self.count}.jsonl"

    def partial(self, job_dir: Path) -> Path:
        out = self.output(job_dir)
        return out.with_name(out.name + PARTIAL_SUFFIX)

    def lock(self, job_dir: Path) -> JobLock:
        if self.whole:
            return JobLock(job_dir)
        return JobLock(job_dir / SHARD_DIR, name=f".{self.index}-of-{self.count}.lock")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _complete_lines(path: Path) -> list[tuple[Key, bytes]]:
    """``(key, line)`` of every complete JSON line of ``path`` (stops at a torn or foreign line)."""
    out = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        try:
            row = json.loads(data[pos:nl])
            key = (str(row["problem_id"]), int(row["sample_idx"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            break
        out.append((key, data[pos : nl + 1]))
        pos = nl + 1
    return out


def recover_partial(path: Path, expected: list[Key]) -> int:
    """Cut ``path`` back to its longest prefix of whole lines that are the ``expected`` samples in order;
    return how many it holds. Each sample has its own seed, so every whole line is reusable."""
    if not path.exists():
        return 0
    keep = done = 0
    for key, line in _complete_lines(path):
        if done >= len(expected) or key != expected[done]:
            break
        keep += len(line)
        done += 1
    if keep != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return done


def shard_files(job_dir: Path) -> list[Path]:
    """Finished shard files of a job (any count)."""
    d = job_dir / SHARD_DIR
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _SHARD_RE.match(p.name)),
                  key=lambda p: tuple(int(x) for x in _SHARD_RE.match(p.name).groups())[::-1])


def _cleanup(job_dir: Path) -> None:
    """Remove the shard files of a merged job; a partial file only when nobody generates it."""
    d = job_dir / SHARD_DIR
    if not d.is_dir():
        return
    for p in shard_files(job_dir):
        p.unlink(missing_ok=True)
    for p in d.glob("*" + PARTIAL_SUFFIX):
        stem = p.name[: -len(PARTIAL_SUFFIX) - len(".jsonl")]
        try:
            lock = JobLock(d, name=f".{stem}.lock").acquire()
        except JobBusy:
            continue
        try:
            p.unlink(missing_ok=True)
            (d / f".{stem}.lock").unlink(missing_ok=True)
        finally:
            lock.release()
    for p in d.glob(".*-of-*.lock"):  # the lock files of finished shards
        if not (d / (p.name[1:-len(".lock")] + ".jsonl" + PARTIAL_SUFFIX)).exists():
            p.unlink(missing_ok=True)
    if [p.name for p in d.iterdir()] == [MERGE_LOCK]:  # the caller holds it; a late process recreates the folder
        (d / MERGE_LOCK).unlink(missing_ok=True)
        try:
            d.rmdir()
        except OSError:
            pass


def _merge_locked(job_dir: Path, expected: list[Key]) -> int:
    """Merge under ``.merge.lock`` (held by the caller); return how many expected samples the shards hold."""
    if (job_dir / GEN_FILE).exists():
        _cleanup(job_dir)
        return len(expected)
    want = set(expected)
    found: dict[Key, bytes] = {}
    for f in shard_files(job_dir):
        for key, line in _complete_lines(f):
            if key in want:
                found.setdefault(key, line)
    if len(found) == len(want):
        atomic_write_bytes(job_dir / GEN_FILE, b"".join(found[k] for k in expected))
        _cleanup(job_dir)
    return len(found)


def finish_shard(job_dir: Path, shard: Shard, expected: list[Key]) -> bool:
    """Rename a shard's finished partial file into place and merge the job if every shard is there."""
    with JobLock(job_dir / SHARD_DIR, wait=True, name=MERGE_LOCK):
        os.replace(shard.partial(job_dir), shard.output(job_dir))
        return _merge_locked(job_dir, expected) == len(expected)


def expected_keys(job_dir: Path) -> list[Key]:
    """Every sample of a job, in order, from its ``problems.jsonl`` and the ``n`` of its ``config.json``."""
    n = read_json(job_dir / "config.json")["n"]
    return [(str(p["problem_id"]), j) for p in read_jsonl(job_dir / "problems.jsonl") for j in range(n)]


def merge_job(job_dir: Path) -> tuple[int, int]:
    """Merge a sharded job's finished shards if they hold every sample: ``(samples there, samples expected)``."""
    expected = expected_keys(job_dir)
    with JobLock(job_dir / SHARD_DIR, wait=True, name=MERGE_LOCK):
        return _merge_locked(job_dir, expected), len(expected)


def sharded_jobs(runs: Path) -> list[Path]:
    """Job directories under ``runs`` that hold shard files."""
    return sorted(p.parent for p in Path(runs).glob(f"*/*/{SHARD_DIR}") if p.is_dir())
