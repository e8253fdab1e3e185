"""The benchmark registry and its readers: specs by name, rows from files or the hub, problems from rows.

A benchmark family (:mod:`evaluation.text_benchmarks`, :mod:`evaluation.code_benchmarks`,
:mod:`evaluation.vision`) registers its :class:`BenchmarkSpec` here; :mod:`evaluation.benchmarks` imports
every family, so code that needs the full table imports that module. This module imports no family (the
dependency is one-way: families -> registry).

Staged copies are read from ``LPO_BENCHMARKS_DIR`` (default ``<repo>/../shared/benchmarks``); every
benchmark also reads a user-given local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or a Hugging
Face dataset name (``org/name[:config][@split]``, loaded with ``datasets``). A spec's ``size`` is its full
test set: fewer problems (a staged subset, a smaller file, ``--limit``) is a subset, recorded in
:attr:`LoadedBenchmark.notes` and said loudly by ``generate`` and ``report``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from openrlhf_lpo.registry import register_unique

from .io import canonical_json, sha256_text

REPO_ROOT = Path(__file__).resolve().parent.parent


def benchmarks_dir() -> Path:
    """``LPO_BENCHMARKS_DIR`` or ``<repo>/../shared/benchmarks``."""
    env = os.environ.get("LPO_BENCHMARKS_DIR")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "benchmarks").resolve()


@dataclass(frozen=True)
class Problem:
    """One benchmark question. ``kind``: "math" or "choice"; ``choices``: allowed option labels."""

    id: str
    question: str
    gold: str
    kind: str
    choices: str | None = None
    images: tuple[str, ...] = ()  # data-URI images of a vision benchmark (evaluation/vision.py)


class FieldMissing(ValueError):
    pass


def field_value(row: dict, names: tuple[str, ...], what: str) -> Any:
    for name in names:
        cur: Any = row
        ok = True
        for part in name.split("."):
            if isinstance(cur, dict) and part in cur and cur[part] is not None:
                cur = cur[part]
            else:
                ok = False
                break
        if ok:
            return cur
    raise FieldMissing(f"no {what} field (looked for {' / '.join(repr(n) for n in names)}; row has {sorted(row)})")


def user_content(prompt: Any) -> str | None:
    """The last user message of a chat-list prompt (LUFFY/verl parquet schema)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict):
        users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
        return str(users[-1].get("content", ""))
    return None


def question_text(row: dict, names: tuple[str, ...]) -> str:
    if "prompt" in row and user_content(row["prompt"]) is not None:
        return user_content(row["prompt"])  # type: ignore[return-value]
    q = field_value(row, names, "question")
    return str(q)


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def strip_dollars(s: str) -> str:
    return _UNESCAPED_DOLLAR.sub("", s).strip()


def number_gold(v: Any) -> str:
    """AMC golds are floats (27.0): integral floats become "27"; other values their plain string."""
    if isinstance(v, bool):
        raise FieldMissing(f"answer {v!r} is a bool, expected a number or string")
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    s = str(v).strip()
    if re.fullmatch(r"-?\d+\.0+", s):
        return s.split(".")[0]
    return s


def math_gold(row: dict) -> str:
    if "reward_model" in row and isinstance(row["reward_model"], dict):
        return str(field_value(row, ("reward_model.ground_truth",), "gold answer")).strip()
    v = field_value(row, ("answer", "Answer", "final_answer", "ground_truth"), "gold answer")
    if isinstance(v, (list, tuple)):
        return ", ".join(strip_dollars(str(x)) for x in v)
    return number_gold(v)


# -- the registry ---------------------------------------------------------------------------------

MATH_Q = ("problem", "question", "Problem", "Question")


def convert_math(row: dict, i: int) -> Problem:
    return Problem(str(i), question_text(row, MATH_Q), math_gold(row), "math")


@dataclass(frozen=True)
class BenchmarkSpec:
    """A benchmark: ``kind`` picks its instruction (``templates.INSTRUCTIONS``) and grader
    (``grading.GRADERS``); ``group`` is "math" (in-distribution average), "ood", "code", "vision" or "custom";
    ``k`` the paper's Pass@k."""

    name: str
    kind: str
    group: str
    k: int
    convert: Callable[[dict, int], Problem]
    staged: str | None = None
    row_filter: Callable[[dict], bool] | None = None
    aliases: tuple[str, ...] = ()
    note: str = ""
    default_rows: Callable[[], list[dict]] | None = None  # rows when no source is given (data shipped in a package)
    read: Callable[[str | None], tuple[list[dict], str]] | None = None  # own reader: source -> (rows, label)
    size: int | None = None  # problems of the full test set; fewer loaded is a subset (said loudly)
    # one row -> several problems under the benchmark's options (GPQA: one per option ordering); replaces convert
    expand: Callable[[dict, int, dict], list[Problem]] | None = None


BENCHMARKS: dict[str, BenchmarkSpec] = {}
_ALIASES: dict[str, str] = {}


def register_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    taken = {**BENCHMARKS, **_ALIASES}  # a name or an alias names one benchmark; nothing is added on a clash
    for key in (spec.name, *spec.aliases):
        register_unique(taken, "benchmark name", key, spec.name)
    BENCHMARKS[spec.name] = spec
    _ALIASES.update(dict.fromkeys(spec.aliases, spec.name))
    return spec


_CUSTOM_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")


def register_custom_benchmarks(data: dict[str, str]) -> list[str]:
    """Register every ``--data`` name that is not a known benchmark as a custom math benchmark.

    A custom benchmark reads ``problem``/``question`` and ``answer`` fields (or a verl/LUFFY
    ``prompt`` + ``reward_model.ground_truth`` row), is graded as math, has k=1 by default and is
    in neither the math nor the OOD average (group ``custom``). Returns the new names.
    """
    new = []
    for name in data:
        key = name.strip().lower()
        if key in BENCHMARKS or key in _ALIASES:
            continue
        if not _CUSTOM_NAME.match(key):
            raise ValueError(f"--data {name}=...: a custom benchmark name must match [a-z][a-z0-9_.-]*")
        register_benchmark(BenchmarkSpec(key, "math", "custom", 1, convert_math, None,
                                         note=f"custom benchmark: pass --data {key}=PATH"))
        new.append(key)
    return new


def get_benchmark(name: str) -> BenchmarkSpec:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    return BENCHMARKS[key]


# -- reading rows ---------------------------------------------------------------------------------


def _read_rows_file(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: invalid JSON line ({e.msg})") from None
        return rows
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict):
            for key in ("data", "rows", "test", "examples"):
                if isinstance(data.get(key), list):
                    return data[key]
            raise ValueError(f"{path}: a JSON object must hold the rows in 'data', 'rows', 'test' or 'examples'")
        return list(data)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"{path}: unsupported data file type {suffix!r} (use .jsonl, .json, .parquet or .csv)")


def _read_rows_hf(name: str) -> list[dict]:
    spec, _, split = name.partition("@")
    repo, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading Hugging Face dataset {name!r} needs the 'datasets' package") from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=split or "test")
    except Exception as e:  # hub unreachable, unknown name, gated, ...
        raise ValueError(
            f"could not load Hugging Face dataset {name!r} (format org/name[:config][@split]): {type(e).__name__}: {e}"
        ) from None
    return [dict(r) for r in ds]


@dataclass
class LoadedBenchmark:
    """A benchmark's problems. ``notes``: what a report must say about the data (recorded with the job,
    not part of its key): ``questions`` (rows used), ``size`` (the full test set, when known), ``subset``
    (fewer questions than ``size``), ``orderings`` (problems per question, for an ``expand`` benchmark)."""

    spec: BenchmarkSpec
    problems: list[Problem]
    source: str
    data_sha: str = field(default="")
    notes: dict = field(default_factory=dict)


def _rows_of(spec: BenchmarkSpec, source: str | None) -> tuple[list[dict], str]:
    if spec.read is not None:
        return spec.read(source)
    if source is None and spec.default_rows is not None:
        return spec.default_rows(), f"{spec.name} (built in)"
    if source is None:
        if spec.staged is None:
            raise ValueError(f"benchmark {spec.name!r} has no staged copy: {spec.note}")
        path = benchmarks_dir() / spec.staged
        if not path.exists():
            raise ValueError(
                f"benchmark {spec.name!r}: data file {path} not found; set LPO_BENCHMARKS_DIR to the folder "
                f"holding {spec.staged}, or pass --data {spec.name}=PATH_OR_HF_NAME"
            )
        return _read_rows_file(path), str(path)
    if os.path.exists(source):
        return _read_rows_file(Path(source)), str(Path(source).resolve())
    if re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?(@[\w.\[\]:%-]+)?", source):
        return _read_rows_hf(source), "hf:" + source
    raise ValueError(f"--data {spec.name}={source}: no such file, and not a Hugging Face dataset name (org/name)")


def load_benchmark(name: str, source: str | None = None, limit: int | None = None,
                   options: dict | None = None) -> LoadedBenchmark:
    """Load a benchmark's problems.

    ``source``: ``None`` (the staged copy), a local file, or a Hugging Face dataset name. ``limit``
    keeps the first ``limit`` problems (for an ``expand`` benchmark: the first ``limit`` questions, each
    with all its variants). ``options``: the benchmark's options (GPQA: ``{"orderings": 4}``). Raises
    ValueError naming the missing file, field or option.
    """
    spec = get_benchmark(name)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    rows, label = _rows_of(spec, source)
    if spec.row_filter is not None:
        rows = [r for r in rows if spec.row_filter(r)]
    n_rows = len(rows)
    if spec.expand is not None and limit is not None:
        rows = rows[:limit]
    problems: list[Problem] = []
    per_row = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"benchmark {spec.name!r} ({label}) row {i} is not an object")
        try:
            if spec.expand is not None:
                made = spec.expand(row, i, dict(options or {}))
                per_row.add(len(made))
                problems.extend(made)
            else:
                problems.append(spec.convert(row, i))
        except FieldMissing as e:
            raise ValueError(f"benchmark {spec.name!r} ({label}) row {i}: {e}") from None
    if not problems:
        raise ValueError(f"benchmark {spec.name!r} ({label}) has no rows")
    if limit is not None and spec.expand is None:
        problems = problems[:limit]
    questions = len(rows) if spec.expand is not None else len(problems)
    notes: dict[str, Any] = {"questions": questions, "rows": n_rows}
    if spec.size is not None:
        notes.update(size=spec.size, subset=questions < spec.size)
    if spec.expand is not None:
        notes["orderings"] = max(per_row)
    # text problems hash as before images existed (their job keys, and so resume, stay valid)
    data_sha = sha256_text(canonical_json([{k: v for k, v in p.__dict__.items() if k != "images" or v}
                                           for p in problems]))
    return LoadedBenchmark(spec, problems, label, data_sha, notes)
