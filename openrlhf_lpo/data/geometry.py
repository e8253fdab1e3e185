"""A synthetic geometry task drawn offline with PIL: diagrams with verifiable numeric answers.

Each problem is a small diagram (``size`` x ``size`` pixels; 112 px = 16 image tokens for
Qwen2.5-VL) and a short question, in the Geometry3k row layout the training recipe reads
(``prompt`` with ``<image>``, ``label`` for the geometry reward, ``images`` = one data-URI PNG, or a
file path with ``image_dir``). Kinds (a registry, :data:`KINDS`):

* ``triangle_angle``: a triangle with two labelled angles a and b; x = 180 - a - b;
* ``segment_sum``: points A, B, C on a line with AB and BC labelled; AC = AB + BC;
* ``right_hypotenuse``: a right triangle whose legs form a Pythagorean triple; x = the hypotenuse;
* ``read_number``: a printed integer ("What number is shown?"), so the reward depends on the
  vision tower.

Answers are exact integers. The same question text ("Find x.") is reused across different
diagrams, as in Geometry3k: only the image tells two prompts apart.
"""

from __future__ import annotations

import base64
import io
import math
import os
import random
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from openrlhf_lpo.data.templates import render
from openrlhf_lpo.registry import registrar
from openrlhf_lpo.rewards.geometry import geometry_label

__all__ = ["KINDS", "register_kind", "draw_problem", "generate_geometry_problems", "image_to_data_uri"]

Drawing = Tuple["object", str, str]  # (PIL image, question, answer)
KINDS: Dict[str, Callable[[random.Random, int], Drawing]] = {}
PYTHAGOREAN = ((3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (7, 24, 25), (9, 12, 15), (12, 16, 20), (20, 21, 29))


def register_kind(name: str):
    return registrar(KINDS, "geometry kind", name)


def _canvas(size: int):
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    return image, ImageDraw.Draw(image), ImageFont.load_default()


def _label(draw, font, xy, text) -> None:
    x, y = xy
    box = draw.textbbox((0, 0), text, font=font)
    draw.text((x - (box[2] - box[0]) / 2, y - (box[3] - box[1]) / 2), text, fill="black", font=font)


def _toward(p, q, frac):
    return (p[0] + (q[0] - p[0]) * frac, p[1] + (q[1] - p[1]) * frac)


@register_kind("triangle_angle")
def _triangle_angle(rng: random.Random, size: int) -> Drawing:
    image, draw, font = _canvas(size)
    a = rng.randint(30, 80)
    b = rng.randint(30, 150 - a)
    # unit base A=(0,0), B=(1,0); apex C from the base angles a (at A) and b (at B); then fit the
    # triangle into the canvas (y grows downwards in the image)
    ta, tb = math.tan(math.radians(a)), math.tan(math.radians(b))
    cx = tb / (ta + tb)
    pts = [(0.0, 0.0), (1.0, 0.0), (cx, cx * ta)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    m = size * 0.12
    scale = (size - 2 * m) / max(max(xs) - min(xs), max(ys) - min(ys))
    A, B, C = [(m + (x - min(xs)) * scale, size - m - (y - min(ys)) * scale) for x, y in pts]
    draw.polygon([A, B, C], outline="black")
    centroid = ((A[0] + B[0] + C[0]) / 3, (A[1] + B[1] + C[1]) / 3)
    for vertex, text in ((A, f"{a}"), (B, f"{b}"), (C, "x")):
        _label(draw, font, _toward(vertex, centroid, 0.35), text)
    return image, "Find x.", str(180 - a - b)


@register_kind("segment_sum")
def _segment_sum(rng: random.Random, size: int) -> Drawing:
    image, draw, font = _canvas(size)
    ab, bc = rng.randint(2, 40), rng.randint(2, 40)
    m, y = size * 0.08, size * 0.55
    A, C = (m, y), (size - m, y)
    B = (A[0] + (C[0] - A[0]) * ab / (ab + bc), y)
    draw.line([A, C], fill="black", width=2)
    for p, name in ((A, "A"), (B, "B"), (C, "C")):
        draw.ellipse([p[0] - 2, p[1] - 2, p[0] + 2, p[1] + 2], fill="black")
        _label(draw, font, (p[0], p[1] + size * 0.12), name)
    _label(draw, font, ((A[0] + B[0]) / 2, y - size * 0.12), str(ab))
    _label(draw, font, ((B[0] + C[0]) / 2, y - size * 0.12), str(bc))
    return image, "Find AC.", str(ab + bc)


@register_kind("right_hypotenuse")
def _right_hypotenuse(rng: random.Random, size: int) -> Drawing:
    image, draw, font = _canvas(size)
    p, q, r = rng.choice(PYTHAGOREAN)
    if rng.random() < 0.5:
        p, q = q, p
    m = size * 0.15
    scale = (size - 2 * m) / max(p, q)
    R = (m, size - m)
    P, Q = (m + q * scale, size - m), (m, size - m - p * scale)
    draw.polygon([R, P, Q], outline="black")
    s = size * 0.06
    draw.line([(R[0] + s, R[1]), (R[0] + s, R[1] - s), (R[0], R[1] - s)], fill="black")  # right-angle mark
    _label(draw, font, ((R[0] + P[0]) / 2, R[1] + size * 0.07), str(q))
    _label(draw, font, (R[0] - size * 0.07, (R[1] + Q[1]) / 2), str(p))
    mid = ((P[0] + Q[0]) / 2, (P[1] + Q[1]) / 2)
    _label(draw, font, (mid[0] + size * 0.07, mid[1] - size * 0.07), "x")
    return image, "Find x.", str(r)


@register_kind("read_number")
def _read_number(rng: random.Random, size: int) -> Drawing:
    image, draw, font = _canvas(size)
    n = rng.randint(0, 99)
    _label(draw, font, (size / 2, size / 2), str(n))
    return image, "What number is shown?", str(n)


def image_to_png(image) -> bytes:
    """The PNG encoding of a PIL image."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_to_data_uri(image) -> str:
    """PNG bytes of ``image`` as a ``data:image/png;base64,...`` string (OpenRLHF's load_images reads it)."""
    return "data:image/png;base64," + base64.b64encode(image_to_png(image)).decode("ascii")


def draw_problem(kind: str, seed: int, size: int = 112) -> Drawing:
    """One diagram: ``(PIL image, question, answer)``; deterministic in ``(kind, seed, size)``."""
    if kind not in KINDS:
        raise ValueError(f"geometry kind {kind!r} is unknown; choose from {sorted(KINDS)}")
    if size < 56:
        raise ValueError(f"size={size}: diagrams need at least 56 pixels")
    return KINDS[kind](random.Random(f"{kind}:{seed}"), size)


def generate_geometry_problems(
    n: int,
    seed: int = 0,
    kinds: Sequence[str] = tuple(KINDS),
    size: int = 112,
    template: str = "geometry",
    image_dir: Optional[str] = None,
) -> List[dict]:
    """``n`` prompt rows ``{"prompt", "label", "images", "answer", "kind"}``; kinds are cycled.

    ``template``: ``geometry`` (the paper's verl instruction) or ``geometry-short`` (tiny models).
    ``image_dir``: write PNG files there and reference them by path instead of embedding data URIs.
    """
    if n < 1:
        raise ValueError(f"n={n}: need at least one problem")
    kinds = list(kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"geometry kind {kind!r} is unknown; choose from {sorted(KINDS)}")
    if image_dir:
        os.makedirs(image_dir, exist_ok=True)
    rows = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        image, question, answer = draw_problem(kind, seed * 1_000_003 + i, size)
        if image_dir:
            ref = os.path.abspath(os.path.join(image_dir, f"{kind}-{seed}-{i}.png"))
            tmp = ref + ".tmp.png"
            image.save(tmp, format="PNG")
            os.replace(tmp, ref)
        else:
            ref = image_to_data_uri(image)
        rows.append({
            "prompt": render(template, problem="<image>" + question),
            "label": geometry_label(answer),
            "images": [ref],
            "answer": answer,
            "kind": kind,
        })
    return rows
