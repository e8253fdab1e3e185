"""Checks of a finished ``lpo-demo`` run directory, as plain functions so that other end-to-end tests
(a shared fixture that runs the demo once) can reuse them. Each raises AssertionError with the reason.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Dict, List

import pytest


def load_rows(run: Path, method: str) -> List[Dict]:
    return [json.loads(x) for x in (Path(run) / "metrics" / f"{method}.jsonl").read_text().splitlines()]


def check_layout(run: Path, methods: List[str]) -> Dict:
    """config/status/warmup/summary/plot exist and every method finished; returns the config."""
    run = Path(run)
    config = json.loads((run / "config.json").read_text())
    assert config["methods"] == methods
    status = json.loads((run / "status.json").read_text())
    assert {n: s["state"] for n, s in status.items()} == {m: "done" for m in methods}, status
    png = (run / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", png[16:24])
    assert w > 900 and h > 400
    summary = (run / "summary.txt").read_text()
    assert all(m in summary for m in methods) and "held-out (start -> end)" in summary
    assert "WARNING" not in summary, summary
    return config


def check_warmup(run: Path, min_accuracy: float) -> Dict:
    """The warm-up reached its target: RL starts from a policy that is right sometimes."""
    warm = json.loads((Path(run) / "warmup.json").read_text())
    assert warm["reached_target"] and warm["sampled_accuracy"] >= min_accuracy, warm
    return warm


def check_pipeline_rows(rows: List[Dict], name: str, k: int, g: int, steps: int) -> List[Dict]:
    """One row per RL step with the pipeline's metrics, consistent with G groups of K 0/1 rewards;
    returns the RL-step rows (the step-0 row holds only the warm-up's held-out metrics)."""
    assert [r["step"] for r in rows] == list(range(0, steps + 1)), [r["step"] for r in rows]
    train = rows[1:]
    for r in train:
        assert r["method"] == name and r["backend"] == "pipeline"
        assert 0.0 <= r["reward"] <= 1.0 and r["reward"] * g * k == pytest.approx(round(r["reward"] * g * k))
        up = r["upstream"]
        assert up["rollout/num_samples"] == g * k and up["lpo/groups"] == g
        assert 0.0 < r["entropy"] <= math.log(128) + 1e-6
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] >= 0.0
        # every method logs KL(w*||P) against its own target; on-policy start: KL(w*||U) = log K - H(w*)
        assert r["kl_target"] == up["lpo/kl_end"] and r["kl_target"] >= 0.0
        if name == "lpo-fwd" and up["lpo/entropy_target"] < math.log(k) - 1e-5:
            # LPO-fwd descends KL(w*||P) itself: an informative step ends below where it started
            assert r["kl_target"] < up["lpo/kl_start"], (r["step"], r["kl_target"], up["lpo/kl_start"])
        assert up["lpo/kl_start"] == pytest.approx(math.log(k) - up["lpo/entropy_target"], abs=1e-6)
        assert 0.0 <= up["rollout_fingerprint"] < 1.0
    return train


def informative_steps(train: List[Dict], k: int) -> List[bool]:
    """Per RL step: did any group have unequal rewards? On-policy, w* is uniform exactly for groups
    with equal rewards, so the mean target entropy is below log K iff some group was informative."""
    return [r["upstream"]["lpo/entropy_target"] < math.log(k) - 1e-5 for r in train]


def check_informative(train: List[Dict], k: int) -> None:
    """The run learned from something: some group had unequal rewards, the gradient was nonzero
    exactly at the steps that had such a group (no KL or entropy term: degenerate groups give no
    gradient), and LPO's own degenerate-group fraction agrees."""
    inf = informative_steps(train, k)
    assert any(inf), "no informative group in any step: every gradient is zero and nothing is learned"
    for r, has in zip(train, inf):
        assert (r["grad_norm"] > 1e-8) == has, (r["step"], r["grad_norm"], has)
        if "informative_groups" in r:  # LPO logs the fraction of degenerate groups
            assert (r["informative_groups"] > 0) == has
            assert 0.0 <= r["informative_groups"] <= 1.0


def check_heldout(rows: List[Dict], samples: int) -> None:
    """Held-out metrics at the warm-up (step 0, the same for every method) and at the last step."""
    first, last = rows[0], rows[-1]
    for r in (first, last):
        ks = sorted(int(key.split("@")[1]) for key in r if key.startswith("heldout_pass@"))
        assert ks == sorted({1, 4, samples} & set(range(1, samples + 1))), ks
        vals = [r[f"heldout_pass@{k}"] for k in ks]
        assert all(0.0 <= v <= 1.0 for v in vals) and vals == sorted(vals)  # Pass@k grows with k
        assert 0.0 <= r["heldout_distinct_correct"] <= min(4, samples)
        assert r["heldout_coverage"] == pytest.approx(r["heldout_distinct_correct"] / 4)  # pairsum: 4 answers
        assert 0.0 <= r["heldout_greedy"] <= 1.0


def check_same_start(rows_by_method: Dict[str, List[Dict]]) -> None:
    """Every method starts from the same warm-up: equal step-0 held-out metrics."""
    starts = [{k: v for k, v in rows[0].items() if k.startswith("heldout_")} for rows in rows_by_method.values()]
    assert all(s == starts[0] for s in starts), starts


def check_paired_rollouts(rows_by_method: Dict[str, List[Dict]]) -> None:
    """Same seed -> the same step-1 rollouts for every method (the per-step mean of the reward file's
    CRC fingerprint of prompt + response, and the step-1 reward)."""
    first = {n: rows[1] for n, rows in rows_by_method.items()}
    ref = next(iter(first.values()))
    for name, r in first.items():
        assert r["upstream"]["rollout_fingerprint"] == pytest.approx(ref["upstream"]["rollout_fingerprint"],
                                                                     abs=1e-6), name
        assert r["reward"] == ref["reward"], name


def inprocess_runs(model, methods, k, seeds, **cfg):
    """{(method, k, seed): rows} of ``run_inprocess`` runs (RLConfig fields in ``cfg``)."""
    from openrlhf_lpo.demo.loop import RLConfig, run_inprocess
    from openrlhf_lpo.demo.methods import METHODS

    out = {}
    for seed in seeds:
        for m in methods:
            rows = []
            run_inprocess(METHODS[m], RLConfig(k=k, seed=seed, threads=1, **cfg), model, on_row=rows.append,
                          progress=False)
            out[(m, k, seed)] = rows
    return out


def check_study_files(run: Path, methods: List[str], baseline: str, window: int = 5) -> None:
    """The demo ran as a one-seed study (openrlhf_lpo.compare): each method's done marker holds its settings
    hash and attempt, its job loads its checkpoints when started again, and the study table's numbers are the
    rows' own (recomputed here: the last ``window`` steps' mean, the last evaluation, the paired difference)."""
    run = Path(run)
    table = json.loads((run / "table.json").read_text())
    assert table["baseline"] == baseline and table["methods"][0] == baseline and len(table["seeds"]) == 1
    seed = table["seeds"][0]
    finals = {}
    for m in methods:
        done = json.loads((run / "pipeline" / m / "done.json").read_text())
        attempt = json.loads((run / "pipeline" / m / "attempt.json").read_text())
        assert done["settings_hash"] == attempt["settings_hash"] and done["attempts"] == attempt["n"] == 1
        assert (run / "pipeline" / m / "trained.json").exists()
        assert "--ckpt.load_enable" in (run / "pipeline" / m / "command.txt").read_text().split()
        rows = load_rows(run, m)
        train = [r for r in rows if r["step"] >= 1]
        evals = [r for r in rows if "heldout_pass@1" in r]
        want = {"reward_final": sum(r["reward"] for r in train[-window:]) / len(train[-window:]),
                "response_length_final": sum(r["response_length"] for r in train[-window:]) / len(train[-window:]),
                "grad_norm_mean": sum(r["grad_norm"] for r in train) / len(train),
                "heldout_pass@1": evals[-1]["heldout_pass@1"]}
        got = table["runs"][f"{m}/seed{seed}"]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (m, key)
        finals[m] = want
    for m in methods:
        if m != baseline:
            d = table["paired_differences"][m]
            for key in finals[m]:
                assert d[key]["values"] == [pytest.approx(finals[m][key] - finals[baseline][key], rel=1e-9)]
    md = (run / "table.md").read_text()
    assert "Paired differences against " + baseline in md and all(f"| {m} |" in md for m in methods)

