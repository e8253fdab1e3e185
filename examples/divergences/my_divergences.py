"""Worked example of docs/divergences.md: a new divergence (Pearson chi^2) and a new parametric family
(Renyi divergences renyi:<a>), each with closed-form coefficients c = dD/ds and a self-check.

    PYTHONPATH=examples/divergences LPO_PLUGINS=my_divergences lpo-train ... --lpo.divergence renyi:0.5
    PYTHONPATH=examples/divergences python -m my_divergences      # the self-check
"""

import math

import torch

from openrlhf_lpo.listwise import (Divergence, listwise_coefficients, listwise_divergence, register_coefficients,
                                   register_divergence, register_divergence_family)


@register_divergence("chi2")
def pearson_chi2(log_p, target):
    """Pearson chi^2(w* || P) = sum_k (w*_k - P_k)^2 / P_k = sum_k w*_k^2 / P_k - 1 (= 2 x alpha:2)."""
    return (target.square() * (-log_p).exp()).sum(-1) - 1


@register_coefficients("chi2")
def _chi2_coefficients(log_p, target):
    """g = dD/dP = -(w*/P)^2, then through the softmax: c = P (g - E_P g)."""
    p = log_p.exp()
    g = -(target / p).square()
    return p * (g - (p * g).sum(-1, keepdim=True))


def _parse_renyi(text):
    a = float(text)  # a ValueError here becomes "divergence 'renyi:x': ..." for the user
    if not (math.isfinite(a) and a > 0 and a != 1):
        raise ValueError(f"a = {text} must be positive and not 1 (renyi:1 is forward KL: use fwd)")
    return a


@register_divergence_family("renyi", _parse_renyi, "renyi:<a> (a > 0, a != 1)")
def renyi(name, a):
    """Renyi divergence R_a(w* || P) = log(sum_k w*_k^a P_k^(1-a)) / (a - 1); with u = w*^a P^(1-a) and
    S = sum u: g = dR/dP = -(w*/P)^a / S, so c = -(u - P S) / S."""

    def value(log_p, target):
        log_u = a * torch.log(target.clamp_min(torch.finfo(target.dtype).tiny)) + (1 - a) * log_p
        return torch.logsumexp(log_u, dim=-1) / (a - 1)

    def coefficients(log_p, target):
        log_u = a * torch.log(target.clamp_min(torch.finfo(target.dtype).tiny)) + (1 - a) * log_p
        u = torch.softmax(log_u, dim=-1)  # u / S
        return -(u - log_p.exp())

    return Divergence(name, value, coefficients, bound=2.0)  # sum |u/S - P| <= 2


def check(seed=0):
    """Closed forms against autograd and central finite differences (float64), and chi^2 = 2 x alpha:2.
    Returns the largest error of each check."""
    g = torch.Generator().manual_seed(seed)
    s = 0.5 * torch.randn(5, 8, generator=g, dtype=torch.float64)
    w = torch.softmax(2 * torch.randn(5, 8, generator=g, dtype=torch.float64), -1)
    errors = {}
    for name in ("chi2", "renyi:0.5", "renyi:2", "renyi:3.5"):
        c = listwise_coefficients(s, w, name)
        x = s.clone().requires_grad_(True)
        listwise_divergence(x, w, name).sum().backward()
        h, fd = 1e-6, torch.zeros_like(s)
        for k in range(s.shape[1]):
            e = torch.zeros_like(s)
            e[:, k] = h
            fd[:, k] = (listwise_divergence(s + e, w, name) - listwise_divergence(s - e, w, name)) / (2 * h)
        errors[name] = {"autograd": float((c - x.grad).abs().max()), "finite_diff": float((c - fd).abs().max()),
                        "zero_sum": float(c.sum(-1).abs().max()), "abs_sum": float(c.abs().sum(-1).max())}
    errors["chi2_vs_alpha2"] = float((listwise_divergence(s, w, "chi2") - 2 * listwise_divergence(s, w, "alpha:2"))
                                     .abs().max())
    return errors


if __name__ == "__main__":
    for key, value in check().items():
        print(key, value)
