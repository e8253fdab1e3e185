"""Independent references for the LPO OpenRLHF tests, written from the paper rather than from openrlhf_lpo.

numpy float64 targets w* (Eq. 8) and off-policy shifts s_t, each divergence from its definition, the
references' own batching of images, the window-by-window autograd reference of every optimizer step
(``reference_steps``) and the brute-force listwise metrics (``reference_listwise_stats``).
"""

from __future__ import annotations

import math

import torch

# lpo_fixtures first: it keeps OpenRLHF off flash-attn's GPU-only kernel on a CPU machine
from lpo_fixtures import flat_items, make_actor, sample_key
from openrlhf.trainer.ppo_utils.experience import make_experience_batch

def independent_target(rewards, temperature, delta, scale=1.0):
    """numpy float64, group by group: w* = softmax((R - mean)/(scale tau) + delta) (Eq. 8); flat groups
    give softmax(delta). Written from the paper, not from openrlhf_lpo."""
    import numpy as np

    out = []
    for r, d in zip(np.asarray(rewards, dtype=np.float64), np.asarray(delta, dtype=np.float64)):
        if r.max() == r.min():
            logits = d.copy()
        else:
            tau = {"std": lambda: r.std(ddof=1), "one": lambda: 1.0, "mean": lambda: r.mean(),
                   "loo": lambda: (len(r) - 1) / len(r)}[temperature]() \
                if isinstance(temperature, str) else float(temperature)
            logits = (r - r.mean()) / (scale * tau) + d
        e = np.exp(logits - logits.max())
        out.append(e / e.sum())
    return np.stack(out)


def independent_delta(old, rollout, mask, mode, low, high):
    """numpy float64 per sample: mean over response tokens of log pi_t - log mu, clipped to
    [log low, log high] (clip) or restricted to the tokens inside the band (mask); also the kept-token mask."""
    import numpy as np

    ell = np.asarray(old, dtype=np.float64) - np.asarray(rollout, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    if mode == "mask":
        m = m & (ell >= math.log(low)) & (ell <= math.log(high))
    else:
        ell = np.clip(ell, math.log(low), math.log(high))
    return float((ell * m).sum() / max(m.sum(), 1)), m


def _divergence(div, w, log_p):
    """Per-group divergence in plain torch (float64) from its definition: fwd KL(w||P), rev KL(P||w), js,
    hellinger sum (sqrt w - sqrt P)^2, tv sum |w - P| / 2, alpha:<a> (sum w^a P^(1-a) - 1)/(a(a-1))."""
    p = log_p.exp()
    if div == "fwd":
        return (w * (w.log() - log_p)).sum(-1)
    if div == "rev":
        return (p * (log_p - w.log())).sum(-1)
    if div == "hellinger":
        return ((w.sqrt() - p.sqrt()) ** 2).sum(-1)
    if div == "tv":  # subgradient 0 where P = w* (flat groups at the start: equal up to rounding)
        gap = w - p
        return 0.5 * torch.where(gap.abs() <= 1e-12, torch.zeros_like(gap), gap).abs().sum(-1)
    if div.startswith("alpha:"):
        a = float(div.split(":")[1])
        return ((w ** a * p ** (1 - a)).sum(-1) - 1) / (a * (a - 1))
    m = (p + w) / 2
    return 0.5 * ((p * (log_p - m.log())).sum(-1) + (w * (w.log() - m.log())).sum(-1))


def reference_image_inputs(batch) -> dict:
    """The references' own batching of a (VLM) batch's images, independent of the trainer's helper:
    every image sample's ``pixel_values`` and ``image_grid_thw`` concatenated in sample order
    (text samples have none; a text model's batch gives {})."""
    per_sample = [m for m in (getattr(batch, "mm_train_inputs", None) or []) if m is not None]
    if not per_sample:
        return {}
    return {key: torch.cat([m[key] for m in per_sample]) for key in ("pixel_values", "image_grid_thw")}


def reference_steps(model_dir, state_dict, experiences, windows, *, K, divergence="fwd", temperature="std",
                    correction=None, eps=(0.2, 0.2), lr=0.0, projection="listwise", kl_coef=0.0, entropy_coef=0.0,
                    behaviour=None, temperature_scale=1.0, max_norm=None):
    """Window by window at the updated parameters: the gradient of the listwise loss averaged over
    each window's groups (one autograd call per window), then an SGD step of ``lr``. ``windows`` lists
    the global group ids of each optimizer step in training order. Targets and s_t are computed here
    independently (numpy) from the rewards and the behaviour log-probs (``behaviour``: the planted
    log-probs of replayed samples by :func:`sample_key`, whose s_t is the untruncated mean log-ratio
    unless ``correction`` is set; ``temperature_scale`` multiplies tau). ``kl_coef`` adds the k3 KL to
    the reference log-probs (``base_action_log_probs``) and ``entropy_coef`` subtracts the entropy, each
    as a token mean over the window. ``max_norm`` clips each window's gradient to that global norm as
    DeepSpeed does (scale max_norm / (norm + 1e-6) when below 1). Returns the list of (clipped) gradients."""
    import numpy as np

    actor = make_actor(model_dir, packing=False)
    actor.model.load_state_dict(state_dict)
    params = [p for p in actor.parameters() if p.requires_grad]
    by_gid = {}
    for it in flat_items(experiences):
        by_gid.setdefault(int(it.info["lpo_gid"]), []).append(it)
    consts = {}
    for g, members in by_gid.items():
        assert len(members) == K
        deltas, keeps = [], []
        for it in members:
            mask = it.action_mask.numpy()
            planted = None if behaviour is None else behaviour.get(sample_key(it))
            mu = planted[:mask.shape[0]] if planted is not None else (
                None if it.rollout_log_probs is None else it.rollout_log_probs.numpy())
            if correction is None and planted is None:
                deltas.append(0.0)
                keeps.append(mask.astype(bool))
            elif correction is None:  # a replayed sample without a correction: the plain mean log-ratio
                deltas.append(float(((it.action_log_probs.numpy() - mu) * mask).sum() / max(mask.sum(), 1)))
                keeps.append(mask.astype(bool))
            else:
                d, m = independent_delta(it.action_log_probs.numpy(), mu, mask, *correction)
                deltas.append(d)
                keeps.append(m)
        rewards = np.array([[float(it.rewards) for it in members]])
        w = independent_target(rewards, temperature, np.array([deltas]), temperature_scale)[0]
        consts[g] = (torch.tensor(w), torch.tensor(deltas), [torch.tensor(k) for k in keeps])
    lo, hi = math.log(1 - eps[0]), math.log(1 + eps[1])
    grads = []
    for gids in windows:
        gids = sorted(gids)
        members = [it for g in gids for it in by_gid[g]]
        batch = make_experience_batch(members)
        lp, out = actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask, return_output=True,
                        return_entropy=bool(entropy_coef), **reference_image_inputs(batch))
        lp = lp.double()
        keep = torch.zeros_like(lp, dtype=torch.bool)
        for j, (g, k) in enumerate((g, k) for g in gids for k in range(K)):
            m = consts[g][2][k]
            keep[j, :m.shape[0]] = m
        ratio = (lp - batch.action_log_probs.double()).clamp(lo, hi)
        s = (ratio * keep).sum(1) / keep.sum(1).clamp(min=1) + torch.cat([consts[g][1] for g in gids])
        w = torch.stack([consts[g][0] for g in gids])
        s_g = s.view(-1, K)
        if projection == "pointwise":
            loss = -(w * s_g).sum(-1).mean()
        else:
            loss = _divergence(divergence, w, torch.log_softmax(s_g, -1)).mean()
        mask = batch.action_mask.double()
        if kl_coef:  # k3 = exp(-r) - 1 + r, r = log pi - log pi_ref (Schulman), token mean over the window
            r = (lp - batch.base_action_log_probs.double()).clamp(min=-10)
            loss = loss + kl_coef * (((-r).exp() - 1 + r).clamp(-10, 10) * mask).sum() / mask.sum()
        if entropy_coef:
            ent = out.entropy[:, -mask.shape[1]:].double()
            loss = loss - entropy_coef * (ent * mask).sum() / mask.sum()
        g = torch.autograd.grad(loss, params)
        if max_norm is not None:
            scale = max_norm / (float(torch.sqrt(sum((x * x).sum() for x in g))) + 1e-6)
            g = [x * scale for x in g] if scale < 1 else g
        grads.append([x.detach().clone() for x in g])
        with torch.no_grad():
            for p, x in zip(params, g):
                p -= lr * x
    return grads


# ----------------------------------------------------------------------------- listwise metrics reference


def reference_listwise_stats(actor, experiences, K, temperature, eps_low_high):
    """Brute force in numpy float64, one group at a time: s of every sample at ``actor``'s current
    parameters (clipped token log-ratios, length mean), w* = softmax((R - mean)/tau) of its group
    (uniform for equal rewards), and the means of KL(w*||P), H(P), H(w*) with P = softmax(s)."""
    import numpy as np

    lo, hi = math.log(1 - eps_low_high[0]), math.log(1 + eps_low_high[1])
    rows = []
    for e in experiences:
        with torch.no_grad():
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask,
                       **reference_image_inputs(e)).double()
        m = e.action_mask.double()
        ratio = (lp - e.action_log_probs.double()).clamp(lo, hi) * m
        s = ratio.sum(1) / m.sum(1).clamp(min=1.0)
        for j, i in enumerate(e.index):
            rows.append((int(i), float(s[j]), float(e.rewards[j])))
    rows.sort()
    s_all = np.array([r[1] for r in rows]).reshape(-1, K)
    r_all = np.array([r[2] for r in rows]).reshape(-1, K)
    kls, h_ps, h_ws = [], [], []
    for s, r in zip(s_all, r_all):
        if r.max() == r.min():
            logits = np.zeros(K)
        else:
            tau = {"std": lambda: r.std(ddof=1), "one": lambda: 1.0, "mean": lambda: r.mean(),
                   "loo": lambda: (len(r) - 1) / len(r)}[temperature]() \
                if isinstance(temperature, str) else float(temperature)
            logits = (r - r.mean()) / tau
        w = np.exp(logits - logits.max())
        w /= w.sum()
        p = np.exp(s - s.max())
        p /= p.sum()
        kls.append(sum(wk * (math.log(wk) - math.log(pk)) for wk, pk in zip(w, p) if wk > 0))
        h_ps.append(-sum(pk * math.log(pk) for pk in p))
        h_ws.append(-sum(wk * math.log(wk) for wk in w if wk > 0))
    return {"kl": float(np.mean(kls)), "entropy_p": float(np.mean(h_ps)), "entropy_target": float(np.mean(h_ws))}
