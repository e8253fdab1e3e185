"""benchmarks/toy_sample_efficiency.py --suite research: the grid, the contrasts' paired differences against a
direct computation, and the four figures, on real in-process runs of a micro model."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

from openrlhf_lpo.compare.stats import paired_ci

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "toy_sample_efficiency.py"
K = 8
METHODS_RUN = ("grpo", "lpo-fwd", "lpo-rev", "lpo-tv", "lpo-fwd2rev-step", "lpo-fwd2rev-entropy", "lpo-fwd-tau0.5",
               "lpo-fwd-tau2", "lpo-fwd-replay")


def _bench():
    spec = importlib.util.spec_from_file_location("toy_sample_efficiency", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_research_grid_and_contrasts():
    bench = _bench()
    grid = bench.research_grid([4, 8])
    assert len(grid) == len(set(grid)) == 2 * 8 + 5
    assert {m for m, k in grid if k == 4} == set(bench.RESEARCH_FAMILY)
    assert ("lpo-fwd-replay", 8) in grid and ("lpo-fwd-replay", 4) not in grid
    contrasts = bench.research_contrasts([4, 8])
    assert ("lpo-alpha2", "lpo-fwd", 4) in contrasts and ("lpo-fwd-replay", "grpo", 8) in contrasts
    assert ("lpo-fwd2rev-entropy", "lpo-rev", 8) in contrasts and ("lpo-fwd-tau2", "lpo-fwd", 8) in contrasts
    assert all((m, k) in grid and (ref, k) in grid for m, ref, k in contrasts)
    assert bench.research_grid([4]) == [(m, 4) for m in bench.RESEARCH_FAMILY]


@pytest.fixture(scope="module")
def runs(micro_tiny_model):
    from demo_checks import inprocess_runs  # a helper module: "conftest" is ambiguous in a full run

    return inprocess_runs(micro_tiny_model, METHODS_RUN, K, (0, 1), task="tripsum", prompts_per_step=2, steps=2,
                          eval_every=1, eval_prompts=4, eval_samples=4, mini_batches=2)


def test_contrasts_match_a_direct_computation_and_the_figures_are_written(runs, tmp_path):
    bench = _bench()
    seeds = [0, 1]
    assert bench.check_pairing(runs) == 2
    contrasts = [c for c in bench.research_contrasts([K]) if c[0] in METHODS_RUN and c[1] in METHODS_RUN]
    diffs = bench.contrast_differences(runs, contrasts, seeds, window=2)
    assert set(diffs) == {f"{m}|{ref}|{K}" for m, ref, _ in contrasts}
    for m, ref, _ in contrasts:
        for key in ("heldout_pass@1", "reward_final", "entropy_final"):
            def final(name, s):
                rows = runs[(name, K, s)]
                if key == "heldout_pass@1":
                    return [r[key] for r in rows if key in r][-1]
                train = [r for r in rows if r["step"] >= 1][-2:]
                return sum(r[{"reward_final": "reward", "entropy_final": "entropy"}[key]] for r in train) / len(train)

            want = paired_ci([final(m, s) for s in seeds], [final(ref, s) for s in seeds])
            got = diffs[f"{m}|{ref}|{K}"][key]
            assert got["mean"] == pytest.approx(want.mean, abs=1e-12) and got["n"] == 2
            assert math.isnan(want.half) or got["ci95"] == pytest.approx(want.half, abs=1e-12)
    text = bench.format_contrasts(diffs)
    assert re.search(r"lpo-fwd-replay +grpo +8 ", text) and text.count("\n") == len(diffs) + 2
    agg = bench.aggregate(runs, list(METHODS_RUN), [K], seeds, window=2)
    paths = bench.plot_research(agg, runs, [K], seeds, tmp_path, "test")
    assert [p.name for p in paths] == ["divergences.png", "schedules.png", "tau_scale.png", "replay.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # the replay curve's x axis is the fresh rollouts generated: 0, 16, 32
    xs, ys, _ = bench._curves(runs, "lpo-fwd-replay", K, seeds, "heldout_pass@1", x_key="fresh_rollouts")
    assert xs == [0.0, 16.0, 32.0] and len(ys) == 3


def test_auto_switch_entropy_is_halfway_along_fwd_entropy_drop():
    bench = _bench()
    runs = {0: [{"step": 0}] + [{"step": t, "reward": 0.1, "entropy": e} for t, e in enumerate([0.9, 0.8, 0.7, 0.6, 0.5,
                                                                                             0.4, 0.3], 1)],
            1: [{"step": t, "reward": 0.1, "entropy": e} for t, e in enumerate([1.0, 1.0, 1.0, 0.2, 0.2, 0.2], 1)]}
    # heads: mean(0.9, 0.8, 0.7) = 0.8 and 1.0 -> 0.9; tails: mean(0.5, 0.4, 0.3) = 0.4 and 0.2 -> 0.3
    assert bench.auto_switch_entropy(runs) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="need >= 6"):
        bench.auto_switch_entropy({0: runs[1][:4]})


def test_a_rerun_keeps_finished_runs_of_the_same_settings(tmp_path):
    """The done-file holds the config as JSON has it (tuples as lists); a rerun with the same settings keeps
    the run, other settings or another entropy threshold redo it."""
    import dataclasses
    import json

    from openrlhf_lpo.demo.loop import RLConfig

    bench = _bench()
    base = RLConfig(k=4, seed=0, pipeline_args=("--x", "1"))
    path = tmp_path / "run.done.json"
    assert bench.finished(path, bench.job_config(base, 8, 1), None) is None
    cfg = bench.job_config(base, 8, 1)
    path.write_text(json.dumps({"name": "run", "config": cfg, "switch_entropy": 0.5}))
    assert bench.finished(path, bench.job_config(base, 8, 1), 0.5)["name"] == "run"
    assert cfg["k"] == 8 and cfg["seed"] == 1 and cfg["pipeline_args"] == ["--x", "1"]
    assert bench.finished(path, bench.job_config(base, 8, 1), 0.4) is None
    assert bench.finished(path, bench.job_config(dataclasses.replace(base, lr=1e-3), 8, 1), 0.5) is None
    # the old comparison (asdict, tuples) never matched what json stored: every rerun redid the grid
    assert dataclasses.asdict(dataclasses.replace(base, k=8, seed=1)) != json.loads(path.read_text())["config"]
