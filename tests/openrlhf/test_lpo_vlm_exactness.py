"""LPO on OpenRLHF's vision-language path: every optimizer step == the window's listwise gradient.

The exactness check of test_lpo_gradient_exactness.py on image batches: a tiny random Qwen2.5-VL
(float64 parameters), 4 prompt groups x K=4 (three diagrams of 4, 9 and 16 image tokens under the
same question text, plus one text-only group), two optimizer windows per rollout batch and two
epochs with SGD (lr 0.5), so later windows run at updated parameters and their no-grad pre-pass must
see the images. Micro-batch sizes 1, K/2 (groups split across micro-batches), K and 2K, divergences
fwd/rev/js, off-policy data (clip / mask corrections) and the stock k3 KL loss + entropy bonus composed
with the listwise loss at dp 1 (in process); fwd at dp 2 (two gloo processes). The reference (lpo_references.reference_steps) is one autograd call per window through the
same Actor with the window's images, batched by the reference itself (reference_image_inputs), the
targets and s_t recomputed in numpy. Gradients cover every parameter, the vision tower included.
"""

import copy

import pytest
import torch

from gloo_util import collect_dp2_matrix, kill_all, launch_dp2_matrix
from lpo_matrix import check_matrix_row

K = 4
# Same tolerance and reason as test_lpo_gradient_exactness.py (float32 logits in OpenRLHF's Actor:
# a batch of another composition moves s by ~1e-9); measured here: docs/vlm.md.
REL_TOL = 1e-5


def _cases(dp):
    from vlm_harness import vlm_matrix_cases

    return [name for name, _ in vlm_matrix_cases(K, dp)]


@pytest.fixture(scope="module")
def vlm_dp2(tiny_vlm_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vlm_dp2") / "dp2.json")
    procs = launch_dp2_matrix(tiny_vlm_dir, out, "vlm")
    yield procs, out
    kill_all(procs)


@pytest.fixture(scope="module")
def vlm_dp1(tiny_vlm_dir, gloo_world1, vlm_dp2):
    # vlm_dp2 first: its two worker processes import while this process computes.
    from lpo_matrix import gradient_matrix
    from vlm_harness import vlm_matrix_kwargs

    return gradient_matrix(tiny_vlm_dir, dp=1, rank=0, **vlm_matrix_kwargs(tiny_vlm_dir, dp=1, K=K))


@pytest.fixture(scope="module")
def vlm_dp2_table(vlm_dp2):
    procs, out = vlm_dp2
    return collect_dp2_matrix(procs, out)


def _check(table, name):
    check_matrix_row(table[name], REL_TOL)


@pytest.mark.parametrize("name", _cases(1))
def test_vlm_every_step_gradient_equals_window_reference_dp1(vlm_dp1, name):
    _check(vlm_dp1, name)


@pytest.mark.parametrize("name", _cases(2))
def test_vlm_every_step_gradient_equals_window_reference_dp2(vlm_dp2_table, name):
    _check(vlm_dp2_table, name)


def test_vlm_gradient_reaches_the_vision_tower(tiny_vlm_dir, vlm_dp1):
    from lpo_fixtures import make_actor

    actor = make_actor(tiny_vlm_dir)
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert any("visual" in n for n in names)
    assert vlm_dp1["packing=0,micro=1,div=fwd"]["n_params"] == len(names)


def test_print_vlm_error_table(vlm_dp1, vlm_dp2_table, capsys):
    with capsys.disabled():
        print("\nLPO gradient exactness on image batches (tiny Qwen2.5-VL, 4 steps per case), max abs error:")
        for tag, table in (("dp1", vlm_dp1), ("dp2", vlm_dp2_table)):
            for key, row in sorted(table.items()):
                print(f"  {tag},{key}: {row['err']:.2e} (relative {row['rel']:.1e})")
    assert max(r["rel"] for t in (vlm_dp1, vlm_dp2_table) for r in t.values()) < REL_TOL


def test_no_grad_pass_sees_the_images(tiny_vlm_dir, gloo_world1):
    """At the rollout policy (old log-probs from the same actor) the pre-pass s (_log_ratio) is exactly
    0 for every image sample; without the images it is not (the bug this guards)."""
    from lpo_fixtures import CPUStrategy, cpu_cuda_queries, make_actor, make_experiences, make_trainer, parse_args
    from vlm_harness import make_vlm_rollout_samples_for

    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    args = parse_args(tiny_vlm_dir, K=K, G=4, micro=1)
    actor = make_actor(tiny_vlm_dir)
    strategy = CPUStrategy(args)
    exps = make_experiences(args, strategy, actor, make_vlm_rollout_samples_for(tiny_vlm_dir)(4, K, seed=3))
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor)
    with_images, without = [], []
    for e in exps:
        with cpu_cuda_queries():
            with_images.append(trainer._log_ratio(e, None))
            bare = copy.copy(e)
            bare.mm_train_inputs = [None] * len(e.sequences)
            without.append(trainer._log_ratio(bare, None))
    s, s_bare = torch.cat(with_images), torch.cat(without)
    has_image = torch.tensor([m is not None for e in exps for m in e.mm_train_inputs])
    assert has_image.sum() == 12 and (~has_image).sum() == 4
    assert float(s.abs().max()) == 0.0
    assert float(s_bare[has_image].abs().max()) > 1e-4


def _group_images(experiences):
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    from openrlhf_lpo.openrlhf.vlm import group_key

    return [group_key(it)[1] for e in experiences for it in split_experience_batch(copy.deepcopy(e))][::K]


def test_group_check_and_order_use_the_images(tiny_vlm_dir, gloo_world1):
    """Same question text, a different diagram inside one group: the split refuses it. Groups that
    differ only by their diagram get one canonical order whatever order they arrive in."""
    from lpo_fixtures import CPUStrategy, parse_args
    from vlm_harness import make_vlm_rollout_samples_for

    from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker

    args = parse_args(tiny_vlm_dir, K=K, G=4, micro=K)
    samples = make_vlm_rollout_samples_for(tiny_vlm_dir)(4, K, seed=0)
    maker = LPOExperienceMaker(None, None, None, None, None, CPUStrategy(args), type("T", (), {"pad_token_id": 0}))
    split = maker.split_rollout_samples(copy.deepcopy(samples))
    assert len(split) == 4  # whole groups pass
    assert samples[1].prompts == samples[K + 1].prompts  # same text across groups ...
    swapped = copy.deepcopy(samples)
    swapped[1].images = samples[K + 1].images  # ... so only the image tells member 1 is foreign
    with pytest.raises(ValueError, match="do not share one prompt"):
        maker.split_rollout_samples(swapped)
    # arrival order (ray.wait) must not change the layout: reversed groups -> the same group order
    reversed_groups = [s for g in reversed(range(4)) for s in samples[g * K:(g + 1) * K]]
    order = _group_images(split)
    assert len(set(order)) == 4
    assert _group_images(maker.split_rollout_samples(copy.deepcopy(reversed_groups))) == order
