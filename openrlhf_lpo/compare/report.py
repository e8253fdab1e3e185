"""The report of a paired study: a table (markdown, CSV, JSON) and two figures of the paper's Figure 5
quantities (lpo-compare; lpo-demo writes the table of its one seed).

* ``table.md`` / ``table.csv`` / ``table.json``: per method, each quantity's per-run summary
  (:func:`openrlhf_lpo.compare.summary.run_summary`) as the mean and 95% t-interval over seeds; per method
  but the baseline (the first method), the paired difference ``method - baseline`` on the same seeds with its
  interval, and the per-seed differences.
* ``figure5.png``: reward, entropy, gradient norm, response length and held-out Pass@k against the step,
  per method the mean over seeds with a 95% band.
* ``paired.png``: the same panels, the per-step difference to the baseline on the same seed (mean, 95% band,
  the zero line).

The plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from openrlhf_lpo.compare.files import atomic_write_json, atomic_write_text
from openrlhf_lpo.compare.metrics import FIGURE5, pass_columns
from openrlhf_lpo.compare.summary import aggregate, curve, paired_curve, run_summary, study_keys, trailing_mean

Runs = Mapping[Tuple[str, int], List[Dict]]  # (method, seed) -> metrics rows


def _label(key: str) -> str:
    labels = {q.key: q.label for q in FIGURE5}
    if key in labels:
        return labels[key]
    if "pass@" in key:
        source = key[len("heldout_"):].rsplit("pass@", 1)[0].rstrip("_")
        return f"held-out {source + ' ' if source else ''}Pass@{key.rsplit('@', 1)[1]}"
    return key


def _num(v: Optional[float], spec: str = ".4g") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _interval(v: Optional[Dict], signed: bool = False) -> str:
    if not v or v["n"] == 0:
        return "-"
    mean = format(v["mean"], "+.4g" if signed else ".4g")
    if math.isnan(v["ci95"]):
        return mean
    star = "*" if signed and abs(v["mean"]) > v["ci95"] else ""
    return f"{mean} ± {v['ci95']:.2g}{star}"


def build_table(runs: Runs, methods: Sequence[str], seeds: Sequence[int], window: int) -> Dict:
    """The study's numbers (what table.json holds): per-run summaries, per-method cells, paired differences
    against ``methods[0]``."""
    summaries = {key: run_summary(rows, window) for key, rows in runs.items() if rows}
    baseline = methods[0]
    agg = aggregate(summaries, methods, seeds, lambda m: baseline)
    return {"baseline": baseline, "methods": list(methods), "seeds": list(seeds), "window": window,
            "keys": study_keys(agg), "runs": {f"{m}/seed{s}": v for (m, s), v in summaries.items()}, **agg}


def table_markdown(table: Dict, title: str = "") -> str:
    keys, base = table["keys"], table["baseline"]
    head = "| method | seeds | " + " | ".join(_label(k) for k in keys) + " |"
    rule = "|---|---|" + "---|" * len(keys)
    lines = [f"# {title}", ""] if title else []
    lines += [f"Per run: the mean of the last {table['window']} training steps (gradient norm: of all steps); "
              "held-out Pass@k at the last evaluation. Mean ± 95% t-interval over seeds.", "", head, rule]
    for m in table["methods"]:
        cell = table["cells"].get(m)
        if cell is None:
            lines.append(f"| {m} | 0 | " + " | ".join("-" for _ in keys) + " |")
            continue
        lines.append(f"| {m} | {len(cell['seeds'])} | " + " | ".join(_interval(cell.get(k)) for k in keys) + " |")
    diffs = table["paired_differences"]
    if diffs:
        lines += ["", f"Paired differences against {base} (method − {base} on the same seed; mean ± 95% t-interval "
                  "of the per-seed differences; * = the interval excludes 0):", "", head, rule]
        for m, d in diffs.items():
            lines.append(f"| {m} | {len(d['seeds'])} | " + " | ".join(_interval(d.get(k), signed=True) for k in keys)
                         + " |")
        lines += ["", "Per-seed differences:", "", "| method | seed | " + " | ".join(_label(k) for k in keys) + " |",
                  rule]
        for m, d in diffs.items():
            for i, s in enumerate(d["seeds"]):
                vals = [_num(d[k]["values"][i], "+.4g") if k in d else "-" for k in keys]
                lines.append(f"| {m} | {s} | " + " | ".join(vals) + " |")
    missing = [f"{m}/seed{s}" for m in table["methods"] for s in table["seeds"]
               if f"{m}/seed{s}" not in table["runs"]]
    if missing:
        lines += ["", "Not finished (left out): " + ", ".join(missing)]
    return "\n".join(lines) + "\n"


def table_csv(table: Dict) -> str:
    """Long format: one line per (kind, method, quantity): kind ``final`` (over seeds) or ``paired``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["kind", "method", "baseline", "quantity", "n", "mean", "ci95", "low", "high", "seeds", "values"])
    for kind, source in (("final", table["cells"]), ("paired", table["paired_differences"])):
        for m, cell in source.items():
            for k in table["keys"]:
                v = cell.get(k)
                if not v:
                    continue
                half = v["ci95"]
                w.writerow([kind, m, table["baseline"] if kind == "paired" else "", k, v["n"], repr(v["mean"]),
                            "" if math.isnan(half) else repr(half),
                            "" if math.isnan(half) else repr(v["mean"] - half),
                            "" if math.isnan(half) else repr(v["mean"] + half),
                            ";".join(str(s) for s in cell["seeds"]),
                            ";".join("" if x is None else repr(x) for x in v["values"])])
    return buf.getvalue()


def write_table(out_dir: Path, table: Dict, title: str = "") -> Dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {"md": out_dir / "table.md", "csv": out_dir / "table.csv", "json": out_dir / "table.json"}
    atomic_write_text(paths["md"], table_markdown(table, title))
    atomic_write_text(paths["csv"], table_csv(table))
    atomic_write_json(paths["json"], table)
    return paths


# ----------------------------------------------------------------------------- figures


def band(ax, xs, ys, es, color, label, marker=None):
    """A mean curve with its 95% band."""
    ax.plot(xs, ys, color=color, marker=marker, markersize=3, label=label)
    ax.fill_between(xs, [y - e for y, e in zip(ys, es)], [y + e for y, e in zip(ys, es)], color=color, alpha=0.15)


def save_figure(fig, out_png: Path, dpi: int = 90) -> Path:
    """Write ``fig`` atomically and close it."""
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.stem}.tmp-{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png


def _panels(runs: Runs) -> List[Tuple[List[str], str]]:
    """(row columns drawn, title) per panel: the four training quantities, then the held-out Pass@k."""
    present = {k for rows in runs.values() for r in rows for k in r}
    panels = [([q.column], q.label) for q in FIGURE5]
    passes = pass_columns(present)
    if passes:
        shown = sorted({passes[0], passes[-1]}, key=passes.index)  # Pass@1 and the largest k
        panels.append((shown, "held-out " + " / ".join(_label(k).split()[-1] for k in shown)))
    return panels


def plot_study(runs: Runs, methods: Sequence[str], seeds: Sequence[int], out_dir: Path, title: str = "",
               colors: Optional[Mapping[str, str]] = None, window: int = 5) -> Dict[str, Path]:
    """``figure5.png`` (mean ± 95% band over seeds per method) and, with two or more methods, ``paired.png``
    (the per-step difference to ``methods[0]`` on the same seed). Each seed's training curves are first
    smoothed by their trailing mean over ``window`` steps; held-out points are drawn as evaluated."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    colors = dict(colors or {})
    for i, m in enumerate(methods):
        colors.setdefault(m, f"C{i}")
    panels = _panels(runs)
    by_method = {}
    for m in methods:
        by_method[m] = {}
        for s in seeds:
            rows = runs.get((m, s))
            for cols, _ in panels[:len(FIGURE5)]:
                rows = trailing_mean(rows, cols[0], window) if rows else rows
            if rows:
                by_method[m][s] = rows
    styles = ("-", "--", ":")
    out = {}

    def draw(name: str, per_method, suffix: str):
        fig, axes = plt.subplots(1, len(panels), figsize=(3.9 * len(panels), 3.4), squeeze=False)
        for ax, (cols, label) in zip(axes[0], panels):
            for m, series in per_method.items():
                for j, col in enumerate(cols):
                    xs, ys, es = series(m, col)
                    if xs:
                        band(ax, xs, ys, es, colors[m], m if j == 0 else None,
                             "o" if col.startswith("heldout_") else None)
                        ax.lines[-1].set_linestyle(styles[min(j, len(styles) - 1)])
            if suffix:
                ax.axhline(0.0, color="grey", linewidth=0.8)
            ax.set_title(label + suffix, fontsize=9)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
        if axes[0][0].get_legend_handles_labels()[0]:
            axes[0][0].legend(fontsize=7)
        if title:
            fig.suptitle(f"{title}  (training curves: trailing mean over {window} steps; bands: 95% over seeds)",
                         fontsize=10)
        out[name] = save_figure(fig, Path(out_dir) / f"{name}.png")

    draw("figure5", {m: (lambda m, col: curve(by_method[m], col)) for m in methods}, "")
    base = methods[0]
    if len(methods) > 1:
        draw("paired", {m: (lambda m, col: paired_curve(by_method[m], by_method[base], col)) for m in methods[1:]},
             f"\nminus {base}, same seed")
    return out
