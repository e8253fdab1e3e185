"""Metrics files, the comparison plot and the text summary of a demo run directory.

Layout of a run directory (everything written atomically or appended line by line, so a run that
stops half-way keeps what finished):

    <run_dir>/
      config.json               the demo's resolved settings
      metrics/<method>.jsonl    one row per RL step: step, reward, entropy, grad_norm, kl_target, ...
      status.json               per-method state: done / failed (with the error) / running
      comparison.png            reward, response entropy, gradient norm and KL(w*||P) vs step
      summary.txt               start/final/peak reward, steps to reach GRPO's final reward, times

The plot uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PANELS = (
    ("reward", "sampled reward (accuracy)"),
    ("entropy", "response entropy (nats/token)"),
    ("grad_norm", "gradient norm"),
    ("kl_target", "KL(w* || P) after update"),
)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


class MetricsWriter:
    """Append one json row per line and flush, so a crash keeps every finished step."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")

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


def plot_run(runs: Dict[str, List[Dict]], out_png: Path, title: str = "") -> Path:
    """Write the 2x2 comparison figure (raw values faint, EMA-smoothed solid) atomically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from openrlhf_lpo.demo.methods import METHODS

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            xs, ys = _series(rows, key)
            if not xs:
                continue
            m = METHODS.get(name)
            color = m.color if m else None
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, ema(ys), color=color, linewidth=2, label=m.label if m else name)
            if key == "reward":  # held-out greedy accuracy, where the backend measured it
                gx, gy = _series(rows, "greedy_accuracy")
                if gx:
                    ax.plot(gx, gy, color=color, linestyle="--", marker="o", markersize=4, linewidth=1,
                            label=f"{name}: greedy, held-out")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if key == "reward":
            if any(_series(rows, "greedy_accuracy")[0] for rows in runs.values()):
                ax.set_title("reward: sampled (solid, EMA) and greedy held-out (dashed)")
            ax.legend(loc="lower right", fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("RL step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def steps_to_reach(rows: List[Dict], threshold: float, window: int = 5) -> Optional[int]:
    """First step whose trailing ``window``-step mean reward is >= ``threshold`` (None if never)."""
    rewards = [r["reward"] for r in rows]
    for i in range(len(rewards)):
        lo = max(0, i - window + 1)
        if _mean(rewards[lo: i + 1]) >= threshold and i + 1 >= min(window, len(rewards)):
            return rows[i]["step"]
    return None


def method_stats(rows: List[Dict], window: int = 5) -> Dict:
    w = max(1, min(window, len(rows)))
    rewards = [r["reward"] for r in rows]
    greedy = [r["greedy_accuracy"] for r in rows if r.get("greedy_accuracy") is not None]
    return {
        "steps": len(rows),
        "reward_start": _mean(rewards[:w]),
        "reward_final": _mean(rewards[-w:]),
        "reward_peak": max(_mean(rewards[max(0, i - w + 1): i + 1]) for i in range(len(rewards))),
        "entropy_final": _mean([r.get("entropy") for r in rows[-w:]]),
        "grad_norm_mean": _mean([r.get("grad_norm") for r in rows]),
        "kl_target_mean": _mean([r.get("kl_target") for r in rows]),
        "greedy_final": greedy[-1] if greedy else None,
        "elapsed_s": rows[-1].get("elapsed_s"),
    }


def summarize(runs: Dict[str, List[Dict]], status: Optional[Dict] = None, header: str = "",
              window: int = 5) -> str:
    """Plain-text summary; ``steps to GRPO final`` uses GRPO's final ``window``-step mean reward."""
    stats = {name: method_stats(rows, window) for name, rows in runs.items()}
    lines = [header] if header else []
    lines.append(f"(rewards are means over {window}-step windows of the sampled reward, temperature 1)")
    fmt = "{:<9} {:>6} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>8}"
    lines.append(fmt.format("method", "steps", "start", "final", "peak", "entropy", "|grad|",
                            "KL(w*||P)", "time_s"))
    for name, s in stats.items():
        lines.append(fmt.format(
            name, s["steps"], f"{s['reward_start']:.3f}", f"{s['reward_final']:.3f}", f"{s['reward_peak']:.3f}",
            f"{s['entropy_final']:.3f}", f"{s['grad_norm_mean']:.3f}", f"{s['kl_target_mean']:.4f}",
            f"{s['elapsed_s']:.0f}" if s["elapsed_s"] is not None else "-"))
    if "grpo" in stats:
        goal = stats["grpo"]["reward_final"]
        lines.append(f"steps to reach GRPO's final reward ({goal:.3f}):")
        for name, rows in runs.items():
            hit = steps_to_reach(rows, goal, window)
            lines.append(f"  {name:<9} {hit if hit is not None else 'not reached'}")
    greedy = {n: s["greedy_final"] for n, s in stats.items() if s["greedy_final"] is not None}
    for n, st in (status or {}).items():  # pipeline runs: the saved final model, evaluated after training
        if n not in greedy and st.get("greedy_accuracy_end") is not None:
            greedy[n] = st["greedy_accuracy_end"]
    if greedy:
        lines.append("greedy accuracy at the end (held-out problems): "
                     + ", ".join(f"{n} {v:.3f}" for n, v in greedy.items()))
    if status:
        bad = {n: st for n, st in status.items() if st.get("state") != "done"}
        for n, st in bad.items():
            lines.append(f"{n}: {st.get('state')} — {st.get('error', '')}".rstrip(" —"))
    return "\n".join(lines) + "\n"
