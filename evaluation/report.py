"""Stage 3 (``lpo-eval report``): checkpoints x benchmarks tables and plots from ``metrics.json`` files.

Writes ``summary.md`` (Pass@1 and Pass@k tables in percent), ``summary.csv``, ``summary.json`` (raw
fractions), ``passk.png`` (Pass@k against k per benchmark, one line per checkpoint) and ``steps.png``
(a metric against training step, one line per run, one panel per benchmark and average).
Averages: ``math_avg`` over the in-distribution math benchmarks, ``ood_avg`` over the OOD ones; an
average is left empty for a checkpoint that lacks one of its benchmarks.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from .benchmarks import BENCHMARKS
from .io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from .score import METRICS_FILE

FORMATS = ("md", "csv", "json")


def collect(runs: str | Path) -> list[dict]:
    root = Path(runs)
    if not root.is_dir():
        raise ValueError(f"--runs {str(root)!r} is not a directory")
    ms = [read_json(p) for p in sorted(root.glob(f"*/*/{METRICS_FILE}"))]
    if not ms:
        raise ValueError(f"--runs {str(root)!r} holds no metrics.json (run `lpo-eval score` first)")
    seen: dict[tuple[str, str], str] = {}
    for m in ms:
        key = (m["checkpoint"], m["benchmark"])
        if key in seen and seen[key] != m["config_sha"]:
            raise ValueError(
                f"{key[0]} / {key[1]} was evaluated with two configs ({seen[key][:12]}, {m['config_sha'][:12]}); "
                "report one config at a time: move one job directory out of --runs"
            )
        seen[key] = m["config_sha"]
    return ms


def build_table(ms: list[dict]) -> dict:
    """Rows (checkpoints, ordered by step then name) x benchmarks (registry order) with averages."""
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    benches = sorted({m["benchmark"] for m in ms}, key=lambda b: (order.get(b, len(order)), b))
    groups = {m["benchmark"]: m["group"] for m in ms}
    ks = {}
    for m in ms:
        ks.setdefault(m["benchmark"], set()).add(m["k"])
    for b, kset in ks.items():
        if len(kset) != 1:
            raise ValueError(f"benchmark {b} has different k across checkpoints ({sorted(kset)}); use one --k")
    kmap = {b: next(iter(v)) for b, v in ks.items()}
    rows: dict[str, dict] = {}
    for m in ms:
        r = rows.setdefault(m["checkpoint"], {"checkpoint": m["checkpoint"], "step": m.get("step"),
                                               "checkpoint_path": m.get("checkpoint_path"), "cells": {}})
        r["cells"][m["benchmark"]] = {
            "pass@1": m["pass@1"],
            "pass@k": m["pass@k"][str(m["k"])],
            "k": m["k"],
            "n": m["n"],
            "curve": {int(k): v for k, v in m["pass@k"].items()},
        }
    for r in rows.values():
        for group in ("math", "ood"):
            members = [b for b in benches if groups[b] == group]
            if not members:
                continue
            for metric in ("pass@1", "pass@k"):
                vals = [r["cells"][b][metric] for b in members if b in r["cells"]]
                r[f"{group}_avg_{metric}"] = sum(vals) / len(vals) if len(vals) == len(members) else None
    ordered = sorted(rows.values(), key=lambda r: (r["step"] is None, r["step"] or 0, r["checkpoint"]))
    return {"benchmarks": benches, "groups": groups, "k": kmap, "rows": ordered}


def _fmt(v) -> str:
    return "" if v is None else f"{100 * v:.1f}"


def _columns(table: dict, metric: str) -> list[tuple[str, str, str | None]]:
    """(header, benchmark-or-avg, metric) columns for one metric."""
    cols = []
    for b in table["benchmarks"]:
        k = table["k"][b]
        label = f"{b} (pass@{k})" if metric == "pass@k" else b
        cols.append((label, b, metric))
    for group in ("math", "ood"):
        if any(table["groups"][b] == group for b in table["benchmarks"]):
            cols.append((f"{group} avg", f"{group}_avg", metric))
    return cols


def _cell(row: dict, key: str, metric: str):
    if key.endswith("_avg"):
        return row.get(f"{key}_{metric}")
    c = row["cells"].get(key)
    return None if c is None else c[metric]


def to_markdown(table: dict) -> str:
    out = []
    metrics = [("pass@1", "Pass@1 (%), mean accuracy over n samples")]
    if any(k > 1 for k in table["k"].values()):
        metrics.append(("pass@k", "Pass@k (%), unbiased estimator at each benchmark's k"))
    for metric, title in metrics:
        cols = _columns(table, metric)
        out.append(f"### {title}\n")
        out.append("| checkpoint | step | " + " | ".join(c[0] for c in cols) + " |")
        out.append("|---|---:|" + "---:|" * len(cols))
        for r in table["rows"]:
            step = "" if r["step"] is None else str(r["step"])
            out.append(f"| {r['checkpoint']} | {step} | " + " | ".join(_fmt(_cell(r, c[1], c[2])) for c in cols) + " |")
        out.append("")
    ns = ", ".join(f"{b}: n={table['rows'][0]['cells'][b]['n'] if b in table['rows'][0]['cells'] else '?'}"
                   for b in table["benchmarks"])
    out.append(f"Samples per problem: {ns}.\n")
    return "\n".join(out)


def to_csv(table: dict) -> str:
    cols = _columns(table, "pass@1") + (_columns(table, "pass@k") if any(k > 1 for k in table["k"].values()) else [])
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    headers = []
    for label, key, metric in cols:
        k = table["k"].get(key)
        headers.append(f"{key}/pass@{k}" if (metric == "pass@k" and k) else f"{key}/{metric}")
    w.writerow(["checkpoint", "step"] + headers)
    for r in table["rows"]:
        vals = [_cell(r, c[1], c[2]) for c in cols]
        w.writerow([r["checkpoint"], "" if r["step"] is None else r["step"]] + ["" if v is None else f"{100 * v:.2f}" for v in vals])
    return buf.getvalue()


def _plot_passk(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = table["benchmarks"]
    cols = min(3, len(benches))
    nrows = math.ceil(len(benches) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, b in zip(axes.flat, benches):
        for r in table["rows"]:
            c = r["cells"].get(b)
            if c is None:
                continue
            ks = sorted(c["curve"])
            ax.plot(ks, [100 * c["curve"][k] for k in ks], marker="o", markersize=3, label=r["checkpoint"])
        ax.set_title(b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.grid(alpha=0.3)
    _save_panels(fig, axes, len(benches), path)


def _save_panels(fig, axes, used: int, path: Path) -> None:
    """Hide unused panels, add one shared legend, write the PNG atomically (no timestamp metadata)."""
    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _plot_steps(table: dict, path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(table["benchmarks"]) + [g + "_avg" for g in ("math", "ood") if any(table["groups"][b] == g for b in table["benchmarks"])]
    runs: dict[str, list[dict]] = {}
    for r in table["rows"]:
        if r["step"] is not None:
            run = str(Path(r["checkpoint_path"] or r["checkpoint"]).parent)
            runs.setdefault(run, []).append(r)
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        for run, rs in sorted(runs.items()):
            pts = [(r["step"], _cell(r, key, metric)) for r in rs]
            pts = sorted((s, v) for s, v in pts if v is not None)
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", markersize=3, label=Path(run).name or run)
        ax.set_title(key if metric == "pass@1" else f"{key} ({metric})")
        ax.set_xlabel("training step")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(alpha=0.3)
    _save_panels(fig, axes, len(panels), path)


def report(runs: str | Path, out: str | Path | None = None, formats: tuple[str, ...] = FORMATS,
           plots: bool = True, step_metric: str = "pass@1") -> dict:
    """Write the summary files (and plots) for every scored job under ``runs``; return the table."""
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--format {f!r} is not one of {', '.join(FORMATS)}")
    if step_metric not in ("pass@1", "pass@k"):
        raise ValueError(f"--step-metric must be pass@1 or pass@k, got {step_metric!r}")
    table = build_table(collect(runs))
    out = Path(out or runs)
    if "md" in formats:
        atomic_write_text(out / "summary.md", to_markdown(table))
    if "csv" in formats:
        atomic_write_text(out / "summary.csv", to_csv(table))
    if "json" in formats:
        atomic_write_json(out / "summary.json", table)
    if plots:
        _plot_passk(table, out / "passk.png")
        _plot_steps(table, out / "steps.png", step_metric)
    return table
