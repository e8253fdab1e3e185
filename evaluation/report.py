"""Stage 3 (``lpo-eval report``): checkpoints x benchmarks tables and plots from ``metrics.json`` files.

Writes ``summary.md`` (Pass@1, Pass@k, maj@n, best/worst of n, response length), ``summary.csv``,
``summary.json`` (raw fractions), ``passk.png`` (Pass@k against k per benchmark, one line per
checkpoint), ``steps.png`` (a metric against training step, one line per run, one panel per benchmark
and average) and ``lengths.png`` (mean response length against step, correct and wrong samples).
Averages: ``math_avg`` over the in-distribution math benchmarks, ``ood_avg`` over the OOD ones; an
average is left empty for a checkpoint that lacks one of its benchmarks.

One checkpoint x benchmark evaluated with several configs (say two templates): the latest (by the time
its generations finished) is reported unless ``select`` (``KEY=VALUE`` on ``config.json`` fields,
dotted for nested ones, e.g. ``template=r1`` or ``sampling.temperature=0``) or ``config_sha`` (a
prefix) picks another; the configs left out are named on stderr.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from .benchmarks import BENCHMARKS
from .generate import CONFIG_FILE, GEN_FILE
from .io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json
from .protocol import header_lines, table_protocol
from .score import METRICS_FILE

FORMATS = ("md", "csv", "json")


def _config_value(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


_MISSING = object()


def _matches(cfg: dict, select: dict[str, str]) -> bool:
    for key, want in select.items():
        got = _config_value(cfg, key)
        if got is _MISSING:
            return False
        if not (str(got) == want or json.dumps(got) == want or (isinstance(got, (int, float)) and _num_eq(got, want))):
            return False
    return True


def _num_eq(got, want: str) -> bool:
    try:
        return float(want) == float(got)
    except ValueError:
        return False


def collect(runs: str | Path, select: dict[str, str] | None = None, config_sha: str | None = None,
            quiet: bool = False) -> list[dict]:
    """Metrics of every scored job under ``runs``, one config per checkpoint x benchmark (see module doc)."""
    root = Path(runs)
    if not root.is_dir():
        raise ValueError(f"--runs {str(root)!r} is not a directory")
    found = []
    for p in sorted(root.glob(f"*/*/{METRICS_FILE}")):
        m = read_json(p)
        cfg = read_json(p.parent / CONFIG_FILE) if (p.parent / CONFIG_FILE).exists() else {}
        gen = p.parent / GEN_FILE
        found.append((m, cfg, gen.stat().st_mtime_ns if gen.exists() else 0))
    if not found:
        raise ValueError(f"--runs {str(root)!r} holds no metrics.json (run `lpo-eval score` first)")
    if select:
        found = [f for f in found if _matches(f[1], select)]
    if config_sha:
        found = [f for f in found if f[0]["config_sha"].startswith(config_sha)]
    if not found:
        raise ValueError(f"no scored job under {str(root)!r} matches --select {select or {}} --config-sha {config_sha or ''}")
    groups: dict[tuple[str, str], list] = {}
    for f in found:
        groups.setdefault((f[0]["checkpoint"], f[0]["benchmark"]), []).append(f)
    out = []
    for (ckpt, bench), fs in sorted(groups.items()):
        fs.sort(key=lambda f: (f[2], f[0]["config_sha"]))
        out.append(fs[-1][0])
        if len(fs) > 1 and not quiet:
            dropped = ", ".join(f[0]["config_sha"][:12] for f in fs[:-1])
            print(f"lpo-eval report: {ckpt} / {bench} has {len(fs)} configs; reporting the latest "
                  f"({fs[-1][0]['config_sha'][:12]}), not {dropped} (choose with --select KEY=VALUE or --config-sha)",
                  file=sys.stderr)
    return out


def build_table(ms: list[dict], passk_average: str = "auto") -> dict:
    """Rows (checkpoints, ordered by step then name) x benchmarks (registry order) with averages.

    ``table["protocol"]``: the settings the jobs were made with (:func:`evaluation.protocol.table_protocol`),
    including the Pass@k average rule (``all``, or ``k>1``: the paper's, only benchmarks with k > 1)."""
    protocol = table_protocol(ms, passk_average)
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
        r = rows.setdefault(m["checkpoint"], {"checkpoint": m["checkpoint"], "step": m.get("step"), "run": m.get("run"),
                                               "checkpoint_path": m.get("checkpoint_path"), "cells": {}})
        n = m["n"]
        maj = m.get("maj@k") or {}
        r["cells"][m["benchmark"]] = {
            "pass@1": m["pass@1"],
            "pass@k": m["pass@k"][str(m["k"])],
            "maj@n": maj.get(str(n)),
            "best@n": m.get("best_of_n", m["pass@k"][str(n)]),
            "worst@n": m.get("worst_of_n"),
            "k": m["k"],
            "n": n,
            "curve": {int(k): v for k, v in m["pass@k"].items()},
            "length": m.get("length") or {"mean": m.get("mean_tokens"), "truncated_rate": m.get("truncated_rate")},
            "no_answer_rate": m.get("no_answer_rate"),
            "timeout_rate": m.get("timeout_rate"),
        }
    for r in rows.values():
        for group in ("math", "ood"):
            members = [b for b in benches if groups[b] == group]
            if not members:
                continue
            for metric in ("pass@1", "pass@k", "maj@n"):
                use = [b for b in members if metric != "pass@k" or protocol["passk_average"] == "all" or kmap[b] > 1]
                vals = [r["cells"][b][metric] for b in use if b in r["cells"]]
                ok = bool(use) and len(vals) == len(use) and all(v is not None for v in vals)
                r[f"{group}_avg_{metric}"] = sum(vals) / len(vals) if ok else None
    ordered = sorted(rows.values(), key=lambda r: (r["step"] is None, r["step"] or 0, r["checkpoint"]))
    return {"benchmarks": benches, "groups": groups, "k": kmap, "rows": ordered, "protocol": protocol}


def _fmt(v) -> str:
    return "" if v is None else f"{100 * v:.1f}"


def _columns(table: dict, metric: str) -> list[tuple[str, str, str | None]]:
    """(header, benchmark-or-avg, metric) columns for one metric."""
    cols = []
    for b in table["benchmarks"]:
        k = table["k"][b]
        label = f"{b} (pass@{k})" if metric == "pass@k" else b
        cols.append((label, b, metric))
    if metric in ("pass@1", "pass@k", "maj@n"):
        k_rule = metric == "pass@k" and (table.get("protocol") or {}).get("passk_average") == "k>1"
        for group in ("math", "ood"):
            if any(table["groups"][b] == group for b in table["benchmarks"]):
                cols.append((f"{group} avg" + (" (k>1)" if k_rule else ""), f"{group}_avg", metric))
    return cols


def _cell(row: dict, key: str, metric: str):
    if key.endswith("_avg"):
        return row.get(f"{key}_{metric}")
    c = row["cells"].get(key)
    return None if c is None else c[metric]


def _has_n_gt_1(table: dict) -> bool:
    return any(c["n"] > 1 for r in table["rows"] for c in r["cells"].values())


def _metric_table(table: dict, metric: str, title: str, fmt=_fmt) -> list[str]:
    cols = _columns(table, metric)
    out = [f"### {title}\n", "| checkpoint | step | " + " | ".join(c[0] for c in cols) + " |",
           "|---|---:|" + "---:|" * len(cols)]
    for r in table["rows"]:
        step = "" if r["step"] is None else str(r["step"])
        out.append(f"| {r['checkpoint']} | {step} | " + " | ".join(fmt(_cell(r, c[1], c[2])) for c in cols) + " |")
    out.append("")
    return out


def _num(v, digits=0) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def to_markdown(table: dict) -> str:
    out = header_lines(table["protocol"]) if table.get("protocol") else []
    out += _metric_table(table, "pass@1", "Pass@1 (%), mean accuracy over n samples")
    if any(k > 1 for k in table["k"].values()):
        out += _metric_table(table, "pass@k", "Pass@k (%), unbiased estimator at each benchmark's k")
    if _has_n_gt_1(table):
        out += _metric_table(table, "maj@n", "maj@n (%), majority vote over the n samples (grader-equivalent answers)")
        cols = _columns(table, "best@n")
        out += ["### Best / worst of n (%): some sample correct / every sample correct\n",
                "| checkpoint | step | " + " | ".join(c[0] for c in cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        for r in table["rows"]:
            cells = []
            for _, b, _ in cols:
                c = r["cells"].get(b)
                cells.append("" if c is None else f"{_fmt(c['best@n'])} / {_fmt(c['worst@n'])}")
            out.append(f"| {r['checkpoint']} | {'' if r['step'] is None else r['step']} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["### Response length (tokens)\n",
            "| checkpoint | step | benchmark | mean | p50 | p90 | p99 | max | correct | wrong | truncated % | no answer % |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table["rows"]:
        for b in table["benchmarks"]:
            c = r["cells"].get(b)
            if c is None:
                continue
            ln = c["length"]
            out.append(f"| {r['checkpoint']} | {'' if r['step'] is None else r['step']} | {b} | {_num(ln.get('mean'), 1)} | "
                       f"{_num(ln.get('p50'))} | {_num(ln.get('p90'))} | {_num(ln.get('p99'))} | {_num(ln.get('max'))} | "
                       f"{_num(ln.get('mean_correct'), 1)} | {_num(ln.get('mean_wrong'), 1)} | {_fmt(ln.get('truncated_rate'))} | "
                       f"{_fmt(c.get('no_answer_rate'))} |")
    out.append("")
    ns = ", ".join(f"{b}: n={table['rows'][0]['cells'][b]['n'] if b in table['rows'][0]['cells'] else '?'}"
                   for b in table["benchmarks"])
    out.append(f"Samples per problem: {ns}.\n")
    return "\n".join(out)


def to_csv(table: dict) -> str:
    cols = _columns(table, "pass@1") + (_columns(table, "pass@k") if any(k > 1 for k in table["k"].values()) else [])
    if _has_n_gt_1(table):
        cols += _columns(table, "maj@n") + _columns(table, "best@n") + _columns(table, "worst@n")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    headers = []
    for label, key, metric in cols:
        k = table["k"].get(key)
        headers.append(f"{key}/pass@{k}" if (metric == "pass@k" and k) else f"{key}/{metric}")
    headers += [f"{b}/{x}" for b in table["benchmarks"] for x in ("length_mean", "length_p90", "truncated")]
    w.writerow(["checkpoint", "step"] + headers)
    for r in table["rows"]:
        vals = ["" if v is None else f"{100 * v:.2f}" for v in (_cell(r, c[1], c[2]) for c in cols)]
        for b in table["benchmarks"]:
            ln = (r["cells"].get(b) or {}).get("length") or {}
            vals += [_num(ln.get("mean"), 2), _num(ln.get("p90"), 1),
                     "" if ln.get("truncated_rate") is None else f"{100 * ln['truncated_rate']:.2f}"]
        w.writerow([r["checkpoint"], "" if r["step"] is None else r["step"]] + vals)
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
    bottom = 0.02
    if handles:  # as many legend columns as fit the figure's width (7 pt text: ~4 pt per character)
        width_pt = fig.get_figwidth() * 72
        ncol = max(1, min(len(labels), int(width_pt // (4.2 * max(len(x) for x in labels) + 30))))
        rows = math.ceil(len(labels) / ncol)
        extra = 0.16 * rows + 0.1  # inches for the legend below the panels
        height = fig.get_figheight()
        fig.set_figheight(height + extra)
        bottom = extra / (height + extra)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _runs(table: dict) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for r in table["rows"]:
        if r["step"] is not None:
            run = r.get("run") or Path(r["checkpoint_path"] or r["checkpoint"]).parent.name
            runs.setdefault(run, []).append(r)
    return runs


def _plot_steps(table: dict, path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(table["benchmarks"]) + [g + "_avg" for g in ("math", "ood") if any(table["groups"][b] == g for b in table["benchmarks"])]
    runs = _runs(table)
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        for run, rs in sorted(runs.items()):
            pts = [(r["step"], _cell(r, key, metric)) for r in rs]
            pts = sorted((s, v) for s, v in pts if v is not None)
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", markersize=3, label=run)
        ax.set_title(key if metric == "pass@1" else f"{key} ({metric})")
        ax.set_xlabel("training step")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(alpha=0.3)
    _save_panels(fig, axes, len(panels), path)


def _plot_lengths(table: dict, path: Path) -> None:
    """Mean response length against training step (solid: all samples; dashed: correct; dotted: wrong)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = table["benchmarks"]
    runs = _runs(table)
    cols = min(3, len(benches))
    nrows = math.ceil(len(benches) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, b in zip(axes.flat, benches):
        for i, (run, rs) in enumerate(sorted(runs.items())):
            color = f"C{i % 10}"
            for field_, style, suffix in (("mean", "-", ""), ("mean_correct", "--", " (correct)"), ("mean_wrong", ":", " (wrong)")):
                pts = sorted((r["step"], r["cells"][b]["length"].get(field_)) for r in rs if b in r["cells"])
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o", markersize=3,
                            label=run + suffix)
        ax.set_title(f"{b}: response length")
        ax.set_xlabel("training step")
        ax.set_ylabel("tokens")
        ax.grid(alpha=0.3)
    _save_panels(fig, axes, len(benches), path)


def report(runs: str | Path, out: str | Path | None = None, formats: tuple[str, ...] = FORMATS,
           plots: bool = True, step_metric: str = "pass@1", select: dict[str, str] | None = None,
           config_sha: str | None = None, passk_average: str = "auto") -> dict:
    """Write the summary files (and plots) for every scored job under ``runs``; return the table."""
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--format {f!r} is not one of {', '.join(FORMATS)}")
    if step_metric not in ("pass@1", "pass@k", "maj@n"):
        raise ValueError(f"--step-metric must be pass@1, pass@k or maj@n, got {step_metric!r}")
    table = build_table(collect(runs, select, config_sha), passk_average)
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
        _plot_lengths(table, out / "lengths.png")
    return table
