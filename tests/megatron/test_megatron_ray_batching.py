"""Pure parts of the Megatron Ray policy actor: merging experiences, whole-group windows,
loss selection from the CLI namespace (no process group, no Ray)."""

from dataclasses import fields
from types import SimpleNamespace as NS

import pytest
import torch

from openrlhf_lpo.megatron.ray_actor import loss_spec_from_args, merge_experiences


def _exp(prompt_w, resp_w, rows, tag):
    """rows: list of (prompt_len, resp_len); tokens encode (tag, row, position) for checking."""
    b = len(rows)
    seq = torch.zeros(b, prompt_w + resp_w, dtype=torch.long)
    am = torch.zeros_like(seq)
    act = torch.zeros(b, resp_w, dtype=torch.bool)
    lp = torch.zeros(b, resp_w)
    for i, (p, r) in enumerate(rows):
        seq[i, prompt_w - p: prompt_w + r] = 1000 * tag + 100 * i + torch.arange(p + r) + 1
        am[i, prompt_w - p: prompt_w + r] = 1
        act[i, :r] = True
        lp[i, :r] = -(torch.arange(r) + 1.0) - tag
    return NS(sequences=seq, attention_mask=am, action_mask=act, action_log_probs=lp, advantages=None,
              info={"lpo_target": torch.full((b,), 0.5, dtype=torch.float64), "lpo_gid": torch.arange(b) // 2 + tag * 10})


def test_experience_fields_exist_upstream():
    from openrlhf.trainer.ppo_utils.experience import Experience

    names = {f.name for f in fields(Experience)}
    assert {"sequences", "attention_mask", "action_mask", "action_log_probs", "advantages", "info"} <= names


def test_merge_repads_prompts_left_and_responses_right():
    e1 = _exp(3, 2, [(3, 2), (1, 1)], tag=1)
    e2 = _exp(5, 4, [(2, 4), (5, 3)], tag=2)
    b = merge_experiences([e1, e2])
    assert b["sequences"].shape == (4, 9) and b["action_mask"].shape == (4, 4)
    for e, rows, off in ((e1, [(3, 2), (1, 1)], 0), (e2, [(2, 4), (5, 3)], 2)):
        for i, (p, r) in enumerate(rows):
            real = b["sequences"][off + i][b["attention_mask"][off + i].bool()]
            orig = e.sequences[i][e.attention_mask[i].bool()]
            assert torch.equal(real, orig)  # same tokens, contiguous
            assert int(b["attention_mask"][off + i, :5].sum()) == p  # prompt ends at column 5
            assert torch.equal(b["old_log_probs"][off + i, :r], e.action_log_probs[i, :r])
            assert int(b["action_mask"][off + i].sum()) == r
    assert b["target"].dtype == torch.float64 and torch.equal(b["lpo_gid"], torch.tensor([10, 10, 20, 20]))


def test_loss_spec_from_args():
    """LPO: the listwise loss (each window's plan picks one pass or the surrogate), its divergence and clip band;
    any other estimator: OpenRLHF's PolicyLoss with --actor.eps_clip_low_high."""
    args = NS(algo=NS(advantage=NS(estimator="lpo")), rollout=NS(n_samples_per_prompt=4), train=NS(seed=42),
              actor=NS(eps_clip=0.2, eps_clip_low_high=None, loss_agg_mode="seq-mean-token-mean"),
              lpo=NS(divergence="rev", projection="listwise", force_two_pass=False))
    spec = loss_spec_from_args(args)
    assert (spec.name, spec.divergence, spec.group_size, spec.clip_eps) == ("listwise", "rev", 4, 0.2)
    args.algo.advantage.estimator = "group_norm"
    spec = loss_spec_from_args(args)
    assert spec.name == "pg" and spec.clip_eps == (0.2, 0.2)
    args.actor.eps_clip_low_high = (0.2, 0.28)  # clip-higher reaches the PG loss
    assert loss_spec_from_args(args).clip_eps == (0.2, 0.28)


def test_merge_carries_the_off_policy_log_ratio():
    e = _exp(3, 2, [(3, 2), (1, 1)], tag=1)
    e.info["lpo_prev_log_ratio"] = torch.tensor([0.25, -0.5], dtype=torch.float64)
    b = merge_experiences([e])
    assert b["prev_log_ratio"].tolist() == [0.25, -0.5] and b["prev_log_ratio"].dtype == torch.float64
