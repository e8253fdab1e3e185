"""Geometry3k (Lu et al., 2021; the paper's multi-modal domain) read from the layouts it ships in.

:func:`read_geometry3k` returns plain records ``{"id", "problem", "answer", "choices", "image"}``
(``image``: the diagram's encoded bytes) from any of:

* the **HF layout** (``hiyouga/geometry3k``, what verl/EasyR1 and the paper use): columns
  ``images`` (a one-item list of ``{"bytes", "path"}``, PIL images, bytes, or paths), ``problem``
  (starting with ``<image>``) and ``answer`` (a value). Given as a ``.parquet`` file, a directory of
  parquet shards (a hub snapshot: ``data/<split>-*.parquet``), a ``datasets.save_to_disk``
  directory, or a hub name (``hiyouga/geometry3k``, needs network; an offline machine gets an
  error that says what to download);
* the **original JSON + PNG layout** (InterGPS): ``<root>/<split>/<id>/data.json`` (``problem_text``,
  ``choices``, ``answer`` as an option letter) next to ``img_diagram.png``; ``<root>`` may also be
  the split directory itself.

:func:`load_geometry3k` turns the records into OpenRLHF prompt rows ``{"prompt", "label", "images"}``
(``images`` = one data-URI PNG/JPEG string, which OpenRLHF's ``load_images`` decodes) with the
paper's template (:func:`openrlhf_lpo.data.templates.geometry_prompt`) and the geometry reward label.
"""

from __future__ import annotations

import base64
import glob
import io
import json
import os
import re
from typing import Dict, Iterator, List, Optional

from openrlhf_lpo.data.templates import render
from openrlhf_lpo.rewards.geometry import geometry_label

__all__ = ["HUB_NAME", "read_geometry3k", "load_geometry3k", "bytes_to_data_uri"]

HUB_NAME = "hiyouga/geometry3k"
SPLITS = ("train", "validation", "test")
GEOMETRY_TEMPLATES = ("geometry", "geometry-short")
_HUB_RE = re.compile(r"[\w.-]+/[\w.-]+")


def bytes_to_data_uri(data: bytes) -> str:
    """``data:image/<fmt>;base64,...`` for encoded image bytes (format sniffed by PIL)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        fmt = (im.format or "png").lower()
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode("ascii")


def _image_bytes(value, where: str) -> bytes:
    """Encoded bytes of one ``images`` entry (dict with bytes/path, PIL image, bytes, path)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{where}: expected one diagram per problem, got {len(value)} images")
        value = value[0]
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path") and os.path.isfile(value["path"]):
            value = value["path"]
        else:
            raise ValueError(f"{where}: image entry has neither bytes nor a readable path ({sorted(value)})")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("data:image"):
            return base64.b64decode(value.split(",", 1)[1])
        with open(value, "rb") as f:
            return f.read()
    if hasattr(value, "save"):  # PIL image (datasets decodes the column)
        buf = io.BytesIO()
        value.save(buf, format=value.format or "PNG")
        return buf.getvalue()
    raise ValueError(f"{where}: unsupported image value of type {type(value).__name__}")


def _hf_record(row: dict, idx: int, where: str) -> dict:
    missing = [k for k in ("problem", "answer") if k not in row]
    if missing or ("images" not in row and "image" not in row):
        raise ValueError(f"{where} row {idx}: the HF layout needs 'images', 'problem' and 'answer' (row has {sorted(row)})")
    choices = row.get("choices") or None
    return {"id": str(row.get("id", idx)), "problem": str(row["problem"]), "answer": str(row["answer"]).strip(),
            "choices": [str(c) for c in choices] if choices else None,
            "image": _image_bytes(row.get("images", row.get("image")), f"{where} row {idx}")}


def _json_png_records(root: str, split: str) -> Optional[List[dict]]:
    base = os.path.join(root, split) if os.path.isdir(os.path.join(root, split)) else root
    files = sorted(glob.glob(os.path.join(base, "*", "data.json")),
                   key=lambda p: (len(os.path.basename(os.path.dirname(p))), os.path.basename(os.path.dirname(p))))
    if not files:
        return None
    out = []
    for path in files:
        folder = os.path.dirname(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        text = data.get("problem_text", data.get("problem"))
        if text is None or "answer" not in data:
            raise ValueError(f"{path}: needs 'problem_text' (or 'problem') and 'answer'")
        pngs = [p for p in ("img_diagram.png", "image.png") if os.path.isfile(os.path.join(folder, p))]
        if not pngs:
            raise ValueError(f"{folder}: no img_diagram.png next to data.json")
        with open(os.path.join(folder, pngs[0]), "rb") as f:
            image = f.read()
        choices = data.get("choices") or None
        out.append({"id": str(data.get("id", os.path.basename(folder))), "problem": str(text),
                    "answer": str(data["answer"]).strip(), "choices": [str(c) for c in choices] if choices else None,
                    "image": image})
    return out


def _parquet_rows(paths: List[str]) -> Iterator[dict]:
    import pyarrow.parquet as pq

    for path in paths:
        yield from pq.read_table(path).to_pylist()


def _hub_rows(name: str, split: str) -> List[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {name!r} from the Hugging Face hub needs the 'datasets' package") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, missing split ...
        raise ValueError(
            f"could not load Geometry3k {name!r} split {split!r} from the Hugging Face hub "
            f"({type(e).__name__}: {str(e)[:200]}). On an offline machine download it elsewhere "
            f"(`huggingface-cli download {HUB_NAME} --repo-type dataset --local-dir geometry3k`) and pass "
            "that directory (or one of its parquet files) instead"
        ) from None
    return [dict(r) for r in ds]


def read_geometry3k(source: str, split: str = "train", limit: Optional[int] = None) -> List[dict]:
    """Records ``{"id", "problem", "answer", "choices", "image"}`` of one split (see module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: Geometry3k has {', '.join(SPLITS)}")
    where = source
    if os.path.isfile(source):
        if not source.endswith(".parquet"):
            raise ValueError(f"{source}: a Geometry3k file must be .parquet (or give the JSON+PNG folder)")
        rows: object = _parquet_rows([source])
    elif os.path.isdir(source):
        records = _json_png_records(source, split)
        if records is not None:
            return records[:limit] if limit else records
        shards = sorted(glob.glob(os.path.join(source, "**", f"{split}-*.parquet"), recursive=True)
                        + glob.glob(os.path.join(source, "**", f"{split}.parquet"), recursive=True))
        if shards:
            rows = _parquet_rows(shards)
        else:
            import datasets

            try:
                ds = datasets.load_from_disk(source)
            except (FileNotFoundError, ValueError):
                raise ValueError(
                    f"{source}: no Geometry3k data found (looked for <split>/<id>/data.json + img_diagram.png, "
                    f"{split}-*.parquet shards, and a datasets.save_to_disk directory)"
                ) from None
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{source}: split {split!r} not found; available: {sorted(ds)}")
                ds = ds[split]
            rows = (dict(r) for r in ds)
    elif _HUB_RE.fullmatch(source):
        rows, where = _hub_rows(source, split), f"hf:{source}"
    else:
        raise ValueError(f"Geometry3k source {source!r}: no such file or directory, and not a hub name (org/name)")
    out = []
    for idx, row in enumerate(rows):
        out.append(_hf_record(row, idx, where))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{where}: split {split!r} has no rows")
    return out


def load_geometry3k(source: str, split: str = "train", template: str = "geometry",
                    limit: Optional[int] = None) -> List[Dict]:
    """Prompt rows ``{"prompt", "label", "images", "answer"}`` for OpenRLHF (module docstring)."""
    if template not in GEOMETRY_TEMPLATES:
        raise ValueError(f"template {template!r}: Geometry3k prompts use one of {GEOMETRY_TEMPLATES}")
    rows = []
    for rec in read_geometry3k(source, split, limit):
        label = geometry_label(rec["answer"], rec["choices"])
        rows.append({
            "prompt": render(template, problem=rec["problem"], choices=rec["choices"]),
            "label": label,
            "images": [bytes_to_data_uri(rec["image"])],
            "answer": json.loads(label)["answer"],
        })
    return rows
