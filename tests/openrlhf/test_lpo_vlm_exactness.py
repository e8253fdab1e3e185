"""LPO on OpenRLHF's vision-language path: one optimizer step == the full-batch listwise gradient.

The same exactness check as test_lpo_gradient_exactness.py, on image batches: a tiny random
Qwen2.5-VL (float64 parameters), 4 prompt groups x K=4 (three diagrams of 4, 9 and 16 image tokens
under the same question text, plus one text-only group), micro-batch sizes 1, K/2 (groups split
across micro-batches: the two-pass path, whose no-grad pass must see the images), K and 2K,
divergences fwd/rev/js at dp 1 (in process), fwd at dp 2 (two gloo processes). The reference is one
autograd call of the full-batch listwise loss through the same Actor with the batch's images.
Gradients cover every parameter, the vision tower included.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import HERE, free_port

K = 4
MICRO = (1, K // 2, K, 2 * K)
DIVS = ("fwd", "rev", "js")
DIVS_DP2 = ("fwd",)  # lpo_dp_worker.py ... vlm
TOL = 1e-12  # absolute, on gradients of size ~1e-1 (measured ~5e-17)


@pytest.fixture(scope="module")
def vlm_dp2(tiny_vlm_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vlm_dp2") / "dp2.json")
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "lpo_dp_worker.py"), str(r), "2", port, tiny_vlm_dir, out,
                          "vlm"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    yield procs, out
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def vlm_dp1(tiny_vlm_dir, gloo_world1, vlm_dp2):
    # vlm_dp2 first: its two worker processes import while this process computes.
    from lpo_harness import gradient_matrix, max_abs, max_abs_diff
    from vlm_harness import make_vlm_rollout_samples_for

    results, refs = gradient_matrix(tiny_vlm_dir, dp=1, rank=0, K=K,
                                    samples_fn=make_vlm_rollout_samples_for(tiny_vlm_dir), packing_cases=(False,))
    return {
        f"packing=0,micro={m},div={d}": {"err": max_abs_diff(r["grads"], refs[d]), "scale": max_abs(refs[d]),
                                         "two_pass": r["two_pass"], "n_params": len(r["grads"])}
        for (_, m, d), r in results.items()
    }


@pytest.fixture(scope="module")
def vlm_dp2_table(vlm_dp2):
    procs, out = vlm_dp2
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        assert p.returncode == 0, f"dp=2 VLM worker failed:\n{stdout[-3000:]}"
    with open(out) as f:
        return json.load(f)


def _check(table, micro, div):
    row = table[f"packing=0,micro={micro},div={div}"]
    assert row["scale"] > 1e-3, "reference gradient is trivially small; the check would be vacuous"
    assert row["err"] < TOL, f"max |grad - reference| = {row['err']:.3e} (scale {row['scale']:.3e})"
    assert row["two_pass"] == float(micro % K != 0), "one pass iff micro-batches hold whole groups"


@pytest.mark.parametrize("micro", MICRO)
@pytest.mark.parametrize("div", DIVS)
def test_vlm_step_gradient_equals_full_batch_listwise_dp1(vlm_dp1, micro, div):
    _check(vlm_dp1, micro, div)


@pytest.mark.parametrize("micro", MICRO)
@pytest.mark.parametrize("div", DIVS_DP2)
def test_vlm_step_gradient_equals_full_batch_listwise_dp2(vlm_dp2_table, micro, div):
    _check(vlm_dp2_table, micro, div)


def test_vlm_gradient_reaches_the_vision_tower(tiny_vlm_dir, vlm_dp1):
    from lpo_harness import make_actor

    actor = make_actor(tiny_vlm_dir)
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert any("visual" in n for n in names)
    assert vlm_dp1["packing=0,micro=1,div=fwd"]["n_params"] == len(names)


def test_print_vlm_error_table(vlm_dp1, vlm_dp2_table, capsys):
    worst = {f"dp1,{k}": r["err"] for k, r in vlm_dp1.items()}
    worst.update({f"dp2,{k}": r["err"] for k, r in vlm_dp2_table.items()})
    with capsys.disabled():
        print("\nLPO gradient exactness on image batches (tiny Qwen2.5-VL), max abs error per case:")
        for key, err in sorted(worst.items()):
            print(f"  {key}: {err:.2e}")
    assert max(worst.values()) < TOL


def test_no_grad_pass_sees_the_images(tiny_vlm_dir, gloo_world1):
    """At the rollout policy (old log-probs from the same actor, no noise) the two-pass no-grad s is
    exactly 0 for every image sample; without the images it is not (the bug this guards)."""
    from lpo_harness import CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_trainer, parse_args
    from vlm_harness import make_vlm_rollout_samples_for

    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    args = parse_args(tiny_vlm_dir, K=K, G=4, micro=1)
    actor = make_actor(tiny_vlm_dir)
    strategy = CPUStrategy(args)
    exps = make_experiences(args, strategy, actor, make_vlm_rollout_samples_for(tiny_vlm_dir)(4, K, seed=3), noise=0.0)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor)
    with_images, without = [], []
    for e in exps:
        with cpu_cuda_queries():
            with_images.append(trainer._sequence_log_ratio(e))
            bare = copy.copy(e)
            bare.mm_train_inputs = [None] * len(e.sequences)
            without.append(trainer._sequence_log_ratio(bare))
    s, s_bare = torch.cat(with_images), torch.cat(without)
    has_image = torch.tensor([m is not None for e in exps for m in e.mm_train_inputs])
    assert has_image.sum() == 12 and (~has_image).sum() == 4
    assert float(s.abs().max()) == 0.0
    assert float(s_bare[has_image].abs().max()) > 1e-4


def test_group_check_compares_images(tiny_vlm_dir, gloo_world1):
    """Same question text, a different diagram inside one group: the split refuses it."""
    from lpo_harness import CPUStrategy, parse_args
    from vlm_harness import make_vlm_rollout_samples_for

    from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

    args = parse_args(tiny_vlm_dir, K=K, G=4, micro=K)
    samples = make_vlm_rollout_samples_for(tiny_vlm_dir)(4, K, seed=0)
    maker = LPOExperienceMaker(None, None, None, None, None, CPUStrategy(args), type("T", (), {"pad_token_id": 0}))
    assert len(maker.split_rollout_samples(copy.deepcopy(samples))) == 4  # whole groups pass
    assert samples[1].prompts == samples[K + 1].prompts  # same text across groups ...
    swapped = copy.deepcopy(samples)
    swapped[1].images = samples[K + 1].images  # ... so only the image tells member 1 is foreign
    with pytest.raises(ValueError, match="do not share one prompt"):
        maker.split_rollout_samples(swapped)
