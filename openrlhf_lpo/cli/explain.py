"""`lpo-explain`: Listwise Policy Optimization (LPO): its target and coefficients on a worked example, next to the
paired PG baseline.

    lpo-explain --rewards 1 0 0 0 1 0 0 0 --temperature std --divergence fwd
    lpo-explain --rewards 1 0 0 0 --divergence alpha:0.5 --log-ratio 0.1 0 -0.1 0

Prints P, w*, the closed-form coefficients c = dD/ds, D and sum |c| against the divergence's proven
bound (fwd 2, hellinger 2, tv 1, alpha:<a> 2/a for 0 < a <= 1; rev, js and other alphas: none).
"""

from __future__ import annotations

import argparse

import torch

from openrlhf_lpo import listwise as lw

# temperature -> the PG estimator it pairs with (listwise.PG_ESTIMATORS; docs/lpo_flags.md, Table 1)
PAIRED_ESTIMATOR = {"std": "grpo", "one": "dr_grpo", "mean": "maxrl", "loo": "rloo", "batch_std": "reinforce_pp"}


def explain(rewards, temperature="std", divergence="fwd", prev_log_ratio=None, log_ratio=None) -> str:
    r = torch.tensor([rewards], dtype=torch.float64)
    k = r.shape[1]
    s_t = None if prev_log_ratio is None else torch.tensor([prev_log_ratio], dtype=torch.float64)
    s = torch.zeros(1, k, dtype=torch.float64) if log_ratio is None else torch.tensor([log_ratio], dtype=torch.float64)
    tau = lw.group_temperature(r, temperature)
    target = lw.gibbs_target(r, tau, s_t)
    policy = torch.softmax(s, -1)
    coef = lw.listwise_coefficients(s, target, divergence)
    div = lw.listwise_divergence(s, target, divergence)
    rows = [
        f"K={k}  temperature={temperature!r} -> tau={tau.item():.4g}  divergence={divergence}",
        f"{'k':>3} {'R':>6} {'P_k':>8} {'w*_k':>8} {'c_k':>9}" + ("  A_k(PG)" if temperature in PAIRED_ESTIMATOR else ""),
    ]
    adv = lw.pg_advantages(r, PAIRED_ESTIMATOR[temperature]) if temperature in PAIRED_ESTIMATOR else None
    for i in range(k):
        line = f"{i:>3} {r[0, i].item():>6.3g} {policy[0, i].item():>8.4f} {target[0, i].item():>8.4f} {coef[0, i].item():>9.5f}"
        if adv is not None:
            line += f"  {adv[0, i].item():>7.4f}"
        rows.append(line)
    bound = lw.resolve_divergence(divergence).bound
    rows.append(
        f"D = {div.item():.6f}; sum c = {coef.sum().item():.2e}; sum |c| = {coef.abs().sum().item():.4f}"
        + (f" (bound {bound:g})" if bound is not None else " (no bound)")
        + ". Gradient descent raises log pi of responses with c_k < 0."
    )
    if adv is not None and divergence == "rev" and log_ratio is None and prev_log_ratio is None:
        rows.append("On-policy reverse KL: c_k = -A_k/K (Proposition 1).")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="lpo-explain", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--rewards", type=float, nargs="+", default=[1, 0, 0, 1, 0, 0, 0, 0])
    ap.add_argument("--temperature", default="std",
                    help="std | one | mean | loo | batch_std (the --rewards as the whole batch) | <positive float>")
    ap.add_argument("--divergence", default="fwd",
                    help="fwd | rev | js | hellinger | tv | alpha:<a> (any real a) | a registered name")
    ap.add_argument("--log-ratio", type=float, nargs="+", default=None, help="current s (default: on-policy 0)")
    ap.add_argument("--prev-log-ratio", type=float, nargs="+", default=None, help="s_t of the pre-update policy")
    a = ap.parse_args(argv)
    try:
        temperature = lw.parse_temperature(a.temperature)
        lw.parse_divergence(a.divergence)
        print(explain(a.rewards, temperature, a.divergence, a.prev_log_ratio, a.log_ratio))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
