"""From metrics rows to a paired study's numbers: per-run summaries, per-method means with 95% intervals over
seeds, paired differences against a baseline, and per-step curves (lpo-compare and the toy benchmark).

A run's summary (:func:`run_summary`) follows the rules of :data:`openrlhf_lpo.compare.metrics.FIGURE5`, plus
every held-out column of its last evaluation. Over seeds (:func:`aggregate`), each method's value is the mean
with the Student-t interval of :func:`openrlhf_lpo.compare.stats.mean_ci`; the paired difference of a method
against its baseline uses only the seeds where both finished, and its interval is the t-interval of the
per-seed differences (:func:`openrlhf_lpo.compare.stats.paired_ci`): the seed's prompts and sampling are shared
by the pair, so that variation cancels.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from openrlhf_lpo.compare.metrics import EXTRA_SUMMARIES, FIGURE5, pass_columns
from openrlhf_lpo.compare.stats import mean_ci, paired_ci


def training_rows(rows: List[Dict]) -> List[Dict]:
    """Rows of RL steps (step >= 1 with a sampled reward); a step-0 row only holds held-out metrics."""
    return [r for r in rows if r.get("step", 0) >= 1 and r.get("reward") is not None]


def _mean(values) -> Optional[float]:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(xs) / len(xs) if xs else None


def run_summary(rows: List[Dict], window: int) -> Dict[str, float]:
    """One run's summary: each :data:`FIGURE5` (and extra) quantity by its rule over the training steps
    (None where the run never logged the column), and the held-out columns of its last evaluation."""
    train = training_rows(rows)
    out: Dict[str, float] = {}
    for q in FIGURE5 + EXTRA_SUMMARIES:
        span = train[-window:] if q.rule == "last" else train
        value = _mean(r.get(q.column) for r in span)
        if value is not None:
            out[q.key] = value
    evals = [r for r in rows if any(k.startswith("heldout_") for k in r)]
    if evals:
        out.update({k: v for k, v in evals[-1].items() if k.startswith("heldout_") and isinstance(v, (int, float))
                    and not isinstance(v, bool)})
    return out


def _cell(values: List[Optional[float]]) -> Dict:
    ci = mean_ci(values)
    return {"values": values, "mean": ci.mean, "ci95": ci.half, "n": ci.n}


def aggregate(summaries: Mapping[Tuple[str, int], Dict[str, float]], methods: Sequence[str], seeds: Sequence[int],
              baseline_of: Callable[[str], Optional[str]], keys: Optional[Sequence[str]] = None) -> Dict:
    """``summaries[(method, seed)]`` -> ``{"cells": {method: {key: {values, mean, ci95, n}, "seeds": [...]}},
    "paired_differences": {method: {"baseline": b, "seeds": [...], key: {values, mean, ci95, n}}}}``.

    A cell's ``values`` are per seed in ``seeds`` order (None where the run did not log the key); a paired
    difference's ``values`` are ``method - baseline`` per seed where both runs finished. ``keys`` limits the
    differences (default: every key both runs have)."""
    cells, diffs = {}, {}
    for m in methods:
        have = [s for s in seeds if (m, s) in summaries]
        if not have:
            continue
        names = sorted({k for s in have for k in summaries[(m, s)]})
        cells[m] = {"seeds": have, **{k: _cell([summaries[(m, s)].get(k) for s in have]) for k in names}}
        base = baseline_of(m)
        if base is None or base == m:
            continue
        both = [s for s in seeds if (m, s) in summaries and (base, s) in summaries]
        if not both:
            continue
        d = {"baseline": base, "seeds": both}
        for k in (keys if keys is not None else names):
            a = [summaries[(m, s)].get(k) for s in both]
            b = [summaries[(base, s)].get(k) for s in both]
            if any(x is None for x in a + b):
                continue
            ci = paired_ci(a, b)
            d[k] = {"values": [x - y for x, y in zip(a, b)], "mean": ci.mean, "ci95": ci.half, "n": ci.n}
        diffs[m] = d
    return {"cells": cells, "paired_differences": diffs}


def trailing_mean(rows: List[Dict], key: str, window: int) -> List[Dict]:
    """``rows`` with ``key`` replaced, at each training step, by its mean over the last ``window`` training steps
    that logged it (a figure's smoothing; the other columns unchanged)."""
    out, recent = [], []
    for r in rows:
        r = dict(r)
        if r.get("step", 0) >= 1 and r.get(key) is not None:
            recent = (recent + [float(r[key])])[-window:]
            r[key] = sum(recent) / len(recent)
        out.append(r)
    return out


def curve(rows_by_seed: Mapping[Hashable, List[Dict]], key: str, x_key: str = "step"):
    """Mean and 95% half-width over seeds of ``key`` at each x (the rows that have it): ``(xs, means, halves)``
    (half-width 0 where one seed has the x)."""
    by_x: Dict[float, List[float]] = {}
    for rows in rows_by_seed.values():
        for r in rows:
            if r.get(key) is not None:
                x = r["step"] if x_key == "step" else r.get(x_key, 0.0)  # the step-0 row: nothing generated yet
                by_x.setdefault(float(x), []).append(float(r[key]))
    xs = sorted(by_x)
    cis = [mean_ci(by_x[x]) for x in xs]
    return xs, [c.mean for c in cis], [0.0 if math.isnan(c.half) else c.half for c in cis]


def paired_curve(rows_by_seed: Mapping[Hashable, List[Dict]], base_by_seed: Mapping[Hashable, List[Dict]], key: str):
    """Per step: the mean and 95% half-width over seeds of ``key`` (method) minus ``key`` (baseline, same seed)."""
    by_x: Dict[float, List[float]] = {}
    for seed, rows in rows_by_seed.items():
        base = {r["step"]: r.get(key) for r in base_by_seed.get(seed, [])}
        for r in rows:
            b = base.get(r["step"])
            if r.get(key) is not None and b is not None:
                by_x.setdefault(float(r["step"]), []).append(float(r[key]) - float(b))
    xs = sorted(by_x)
    cis = [mean_ci(by_x[x]) for x in xs]
    return xs, [c.mean for c in cis], [0.0 if math.isnan(c.half) else c.half for c in cis]


def study_keys(agg: Dict) -> List[str]:
    """The table's columns in order: the Figure-5 quantities, then the held-out Pass@k columns present."""
    present = {k for cell in agg["cells"].values() for k in cell if k != "seeds"}
    return [q.key for q in FIGURE5 if q.key in present] + pass_columns(present)
