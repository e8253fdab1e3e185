"""Toy sample efficiency and diversity: the paper's comparisons at toy scale, with seeds and 95% CIs.

    python benchmarks/toy_sample_efficiency.py                       # full grid (see below)
    python benchmarks/toy_sample_efficiency.py --methods lpo-fwd,lpo-rev,grpo --ks 2,8 --seeds 0,1,2
    python benchmarks/toy_sample_efficiency.py --out runs/bench --workers 2   # resumes a stopped grid

Grid: methods (default LPO-fwd and LPO-rev paired with GRPO (tau = group std), with Dr.GRPO (tau = 1)
and with MaxRL (tau = group mean), and the three baselines) x group size K (default 2, 4, 8) x seeds
(default 0-4), every run from the same cached warm-up of ``lpo-demo``'s preset (default task
``pairsum``: four correct answers per prompt), the same number of prompts per step for every K (so
a run at K=2 samples a quarter of the responses of K=8, as in the paper's group-size sweep).

Paired seeds: a seed fixes the training prompts of every step and the sampling seed of every step,
so at step 1 (same warm-up weights) every method of a (seed, K) cell samples the same rollouts; the
script asserts it from the digests the loop logs (``prompt_digest`` at every step, ``rollout_digest``
at step 1) and stops if they differ. The held-out evaluation uses the same problems and sampling seed
for every method of a seed.

Reported per (method, K), as mean +- 95% t-interval over seeds (:mod:`openrlhf_lpo.compare.stats`):
final sampled reward (mean of the last ``--window`` steps), held-out Pass@1 / Pass@4 / Pass@16
(unbiased estimator, 16 samples per problem), distinct correct answers per held-out prompt, coverage
of the answer set, response entropy, gradient norm, and steps to threshold: the first step whose
trailing ``--window``-step mean reward reaches the paired baseline's mean final reward at that K
(or ``--threshold``), mean over the seeds that reach it, with the count. Then the paired differences
LPO minus its baseline per K, and ``group_size.png`` (the paper's Fig. 7 layout: metric vs K, one line
per method, 95% error bars).

``--suite baselines`` (issue 31) runs the paper grid with RLOO and REINFORCE++-baseline, each beside LPO-fwd
and LPO-rev at its paired temperature (``loo`` = (K-1)/K; ``batch_std`` = the batch std of R - group mean);
any method of :mod:`openrlhf_lpo.demo.methods` also works in ``--methods``. DAPO, GSPO and CISPO change the
policy loss, not the advantage, and the in-process loop's loss is fixed: they run through ``lpo-train`` only
(``configs/methods/dapo.sh`` ...).

``--suite research`` (issue 25, default task ``tripsum``, where Pass@16 is below 1 after the warm-up)
runs the research agenda instead: the divergence family (GRPO, LPO with fwd, rev, js, hellinger, tv,
alpha:0.5, alpha:2) at K in {4, 8}; at K = 8 forward -> reverse KL by step (@20) and by entropy, the
temperature scale 0.5 and 2, and listwise replay. It reports the same per-(method, K) table, paired
differences for named contrasts (each divergence vs LPO-fwd, schedules vs fwd-only and rev-only, tau
x0.5/x2 vs x1, replay vs on-policy LPO-fwd and GRPO), and four figures: ``divergences.png``,
``schedules.png`` (held-out metrics and entropy against the step), ``tau_scale.png`` and ``replay.png``
(held-out Pass@1 and distinct correct answers against the fresh rollouts generated).

What runs: the in-process loop of :mod:`openrlhf_lpo.demo.loop` (plain torch + HF generate, one
process per run, ``--workers`` at a time), NOT the Ray pipeline: a grid of ~135 pipeline jobs would
spend most of its time starting Ray, the rollout engine and DeepSpeed. The losses are the same
``openrlhf_lpo.listwise`` code the pipeline's actor uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

DEFAULT_METHODS = "lpo-fwd,lpo-rev,grpo,lpo-fwd@one,lpo-rev@one,dr-grpo,lpo-fwd@mean,lpo-rev@mean,maxrl"
# --suite baselines: the 2025 baselines whose advantage fits the toy, each with its LPO pair (demo/methods.py says
# why DAPO, GSPO and CISPO, which change the policy loss, do not)
BASELINE_METHODS = "rloo,lpo-fwd@loo,lpo-rev@loo,reinforce-pp,lpo-fwd@batch_std,lpo-rev@batch_std"
FIGURE_METRICS = (("reward_final", "final sampled reward (training)"),
                  ("heldout_pass@1", "held-out Pass@1"),
                  ("heldout_pass@4", "held-out Pass@4"),
                  ("heldout_distinct_correct", "held-out distinct correct answers / prompt"))
TABLE_METRICS = (("reward_final", "reward"), ("heldout_pass@1", "pass@1"), ("heldout_pass@4", "pass@4"),
                 ("heldout_pass@16", "pass@16"), ("heldout_distinct_correct", "distinct"),
                 ("heldout_coverage", "coverage"), ("entropy_final", "entropy"), ("grad_norm_mean", "|grad|"))

Job = Tuple[str, int, int]  # (method, K, seed)


def job_name(method: str, k: int, seed: int) -> str:
    return f"{method}-K{k}-seed{seed}"


class PairingError(AssertionError):
    """Two methods of one (seed, K) cell did not see the same prompts / step-1 rollouts."""


def check_pairing(runs: Dict[Job, List[Dict]]) -> int:
    """Assert that every method of each (seed, K) saw the same prompts at every step and the same
    rollouts at step 1; return the number of cells checked (with at least two methods)."""
    cells: Dict[Tuple[int, int], Dict[str, List[Dict]]] = {}
    for (method, k, seed), rows in runs.items():
        cells.setdefault((seed, k), {})[method] = [r for r in rows if r.get("step", 0) >= 1]
    checked = 0
    for (seed, k), by_method in sorted(cells.items()):
        if len(by_method) < 2:
            continue
        names = sorted(by_method)
        ref = by_method[names[0]]
        for name in names[1:]:
            rows = by_method[name]
            if [r["prompt_digest"] for r in rows] != [r["prompt_digest"] for r in ref]:
                raise PairingError(f"seed {seed}, K={k}: {name} and {names[0]} trained on different prompts")
            if rows[0]["rollout_digest"] != ref[0]["rollout_digest"]:
                raise PairingError(f"seed {seed}, K={k}: {name} and {names[0]} sampled different step-1 rollouts "
                                   f"({rows[0]['rollout_digest']} vs {ref[0]['rollout_digest']})")
            if rows[0]["reward"] != ref[0]["reward"]:
                raise PairingError(f"seed {seed}, K={k}: equal step-1 rollouts scored differently")
        checked += 1
    return checked


def run_summary(rows: List[Dict], window: int) -> Dict[str, float]:
    """Final metrics of one run (:func:`openrlhf_lpo.compare.summary.run_summary`): the last ``window`` steps'
    reward and entropy, the mean gradient norm, and the held-out metrics of the last evaluation."""
    from openrlhf_lpo.compare.summary import run_summary as summary

    return summary(rows, window)


def aggregate(runs: Dict[Job, List[Dict]], methods: Sequence[str], ks: Sequence[int], seeds: Sequence[int],
              window: int, threshold: Optional[float] = None) -> Dict:
    """Per (method, K): mean +- 95% CI over seeds of every run summary metric and of the steps to
    threshold; per LPO method and K: the paired difference to its baseline
    (:func:`openrlhf_lpo.compare.summary.aggregate` per K)."""
    from openrlhf_lpo.compare.stats import mean_ci
    from openrlhf_lpo.compare.summary import aggregate as per_seed
    from openrlhf_lpo.demo.methods import METHODS
    from openrlhf_lpo.demo.report import steps_to_reach

    summ = {job: run_summary(rows, window) for job, rows in runs.items()}
    cells, diffs = {}, {}
    for k in ks:
        at_k = {(m, s): v for (m, kk, s), v in summ.items() if kk == k}
        agg = per_seed(at_k, methods, seeds, lambda m: METHODS[m].baseline.name,
                       keys=[key for key, _ in TABLE_METRICS])
        for m, cell in agg["cells"].items():
            base = METHODS[m].baseline.name
            if threshold is not None:
                thr = threshold
            else:
                finals = [summ[(base, k, s)]["reward_final"] for s in seeds if (base, k, s) in summ]
                thr = statistics.mean(finals) if finals else None
            hits = [steps_to_reach(runs[(m, k, s)], thr, window) if thr is not None else None for s in cell["seeds"]]
            reached = [h for h in hits if h is not None]
            ci = mean_ci(reached)
            cells[f"{m}|{k}"] = {**cell, "threshold": thr,
                                 "steps_to_threshold": {"values": hits, "mean": ci.mean, "ci95": ci.half,
                                                        "reached": len(reached), "n": len(hits)}}
        diffs.update({f"{m}|{k}": d for m, d in agg["paired_differences"].items()})
    return {"cells": cells, "paired_differences": diffs}


def _cell_str(cell: Dict, key: str, spec: str = ".3f") -> str:
    v = cell.get(key)
    if not v or v["n"] == 0:
        return "-"
    if v["n"] < 2 or math.isnan(v["ci95"]):
        return format(v["mean"], spec)
    return f"{format(v['mean'], spec)}+-{format(v['ci95'], spec)}"


def format_tables(agg: Dict, methods: Sequence[str], ks: Sequence[int]) -> str:
    lines = []
    head = ["method"] + [label for _, label in TABLE_METRICS] + ["steps to thr"]
    for k in ks:
        lines.append(f"K = {k}  (mean +- 95% CI over seeds; held-out metrics at the last step)")
        rows = [head]
        for m in methods:
            cell = agg["cells"].get(f"{m}|{k}")
            if cell is None:
                continue
            st = cell["steps_to_threshold"]
            steps = ("-" if st["reached"] == 0 else
                     f"{st['mean']:.1f}" + ("" if math.isnan(st["ci95"]) else f"+-{st['ci95']:.1f}"))
            steps += f" ({st['reached']}/{st['n']})"
            rows.append([m] + [_cell_str(cell, key, ".2f" if key.startswith("heldout_distinct") else ".3f")
                               for key, _ in TABLE_METRICS] + [steps])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        thr = {agg["cells"][f"{m}|{k}"]["threshold"] for m in methods if f"{m}|{k}" in agg["cells"]}
        lines.append("  steps to thr: first step whose 5-step mean reward reaches the paired baseline's mean final "
                     "reward (" + ", ".join(f"{t:.3f}" for t in sorted(x for x in thr if x is not None)) + "), "
                     "mean over the seeds that reach it (reached/seeds)")
        lines.append("")
    lines.append("Paired differences, LPO minus its baseline on the same seeds (mean +- 95% CI; an interval that "
                 "excludes 0 is a difference this toy resolves):")
    keys = [key for key, _ in TABLE_METRICS if key in ("reward_final", "heldout_pass@1", "heldout_pass@4",
                                                        "heldout_pass@16", "heldout_distinct_correct",
                                                        "entropy_final", "grad_norm_mean")]
    rows = [["method", "vs", "K"] + [dict(TABLE_METRICS)[k2] for k2 in keys]]
    for m in methods:
        for k in ks:
            d = agg["paired_differences"].get(f"{m}|{k}")
            if not d:
                continue
            vals = []
            for key in keys:
                v = d.get(key)
                if not v or v["n"] == 0:
                    vals.append("-")
                else:
                    sig = "*" if not math.isnan(v["ci95"]) and abs(v["mean"]) > v["ci95"] else " "
                    vals.append(f"{v['mean']:+.3f}+-{v['ci95']:.3f}{sig}")
            rows.append([m, d["baseline"], str(k)] + vals)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("  (* = the 95% interval excludes 0)")
    return "\n".join(lines) + "\n"


def plot_group_size(agg: Dict, methods: Sequence[str], ks: Sequence[int], out_png: Path, title: str) -> Path:
    """Metric vs K with 95% error bars (the paper's Fig. 7 layout): one row per temperature family
    (a baseline and the LPO methods paired with it), one column per metric."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from openrlhf_lpo.demo.methods import METHODS

    families: Dict[str, List[str]] = {}
    for m in methods:
        families.setdefault(METHODS[m].baseline.name, []).append(m)
    nrow, ncol = len(families), len(FIGURE_METRICS)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 3.6 * nrow), squeeze=False)
    for row, (base, members) in enumerate(families.items()):
        for col, (key, label) in enumerate(FIGURE_METRICS):
            ax = axes[row][col]
            for i, m in enumerate(members):
                xs, ys, es = [], [], []
                for k in ks:
                    v = agg["cells"].get(f"{m}|{k}", {}).get(key)
                    if v and v["n"]:
                        # small horizontal offsets keep overlapping error bars readable
                        xs.append(k * 2 ** ((i - (len(members) - 1) / 2) * 0.04))
                        ys.append(v["mean"])
                        es.append(0.0 if math.isnan(v["ci95"]) else v["ci95"])
                if xs:
                    meth = METHODS[m]
                    ax.errorbar(xs, ys, yerr=es, color=meth.color, marker="o", markersize=4, capsize=3,
                                linewidth=1.6, label=m)
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(ks))
            ax.set_xticklabels([str(k) for k in ks])
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(label, fontsize=10)
            if row == nrow - 1:
                ax.set_xlabel("group size K")
            if col == 0:
                ax.set_ylabel(f"tau of {base}", fontsize=9)
                ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    return _save(fig, out_png)


# ----------------------------------------------------------------------------- research suite (issue 25)

RESEARCH_FAMILY = ("grpo", "lpo-fwd", "lpo-rev", "lpo-js", "lpo-hellinger", "lpo-tv", "lpo-alpha0.5", "lpo-alpha2")
RESEARCH_SCHEDULES = ("lpo-fwd2rev-step", "lpo-fwd2rev-entropy")
RESEARCH_TAU = ("lpo-fwd-tau0.5", "lpo-fwd-tau2")
RESEARCH_REPLAY = ("lpo-fwd-replay",)
RESEARCH_K = (4, 8)
# tripsum's policy barely moves at the demo's lr 1e-4 in 40 steps (held-out Pass@1 0.176 -> 0.193 for LPO-fwd
# at K=8 in a pilot): the research suite trains 3x faster by default
RESEARCH_LR = 3e-4
RESEARCH_K_ONLY = 8  # schedules, tau scale and replay run at this K


ENTROPY_METHOD = "lpo-fwd2rev-entropy"


def auto_switch_entropy(fwd_runs: Dict[int, List[Dict]], n: int = 3) -> float:
    """Halfway between LPO-fwd's mean response entropy over its first ``n`` and its last ``n`` steps
    (means over seeds): the entropy switch then fires about mid-run, if the run's entropy falls like fwd's."""
    from openrlhf_lpo.demo.report import training_rows

    heads, tails = [], []
    for rows in fwd_runs.values():
        train = training_rows(rows)
        if len(train) < 2 * n:
            raise ValueError(f"auto entropy threshold: an LPO-fwd run has {len(train)} steps, need >= {2 * n}")
        heads.append(statistics.mean(r["entropy"] for r in train[:n]))
        tails.append(statistics.mean(r["entropy"] for r in train[-n:]))
    return (statistics.mean(heads) + statistics.mean(tails)) / 2


def research_grid(ks: Sequence[int]) -> List[Tuple[str, int]]:
    """(method, K) of the research suite: the family at every K, the rest at K = 8 (if asked for)."""
    grid = [(m, k) for k in ks for m in RESEARCH_FAMILY]
    if RESEARCH_K_ONLY in ks:
        grid += [(m, RESEARCH_K_ONLY) for m in RESEARCH_SCHEDULES + RESEARCH_TAU + RESEARCH_REPLAY]
    return grid


def research_contrasts(ks: Sequence[int]) -> List[Tuple[str, str, int]]:
    """(method, reference, K) pairs whose per-seed differences the research suite reports."""
    out = [(m, "lpo-fwd", k) for k in ks for m in RESEARCH_FAMILY if m not in ("grpo", "lpo-fwd")]
    out += [(m, "grpo", k) for k in ks for m in ("lpo-fwd", "lpo-rev")]
    if RESEARCH_K_ONLY in ks:
        k = RESEARCH_K_ONLY
        out += [(m, ref, k) for m in RESEARCH_SCHEDULES for ref in ("lpo-fwd", "lpo-rev")]
        out += [(m, "lpo-fwd", k) for m in RESEARCH_TAU]
        out += [(m, ref, k) for m in RESEARCH_REPLAY for ref in ("lpo-fwd", "grpo")]
    return out


CONTRAST_METRICS = ("reward_final", "heldout_pass@1", "heldout_pass@4", "heldout_pass@16", "heldout_distinct_correct",
                    "entropy_final", "grad_norm_mean")


def contrast_differences(runs: Dict[Job, List[Dict]], contrasts, seeds, window: int) -> Dict:
    """Per contrast: the paired difference (method minus reference, same seeds) of each metric."""
    from openrlhf_lpo.compare.stats import paired_ci

    summ = {job: run_summary(rows, window) for job, rows in runs.items()}
    out = {}
    for m, ref, k in contrasts:
        both = [s for s in seeds if (m, k, s) in summ and (ref, k, s) in summ]
        if not both:
            continue
        d = {}
        for key in CONTRAST_METRICS:
            a = [summ[(m, k, s)].get(key) for s in both]
            b = [summ[(ref, k, s)].get(key) for s in both]
            if all(v is not None for v in a + b):
                ci = paired_ci(a, b)
                d[key] = {"mean": ci.mean, "ci95": ci.half, "n": ci.n}
        out[f"{m}|{ref}|{k}"] = d
    return out


def format_contrasts(diffs: Dict) -> str:
    short = dict(TABLE_METRICS)
    rows = [["method", "vs", "K"] + [short[k] for k in CONTRAST_METRICS]]
    for name, d in diffs.items():
        m, ref, k = name.split("|")
        vals = []
        for key in CONTRAST_METRICS:
            v = d.get(key)
            if not v or v["n"] == 0:
                vals.append("-")
                continue
            sig = "*" if not math.isnan(v["ci95"]) and abs(v["mean"]) > v["ci95"] else " "
            vals.append(f"{v['mean']:+.3f}+-{v['ci95']:.3f}{sig}")
        rows.append([m, ref, k] + vals)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["Paired differences of the research contrasts (method minus reference on the same seeds, mean +- 95% "
             "CI; * = the interval excludes 0):"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def _curves(runs: Dict[Job, List[Dict]], method: str, k: int, seeds, key: str, x_key: str = "step"):
    """Mean and 95% CI over seeds of ``key`` at each x (rows that have it)."""
    from openrlhf_lpo.compare.summary import curve

    return curve({s: runs.get((method, k, s), []) for s in seeds}, key, x_key)


def _cell_points(agg: Dict, methods_x, k: int, key: str):
    """x, mean and 95% half-width of ``key`` for each (method, x) with data at K = k."""
    xs, ys, es = [], [], []
    for m, x in methods_x:
        v = agg["cells"].get(f"{m}|{k}", {}).get(key)
        if v and v["n"]:
            xs.append(x)
            ys.append(v["mean"])
            es.append(0.0 if math.isnan(v["ci95"]) else v["ci95"])
    return xs, ys, es


def _band(ax, xs, ys, es, color, label, marker="o"):
    """A mean curve with its 95% band."""
    from openrlhf_lpo.compare.report import band

    band(ax, xs, ys, es, color, label, marker)


def _style(ax, title: str, legend: bool, xlabel: Optional[str] = None):
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def _save(fig, out_png: Path) -> Path:
    from openrlhf_lpo.compare.report import save_figure

    return save_figure(fig, out_png)


def plot_research(agg: Dict, runs: Dict[Job, List[Dict]], ks: Sequence[int], seeds, out_dir: Path, title: str):
    """The research suite's four figures (divergences, schedules, tau scale, replay); returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from openrlhf_lpo.demo.methods import METHODS

    out_dir = Path(out_dir)
    keys = (("heldout_pass@1", "held-out Pass@1"), ("heldout_pass@4", "held-out Pass@4"),
            ("heldout_pass@16", "held-out Pass@16"), ("heldout_distinct_correct", "distinct correct / prompt"),
            ("entropy_final", "response entropy (last 5 steps)"))
    paths = []
    # 1. the divergence family at each K (final values, 95% CI)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.0 * len(keys), 3.8), squeeze=False)
    for col, (key, label) in enumerate(keys):
        ax = axes[0][col]
        for j, k in enumerate(ks):
            xs, ys, es = _cell_points(agg, [(m, i + (j - (len(ks) - 1) / 2) * 0.18) for i, m in
                                            enumerate(RESEARCH_FAMILY)], k, key)
            ax.errorbar(xs, ys, yerr=es, fmt="o", capsize=3, label=f"K={k}")
        ax.set_xticks(range(len(RESEARCH_FAMILY)))
        ax.set_xticklabels([m.replace("lpo-", "") for m in RESEARCH_FAMILY], rotation=60, fontsize=8)
        _style(ax, label, col == 0)
    fig.suptitle(f"divergence family at step end ({title})", fontsize=10)
    paths.append(_save(fig, out_dir / "divergences.png"))
    k8 = RESEARCH_K_ONLY
    if k8 not in ks:
        return paths
    # 2. schedules: held-out metrics and entropy against the step
    curves = (("heldout_pass@1", "held-out Pass@1"), ("heldout_pass@16", "held-out Pass@16"),
              ("heldout_distinct_correct", "distinct correct / prompt"), ("entropy", "response entropy (training)"))
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), squeeze=False)
    for col, (key, label) in enumerate(curves):
        ax = axes[0][col]
        for m in ("lpo-fwd", "lpo-rev") + RESEARCH_SCHEDULES:
            xs, ys, es = _curves(runs, m, k8, seeds, key)
            if xs:
                _band(ax, xs, ys, es, METHODS[m].color, m, "o" if key.startswith("heldout") else None)
        ax.axvline(20, color="grey", linestyle=":", linewidth=1)
        _style(ax, label, col == 0, "RL step")
    fig.suptitle(f"forward -> reverse KL by step (@20, dotted) and by entropy, K={k8} ({title})", fontsize=10)
    paths.append(_save(fig, out_dir / "schedules.png"))
    # 3. tau scale
    fig, axes = plt.subplots(1, len(keys), figsize=(4.0 * len(keys), 3.4), squeeze=False)
    scales = (("lpo-fwd-tau0.5", 0.5), ("lpo-fwd", 1.0), ("lpo-fwd-tau2", 2.0))
    for col, (key, label) in enumerate(keys):
        ax = axes[0][col]
        xs, ys, es = _cell_points(agg, scales, k8, key)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color="C0", label="LPO-fwd")
        g = agg["cells"].get(f"grpo|{k8}", {}).get(key)
        if g and g["n"]:
            ax.axhline(g["mean"], color="C3", linestyle="--", linewidth=1, label="GRPO (tau = std)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([0.5, 1, 2])
        ax.set_xticklabels(["0.5", "1", "2"])
        _style(ax, label, col == 0, "tau scale (x group std)")
    fig.suptitle(f"--lpo.temperature_scale, K={k8} ({title})", fontsize=10)
    paths.append(_save(fig, out_dir / "tau_scale.png"))
    # 4. replay against the fresh rollouts generated
    curves = (("heldout_pass@1", "held-out Pass@1"), ("heldout_distinct_correct", "distinct correct / prompt"),
              ("heldout_pass@16", "held-out Pass@16"))
    fig, axes = plt.subplots(1, len(curves), figsize=(4.4 * len(curves), 3.6), squeeze=False)
    for col, (key, label) in enumerate(curves):
        ax = axes[0][col]
        for m in ("lpo-fwd", "lpo-fwd-replay", "grpo"):
            xs, ys, es = _curves(runs, m, k8, seeds, key, x_key="fresh_rollouts")
            if xs:
                _band(ax, xs, ys, es, METHODS[m].color, m)
        _style(ax, label, col == 0, "fresh rollouts generated")
    rm = METHODS["lpo-fwd-replay"]
    fig.suptitle(f"listwise replay (last {rm.replay_batches} batches, {rm.replay_ratio:g} replayed group per fresh "
                 f"group, |s_t| <= {rm.replay_max_abs_s:g}), K={k8} ({title})", fontsize=10)
    paths.append(_save(fig, out_dir / "replay.png"))
    return paths


# ----------------------------------------------------------------------------- running


def job_config(base, k: int, seed: int) -> Dict:
    """A run's RLConfig as JSON has it (tuples become lists), as its done-file stores it."""
    return json.loads(json.dumps(dataclasses.asdict(dataclasses.replace(base, k=k, seed=seed))))


def finished(done_path: Path, cfg: Dict, switch_entropy: Optional[float]) -> Optional[Dict]:
    """The done-file of a finished run with these settings (kept on a rerun), else None."""
    if not done_path.exists():
        return None
    prev = json.loads(done_path.read_text())
    return prev if prev.get("config") == cfg and prev.get("switch_entropy") == switch_entropy else None


def _run_job(spec: Dict) -> Dict:
    """One (method, K, seed) run in a worker process; writes its metrics and a done-file."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from openrlhf_lpo.demo.cli import _quiet_libraries
    from openrlhf_lpo.demo.loop import RLConfig, run_inprocess
    from openrlhf_lpo.demo.methods import METHODS
    from openrlhf_lpo.demo.report import MetricsWriter, atomic_write_json

    _quiet_libraries()
    torch.set_num_threads(1)
    cfg = RLConfig(**spec["config"])
    out = Path(spec["out"])
    method = METHODS[spec["method"]]
    if spec.get("switch_entropy") is not None:
        method = dataclasses.replace(method, switch_entropy=spec["switch_entropy"])
    t0, c0 = time.time(), time.process_time()
    # a rerun rewrites the metrics: its old done-file goes first, so a stop halfway leaves no done-file
    (out / "metrics" / f"{spec['name']}.done.json").unlink(missing_ok=True)
    writer = MetricsWriter(out / "metrics" / f"{spec['name']}.jsonl")
    try:
        run_inprocess(method, cfg, spec["model"], on_row=writer, progress=False,
                      start_eval=spec["start_eval"])
    finally:
        writer.close()
    done = {"name": spec["name"], "config": spec["config"], "switch_entropy": spec.get("switch_entropy"),
            "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0}
    atomic_write_json(out / "metrics" / f"{spec['name']}.done.json", done)
    return done


def _start_eval(out: Path, model: str, cfg, seed: int) -> Dict:
    """Held-out metrics of the warm-up for one seed's sampling (shared by every run of the seed)."""
    from openrlhf_lpo.demo.heldout import evaluate_checkpoint
    from openrlhf_lpo.demo.report import atomic_write_json
    from openrlhf_lpo.demo.task import get_task

    path = out / f"start-seed{seed}.json"
    hcfg = dataclasses.replace(cfg, seed=seed).heldout()
    key = {"model": model, "heldout": dataclasses.asdict(hcfg)}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["metrics"]
    metrics = evaluate_checkpoint(model, get_task(cfg.task), hcfg)
    atomic_write_json(path, {"key": key, "metrics": metrics})
    return metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("paper", "research", "baselines"), default="paper",
                   help="paper: --methods x --ks (default grid); research: the issue-25 grid (module docstring); "
                        f"baselines: --methods default {BASELINE_METHODS}")
    p.add_argument("--methods", default=None, help=f"paper / baselines suite (default {DEFAULT_METHODS})")
    p.add_argument("--ks", default=None, help="comma-separated group sizes K (default 2,4,8; research: 4,8)")
    p.add_argument("--switch-entropy", type=float, default=None,
                   help="research: the threshold of lpo-fwd2rev-entropy (default: auto, halfway between LPO-fwd's "
                        "mean response entropy over its first and its last 3 steps, measured in this grid)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated RL seeds")
    p.add_argument("--task", default=None, help="demo task (default pairsum; research: tripsum)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--lr", type=float, help="RL learning rate (default: the preset's; research: 3e-4)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--preset", default="cpu-demo", help="warm-up and RL defaults come from this lpo-demo preset")
    p.add_argument("--threshold", type=float, help="reward threshold for steps-to-threshold "
                                                   "(default: the paired baseline's mean final reward per K)")
    p.add_argument("--out", default=None, help="output directory (default runs/toy-bench-<time>); rerun to resume")
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one CPU thread each)")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from openrlhf_lpo.demo.cli import _quiet_libraries
    from openrlhf_lpo.demo.methods import parse_methods
    from openrlhf_lpo.demo.presets import get_preset
    from openrlhf_lpo.demo.report import atomic_write_json, atomic_write_text, read_metrics
    from openrlhf_lpo.demo.warmup import ensure_warmup

    _quiet_libraries()
    research = args.suite == "research"
    if research and args.methods:
        p.error("--methods applies to --suite paper; the research suite's methods are fixed (module docstring)")
    try:
        ks = [int(x) for x in (args.ks or ("4,8" if research else "2,4,8")).split(",") if x.strip()]
        if research:
            grid = research_grid(ks)
            methods = list(dict.fromkeys(m for m, _ in grid))
        else:
            default = BASELINE_METHODS if args.suite == "baselines" else DEFAULT_METHODS
            methods = [m.name for m in parse_methods(args.methods or default)]
            grid = [(m, k) for k in ks for m in methods]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        preset = get_preset(args.preset)
        wu, base = preset.for_task(args.task or ("tripsum" if research else "pairsum"))
    except ValueError as e:
        p.error(str(e))
    if not ks or not seeds:
        p.error("--ks and --seeds must each name at least one value")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    over = dict(steps=args.steps, prompts_per_step=args.prompts_per_step, eval_every=args.eval_every,
                eval_prompts=args.eval_prompts, eval_samples=args.eval_samples, threads=1)
    if args.lr is not None or research:
        over["lr"] = args.lr if args.lr is not None else RESEARCH_LR
    base = dataclasses.replace(base, **over)
    try:
        for k in ks:
            dataclasses.replace(base, k=k).validate()
        base.heldout().validate()
    except ValueError as e:
        p.error(str(e))
    out = Path(args.out or Path("runs") / time.strftime("toy-bench-%Y%m%d-%H%M%S"))
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    t0, c0 = time.time(), time.process_time()
    warm = ensure_warmup(wu, progress=not args.no_progress)
    print(f"[bench] warm-up {'cached' if warm['cached'] else 'trained'}: {warm['path']} "
          f"({warm['steps']} SFT steps, sampled accuracy {warm['sampled_accuracy']:.2f})", flush=True)
    start = {s: _start_eval(out, warm["path"], base, s) for s in seeds}

    done: Dict[str, Dict] = {}

    def collect(pairs, switch_entropy):
        specs = []
        for seed in seeds:
            for m, k in pairs:
                cfg = job_config(base, k, seed)
                name = job_name(m, k, seed)
                entropy = switch_entropy if m == ENTROPY_METHOD else None
                prev = finished(out / "metrics" / f"{name}.done.json", cfg, entropy)
                if prev is not None:
                    done[name] = prev
                    continue
                specs.append({"name": name, "method": m, "config": cfg, "model": warm["path"], "out": str(out),
                              "start_eval": start[seed], "switch_entropy": entropy})
        return specs

    def execute(specs):
        if not specs:
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_job, s): s["name"] for s in specs}
            for i, fut in enumerate(as_completed(futures), 1):
                info = fut.result()
                done[info["name"]] = info
                print(f"[bench] {i}/{len(specs)} {info['name']}: {info['wall_s']:.0f}s wall, "
                      f"{info['cpu_s']:.0f}s CPU", flush=True)

    # the entropy switch's threshold ("auto"): halfway along LPO-fwd's own entropy drop at that K, measured
    # on this grid's LPO-fwd runs, so those run first
    later = [(m, k) for m, k in grid if m == ENTROPY_METHOD]
    first = [(m, k) for m, k in grid if m != ENTROPY_METHOD]
    specs = collect(first, None)
    print(f"[bench] {len(specs) + len(later) * len(seeds)} runs to do (at most), {len(done)} kept from an earlier "
          f"run in {out}", flush=True)
    execute(specs)
    switch_entropy = args.switch_entropy
    if later:
        if switch_entropy is None:
            switch_entropy = auto_switch_entropy(
                {s: read_metrics(out / "metrics" / f"{job_name('lpo-fwd', later[0][1], s)}.jsonl") for s in seeds})
            print(f"[bench] entropy switch threshold (auto): {switch_entropy:.4f}", flush=True)
        execute(collect(later, switch_entropy))

    runs = {(m, k, s): read_metrics(out / "metrics" / f"{job_name(m, k, s)}.jsonl")
            for s in seeds for m, k in grid}
    cells_checked = check_pairing(runs)
    agg = aggregate(runs, methods, ks, seeds, args.window, args.threshold)
    if research:
        agg["contrasts"] = contrast_differences(runs, research_contrasts(ks), seeds, args.window)
    wall, cpu = time.time() - t0, time.process_time() - c0
    job_cpu = sum(d.get("cpu_s", 0.0) for d in done.values())
    header = (f"toy benchmark: task {base.task}, K in {ks}, {base.prompts_per_step} prompts/step, {base.steps} steps, "
              f"lr {base.lr}, {base.mini_batches} optimizer steps per rollout, seeds {seeds}; held-out: "
              f"{base.eval_prompts} problems x {base.eval_samples} samples\n"
              f"warm-up: {warm['steps']} SFT steps, sampled accuracy {warm['sampled_accuracy']:.3f}; "
              f"held-out start (seed {seeds[0]}): " + ", ".join(f"{k.replace('heldout_', '')} {v:.3f}"
                                                                 for k, v in start[seeds[0]].items()) + "\n"
              f"pairing checked: {cells_checked} (seed, K) cells, same prompts at every step and same rollouts at "
              f"step 1 for every method\n"
              f"backend: in-process loop (same openrlhf_lpo.listwise loss as lpo-train, not the Ray pipeline)\n"
              f"wall time {wall:.0f}s for this invocation; CPU time of all {len(done)} runs {job_cpu:.0f}s "
              f"(+{cpu:.0f}s in the driver)\n")
    if research and later:
        header += f"entropy switch of {ENTROPY_METHOD}: threshold {switch_entropy:.4f} (3-step running mean)\n"
    text = header + "\n" + format_tables(agg, methods, ks)
    if research:
        text += "\n" + format_contrasts(agg["contrasts"])
    result = {"config": dataclasses.asdict(base), "methods": methods, "ks": ks, "seeds": seeds,
              "warmup": {k: v for k, v in warm.items() if k != "history"}, "start_eval": start,
              "pairing_cells_checked": cells_checked, "wall_s": wall, "runs_cpu_s": job_cpu,
              "switch_entropy": switch_entropy if research else None, **agg}
    atomic_write_json(out / "benchmark.json", result)
    atomic_write_text(out / "benchmark.txt", text)
    if research:
        pngs = plot_research(agg, runs, ks, seeds, out, f"{base.task}, {len(seeds)} seeds, {base.steps} steps, "
                                                        f"{base.prompts_per_step} prompts/step; 95% CI")
    else:
        pngs = [plot_group_size(agg, methods, ks, out / "group_size.png",
                                f"toy group-size sweep ({base.task}, {len(seeds)} seeds, {base.steps} steps, "
                                f"{base.prompts_per_step} prompts/step; 95% CI)")]
    print(text, end="")
    print(f"[bench] written to {out} ({', '.join(p.name for p in pngs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
