"""Held-out metrics (Pass@k, distinct correct answers, coverage) and the benchmark's seed statistics,
against brute force and independent numerics."""

import itertools
import math
import random

import pytest
import torch

from openrlhf_lpo.demo.heldout import HeldoutConfig, evaluate_heldout, heldout_problems, summarize_samples
from openrlhf_lpo.compare.stats import mean_ci, paired_ci, t975
from openrlhf_lpo.demo.task import get_task


def test_summarize_samples_against_subset_enumeration():
    task = get_task("pairsum")
    rng = random.Random(0)
    problems = task.problems(12, seed=3, split="heldout")
    n = 6
    answers = []
    for _, label in problems:
        sols = list(task.solutions(label))
        answers.append([rng.choice(sols + ["9+9", "1+1", ""]) for _ in range(n)])
    got = summarize_samples(task, problems, answers, ks=(1, 2, 4, 6))
    for k in (1, 2, 4, 6):
        # Pass@k = probability that a uniformly random k-subset of the n samples holds a correct one
        per = []
        for (_, label), row in zip(problems, answers):
            subsets = list(itertools.combinations(range(n), k))
            per.append(sum(any(task.is_correct(row[i], label) for i in s) for s in subsets) / len(subsets))
        assert got[f"heldout_pass@{k}"] == pytest.approx(sum(per) / len(per), abs=1e-12)
    distinct = [len({a for a in row if task.is_correct(a, label)}) for (_, label), row in zip(problems, answers)]
    assert got["heldout_distinct_correct"] == pytest.approx(sum(distinct) / len(distinct))
    assert got["heldout_coverage"] == pytest.approx(sum(d / 4 for d in distinct) / len(distinct))


def test_summarize_samples_collapse_vs_spread():
    """Same accuracy, different diversity: one answer repeated vs all four answers."""
    task = get_task("pairsum")
    problems = task.problems(3, seed=0, split="heldout")
    collapsed = [[task.solutions(lab)[0]] * 8 for _, lab in problems]
    spread = [list(task.solutions(lab)) * 2 for _, lab in problems]
    a = summarize_samples(task, problems, collapsed, (1, 8))
    b = summarize_samples(task, problems, spread, (1, 8))
    assert a["heldout_pass@1"] == b["heldout_pass@1"] == 1.0
    assert (a["heldout_distinct_correct"], b["heldout_distinct_correct"]) == (1.0, 4.0)
    assert (a["heldout_coverage"], b["heldout_coverage"]) == (0.25, 1.0)


def test_heldout_problems_are_fixed_and_heldout():
    task = get_task("pairsum")
    p = heldout_problems(task, 20)
    assert p == heldout_problems(task, 20) and all(task.split_of(lab) == "heldout" for _, lab in p)


def test_heldout_config_rejects_k_above_samples():
    with pytest.raises(ValueError, match="--eval-samples"):
        HeldoutConfig(samples=4, ks=(1, 8)).validate()


def test_evaluate_heldout_is_seeded_and_leaves_training_rng_alone(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_lpo.testing.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", seed=2, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            head_dim=16, intermediate_size=64)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()  # the evaluation switches to eval mode and back
    cfg = HeldoutConfig(prompts=6, samples=4, ks=(1, 4), seed=5)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = evaluate_heldout(model, tok, get_task("pairsum"), cfg)
    assert torch.equal(torch.get_rng_state(), before)
    b = evaluate_heldout(model, tok, get_task("pairsum"), cfg)
    assert a == b and set(a) == {"heldout_pass@1", "heldout_pass@4", "heldout_distinct_correct",
                                 "heldout_coverage", "heldout_greedy"}
    assert 0.0 <= a["heldout_pass@1"] <= a["heldout_pass@4"] <= 1.0 and model.training


def _t_cdf(q, df, steps=20000):
    """P(T <= q) for Student's t by Simpson integration of its density (independent of the table)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = q / steps
    s = f(0) + f(q) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


@pytest.mark.parametrize("df", [2, 3, 4, 5, 8, 14, 30])
def test_t975_is_the_975_quantile(df):
    assert _t_cdf(t975(df), df) == pytest.approx(0.975, abs=2e-6)


def test_mean_ci_and_paired_ci_values():
    xs = [0.61, 0.70, 0.66, 0.58, 0.74]
    m = sum(xs) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 4)
    ci = mean_ci(xs + [None, float("nan")])
    assert ci.n == 5 and ci.mean == pytest.approx(m) and ci.half == pytest.approx(2.776445 * sd / math.sqrt(5))
    assert mean_ci([]).n == 0 and math.isnan(mean_ci([0.3]).half)
    ys = [x - 0.05 + 0.01 * i for i, x in enumerate(xs)]
    d = paired_ci(xs, ys)
    diffs = [x - y for x, y in zip(xs, ys)]
    assert d.mean == pytest.approx(sum(diffs) / 5) and d.half == pytest.approx(mean_ci(diffs).half)
    assert d.half < mean_ci(xs).half  # pairing removes the shared seed variation
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ci([1.0], [1.0, 2.0])
