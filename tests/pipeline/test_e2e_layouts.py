"""lpo-train end to end on two data-parallel ranks with micro-batches that split every group (the two-pass
path: c from s_t in the first window, a no-grad pre-pass after): the weights it ends at equal a float64
autograd reference of the same update, computed here from the groups the run trained.

One rollout batch (4 prompts x K=4), one optimizer window per epoch, two epochs, SGD (LPO_CPU_OPTIMIZER):
the run's final weights must equal init - lr (g_1 + g_2), where g_e is the window gradient of the
listwise loss (fwd KL, tau = group std, eps 0.2) at the parameters of epoch e, clipped to --actor.max_norm
as DeepSpeed clips it (tests/openrlhf/lpo_references.reference_steps: numpy targets, float64 model). The
groups come from the step-1 checkpoint's replay file (``--lpo.replay_batches 1``: token ids, masks and
rewards as the trainer received them; with one rollout batch nothing is ever replayed), the old log-probs
from the float64 model at the initial weights.

dp 2's one-pass path (micro-batch K) is the gradient matrix's, in one process against the same reference
(tests/openrlhf/test_lpo_gradient_exactness.py, dp 2, micro K); dp 1's one-pass path through the pipeline
is the async family run's (test_e2e_families.py, micro-batches of K). OpenRLHF's recipe families over partial batches:
test_e2e_hybrid.py and test_e2e_families.py.

The run: local Ray, OpenRLHF's trainer and actors, DeepSpeed ZeRO-2 on gloo, the CPU rollout engine, a
tiny offline Qwen3 and the vowel-fraction reward (tests/pipeline/toy_reward.py).
"""

import re
import sys
from pathlib import Path

import pytest
import torch

from e2e_common import base_args, load_weights, max_weight_diff, run_cli, run_env, tb_scalars, write_prompts

pytestmark = pytest.mark.e2e  # one lpo-train run: dp 2, two passes

K, GROUPS, LR, EPOCHS = 4, 4, 0.2, 2
MAX_NORM = 1.0  # the stock default of --actor.max_norm, which the run keeps


@pytest.fixture(scope="module")
def dp2_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    data = write_prompts(root / "prompts.jsonl", GROUPS)
    out = root / "dp2_two_pass"
    args = base_args(tiny_model_dir, data, out, dp=2, micro=2, k=K, train=GROUPS * K,
                     extra=["--train.max_epochs", str(EPOCHS), "--actor.adam.lr", str(LR),
                            "--lpo.replay_batches", "1"])
    rc, wall, log = run_cli(args, run_env({"LPO_CPU_OPTIMIZER": "sgd"}), root / "dp2.log")
    assert rc == 0, f"dp 2 failed (rc={rc}); tail:\n{log[-6000:]}"
    print(f"\n[e2e dp] dp2_two_pass {wall:.0f}s")
    return {"out": out, "log": log, "tb": tb_scalars(out / "tb"), "model": tiny_model_dir}


def _trained_groups(replay_file: Path, actor):
    """The step's K-sample groups from the checkpoint's replay file, batched one group each, with their
    old log-probs from ``actor`` (float64, initial weights) and a group id."""
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch, split_experience_batch

    state = torch.load(replay_file, map_location="cpu", weights_only=True)
    assert len(state["batches"]) == 1  # the one rollout batch
    groups = state["batches"][0]["groups"]
    assert len(groups) == GROUPS and all(len(g) == K for g in groups)
    batches = []
    for gid, records in enumerate(groups):
        members = []
        for rec in records:  # a one-row Experience each
            (sample,) = split_experience_batch(Experience(**rec))
            sample.info = dict(sample.info, lpo_gid=gid)
            members.append(sample)
        batch = make_experience_batch(members)
        with torch.no_grad():
            batch.action_log_probs = actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
        batches.append(batch)
    return batches


def test_two_ranks_with_split_groups_update_like_the_float64_reference(dp2_run):
    tests = str(Path(__file__).resolve().parents[1] / "openrlhf")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from lpo_fixtures import make_actor
    from lpo_references import reference_steps

    actor = make_actor(dp2_run["model"])  # float64
    # the initial weights as the run loads them (float32 in the CPU mode; make_actor reads bf16)
    saved = load_weights(dp2_run["model"])
    saved.setdefault("lm_head.weight", saved["model.embed_tokens.weight"])  # tied: the file holds one copy
    init = {k: saved[k].to(torch.float64) for k in actor.model.state_dict()}
    actor.model.load_state_dict(init)
    names = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    groups = _trained_groups(dp2_run["out"] / "ckpt" / "_lpo_replay" / "global_step1.pt", actor)
    grads = reference_steps(dp2_run["model"], init, groups, [list(range(GROUPS))] * EPOCHS, K=K, lr=LR,
                            max_norm=MAX_NORM)
    want = {n: init[n] - LR * sum(g[i] for g in grads) for i, n in enumerate(names)}
    got = load_weights(dp2_run["out"] / "final")
    moved = max_weight_diff(want, init)
    assert moved > 1e-3, "SGD did not move the weights: the comparison would be vacuous"
    diff = max_weight_diff(got, want)
    print(f"\n[e2e dp] dp2_two_pass vs the float64 reference: max |dw| {diff:.3g} (moved {moved:.3g})")
    assert diff < 1e-4 * moved
    # the run really took the exact two-pass path: c from s_t, then a no-grad pre-pass
    tb = dp2_run["tb"]
    assert tb["train/lpo/shortcut_windows"][1] == 1.0 and tb["train/lpo/pre_pass_windows"][1] == 1.0
    assert tb["train/lpo/one_pass_windows"][1] == 0.0 and tb["train/lpo/replay_groups"][1] == 0.0
    # the DeepSpeed actor group's ranks in node-major bundle order (openrlhf/placement.py)
    assert re.search(r"\[placement\] \w+: node 0 \([0-9a-f]{8}\): ranks 0-1\n", dp2_run["log"])
