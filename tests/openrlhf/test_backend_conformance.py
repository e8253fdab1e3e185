"""Both backends run one update loop (core/update.py): the same rollout batch through the DeepSpeed trainer's engine
and the Megatron actor's engine gives the same windows, the same micro-batch split, the same c and the same update as
a float64 reference written from the paper (tests/openrlhf/conformance_worker.py: one process, both real backends,
a tiny Qwen3), for every mode (one pass, shortcut, pre-pass, pointwise), a divergence schedule, replayed groups
(s_t != 0), the temperature scale, token-budget micro-batches and a policy-gradient estimator; and both log the
same metric keys. A failure names the case, the window and the backend that drifted."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.e2e  # a process with both backends (megatron-core on gloo)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    repo = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, os.path.join(HERE, "conformance_worker.py"),
                          str(tmp_path_factory.mktemp("conformance"))], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("CONFORMANCE ")][-1]
    return json.loads(line[len("CONFORMANCE "):])


CASES = ["one_pass_fwd", "split_rev_two_epochs", "pointwise", "schedule_fwd_then_rev", "replay_s_t",
         "temperature_scale", "token_budget", "grpo"]


@pytest.mark.parametrize("case", CASES)
def test_same_plan_c_and_update_on_both_backends(record, case):
    rec = record[case]
    assert rec["n_windows"] == [rec["n_ref_windows"]] * 2, rec["n_windows"]
    assert rec["status_keys"]["deepspeed"] == rec["status_keys"]["megatron"]  # one metric set
    modes = set()
    for w, win in enumerate(rec["windows"]):
        where = f"{case} window {w}"
        assert win["ds_indices"] == win["mg_indices"], where  # the same windows, in the same micro-batch order
        assert sorted(win["ds_indices"]) == sorted(win["ref_indices"]), where  # the shuffle rule's windows
        assert win["ds_micro"] == win["mg_micro"], where  # the same micro-batch split
        if win["ref_micro"] is not None:
            assert [len(m) for m in win["ds_micro"]] == win["ref_micro"], where
        else:  # token budgets: none over the budget unless a single sample
            assert all(t <= 24 or len(m) == 1 for t, m in zip(win["micro_tokens"], win["ds_micro"])), where
        assert win["ds_mode"] == win["mg_mode"] == win["ref_mode"], where
        modes.add(win["ref_mode"])
        if "c_scale" in win:
            assert win["c_scale"] > 1e-3, where
            # (OpenRLHF's Actor takes its log-probs in float32, megatron-core's model is float32)
            assert win["c_ds_vs_ref"] < 1e-6, (where, "deepspeed", win)
            assert win["c_mg_vs_ref"] < 1e-6, (where, "megatron", win)
        if "c_pre_vs_s_t" in win:
            assert win["c_pre_vs_s_t"] > 1e-4, (where, "the pre-pass's c equals the shortcut's: the case tests nothing")
        assert win["delta_scale"] > 1e-4, where
        # the parameter update relative to its largest element (megatron's Adam with betas 0, lr = eps: SGD to ~1e-5)
        assert win["delta_ds_vs_ref"] < 2e-5, (where, "deepspeed", win["delta_ds_vs_ref"])
        assert win["delta_mg_vs_ref"] < 5e-5, (where, "megatron", win["delta_mg_vs_ref"])
    want = {"one_pass_fwd": {"one_pass"}, "split_rev_two_epochs": {"shortcut", "pre_pass"},
            "pointwise": {"pointwise"}, "schedule_fwd_then_rev": {"shortcut", "pre_pass"},
            "replay_s_t": {"shortcut", "pre_pass"}, "temperature_scale": {"one_pass"},
            "token_budget": {"shortcut", "pre_pass"}, "grpo": {"pg"}}[case]
    assert modes == want, (case, modes)
