"""Both backends' LPO losses against one float64 reference.

The same windows go through the DeepSpeed trainer's loss (``LPOPolicyLoss`` with its micro-batch
context) and the Megatron actor's losses (``listwise`` / ``listwise_surrogate`` of megatron/losses.py),
with each window's mode and coefficients from the shared update plan (core/update.py), and each
backend's normalisation (DeepSpeed: total / window groups; Megatron: total / window responses, K per
group). The gradient with respect to the token log-probs must equal autograd of the reference loss,
written here from the paper (Eq. 4, 8, 10/11) with its own divergences, clip band and targets:
mean over the window's groups of D(w*, softmax(s)), s_k = mean over kept tokens of
clip(log pi - log pi_old) + s_t, w* = softmax(R / (scale * tau) + s_t).

Cases: each divergence; a schedule switch (the next window projects with another divergence, set as
each backend's driver call sets it); off-policy s_t with the behaviour correction's mask mode; replayed
groups (s_t != 0, no correction); the temperature scale; a partial last window; micro-batches that split
groups (shortcut at s_t, then pre-pass) and the pointwise projection.
A failure names the backend that drifted.
"""

import math

import pytest
import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.core import update
from openrlhf_lpo.core.offpolicy import BehaviourCorrection
from openrlhf_lpo.core.update import WindowMode
from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss
from openrlhf_lpo.openrlhf.actor_trainer import LPOMicroBatch, LPOPolicyLoss

K, T = 4, 6
EPS = (0.2, 0.28)  # clip-higher: asymmetric band


# ----------------------------------------------------------------------------- the reference (float64)

def _ref_divergence(name: str, w: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Per group, from the definitions: KL(w||p), KL(p||w), JS, Amari alpha."""
    p = log_p.exp()
    if name == "fwd":
        return (w * (w.log() - log_p)).sum(-1)
    if name == "rev":
        return (p * (log_p - w.log())).sum(-1)
    if name == "js":
        m = 0.5 * (w + p)
        return 0.5 * (w * (w / m).log()).sum(-1) + 0.5 * (p * (p / m).log()).sum(-1)
    if name.startswith("alpha:"):
        a = float(name.split(":")[1])
        return (1.0 - (w.pow(a) * p.pow(1 - a)).sum(-1)) / (a * (1 - a))
    raise KeyError(name)


def _ref_target(rewards: torch.Tensor, scale: float, s_t: torch.Tensor) -> torch.Tensor:
    """w* = softmax(R / (scale * std) + s_t) per group (std with Bessel's correction, GRPO's pairing)."""
    tau = scale * rewards.std(dim=-1, unbiased=True, keepdim=True)
    return torch.softmax(rewards / tau + s_t, dim=-1)


def _ref_loss(lp, old, keep, s_t, target, divergence, projection):
    lo, hi = math.log(1 - EPS[0]), math.log(1 + EPS[1])
    kf = keep.double()
    s = ((lp - old).clamp(lo, hi) * kf).sum(-1) / kf.sum(-1) + s_t
    s_g, w_g = s.view(-1, K), target.view(-1, K)
    if projection == "pointwise":
        return -(w_g * s_g).sum(-1).mean()
    return _ref_divergence(divergence, w_g, torch.log_softmax(s_g, -1)).mean()


# ----------------------------------------------------------------------------- the two backends

def _deepspeed_window(lp, data, rows_per_micro, mode, coef, divergence, projection, correction):
    loss_fn = LPOPolicyLoss(*EPS, correction=correction)
    n_groups = lp.shape[0] // K
    total = 0.0
    for rows in rows_per_micro:
        r = torch.tensor(rows)
        micro = LPOMicroBatch(target=data["target"][r], groups_norm=float(n_groups), group_size=K,
                              divergence=divergence, projection=projection, prev=data["s_t"][r],
                              coefficients=None if coef is None else coef[r])
        loss, *_ = loss_fn(lp[r], data["old"][r], None, data["mask"][r], data["rollout"][r], dp_size=1,
                           micro_batch=micro)
        total = total + loss
    return total


def _megatron_window(lp, data, rows_per_micro, mode, coef, divergence, projection, correction):
    spec = LossSpec(name="listwise" if mode is WindowMode.ONE_PASS else "listwise_surrogate", group_size=K,
                    divergence=divergence, projection=projection, clip_eps=EPS, correction=correction)
    loss = get_policy_loss(spec.name)
    total, count = 0.0, 0
    for rows in rows_per_micro:
        r = torch.tensor(rows)
        mb = {"old_log_probs": data["old"][r], "action_mask": data["mask"][r], "target": data["target"][r],
              "prev_log_ratio": data["s_t"][r], "rollout_log_probs": data["rollout"][r]}
        if coef is not None:
            mb["coefficients"] = coef[r]
        t, c, _ = loss(lp[r], mb, spec)
        total, count = total + t, count + int(c)
    return total / count  # megatron divides the summed losses by the window's responses (each total is K x per group)


BACKENDS = {"deepspeed": _deepspeed_window, "megatron": _megatron_window}


# ----------------------------------------------------------------------------- the cases

def _window_data(n_groups, seed, s_t_scale=0.0, scale=1.0, correction=None):
    g = torch.Generator().manual_seed(seed)
    B = n_groups * K
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b, : int(torch.randint(1, T + 1, (1,), generator=g))] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rollout = old - 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # an older behaviour policy
    rollout[:, 0] = old[:, 0]  # the first token is always in the band: every response keeps a token
    rewards = torch.rand(n_groups, K, generator=g, dtype=torch.float64).round(decimals=1)
    rewards[:, 0] += 1.0  # no degenerate group
    s_t = s_t_scale * torch.randn(B, generator=g, dtype=torch.float64)
    target = listwise.gibbs_target(rewards, scale * listwise.group_temperature(rewards, "std"),
                                   prev_log_ratio=s_t.view(-1, K)).reshape(-1)
    ref_target = _ref_target(rewards, scale, s_t.view(-1, K)).reshape(-1)
    torch.testing.assert_close(target, ref_target, rtol=1e-12, atol=1e-14)  # the product's w* is the paper's
    lp = old + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)  # the current policy
    keep = mask.clone()
    if correction is not None and correction.mode == "mask":
        ell = old - rollout
        keep &= (ell >= math.log(correction.low)) & (ell <= math.log(correction.high))
        assert (mask & ~keep).any(), "the mask mode rejects no token: the case tests nothing"
    return {"old": old, "rollout": rollout, "mask": mask, "keep": keep, "s_t": s_t, "target": target}, lp


CASES = {
    # name: (divergences per window, groups per window, micro-batch size, extra)
    "fwd": (["fwd"], [2], K, {}),
    "rev": (["rev"], [2], K, {}),
    "js": (["js"], [2], K, {}),
    "alpha_0.5": (["alpha:0.5"], [2], K, {}),
    "alpha_2": (["alpha:2"], [2], K, {}),
    "schedule_switch": (["fwd", "rev"], [2, 2], K, {}),
    "offpolicy_s_t": (["rev"], [2], K, {"s_t_scale": 0.2, "correction": BehaviourCorrection("mask", 0.8, 1.25)}),
    "replay_s_t": (["fwd"], [3], K, {"s_t_scale": 0.3}),
    "temperature_scale": (["rev"], [2], K, {"scale": 0.5}),
    "partial_window": (["fwd"], [3, 1], K, {}),
    "split_groups": (["rev", "rev"], [2, 2], 3, {"s_t_scale": 0.1}),
    "pointwise": (["fwd"], [2], K, {"projection": "pointwise"}),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_equals_the_float64_reference(case, backend):
    divergences, groups, micro, extra = CASES[case]
    projection = extra.get("projection", "listwise")
    correction = extra.get("correction")
    data, lp0 = _window_data(sum(groups), seed=len(case), s_t_scale=extra.get("s_t_scale", 0.0),
                             scale=extra.get("scale", 1.0), correction=correction)
    start = 0
    for w, (n_groups, divergence) in enumerate(zip(groups, divergences)):
        rows = list(range(start * K, (start + n_groups) * K))
        start += n_groups
        window = {k: v[rows] for k, v in data.items()}
        lp = lp0[rows].clone().requires_grad_(True)
        micro_batches = [list(range(i, min(i + micro, len(rows)))) for i in range(0, len(rows), micro)]
        whole = all(len(m) % K == 0 for m in micro_batches)
        mode = update.choose_mode(projection, whole, first_window=w == 0, force_two_pass=False)
        s_now = None
        if mode in (WindowMode.SHORTCUT, WindowMode.PRE_PASS):
            # shortcut: the window runs at the rollout's parameters (lp = old), so s = s_t; else a no-grad pass
            if mode is WindowMode.SHORTCUT:
                lp = window["old"].clone().requires_grad_(True)
                s_now = window["s_t"]
            else:
                with torch.no_grad():
                    kf = window["keep"].double()
                    lo, hi = math.log(1 - EPS[0]), math.log(1 + EPS[1])
                    s_now = ((lp - window["old"]).clamp(lo, hi) * kf).sum(-1) / kf.sum(-1) + window["s_t"]
        coef = update.window_coefficients(mode, window["target"], divergence, projection, K, s=s_now)
        got = BACKENDS[backend](lp, window, micro_batches, mode, coef, divergence, projection, correction)
        (g_got,) = torch.autograd.grad(got, lp)
        ref_lp = lp.detach().clone().requires_grad_(True)
        ref = _ref_loss(ref_lp, window["old"], window["keep"], window["s_t"], window["target"], divergence, projection)
        (g_ref,) = torch.autograd.grad(ref, ref_lp)
        assert g_ref.abs().max() > 1e-6, "the reference gradient vanished: the case tests nothing"
        torch.testing.assert_close(g_got, g_ref, rtol=1e-9, atol=1e-12,
                                   msg=lambda m: f"{backend} drifted from the reference ({case}, window {w}, "
                                                 f"{mode.value}): {m}")


def test_the_cases_cover_every_mode():
    """The matrix above reaches one pass, the shortcut, the pre-pass and the pointwise projection."""
    seen = set()
    for divergences, groups, micro, extra in CASES.values():
        for w in range(len(groups)):
            whole = micro % K == 0
            seen.add(update.choose_mode(extra.get("projection", "listwise"), whole, w == 0, False))
    assert seen == set(WindowMode)
