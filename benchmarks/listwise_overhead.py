"""What does the listwise part of LPO cost next to GRPO's token-level PPO loss?

Times forward+backward, from token log-probs [B, T] to their gradient, on the same batch:
  GRPO  OpenRLHF 0.11.2's PolicyLoss (ppo, token-mean) with group-normalised advantages
  LPO   sequence_log_ratio (clip + length-normalise) + listwise divergence over [G, K]
and, separately, the listwise part alone (the [G, K] softmax/divergence/backward given s).
Prints the ratios against GRPO measured in the same run.

    python benchmarks/listwise_overhead.py [--batch 2048 --tokens 1024 --k 8 --repeats 20] [--device auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from openrlhf_lpo import listwise as lw


def timeit(fn, repeats: int, sync, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--divergence", default="fwd", choices=sorted(lw.DIVERGENCES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, auto (the accelerator if any) or a torch device")
    a = ap.parse_args(argv)
    if a.device == "auto":
        dev = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    else:
        dev = torch.device(a.device)
    sync = torch.get_device_module(dev.type).synchronize if dev.type != "cpu" else (lambda: None)
    if a.threads:
        torch.set_num_threads(a.threads)
    from openrlhf.models.loss import PolicyLoss

    torch.manual_seed(0)
    B, T, K = a.batch, a.tokens, a.k
    if B % K:
        raise SystemExit(f"--batch {B} must be a multiple of --k {K}")
    old = (-torch.rand(B, T) * 3).to(dev)
    logp = (old + 0.05 * torch.randn(B, T).to(dev)).requires_grad_(True)
    lengths = torch.randint(T // 4, T + 1, (B,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float().to(dev)
    rewards = torch.randint(0, 2, (B // K, K)).float().to(dev)
    adv = lw.pg_advantages(rewards, "grpo").reshape(B, 1).expand(B, T).contiguous()
    target = lw.gibbs_target(rewards, "std")
    grpo_loss = PolicyLoss(0.2, 0.2, token_level_loss=True)

    def grpo():
        logp.grad = None
        loss, *_ = grpo_loss(logp, old, adv, action_mask=mask)
        loss.backward()

    def lpo():
        logp.grad = None
        s = lw.sequence_log_ratio(logp, old, mask, 0.2)
        lw.listwise_loss(s.view(-1, K), target, a.divergence).backward()

    s_leaf = torch.zeros(B // K, K, device=dev, requires_grad=True)

    def listwise_only():
        s_leaf.grad = None
        lw.listwise_loss(s_leaf, target, a.divergence).backward()

    t_grpo = timeit(grpo, a.repeats, sync)
    t_lpo = timeit(lpo, a.repeats, sync)
    t_list = timeit(listwise_only, a.repeats * 5, sync)
    print(f"batch B={B} responses x T={T} tokens, K={K}, divergence={a.divergence}, device={dev}, "
          f"threads={torch.get_num_threads()}")
    print(f"GRPO PolicyLoss fwd+bwd      : {t_grpo * 1e3:9.2f} ms")
    print(f"LPO loss fwd+bwd (s + simplex): {t_lpo * 1e3:9.2f} ms   ratio LPO/GRPO = {t_lpo / t_grpo:.3f}")
    print(f"listwise simplex part alone  : {t_list * 1e3:9.3f} ms   ratio listwise/GRPO = {t_list / t_grpo:.4f}")


if __name__ == "__main__":
    main()
