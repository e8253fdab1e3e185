"""Metrics files, summary statistics and the comparison PNG of a demo run directory."""

import json
import math
import struct

import pytest

from openrlhf_lpo.demo.report import (MetricsWriter, ema, load_run, merge_step_metrics, method_stats, plot_run,
                                      read_metrics, steps_to_reach, summarize)


def _rows(method, rewards):
    return [{"method": method, "step": i + 1, "reward": r, "entropy": 1.0 - 0.01 * i, "grad_norm": 0.5,
             "kl_target": 0.1 / (i + 1), "elapsed_s": float(i + 1)} for i, r in enumerate(rewards)]


def test_writer_appends_and_reader_ignores_torn_line(tmp_path):
    w = MetricsWriter(tmp_path / "m" / "a.jsonl")
    for row in _rows("a", [0.1, 0.2, 0.3]):
        w(row)
    w.close()
    with open(tmp_path / "m" / "a.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # a writer killed mid-line
    rows = read_metrics(tmp_path / "m" / "a.jsonl")
    assert [r["reward"] for r in rows] == [0.1, 0.2, 0.3]


def test_ema_matches_recurrence():
    xs = [1.0, 0.0, 2.0, 5.0]
    a = 0.3
    ref, acc = [], None
    for x in xs:
        acc = x if acc is None else a * x + (1 - a) * acc
        ref.append(acc)
    assert ema(xs, a) == pytest.approx(ref)


def _brute_steps_to_reach(rewards, thr, window):
    for i in range(len(rewards)):
        if i + 1 < min(window, len(rewards)):
            continue
        seg = rewards[max(0, i - window + 1): i + 1]
        if sum(seg) / len(seg) >= thr:
            return i + 1
    return None


@pytest.mark.parametrize("seed", range(20))
def test_steps_to_reach_against_brute_force(seed):
    import random

    rng = random.Random(seed)
    rewards = [rng.random() for _ in range(rng.randint(1, 30))]
    thr = rng.random()
    window = rng.randint(1, 6)
    assert steps_to_reach(_rows("x", rewards), thr, window) == _brute_steps_to_reach(rewards, thr, window)


def test_method_stats_values():
    rewards = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.9]
    s = method_stats(_rows("a", rewards), window=3)
    assert s["reward_start"] == pytest.approx(0.2)
    assert s["reward_final"] == pytest.approx((0.8 + 1.0 + 0.9) / 3)
    assert s["reward_peak"] == pytest.approx((0.8 + 1.0 + 0.9) / 3)
    assert s["kl_target_mean"] == pytest.approx(sum(0.1 / (i + 1) for i in range(7)) / 7)
    assert s["steps"] == 7


def test_summary_and_png(tmp_path):
    runs = {"lpo-fwd": _rows("lpo-fwd", [0.5, 0.6, 0.7, 0.8, 0.9, 0.95]),
            "grpo": _rows("grpo", [0.5, 0.55, 0.6, 0.65, 0.7, 0.7])}
    for name, rows in runs.items():
        w = MetricsWriter(tmp_path / "metrics" / f"{name}.jsonl")
        for r in rows:
            w(r)
        w.close()
    assert load_run(tmp_path) == {"grpo": runs["grpo"], "lpo-fwd": runs["lpo-fwd"]}
    # held-out rows: step 0 (the warm-up) and the last step, merged into the files
    for name, end in (("lpo-fwd", 0.8), ("grpo", 0.7)):
        merged = merge_step_metrics(tmp_path / "metrics" / f"{name}.jsonl", {
            0: {"heldout_pass@1": 0.4, "heldout_pass@4": 0.8, "heldout_distinct_correct": 3.0, "heldout_greedy": 0.5},
            6: {"heldout_pass@1": end, "heldout_pass@4": 0.9, "heldout_distinct_correct": 2.0, "heldout_greedy": end}})
        assert [r["step"] for r in merged] == [0, 1, 2, 3, 4, 5, 6]
        assert merged[-1]["reward"] == runs[name][-1]["reward"] and merged[-1]["heldout_pass@1"] == end
        assert merged[0] == {"method": name, "step": 0, "heldout_pass@1": 0.4, "heldout_pass@4": 0.8,
                             "heldout_distinct_correct": 3.0, "heldout_greedy": 0.5}
    runs = load_run(tmp_path)
    assert method_stats(runs["grpo"], window=2)["steps"] == 6  # the step-0 row is not an RL step
    text = summarize(runs, {"grpo": {"state": "failed", "error": "Ray did not start"}}, window=2)
    grpo_final = (0.7 + 0.7) / 2
    # lpo-fwd: 2-step means 0.55, 0.65 (step 3, < 0.7), 0.75 (step 4, >= 0.7); grpo at step 6
    assert f"steps to reach grpo's final reward ({grpo_final:.3f}): lpo-fwd 4, grpo 6" in text
    assert "lpo-fwd       pass@ 1: 0.400->0.800   4: 0.800->0.900  distinct 3.00->2.00" in text
    assert "greedy 0.700" in text
    assert "grpo: failed — Ray did not start" in text
    assert "WARNING" not in text
    png = plot_run(runs, tmp_path / "comparison.png", title="t")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 900 and height > 400
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[:2] == (height, width)
    assert not list(tmp_path.glob(".*tmp*")) and not list((tmp_path / "metrics").glob(".*tmp*"))


def test_summary_warns_when_no_group_was_informative():
    rows = [dict(r, informative_groups=0.0) for r in _rows("lpo-fwd", [0.0, 0.0, 0.0])]
    assert "WARNING lpo-fwd: no informative group" in summarize({"lpo-fwd": rows})
    rows = [dict(r, informative_groups=0.25) for r in _rows("lpo-fwd", [0.0, 0.1, 0.0])]
    assert "WARNING" not in summarize({"lpo-fwd": rows})
