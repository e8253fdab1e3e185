"""Uncertainty: the standard error of Pass@k against numpy on brute-force Pass@k, the paired bootstrap
against the exact bootstrap distribution (every resample enumerated), and both in `report` / `compare`."""

import itertools
import json
import math
import random

import numpy as np
import pytest

from evaluation.cli import main
from evaluation.generate import GenOptions
from evaluation.launch import generate
from evaluation.score import compute_metrics, score
from evaluation.stats import bootstrap_means, combined_stderr, mean_stderr, paired_bootstrap


def _brute_pass_at_k(row: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(row, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_passk_stderr_is_the_standard_error_of_the_per_problem_mean():
    rng = random.Random(3)
    n, problems = 6, 9
    correct = [[rng.random() < p for _ in range(n)] for p in (0.0, 0.1, 0.3, 0.5, 0.5, 0.7, 0.9, 1.0, 0.2)]
    rows = [{"problem_id": str(p), "sample_idx": j, "correct": c, "n_tokens": 5, "finish_reason": "stop",
             "grader_status": "ok"} for p in range(problems) for j, c in enumerate(correct[p])]
    cfg = {"n": n, "k": 4, "checkpoint": "c", "benchmark": "b", "group": "math", "config_sha": "x",
           "sampling": {"max_tokens": 9}}
    m = compute_metrics(cfg, rows, "sha", {})
    for k in range(1, n + 1):
        per_problem = np.array([_brute_pass_at_k(r, k) for r in correct])
        assert m["pass@k"][str(k)] == pytest.approx(per_problem.mean(), abs=1e-12)
        want = per_problem.std(ddof=1) / math.sqrt(problems)
        assert m["pass@k_stderr"][str(k)] == pytest.approx(want, rel=1e-12), k
    assert m["pass@1_stderr"] == m["pass@k_stderr"]["1"] > 0
    assert mean_stderr([0.5]) is None and combined_stderr([0.03, 0.04]) == pytest.approx(0.025)


def _exact_bootstrap(d: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Every one of the P^P equally likely resamples: (distinct means, their probabilities)."""
    means = np.array([np.mean(s) for s in itertools.product(d, repeat=len(d))])
    values, counts = np.unique(np.round(means, 12), return_counts=True)
    return values, counts / counts.sum()


def test_paired_bootstrap_matches_the_exact_bootstrap_distribution():
    a = [0.25, 0.5, 0.0, 1.0, 0.75, 0.5]
    b = [0.75, 0.5, 0.25, 1.0, 1.0, 0.0]
    d = [y - x for x, y in zip(a, b)]
    delta = float(np.mean(d))
    values, probs = _exact_bootstrap(d)
    cdf = np.cumsum(probs)
    exact_p = float(probs[np.abs(values - delta) >= abs(delta) - 1e-12].sum())
    exact_sd = math.sqrt(float(((values - (values * probs).sum()) ** 2 * probs).sum()))
    assert exact_sd == pytest.approx(np.std(d) / math.sqrt(len(d)))  # bootstrap variance: the ddof-0 variance / P
    t = paired_bootstrap(a, b, resamples=40000, seed=0)
    assert t["delta"] == pytest.approx(delta) and t["problems"] == 6
    assert t["stderr"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(len(d)))
    assert t["p"] == pytest.approx(exact_p, abs=0.01)  # Monte-Carlo error ~0.0025
    for q, end in ((0.025, t["ci"][0]), (0.975, t["ci"][1])):
        below = float(probs[values < end - 1e-9].sum())  # the exact distribution's mass below and at the end point
        at_or_below = float(probs[values <= end + 1e-9].sum())
        assert below <= q + 0.01 and at_or_below >= q - 0.01, (q, end)
    assert float(np.std(bootstrap_means(d, 40000, 0))) == pytest.approx(exact_sd, rel=0.02)
    assert cdf[-1] == pytest.approx(1.0)
    # reproducible from the seed; no difference at all -> [0, 0] and p = 1; B better everywhere -> p = 1/(R+1)
    assert paired_bootstrap(a, b, 2000, seed=5) == paired_bootstrap(a, b, 2000, seed=5)
    same = paired_bootstrap(a, a, 500)
    assert same["ci"] == [0.0, 0.0] and same["p"] == 1.0
    assert paired_bootstrap([0.0] * 8, [0.5, 1.0] * 4, 999)["p"] == pytest.approx(1 / 1000)
    with pytest.raises(ValueError, match="same problems"):
        paired_bootstrap([0.1], [0.1, 0.2])


@pytest.fixture(scope="module")
def two_ckpts(tmp_path_factory, tiny_ckpt, planted):
    """Two checkpoints of one run answering 16 planted problems (n = 4), B right more often than A."""
    import shutil

    root = tmp_path_factory.mktemp("stats")
    rng = random.Random(7)
    texts = {str(g): [f"\\boxed{{{g if rng.random() < 0.6 else g + 1}}}" for _ in range(4)] for g in range(10, 26)}
    data = planted.make(root, texts)
    for step in (10, 20):
        shutil.copytree(tiny_ckpt, root / "run" / "ckpt" / f"global_step{step}_hf")
    out = root / "runs"
    opts = dict(benchmarks=["planted"], data={"planted": str(data)}, engine="planted-test", n={"*": 4}, k={"*": 2},
                progress=False, max_tokens=32, template="none")
    generate([str(root / "run" / "ckpt" / "global_step10_hf")], GenOptions(out=str(out), **opts))
    # step 20: the first three samples of each problem right, the fourth as at step 10
    planted.plan = {p: [f"\\boxed{{{10 + int(p)}}}"] * 3 + [ts[3]] for p, ts in planted.plan.items()}
    generate([str(root / "run" / "ckpt" / "global_step20_hf")], GenOptions(out=str(out), **opts))
    score(out, workers=1, timeout=20, show_progress=False, budgets=())
    return out


def _per_problem(out, step: str, k: int = 1) -> list[float]:
    (f,) = out.glob(f"*{step}_hf-*/planted-*/samples.jsonl")
    acc: dict[str, list[bool]] = {}
    for r in map(json.loads, f.read_text().splitlines()):
        acc.setdefault(r["problem_id"], []).append(r["correct"])
    return [_brute_pass_at_k(v, k) for _, v in sorted(acc.items(), key=lambda x: int(x[0]))]


def test_report_shows_each_score_with_its_standard_error(two_ckpts, capsys):
    out = two_ckpts
    assert main(["report", "--runs", str(out), "--no-plots"]) == 0
    md = (out / "summary.md").read_text()
    for step in ("step10", "step20"):
        x = np.array(_per_problem(out, step))
        cell = f"{100 * x.mean():.1f} ± {100 * x.std(ddof=1) / math.sqrt(len(x)):.1f}"
        line = next(row for row in md.splitlines() if f"global_{step}_hf-" in row and "±" in row)
        assert f"| {cell} |" in line, (line, cell)
        x2 = np.array(_per_problem(out, step, k=2))
        cell2 = f"{100 * x2.mean():.1f} ± {100 * x2.std(ddof=1) / math.sqrt(len(x2)):.1f}"
        assert any(f"| {cell2} |" in row for row in md.splitlines() if f"global_{step}_hf-" in row), cell2
    csv = (out / "summary.csv").read_text().splitlines()
    assert "planted/pass@1_se" in csv[0].split(",") and "planted/pass@2_se" in csv[0].split(",")


def test_compare_gives_the_paired_interval_of_the_difference(two_ckpts, capsys):
    out = two_ckpts
    assert main(["compare", "--runs", str(out), "--a", "step10", "--b", "step20", "--bootstrap", "5000"]) == 0
    md = capsys.readouterr().out
    a, b = _per_problem(out, "step10"), _per_problem(out, "step20")
    t = paired_bootstrap(a, b, 5000, seed=0)
    assert t["delta"] > 0
    want = f"{100 * t['delta']:+.1f} [{100 * t['ci'][0]:+.1f}, {100 * t['ci'][1]:+.1f}] | {t['p']:.2g} |"
    assert want in md
    a2, b2 = _per_problem(out, "step10", 2), _per_problem(out, "step20", 2)
    t2 = paired_bootstrap(a2, b2, 5000, seed=0)
    assert f"| planted | 2 | {100 * np.mean(a2):.1f} | {100 * np.mean(b2):.1f} | {100 * t2['delta']:+.1f} [" in md
    assert "5000 resamples, seed 0" in md
