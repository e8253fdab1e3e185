"""Preflight check ``datasets``: ``--data.prompt_dataset`` and ``--eval.dataset`` as OpenRLHF 0.11.2 reads them.

Reading is upstream's own ``openrlhf.datasets.utils.blending_datasets`` (comma-separated datasets,
``path@data_dir``, ``--data.prompt_probs`` interleaving, ``--data.prompt_split`` / ``--eval.split``,
``--data.max_samples`` per dataset and in total), one dataset at a time so a failure names its file,
then once for the blend the trainer will get. A dataset that does not load is diagnosed here:
JSON / JSON-lines files are scanned for the first bad line (``file:LINE``), an empty file, a missing
split. Then, per row (1-based lines of a ``.jsonl``, rows otherwise):

* the ``--data.input_key`` / ``--data.label_key`` / ``--data.image_key`` columns exist (else the error
  lists the keys the dataset has);
* the dataset is not empty;
* the prompt is a non-empty string, or a list of chat messages with ``--data.apply_chat_template``;
* with ``--data.max_images_per_prompt`` > 0: at most that many images per row, local image paths exist,
  and (with a chat template) as many ``<image>`` placeholders as images;
* duplicate prompts (prompt and images) are counted for the summary.

A hub dataset is read by a real launch (before Ray starts) and left to the run by ``--dry-run``,
which starts nothing and downloads nothing. Facts for later checks: ``ctx.datasets["train"|"eval"]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_lpo.cli.preflight import PreflightError, looks_like_path, register_check

LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow")
MAX_LISTED = 3  # rows named per problem


@dataclass
class Source:
    """One comma-separated entry of a dataset flag, loaded (split and per-dataset cap applied)."""

    spec: str
    path: str
    kind: str  # "file", "folder" or "hub"
    dataset: Any = None
    _lines: Optional[List[int]] = None

    def where(self, i: int) -> str:
        """Where row ``i`` (0-based) is: ``file:LINE`` for JSON lines, else ``file row N``."""
        if self.kind == "file" and self.path.endswith((".jsonl", ".json")):
            if self._lines is None:
                self._lines = _row_lines(self.path)
            if self._lines is not None and i < len(self._lines):
                return f"{self.path}:{self._lines[i]}"
        return f"{self.path} row {i + 1}"


@dataclass
class DataFacts:
    flag: str
    sources: List[Source] = field(default_factory=list)
    rows: Optional[int] = None           # rows of the blend the trainer gets (None: not read)
    limits: List[int] = field(default_factory=list)  # rows of each source that reach the trainer

    def column(self, key: Optional[str]) -> List[Any]:
        """The values of column ``key`` over the rows that reach the trainer (None where a source lacks it)."""
        out: List[Any] = []
        for source, n in zip(self.sources, self.limits):
            ds = source.dataset
            if key is not None and key in ds.column_names:
                out.extend(ds.select_columns([key])[:n][key])  # a batch: columnar, rows decoded as upstream's
            else:
                out.extend([None] * n)
        return out

    def locations(self) -> List[Tuple[Source, int]]:
        """(source, row) of every row that reaches the trainer, in :meth:`column` order."""
        return [(source, i) for source, n in zip(self.sources, self.limits) for i in range(n)]


class RowProblems:
    """Bad rows grouped by what is wrong; ``raise_if_any`` names the first few of each."""

    def __init__(self, facts: DataFacts):
        self.facts = facts
        self.where = facts.locations()
        self.found: Dict[str, List[int]] = {}
        self.details: Dict[str, str] = {}

    def add(self, what: str, row: int, detail: Optional[str] = None) -> None:
        """Row ``row`` has problem ``what``; ``detail``: the full message (shown for the first such row)."""
        self.found.setdefault(what, []).append(row)
        if detail and detail != what:
            self.details.setdefault(what, detail)

    def raise_if_any(self) -> None:
        if not self.found:
            return
        parts = []
        for what, rows in self.found.items():
            named = ", ".join(self.where[r][0].where(self.where[r][1]) for r in rows[:MAX_LISTED])
            more = f" and {len(rows) - MAX_LISTED} more" if len(rows) > MAX_LISTED else ""
            detail = f" (first: {self.details[what]})" if what in self.details else ""
            parts.append(f"{what}{detail}: {len(rows)} row(s): {named}{more}")
        raise PreflightError(f"{self.facts.flag}: " + "\n".join(parts))


# ----------------------------------------------------------------------------- reading


def _row_lines(path: str) -> Optional[List[int]]:
    """1-based line numbers of the rows of a JSON-lines file (None for a JSON list: rows are its items)."""
    with open(path, "rb") as f:
        if f.read(4096).lstrip().startswith(b"["):
            return None
        f.seek(0)
        return [n for n, line in enumerate(f, 1) if line.strip()]


def _diagnose_json(path: str) -> Optional[str]:
    """The first problem of a JSON / JSON-lines file, or None if the file itself looks well formed."""
    with open(path, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return f"{path}: the file is empty (no rows); prepare it again (python -m openrlhf_lpo.data.prepare ...)"
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    else:
        if isinstance(doc, list) and all(isinstance(r, dict) for r in doc):
            return None if doc else f"{path}: the JSON list is empty (no rows)"
        if isinstance(doc, dict) and text.lstrip().startswith("{") and "\n" not in text.strip():
            return None  # a one-line JSON-lines file
        return (f"{path}: holds one JSON {type(doc).__name__}; a dataset is JSON lines (one object per line) or "
                "a JSON list of objects")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return (f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno}); each line must be one JSON object: "
                    "fix the line or write the file again")
        if not isinstance(row, dict):
            return f"{path}:{n}: a JSON line must be an object {{...}}, got a {type(row).__name__}"
    return None


class _Strategy:
    """What ``blending_datasets`` asks of OpenRLHF's strategy: print, rank and ``args.use_ms``."""

    def __init__(self, args):
        self.args = SimpleNamespace(use_ms=getattr(args, "use_ms", False))

    def print(self, *a, **k):
        pass

    def is_rank_0(self) -> bool:
        return False


def _kind(path: str) -> str:
    if os.path.isfile(path):
        return "file"
    if os.path.isdir(path):
        return "folder"
    return "hub"


def _missing_local(flag: str, path: str) -> Optional[str]:
    if os.path.exists(path):
        return None
    if path.endswith(LOCAL_SUFFIXES) or path.endswith(".py"):
        return (f"{flag} {path}: no such file (prepare it, e.g. python -m openrlhf_lpo.data.prepare ..., or fix "
                "the path; relative paths are relative to the working directory)")
    if looks_like_path(path):
        return f"{flag} {path}: no such file or folder"
    return None


def _load(flag: str, source: Source, split: str, args, max_count) -> Any:
    from openrlhf.datasets.utils import blending_datasets

    try:
        ds = blending_datasets(source.spec, None, _Strategy(args), args.train.seed, max_count=max_count,
                               dataset_split=split)
    except Exception as e:  # noqa: BLE001 - any loader failure becomes a message naming the file or line
        raise PreflightError(_diagnose(flag, source, split, e)) from None
    return ds


def _diagnose(flag: str, source: Source, split: str, error: Exception) -> str:
    path = source.path
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, AttributeError) and "select" in text:
        return _missing_split(flag, source, split)
    if source.kind == "file" and path.endswith((".json", ".jsonl")):
        found = _diagnose_json(path)
        if found:
            return f"{flag}: {found}"
    if source.kind == "file" and (isinstance(error, StopIteration) or "corresponds to no data" in text):
        return f"{flag}: {path}: the file is empty (no rows)"
    where = {"hub": "could not read the Hugging Face dataset", "folder": "could not read the folder"}.get(
        source.kind, "could not read the file")
    hint = (" (offline? download it elsewhere with `huggingface-cli download --repo-type dataset ...` and pass "
            "the folder or a file)") if source.kind == "hub" else ""
    return f"{flag} {source.spec}: {where}: {type(error).__name__}: {text[:300]}{hint}"


def _missing_split(flag: str, source: Source, split: str) -> str:
    option = "--eval.split" if flag == "--eval.dataset" else "--data.prompt_split"
    splits = "train (a local file has only 'train')" if source.kind == "file" else "?"
    if source.kind == "folder":
        try:
            from datasets import load_from_disk

            splits = ", ".join(sorted(load_from_disk(source.path)))
        except Exception:  # noqa: BLE001 - a data-files folder: its splits come from the file names
            splits = "see the folder's file names"
    return f"{option} {split}: {source.spec} has no split {split!r}; its splits: {splits}"


def _probabilities(flag: str, raw: Optional[str], n: int) -> Optional[List[float]]:
    if raw is None:
        return None
    try:
        probs = [float(p) for p in raw.split(",")]
    except ValueError:
        raise PreflightError(f"--data.prompt_probs {raw!r}: give one number per dataset, e.g. 0.7,0.3") from None
    if len(probs) != n:
        raise PreflightError(f"--data.prompt_probs {raw!r} has {len(probs)} value(s) but {flag} names {n} dataset(s); "
                             "give one probability per dataset")
    if any(p < 0 for p in probs) or sum(probs) <= 0:
        raise PreflightError(f"--data.prompt_probs {raw!r}: probabilities must be >= 0 with a positive sum")
    return probs


def read_dataset(ctx, flag: str, spec: str, split: str, probs: Optional[str], max_count, cap) -> DataFacts:
    """Load every source of ``spec`` (the module docstring); ``cap``: the total ``select`` upstream applies."""
    args = ctx.args
    facts = DataFacts(flag=flag)
    parts = [p.strip() for p in spec.split(",")]
    if any(not p for p in parts):
        raise PreflightError(f"{flag} {spec!r}: an empty entry between commas")
    _probabilities(flag, probs, len(parts))
    for part in parts:
        path = part.split("@")[0].strip()
        missing = _missing_local(flag, os.path.expanduser(path))
        if missing:
            raise PreflightError(missing)
        facts.sources.append(Source(spec=part, path=path, kind=_kind(path)))
    if any(s.kind == "hub" for s in facts.sources) and ctx.dry_run:
        hub = ", ".join(s.path for s in facts.sources if s.kind == "hub")
        ctx.say(f"{flag}: {hub} is a hub dataset: a dry run does not download it; a real launch reads it "
                "before Ray starts")
        facts.sources = []
        return facts
    for source in facts.sources:
        source.dataset = _load(flag, source, split, args, max_count)
        if len(source.dataset) == 0:
            raise PreflightError(f"{flag} {source.spec}: the dataset is empty (0 rows in split {split!r}); "
                                 "nothing to train on")
    from openrlhf.datasets.utils import blending_datasets

    blend = blending_datasets(spec, probs, _Strategy(args), args.train.seed, max_count=max_count,
                              dataset_split=split) if len(facts.sources) > 1 else facts.sources[0].dataset
    facts.rows = min(int(cap), len(blend))
    left = facts.rows if probs is None else float("inf")  # interleaving samples every source row
    for source in facts.sources:
        take = int(min(len(source.dataset), left))
        facts.limits.append(take)
        left -= take
    return facts


# ----------------------------------------------------------------------------- rows


def _check_keys(args, facts: DataFacts) -> None:
    data = args.data
    wanted = [("--data.input_key", data.input_key)]
    if data.label_key:
        wanted.append(("--data.label_key", data.label_key))
    if data.max_images_per_prompt > 0:
        wanted.append(("--data.image_key", data.image_key))
    for source in facts.sources:
        columns = source.dataset.column_names
        for option, key in wanted:
            if key not in columns:
                extra = (" (--data.max_images_per_prompt > 0: a vision-language run needs the images column)"
                         if option == "--data.image_key" else "")
                raise PreflightError(f"{option} {key}: {source.spec} has no key {key!r}{extra}; its keys: "
                                     f"{', '.join(columns)}. Pass {option} <one of them>")


def _prompt_problem(value, chat: bool) -> Optional[str]:
    if isinstance(value, str):
        return None if value.strip() else "the prompt is empty"
    if value is None:
        return "the prompt is missing (null)"
    if isinstance(value, list):
        if not chat:
            return ("the prompt is a list (chat messages) but --data.apply_chat_template is off: add "
                    "--data.apply_chat_template, or store the prompt as a string")
        if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                                for m in value):
            return "chat messages must be a non-empty list of {'role': ..., 'content': ...}"
        return None
    return f"the prompt is a {type(value).__name__}, not a string or a list of chat messages"


def _text_of(value) -> str:
    if isinstance(value, str):
        return value
    return "".join(str(m.get("content", "")) for m in value if isinstance(m, dict))


def _image_refs(value) -> List[Any]:
    if value is None:
        return []
    refs = value if isinstance(value, list) else [value]
    return [r for r in refs if r is not None]


def _image_problem(ref) -> Optional[str]:
    if isinstance(ref, (bytes, dict)) or hasattr(ref, "save"):
        return None
    if not isinstance(ref, str):
        return f"an image entry is a {type(ref).__name__} (use a path, URL, data URI or bytes)"
    if ref.startswith(("http://", "https://", "data:image")) or len(ref) > 256:
        return None
    return None if os.path.isfile(ref) else "an image path does not exist on this machine"


def check_rows(ctx, facts: DataFacts) -> None:
    args, data = ctx.args, ctx.args.data
    problems = RowProblems(facts)
    chat = bool(data.apply_chat_template)
    prompts = facts.column(data.input_key)
    vision = data.max_images_per_prompt > 0
    images = facts.column(data.image_key) if vision else [None] * len(prompts)
    seen: Dict[str, int] = {}
    duplicates: List[Tuple[int, int]] = []
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        bad = _prompt_problem(prompt, chat)
        if bad:
            problems.add(f"{bad} (--data.input_key {data.input_key})", i)
            continue
        refs = _image_refs(image)
        if vision:
            if len(refs) > data.max_images_per_prompt:
                problems.add(f"more images than --data.max_images_per_prompt {data.max_images_per_prompt}", i)
            for ref in refs:
                bad = _image_problem(ref)
                if bad:
                    problems.add(f"{bad} (--data.image_key {data.image_key})", i)
                    break
            placeholders = _text_of(prompt).count("<image>")
            if chat and placeholders != len(refs) and (placeholders or refs):
                problems.add(f"the number of <image> placeholders in the prompt differs from the number of images "
                             f"(each image needs one <image> where it goes)", i)
        key = hashlib.sha1(json.dumps([prompt, [str(r) for r in refs]], sort_keys=True, default=str)
                           .encode("utf-8", "surrogatepass")).hexdigest()
        first = seen.setdefault(key, i)
        if first != i:
            duplicates.append((i, first))
    problems.raise_if_any()
    where = facts.locations()
    summary = f"{facts.flag}: {facts.rows} rows"
    if facts.rows is not None and sum(facts.limits) != facts.rows:
        summary += f" (blended with --data.prompt_probs from {sum(facts.limits)} source rows)"
    summary += f" from {', '.join(s.spec for s in facts.sources)} (keys: {', '.join(facts.sources[0].dataset.column_names)})"
    ctx.say(summary)
    if duplicates:
        (i, j) = duplicates[0]
        ctx.say(f"  duplicate prompts: {len(duplicates)} row(s) repeat an earlier prompt (first: "
                f"{where[i][0].where(where[i][1])} = {where[j][0].where(where[j][1])})")
    else:
        ctx.say("  duplicate prompts: none")
    if not vision and any(data.image_key in s.dataset.column_names for s in facts.sources):
        ctx.say(f"  the rows hold {data.image_key!r} but --data.max_images_per_prompt is 0: images are not used")


def _check_template(args) -> None:
    template = args.data.input_template
    if template and "{}" in template:
        try:
            template.format("x")
        except (IndexError, KeyError, ValueError) as e:
            raise PreflightError(f"--data.input_template {template!r}: str.format fails on it ({type(e).__name__}: "
                                 f"{e}); use exactly one {{}} and double other braces ({{{{ }}}})") from None


def _quiet_progress():
    import contextlib

    import datasets

    @contextlib.contextmanager
    def quiet():
        was = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            yield
        finally:
            if not was:
                datasets.enable_progress_bars()

    return quiet()


@register_check("datasets")
def check_datasets(ctx) -> None:
    args = ctx.args
    if not args.data.prompt_dataset:
        raise PreflightError("--data.prompt_dataset is required: a .jsonl/.json/.parquet file, a dataset folder or a "
                             "Hugging Face dataset id (python -m openrlhf_lpo.data.prepare writes one)")
    if args.data.max_samples < 1:
        raise PreflightError(f"--data.max_samples {args.data.max_samples}: must be >= 1")
    _check_template(args)
    with _quiet_progress():
        jobs = [("train", "--data.prompt_dataset", args.data.prompt_dataset, args.data.prompt_split,
                 args.data.prompt_probs, args.data.max_samples)]
        if getattr(args.eval, "dataset", None):
            jobs.append(("eval", "--eval.dataset", args.eval.dataset, args.eval.split, None, 1e8))
        errors = []
        for name, flag, spec, split, probs, max_count in jobs:
            try:
                facts = read_dataset(ctx, flag, spec, split, probs, max_count, args.data.max_samples)
                ctx.datasets[name] = facts
                if facts.sources:
                    _check_keys(args, facts)
                    check_rows(ctx, facts)
            except PreflightError as e:
                ctx.datasets.pop(name, None)
                errors.append(str(e))
        if errors:
            raise PreflightError("\n".join(errors))
