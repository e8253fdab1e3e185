"""Metrics files, the comparison plot and the text summary of a demo run directory.

Layout of a run directory (everything written atomically or appended line by line, so a run that
stops half-way keeps what finished):

    <run_dir>/
      config.json               the demo's resolved settings
      metrics/<method>.jsonl    one row per RL step: step, reward, entropy, grad_norm, kl_target, ...;
                                a step-0 row and every ``eval_every``-th row also hold the held-out
                                metrics (``heldout_pass@k``, ``heldout_distinct_correct``, ...)
      status.json               per-method state: done / failed (with the error) / running
      comparison.png            six panels against step (see :data:`PANELS`)
      summary.txt               start/final reward, held-out Pass@k and diversity, steps to reach the
                                paired baseline's final reward, times

The plot uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# the run-directory files are shared with lpo-compare (imported here under their old names too)
from openrlhf_lpo.compare.files import (MetricsWriter, atomic_write_json, atomic_write_text,  # noqa: F401
                                        read_metrics, write_metrics)

# (metric key or "heldout_pass", panel title); "heldout_pass" draws Pass@1 and the largest Pass@k
PANELS = (
    ("reward", "sampled reward (training prompts)"),
    ("heldout_pass", "held-out Pass@k (dotted: k=1, solid: k=4, dashed: n)"),
    ("heldout_distinct_correct", "held-out: distinct correct answers / prompt"),
    ("entropy", "response entropy (nats/token)"),
    ("grad_norm", "gradient norm"),
    ("kl_target", "KL(w* || P) after update"),
)


def merge_step_metrics(path: Path, updates: Dict[int, Dict]) -> List[Dict]:
    """Add ``updates[step]`` to the row of that step in a metrics jsonl (rewritten atomically);
    a step without a row gets a new one. Returns the merged rows, ordered by step."""
    rows = read_metrics(path)
    by_step = {r["step"]: r for r in rows}
    method = rows[0].get("method") if rows else None
    for step, values in updates.items():
        row = by_step.setdefault(int(step), {"method": method, "step": int(step)})
        row.update(values)
    merged = sorted(by_step.values(), key=lambda r: r["step"])
    write_metrics(path, merged)
    return merged


def load_run(run_dir: Path) -> Dict[str, List[Dict]]:
    out = {}
    mdir = Path(run_dir) / "metrics"
    if mdir.is_dir():
        for p in sorted(mdir.glob("*.jsonl")):
            rows = read_metrics(p)
            if rows:
                out[p.stem] = rows
    return out


def ema(values: Sequence[float], alpha: float = 0.3) -> List[float]:
    out, acc = [], None
    for v in values:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            out.append(acc if acc is not None else math.nan)
            continue
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _series(rows: List[Dict], key: str):
    xs = [r["step"] for r in rows if r.get(key) is not None]
    ys = [float(r[key]) for r in rows if r.get(key) is not None]
    return xs, ys


def pass_keys(rows: List[Dict]) -> List[str]:
    """The ``heldout_pass@k`` keys present in ``rows``, by increasing k."""
    keys = {k for r in rows for k in r if k.startswith("heldout_pass@")}
    return sorted(keys, key=lambda k: int(k.split("@")[1]))


def training_rows(rows: List[Dict]) -> List[Dict]:
    """Rows of RL steps (step >= 1 with a sampled reward); the step-0 row only holds held-out metrics."""
    return [r for r in rows if r.get("step", 0) >= 1 and r.get("reward") is not None]


def plot_run(runs: Dict[str, List[Dict]], out_png: Path, title: str = "") -> Path:
    """Write the 2x3 comparison figure (raw values faint, EMA-smoothed solid) atomically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from openrlhf_lpo.demo.methods import METHODS

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            m = METHODS.get(name)
            color = m.color if m else None
            if key == "heldout_pass":
                keys = pass_keys(rows)
                styles = [":", "-", "--", "-."]
                for i, pk in enumerate(keys):
                    xs, ys = _series(rows, pk)
                    ax.plot(xs, ys, color=color, marker="o" if i == 1 else ".", markersize=4,
                            linestyle=styles[min(i, len(styles) - 1)], linewidth=2 if i == 1 else 1.2,
                            label=f"{name} Pass@{pk.split('@')[1]}")
                continue
            if key.startswith("heldout_"):
                xs, ys = _series(rows, key)
                if xs:
                    ax.plot(xs, ys, color=color, marker="o", markersize=4, linewidth=2,
                            label=m.label if m else name)
                continue
            xs, ys = _series(training_rows(rows), key)
            if not xs:
                continue
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, ema(ys), color=color, linewidth=2, label=m.label if m else name)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if key in ("reward", "heldout_pass") and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def steps_to_reach(rows: List[Dict], threshold: float, window: int = 5) -> Optional[int]:
    """First step whose trailing ``window``-step mean reward is >= ``threshold`` (None if never)."""
    rows = training_rows(rows)
    rewards = [r["reward"] for r in rows]
    for i in range(len(rewards)):
        lo = max(0, i - window + 1)
        if _mean(rewards[lo: i + 1]) >= threshold and i + 1 >= min(window, len(rewards)):
            return rows[i]["step"]
    return None


def _heldout(rows: List[Dict], key: str, which: int) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return vals[which] if vals else None


def method_stats(rows: List[Dict], window: int = 5) -> Dict:
    train = training_rows(rows)
    w = max(1, min(window, len(train)))
    rewards = [r["reward"] for r in train]
    keys = pass_keys(rows)
    out = {
        "steps": len(train),
        "reward_start": _mean(rewards[:w]),
        "reward_final": _mean(rewards[-w:]),
        "reward_peak": max((_mean(rewards[max(0, i - w + 1): i + 1]) for i in range(len(rewards))),
                           default=math.nan),
        "entropy_final": _mean([r.get("entropy") for r in train[-w:]]),
        "grad_norm_mean": _mean([r.get("grad_norm") for r in train]),
        "kl_target_mean": _mean([r.get("kl_target") for r in train]),
        "informative_mean": _mean([r.get("informative_groups") for r in train]),
        "greedy_final": _heldout(rows, "heldout_greedy", -1),
        "pass_keys": keys,
        "elapsed_s": train[-1].get("elapsed_s") if train else None,
    }
    for key in keys + ["heldout_distinct_correct", "heldout_coverage"]:
        out[key + "_start"] = _heldout(rows, key, 0)
        out[key + "_final"] = _heldout(rows, key, -1)
    return out


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def summarize(runs: Dict[str, List[Dict]], status: Optional[Dict] = None, header: str = "",
              window: int = 5) -> str:
    """Plain-text summary: one line per method, held-out metrics at the start (the warm-up) and the
    end, and the steps each method needs to reach its paired baseline's final reward."""
    from openrlhf_lpo.demo.methods import METHODS

    stats = {name: method_stats(rows, window) for name, rows in runs.items()}
    lines = [header] if header else []
    lines.append(f"(rewards: {window}-step means of the sampled reward, temperature 1; held-out: "
                 "start = the warm-up -> end of RL)")
    fmt = "{:<13} {:>5} {:>7} {:>7} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>6}"
    lines.append(fmt.format("method", "steps", "start", "final", "entropy", "|grad|", "KL", "inform",
                            "time_s", "", ""))
    for name, s in stats.items():
        lines.append(fmt.format(
            name, s["steps"], _fmt(s["reward_start"]), _fmt(s["reward_final"]), _fmt(s["entropy_final"]),
            _fmt(s["grad_norm_mean"]), _fmt(s["kl_target_mean"], ".4f"), _fmt(s["informative_mean"], ".2f"),
            _fmt(s["elapsed_s"], ".0f"), "", "").rstrip())
    keys = sorted({k for s in stats.values() for k in s["pass_keys"]}, key=lambda k: int(k.split("@")[1]))
    if keys:
        lines.append("held-out (start -> end): " + ", ".join(k.replace("heldout_", "") for k in keys)
                     + ", distinct correct answers per prompt, coverage of the answer set, greedy accuracy")
        for name, s in stats.items():
            parts = [f"{k.split('@')[1]:>2}: {_fmt(s.get(k + '_start'))}->{_fmt(s.get(k + '_final'))}" for k in keys]
            parts.append(f"distinct {_fmt(s.get('heldout_distinct_correct_start'), '.2f')}->"
                         f"{_fmt(s.get('heldout_distinct_correct_final'), '.2f')}")
            parts.append(f"coverage {_fmt(s.get('heldout_coverage_start'))}->{_fmt(s.get('heldout_coverage_final'))}")
            parts.append(f"greedy {_fmt(s.get('greedy_final'))}")
            lines.append(f"  {name:<13} pass@" + "  ".join(parts))
    for name, rows in runs.items():
        m = METHODS.get(name)
        base = m.baseline.name if m else None
        if m is None or base == name or base not in stats:
            continue
        goal = stats[base]["reward_final"]
        hit, own = steps_to_reach(rows, goal, window), steps_to_reach(runs[base], goal, window)
        lines.append(f"steps to reach {base}'s final reward ({goal:.3f}): {name} "
                     f"{hit if hit is not None else 'not reached'}, {base} {own if own is not None else 'not reached'}")
    low = [n for n, s in stats.items() if s["steps"] and s["informative_mean"] == 0.0]
    for n in low:
        lines.append(f"WARNING {n}: no informative group (every group's rewards were equal): nothing was "
                     "learned; warm the model up further (--warmup-target) or raise --k")
    if status:
        bad = {n: st for n, st in status.items() if st.get("state") != "done"}
        for n, st in bad.items():
            lines.append(f"{n}: {st.get('state')} — {st.get('error', '')}".rstrip(" —"))
    return "\n".join(lines) + "\n"
