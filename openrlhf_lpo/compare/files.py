"""The files of a run directory: written atomically or appended line by line, so that a run that stops
half-way keeps what finished (lpo-compare, lpo-demo, the toy benchmark).

A JSON file is written to a temporary name beside it and moved into place (``os.replace`` is atomic on
one file system); a metrics file has one JSON row per line, flushed as it is written, and a reader skips
a torn last line (a writer killed mid-line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Optional[Dict]:
    """The JSON object in ``path``; None when it is missing or not a whole JSON object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


class MetricsWriter:
    """Append one json row per line and flush, so a crash keeps every finished step."""

    def __init__(self, path: Path, mode: str = "w"):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, mode)

    def __call__(self, row: Dict) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> List[Dict]:
    """Rows of a metrics jsonl; a torn last line (killed writer) is ignored."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def write_metrics(path: Path, rows: List[Dict]) -> None:
    """Replace a metrics jsonl with ``rows`` at once."""
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
