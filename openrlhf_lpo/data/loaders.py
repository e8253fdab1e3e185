"""Loaders that turn MATH-style and Countdown data into OpenRLHF prompt rows.

Every loader returns rows ``{"prompt": str, "label": str, ...}`` for OpenRLHF's
``--data.input_key prompt --data.label_key label``:

* :func:`load_math` reads a ``.jsonl``/``.json``/``.parquet`` file or a HF dataset (name or
  local dataset directory) with a problem field and either an answer field or a worked
  solution whose last ``\\boxed{}`` is the answer (MATH's ``solution``). The prompt is the
  verl template; the label is ``{"task": "math", "answer": ...}``.
* :func:`load_countdown` reads rows with ``nums`` and ``target`` (Countdown-Tasks-3to4).
* :func:`write_jsonl` writes rows atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, Iterable, List, Optional

from openrlhf_lpo.data.countdown import countdown_label
from openrlhf_lpo.data.templates import countdown_prompt, math_prompt
from openrlhf_lpo.rewards.grading import last_boxed  # the grader's extractor: one definition of "the answer"

__all__ = ["last_boxed", "math_label", "read_records", "load_math", "load_countdown", "write_jsonl"]


def math_label(answer: str) -> str:
    """The reward label for a math problem."""
    return json.dumps({"task": "math", "answer": str(answer)})


def read_records(source: str, split: str = "train") -> List[Dict]:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file, or of a HF dataset name/directory."""
    if os.path.isfile(source):
        if source.endswith(".jsonl"):
            with open(source, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if source.endswith(".json"):
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, list):
                raise ValueError(f"{source}: a .json file must hold a list of objects")
            return data
        if source.endswith(".parquet"):
            import pandas as pd

            return pd.read_parquet(source).to_dict(orient="records")
        raise ValueError(f"{source}: unsupported file type; use .jsonl, .json, .parquet or a HF dataset")
    import datasets

    if os.path.isdir(source):
        try:
            ds = datasets.load_from_disk(source)
        except (FileNotFoundError, ValueError):
            ds = datasets.load_dataset(source, split=split)
    else:
        ds = datasets.load_dataset(source, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{source}: split {split!r} not found; available: {sorted(ds)}")
        ds = ds[split]
    return [dict(r) for r in ds]


def load_math(
    source: str,
    split: str = "train",
    problem_key: str = "problem",
    answer_key: Optional[str] = "answer",
    solution_key: str = "solution",
    limit: Optional[int] = None,
) -> List[Dict]:
    """MATH-style rows -> prompt rows (see module docstring). Rows without any answer are an error."""
    out = []
    for idx, rec in enumerate(read_records(source, split)):
        if problem_key not in rec:
            raise ValueError(f"{source} row {idx}: no field {problem_key!r} (set problem_key)")
        answer = rec.get(answer_key) if answer_key else None
        if isinstance(answer, list):
            answer = ", ".join(str(a) for a in answer)
        if answer is None or str(answer).strip() == "":
            answer = last_boxed(str(rec.get(solution_key, "")))
        if answer is None:
            raise ValueError(
                f"{source} row {idx}: no answer in {answer_key!r} and no \\boxed{{}} in {solution_key!r}"
            )
        out.append(
            {"prompt": math_prompt(str(rec[problem_key])), "label": math_label(str(answer).strip()), "answer": str(answer).strip()}
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def load_countdown(source: str, split: str = "train", limit: Optional[int] = None) -> List[Dict]:
    """Rows with ``nums`` and ``target`` -> prompt rows with the paper's Countdown template."""
    out = []
    for idx, rec in enumerate(read_records(source, split)):
        if "nums" not in rec or "target" not in rec:
            raise ValueError(f"{source} row {idx}: Countdown rows need 'nums' and 'target'")
        nums = [int(n) for n in rec["nums"]]
        target = int(rec["target"])
        out.append({"prompt": countdown_prompt(nums, target), "label": countdown_label(nums, target), "nums": nums, "target": target})
        if limit is not None and len(out) >= limit:
            break
    return out


def write_jsonl(rows: Iterable[Dict], path: str) -> str:
    """Write rows as JSON lines atomically (temporary file + ``os.replace``); return ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
