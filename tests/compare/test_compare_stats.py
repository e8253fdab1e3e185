"""The study's numbers: per-run summaries, means with 95% t-intervals over seeds and paired differences, against
an independent computation (the t quantile from a numerically integrated density, float64 sums by hand, and a
coverage simulation); the table files and figures they are written to."""

import csv
import io
import json
import math
import random
import struct

import pytest

from openrlhf_lpo.compare.metrics import eval_columns, step_row
from openrlhf_lpo.compare.report import build_table, plot_study, table_csv, table_markdown, write_table
from openrlhf_lpo.compare.summary import aggregate, curve, paired_curve, run_summary


def _t_quantile(df: int, p: float = 0.975) -> float:
    """Student's t quantile by bisection on a Simpson-integrated density (no table, no library)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731

    def cdf(q, steps=4000):
        h = q / steps
        return 0.5 + (f(0) + f(q) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))) * h / 3

    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def _interval(xs):
    n = len(xs)
    m = math.fsum(xs) / n
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    return m, _t_quantile(n - 1) * sd / math.sqrt(n)


def _rows(method, seed, steps=6, evals=(0, 3, 6)):
    """Rows like the pipeline's: deterministic but irregular values per (method, seed, step)."""
    rng = random.Random(f"{method}-{seed}")
    rows = []
    for s in range(0, steps + 1):
        row = {"method": method, "step": s}
        if s:
            row.update(reward=rng.random(), entropy=0.5 + rng.random(), grad_norm=rng.uniform(0.1, 2.0),
                       response_length=rng.uniform(3, 9))
        if s in evals:
            p1 = rng.random() * 0.5
            row.update({"heldout_pass@1": p1, "heldout_pass@4": p1 + 0.3, "heldout_distinct_correct": 2.0 + s / 10})
        rows.append(row)
    return rows


def test_run_summary_follows_the_rules():
    rows = _rows("grpo", 0)
    rows[3].pop("entropy")  # a step that did not log it: left out, not a zero
    got = run_summary(rows, window=3)
    train = rows[1:]
    assert got["reward_final"] == pytest.approx(math.fsum(r["reward"] for r in train[-3:]) / 3, rel=1e-15)
    assert got["grad_norm_mean"] == pytest.approx(math.fsum(r["grad_norm"] for r in train) / 6, rel=1e-15)
    assert got["entropy_final"] == pytest.approx(math.fsum(r["entropy"] for r in train[-3:]) / 3, rel=1e-15)
    assert got["heldout_pass@4"] == rows[6]["heldout_pass@4"] and "informative_mean" not in got
    assert "entropy_final" not in run_summary([{k: v for k, v in r.items() if k != "entropy"} for r in rows], 3)


def test_aggregate_means_intervals_and_paired_differences_by_hand():
    methods, seeds = ["grpo", "lpo_fwd", "lpo_rev"], [0, 1, 2, 3]
    summ = {(m, s): run_summary(_rows(m, s), 2) for m in methods for s in seeds}
    del summ[("lpo_rev", 2)]  # an unfinished run: its pair is left out, the others stay
    agg = aggregate(summ, methods, seeds, lambda m: "grpo")
    for m in methods:
        have = [s for s in seeds if (m, s) in summ]
        vals = [summ[(m, s)]["reward_final"] for s in have]
        mean, half = _interval(vals)
        cell = agg["cells"][m]["reward_final"]
        assert cell["values"] == vals and cell["n"] == len(have)
        assert cell["mean"] == pytest.approx(mean, rel=1e-14) and cell["ci95"] == pytest.approx(half, rel=1e-5)
    for m in ("lpo_fwd", "lpo_rev"):
        d = agg["paired_differences"][m]
        both = [s for s in seeds if (m, s) in summ]
        assert d["baseline"] == "grpo" and d["seeds"] == both
        diffs = [summ[(m, s)]["heldout_pass@1"] - summ[("grpo", s)]["heldout_pass@1"] for s in both]
        mean, half = _interval(diffs)
        assert d["heldout_pass@1"]["values"] == pytest.approx(diffs, abs=0)
        assert d["heldout_pass@1"]["mean"] == pytest.approx(mean, rel=1e-12)
        assert d["heldout_pass@1"]["ci95"] == pytest.approx(half, rel=1e-5)
    assert "grpo" not in agg["paired_differences"]


def test_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    """The paired 95% interval over 3 seeds, with a seed effect shared by the pair: coverage 0.95 (a normal
    quantile instead of t(2) would give ~0.80; unpaired intervals would be wider than the seed noise)."""
    rng = random.Random(7)
    hits, trials, delta = 0, 4000, 0.3
    for _ in range(trials):
        summ = {}
        for s in range(3):
            shared = rng.gauss(0, 5.0)  # the seed's prompts and sampling: large, cancels in the pair
            summ[("a", s)] = {"x": shared + rng.gauss(0, 1)}
            summ[("b", s)] = {"x": shared + delta + rng.gauss(0, 1)}
        d = aggregate(summ, ["a", "b"], [0, 1, 2], lambda m: "a")["paired_differences"]["b"]["x"]
        hits += abs(d["mean"] - delta) <= d["ci95"]
    assert abs(hits / trials - 0.95) < 0.012, hits / trials  # binomial sd 0.0034


def test_curves_and_paired_curves_per_step():
    a = {0: _rows("lpo_fwd", 0), 1: _rows("lpo_fwd", 1)}
    b = {0: _rows("grpo", 0), 1: _rows("grpo", 1)}
    xs, ys, es = curve(a, "reward")
    assert xs == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    m, h = _interval([a[0][3]["reward"], a[1][3]["reward"]])
    assert ys[2] == pytest.approx(m) and es[2] == pytest.approx(h, rel=1e-5)
    xs, ys, es = paired_curve(a, b, "heldout_pass@1")
    assert xs == [0.0, 3.0, 6.0]
    diffs = [a[s][6]["heldout_pass@1"] - b[s][6]["heldout_pass@1"] for s in (0, 1)]
    assert ys[2] == pytest.approx(sum(diffs) / 2) and es[2] == pytest.approx(_interval(diffs)[1], rel=1e-5)


def test_table_files_and_figures(tmp_path):
    methods, seeds = ["grpo", "lpo_fwd"], [0, 1, 2]
    runs = {(m, s): _rows(m, s) for m in methods for s in seeds}
    table = build_table(runs, methods, seeds, window=2)
    assert table["keys"] == ["reward_final", "entropy_final", "grad_norm_mean", "response_length_final",
                             "heldout_pass@1", "heldout_pass@4"]
    paths = write_table(tmp_path, table, "t")
    md = paths["md"].read_text()
    d = table["paired_differences"]["lpo_fwd"]["reward_final"]
    assert f"{d['mean']:+.4g} ± {d['ci95']:.2g}" in md and "Paired differences against grpo" in md
    lines = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    row = next(r for r in lines if r["kind"] == "paired" and r["quantity"] == "reward_final")
    assert float(row["mean"]) == d["mean"] and float(row["low"]) == pytest.approx(d["mean"] - d["ci95"])
    assert [float(x) for x in row["values"].split(";")] == d["values"] and row["seeds"] == "0;1;2"
    assert json.loads(paths["json"].read_text())["cells"]["grpo"]["reward_final"]["n"] == 3
    assert table_csv(table) == paths["csv"].read_text() and table_markdown(table, "t") == md
    figs = plot_study(runs, methods, seeds, tmp_path, "t")
    for name in ("figure5", "paired"):
        png = figs[name].read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 1500
    # one seed (lpo-demo): no interval, the difference is the seed's own
    one = build_table({(m, 0): runs[(m, 0)] for m in methods}, methods, [0], window=2)
    d1 = one["paired_differences"]["lpo_fwd"]["reward_final"]
    assert d1["n"] == 1 and math.isnan(d1["ci95"]) and d1["values"] == [d1["mean"]]
    assert "nan" not in table_markdown(one)


def test_metric_rows_from_logged_keys():
    row = step_row("grpo", {"step": 3, "rollout/reward_mean": 0.5, "response_entropy": 0.7, "entropy_loss": 9.0,
                            "actor_grad_norm": float("nan"), "rollout/response_length_mean": 4.0,
                            "lpo/degenerate_frac": 0.25, "clip_ratio": 0.125, "policy_loss": -0.5})
    assert (row["step"], row["reward"], row["entropy"], row["response_length"]) == (3, 0.5, 0.7, 4.0)
    assert (row["clip_ratio"], row["loss"]) == (0.125, -0.5)
    assert step_row("grpo", {"step": 1, "entropy_loss": 9.0})["entropy"] == 9.0  # a log from before issue 42
    assert "grad_norm" not in row and row["informative_groups"] == 0.75 and row["upstream"]["entropy_loss"] == 9.0
    one = eval_columns({"eval_math_pass1": 0.4, "eval_math_pass8": 0.7, "eval_pass1": 0.4, "eval_math_maj8": 0.5})
    assert one == {"heldout_pass@1": 0.4, "heldout_pass@8": 0.7}
    two = eval_columns({"eval_pass1": 0.3, "eval_a_pass1": 0.2, "eval_a_pass4": 0.5, "eval_b_pass1": 0.4})
    assert two == {"heldout_pass@1": 0.3, "heldout_a_pass@1": 0.2, "heldout_a_pass@4": 0.5, "heldout_b_pass@1": 0.4}
