"""`lpo-explain`: Listwise Policy Optimization's target and coefficients on a worked example, next to the paired PG
baseline.

    lpo-explain --rewards 1 0 0 0 1 0 0 0 --temperature std --divergence fwd
    lpo-explain --rewards 1 0 0 0 --divergence alpha:0.5 --log-ratio 0.1 0 -0.1 0
    lpo-explain --method tpo --rewards 1 0 0 1 --old-logp -12 -9 -15 -10
    lpo-explain --method kl_cov --rewards 1 0 0 1

Prints P, w*, the closed-form coefficients c = dD/ds, D and sum |c| against the divergence's proven
bound (fwd 2, hellinger 2, tv 1, alpha:<a> 2/a for 0 < a <= 1; rev, js and other alphas: none).
``--method`` takes a baseline of the pairing table (docs/lpo_flags.md): its paired temperature, and what the
method does with this group (TPO: its own target q and coefficients p - q, from the responses' old sequence
log-probs ``--old-logp``).
"""

from __future__ import annotations

import argparse

import torch

from openrlhf_lpo import listwise as lw

# temperature -> the PG estimator it pairs with (listwise.PG_ESTIMATORS; docs/lpo_flags.md, Table 1)
PAIRED_ESTIMATOR = {"std": "grpo", "one": "dr_grpo", "mean": "maxrl", "loo": "rloo", "batch_std": "reinforce_pp"}
# --method: the pairing table's baselines (configs/methods/<name>.sh) -> (paired temperature, what it does per token)
METHODS = {
    "grpo": ("std", "GRPO: PPO's clipped ratio x A_k"),
    "dr_grpo": ("one", "Dr.GRPO: PPO's clipped ratio x A_k"),
    "maxrl": ("mean", "MaxRL: PPO's clipped ratio x A_k"),
    "rloo": ("loo", "RLOO: PPO's clipped ratio x A_k"),
    "reinforce_pp": ("batch_std", "REINFORCE++-baseline: PPO's clipped ratio x A_k (the batch is these rewards)"),
    "dapo": ("std", "DAPO: A_k with clip-higher 0.2/0.28, token-mean, dynamic sampling, overlong shaping"),
    "gspo": ("std", "GSPO: A_k x the clipped sequence ratio exp(mean_t log r_t)"),
    "cispo": ("std", "CISPO: A_k x log pi per token, weighted by the detached ratio clipped to [0, 4]"),
    "clip_cov": ("std", "Clip-Cov: PPO's clipped ratio x A_k per token; in each micro-batch max(1, 2e-4 N) tokens "
                 "drawn at random among those with (log pi - mean)(A - mean) in (1, 5) get no gradient"),
    "kl_cov": ("std", "KL-Cov: -r A_k per token, unclipped; in each micro-batch the max(1, 2e-3 N) tokens of largest "
               "(log pi - mean)(A - mean) add 1 x |log r|"),
    "tpo": ("pop_std", "TPO (Target Policy Optimization, arXiv 2604.06159): P = p_theta = softmax(l_theta), w* = q = "
            "softmax(l_old + u), u = (R - mean)/population std; c = p - q (from p_old = softmax(l_old) on-policy)"),
}


def explain(rewards, temperature="std", divergence="fwd", prev_log_ratio=None, log_ratio=None, method=None,
            old_logp=None) -> str:
    r = torch.tensor([rewards], dtype=torch.float64)
    k = r.shape[1]
    s_t = None if prev_log_ratio is None else torch.tensor([prev_log_ratio], dtype=torch.float64)
    s = torch.zeros(1, k, dtype=torch.float64) if log_ratio is None else torch.tensor([log_ratio], dtype=torch.float64)
    if method is not None:
        temperature = METHODS[method][0]
    if method == "tpo":  # --lpo.anchor old: l_old in P's logits and in w*'s (listwise.group_anchor)
        if old_logp is not None and len(old_logp) != k:
            raise ValueError(f"--old-logp has {len(old_logp)} values for {k} rewards: give one per response")
        l_old = torch.zeros(1, k, dtype=torch.float64) if old_logp is None else torch.tensor([old_logp], dtype=torch.float64)
        anchor = lw.group_anchor(l_old)
        s_t = anchor if s_t is None else s_t + anchor
        s = s + anchor
    tau = lw.group_temperature(r, temperature)
    target = lw.gibbs_target(r, tau, s_t)
    policy = torch.softmax(s, -1)
    coef = lw.listwise_coefficients(s, target, divergence)
    div = lw.listwise_divergence(s, target, divergence)
    rows = ([f"method={method}: {METHODS[method][1]}"] if method else []) + [
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
    ap.add_argument("--method", choices=sorted(METHODS), default=None,
                    help="a baseline of the pairing table: its paired temperature (replaces --temperature) and what it "
                    "does; tpo also prints its own target and coefficients")
    ap.add_argument("--old-logp", type=float, nargs="+", default=None,
                    help="--method tpo: each response's old sequence log-probability l_old (default: all equal)")
    a = ap.parse_args(argv)
    try:
        if a.old_logp is not None and a.method != "tpo":
            raise ValueError("--old-logp is TPO's p_old: it needs --method tpo")
        if a.method is not None and a.temperature != "std" and a.temperature != METHODS[a.method][0]:
            raise ValueError(f"--temperature {a.temperature} with --method {a.method}: the method sets its paired "
                             f"temperature ({METHODS[a.method][0]}); drop --temperature")
        if a.method == "tpo" and a.divergence != "fwd":
            raise ValueError("--method tpo is the forward-KL projection (its gradient is p - q); drop --divergence")
        temperature = lw.parse_temperature(a.temperature)
        lw.parse_divergence(a.divergence)
        print(explain(a.rewards, temperature, a.divergence, a.prev_log_ratio, a.log_ratio, a.method, a.old_logp))
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
