"""benchmarks/toy_sample_efficiency.py: pairing check, per-cell statistics and the group-size figure,
on real in-process runs of a micro model."""

import copy
import importlib.util
import math
import re
import struct
from pathlib import Path

import pytest

from openrlhf_lpo.compare.stats import mean_ci

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "toy_sample_efficiency.py"


def _bench():
    spec = importlib.util.spec_from_file_location("toy_sample_efficiency", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs(micro_tiny_model):
    from demo_checks import inprocess_runs  # a helper module: "conftest" is ambiguous in a full run

    return inprocess_runs(micro_tiny_model, ("lpo-fwd", "grpo"), 2, (0, 1), task="pairsum", prompts_per_step=4,
                          steps=2, eval_every=2, eval_prompts=6, eval_samples=4)


def test_pairing_holds_and_a_broken_pair_is_caught(runs):
    bench = _bench()
    assert bench.check_pairing(runs) == 2
    broken = copy.deepcopy(runs)
    broken[("grpo", 2, 1)][1]["rollout_digest"] = "0" * 16
    with pytest.raises(bench.PairingError, match="seed 1, K=2.*different step-1 rollouts"):
        bench.check_pairing(broken)
    broken = copy.deepcopy(runs)
    broken[("lpo-fwd", 2, 0)][2]["prompt_digest"] = "x"
    with pytest.raises(bench.PairingError, match="different prompts"):
        bench.check_pairing(broken)


def test_aggregate_matches_direct_computation(runs, tmp_path):
    bench = _bench()
    agg = bench.aggregate(runs, ["lpo-fwd", "grpo"], [2], [0, 1], window=2)
    for m in ("lpo-fwd", "grpo"):
        cell = agg["cells"][f"{m}|2"]
        finals = [sum(r["reward"] for r in runs[(m, 2, s)][1:]) / 2 for s in (0, 1)]
        assert cell["reward_final"]["values"] == pytest.approx(finals)
        assert cell["reward_final"]["mean"] == pytest.approx(sum(finals) / 2)
        half = mean_ci(finals).half
        assert (math.isnan(half) and math.isnan(cell["reward_final"]["ci95"])) or \
            cell["reward_final"]["ci95"] == pytest.approx(half)
        last = [runs[(m, 2, s)][-1]["heldout_pass@4"] for s in (0, 1)]
        assert cell["heldout_pass@4"]["values"] == last
        # threshold = the baseline's (GRPO's) mean final reward
        g = [sum(r["reward"] for r in runs[("grpo", 2, s)][1:]) / 2 for s in (0, 1)]
        assert cell["threshold"] == pytest.approx(sum(g) / 2)
    d = agg["paired_differences"]["lpo-fwd|2"]
    diffs = [runs[("lpo-fwd", 2, s)][-1]["heldout_distinct_correct"] - runs[("grpo", 2, s)][-1]["heldout_distinct_correct"]
             for s in (0, 1)]
    assert d["baseline"] == "grpo" and d["heldout_distinct_correct"]["mean"] == pytest.approx(sum(diffs) / 2)
    assert "grpo|2" not in agg["paired_differences"]
    text = bench.format_tables(agg, ["lpo-fwd", "grpo"], [2])
    assert "K = 2" in text and "Paired differences" in text and re.search(r"\nlpo-fwd +grpo +2 +[-+]", text)
    png = bench.plot_group_size(agg, ["lpo-fwd", "grpo"], [2], tmp_path / "g.png", "t").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 1000
