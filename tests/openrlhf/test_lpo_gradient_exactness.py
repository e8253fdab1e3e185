"""One optimizer step of the real LPOActorTrainer == gradient of the full-batch listwise loss.

float64 model parameters (OpenRLHF's Actor casts logits to float32; all LPO math runs in float64),
K = 4 responses x 4 prompts (one group with equal rewards), micro-batch sizes 1, K/2, K, 2K,
dp 1 (in process) and dp 2 (two gloo processes), packing on/off, divergences fwd/rev/js.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, free_port

K = 4
MICRO = (1, K // 2, K, 2 * K)
TOL = 1e-12  # absolute, on gradients of size ~1e-1


@pytest.fixture(scope="module")
def dp2_results(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp2") / "dp2.json")
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "lpo_dp_worker.py"), str(r), "2", port, tiny_model_dir, out],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    yield procs, out
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def dp1_results(tiny_model_dir, gloo_world1, dp2_results):
    # dp2_results first: its two worker processes import while this process computes.
    from lpo_harness import gradient_matrix, max_abs, max_abs_diff

    results, refs = gradient_matrix(tiny_model_dir, dp=1, rank=0, K=K)
    return {
        f"packing={int(p)},micro={m},div={d}": {"err": max_abs_diff(r["grads"], refs[d]), "scale": max_abs(refs[d]),
                                                "two_pass": r["two_pass"]}
        for (p, m, d), r in results.items()
    }


@pytest.fixture(scope="module")
def dp2_table(dp2_results):
    procs, out = dp2_results
    logs = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        logs.append(stdout[-3000:])
        assert p.returncode == 0, f"dp=2 worker failed:\n{stdout[-3000:]}"
    with open(out) as f:
        return json.load(f)


CASES = [(p, m, d) for p in (0, 1) for m in MICRO for d in ("fwd", "rev", "js")]


def _check(table, packing, micro, div):
    row = table[f"packing={packing},micro={micro},div={div}"]
    assert row["scale"] > 1e-3, "reference gradient is trivially small; the check would be vacuous"
    assert row["err"] < TOL, f"max |grad - reference| = {row['err']:.3e} (scale {row['scale']:.3e})"
    assert row["two_pass"] == float(micro % K != 0), "one pass iff micro-batches hold whole groups"


@pytest.mark.parametrize("packing,micro,div", CASES)
def test_step_gradient_equals_full_batch_listwise_dp1(dp1_results, packing, micro, div):
    _check(dp1_results, packing, micro, div)


@pytest.mark.parametrize("packing,micro,div", CASES)
def test_step_gradient_equals_full_batch_listwise_dp2(dp2_table, packing, micro, div):
    _check(dp2_table, packing, micro, div)


def test_print_error_table(dp1_results, dp2_table, capsys):
    with capsys.disabled():
        worst = {}
        for name, table in (("dp1", dp1_results), ("dp2", dp2_table)):
            for key, row in table.items():
                worst[f"{name},{key}"] = row["err"]
        print("\nLPO gradient exactness, max abs error per case:")
        for key, err in sorted(worst.items()):
            print(f"  {key}: {err:.2e}")
    assert max(worst.values()) < TOL
