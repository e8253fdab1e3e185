"""Per-job locks, so several ``lpo-eval`` processes (one per GPU, or one per node) can share one ``--out``.

A job directory's ``.lock`` file is held with ``fcntl.flock`` while the job is generated or scored.
``generate`` tries it without waiting: a job another process holds is skipped (that process finishes
it), so N processes started with the same arguments split the jobs between them. ``score`` waits for
it, then finds the job already scored. The lock is released by the kernel when its process dies, so a
killed run never leaves a stale lock behind. (``flock`` works on local disks and on NFSv4; on file
systems without it, give each process its own ``--out``.)
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"


class JobBusy(Exception):
    """Another process holds the job's lock; ``holder`` says who (pid@host) when known."""

    def __init__(self, job_dir: Path, holder: str):
        super().__init__(f"{job_dir} is being processed by another process ({holder or 'unknown'})")
        self.job_dir = job_dir
        self.holder = holder


class JobLock:
    """``with JobLock(dir, wait=False):`` holds ``dir/.lock`` (or ``dir/name``: a shard's own lock, see
    :mod:`evaluation.shards`); raises :class:`JobBusy` when ``wait`` is False and another process holds it."""

    def __init__(self, job_dir: str | os.PathLike, wait: bool = False, name: str = LOCK_FILE):
        self.dir = Path(job_dir)
        self.wait = wait
        self.name = name
        self._fd: int | None = None

    def acquire(self) -> "JobLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / self.name, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            finally:
                os.close(fd)
            raise JobBusy(self.dir, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "JobLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
