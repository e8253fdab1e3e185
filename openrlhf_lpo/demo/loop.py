"""A small in-process RL loop (plain torch + HF generate) with the same LPO math as the pipeline.

This is *not* the product pipeline: ``lpo-train`` (Ray, OpenRLHF actors, rollout engine) is. The
loop exists for two jobs where the pipeline's fixed costs (Ray start, engine start, DeepSpeed
init, weight sync) would dominate on 2 CPU cores:

* ``benchmarks/toy_sample_efficiency.py`` runs methods x K x seeds with it;
* ``lpo-demo --backend inprocess`` runs the comparison when Ray or the rollout engine cannot start.

Per RL step: draw ``prompts_per_step`` training problems, sample ``k`` responses each at temperature
``sampling_temperature`` (pure sampling), score them with the task's 0/1 reward, then take
``mini_batches`` optimizer steps, each over a disjoint slice of whole groups (so the later slices
are off-policy, where LPO and the policy gradient differ). Losses:

* LPO (Eq. 10/11): ``listwise_loss(s, w*, divergence)`` with ``s = sequence_log_ratio`` (Eq. 4,
  clipped, length-normalised) and ``w* = gibbs_target(R, tau)`` (Eq. 8, tau from the method:
  group std, 1 or group mean);
* policy gradient (GRPO, Dr.GRPO, MaxRL): PPO-clipped token surrogate with
  ``pg_advantages(R, estimator)`` (Eq. 2-3), averaged per sequence then over sequences (the same
  aggregation for every baseline, so only the advantage's temperature differs).

Pairing: the training problems depend on ``seed`` only, and the sampling of step ``t`` is seeded with
``(seed, t)``; every method therefore sees the same prompts, and at step 1 (same warm-up weights) the
same rollouts. Each row carries digests of both (``prompt_digest``, ``rollout_digest``) so a caller
can assert it.

Logged per step (one jsonl row): sampled reward, response entropy (mean token entropy under the
policy), gradient norm (before clipping, mean over the step's optimizer steps), ``kl_target`` =
KL(w* || P_theta) of the step's groups measured *after* the updates against the method's own target,
the fraction of informative groups (rewards not all equal), distinct correct answers per group, and
every ``eval_every`` steps (and at step 0, the warm-up) the held-out metrics of
:mod:`openrlhf_lpo.demo.heldout` (Pass@k, distinct correct answers, coverage, greedy accuracy).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.demo.methods import Method


@dataclass(frozen=True)
class RLConfig:
    task: str = "addition"
    k: int = 8
    prompts_per_step: int = 16
    steps: int = 60
    lr: float = 1e-4
    mini_batches: int = 2
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    sampling_temperature: float = 1.0
    seed: int = 0
    threads: int = 1
    eval_every: int = 10          # held-out evaluation every this many steps (and at steps 0 and last); 0 = off
    eval_prompts: int = 64        # held-out problems
    eval_samples: int = 16        # responses per held-out problem (Pass@k for k <= this)
    pipeline_args: Tuple[str, ...] = ()  # extra lpo-train flags for every pipeline job (last: they override)

    def validate(self) -> None:
        from openrlhf_lpo.demo.task import get_task

        get_task(self.task)
        if self.k < 2:
            raise ValueError(f"--k must be >= 2 (a listwise group needs two responses); got {self.k}")
        for name in ("prompts_per_step", "steps", "mini_batches", "threads", "eval_prompts", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0 = no held-out evaluation); got {self.eval_every}")
        if self.prompts_per_step % self.mini_batches:
            raise ValueError(
                f"--prompts-per-step ({self.prompts_per_step}) must be divisible by mini_batches "
                f"(--mini-batches {self.mini_batches}) so each optimizer step sees whole groups"
            )
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0; got {self.lr}")

    def heldout(self):
        """The held-out evaluation settings (the same sampling seed at every evaluation of a run)."""
        from openrlhf_lpo.demo.heldout import HeldoutConfig

        ks = tuple(k for k in (1, 4, self.eval_samples) if k <= self.eval_samples)
        return HeldoutConfig(prompts=self.eval_prompts, samples=self.eval_samples, ks=tuple(sorted(set(ks))),
                             seed=self.seed, temperature=self.sampling_temperature)

    def eval_steps(self) -> List[int]:
        """Steps after which the held-out evaluation runs (0 = the warm-up, before any RL step)."""
        if not self.eval_every:
            return []
        return sorted({0, self.steps} | set(range(self.eval_every, self.steps + 1, self.eval_every)))


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def grpo_loss(logp, old_logp, mask, advantages_flat, clip_eps):
    """PPO-clipped token surrogate, mean over tokens of a sequence, then over sequences."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages_flat.unsqueeze(-1)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return _seq_mean(surrogate, mask).mean()


def digest(*parts) -> str:
    """Short hex digest of tensors / strings (equal inputs -> equal digest)."""
    h = hashlib.sha1()
    for p in parts:
        h.update(p.contiguous().numpy().tobytes() if isinstance(p, torch.Tensor) else str(p).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


def group_distinct_correct(answers: List[str], rewards: torch.Tensor) -> float:
    """Mean over groups of the number of different correct answers; ``answers`` prompt-major."""
    g, k = rewards.shape
    counts = [len({answers[i * k + j] for j in range(k) if rewards[i, j] > 0}) for i in range(g)]
    return sum(counts) / g


class InprocessReplay:
    """The in-process twin of ``--lpo.replay_batches`` (openrlhf_lpo/openrlhf/replay.py): the last
    ``replay_batches`` steps' groups with their behaviour log-probs; each step draws
    ``floor(replay_ratio x fresh groups)`` of them (seeded by the run seed and the step), measures s_t =
    delta = mean_t(log pi_t - log mu) against each group's own behaviour log-probs (untruncated), drops
    groups with any |delta| > ``replay_max_abs_s``, and trains fresh and replayed groups together in
    shuffled windows of ``prompts_per_step / mini_batches`` groups (more optimizer steps, no extra
    rollouts)."""

    def __init__(self, method: Method, cfg: RLConfig, pad_id: int):
        from collections import deque

        self.method, self.cfg, self.pad = method, cfg, pad_id
        self.batches = deque(maxlen=method.replay_batches)

    def add(self, groups, step: int) -> None:
        self.batches.append([(step, grp) for grp in groups])

    def _pad(self, prompts):
        width = max(int(p.numel()) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - p.numel():] = p
            att[i, width - p.numel():] = 1
        return ids, att

    def step_batch(self, model, tokenizer, fresh, step: int, cfg: RLConfig):
        from openrlhf_lpo.demo.policy import token_logprobs
        from openrlhf_lpo.core.offpolicy import behaviour_stats

        k = cfg.k
        pool = [item for batch in self.batches for item in batch]
        want = min(int(math.floor(self.method.replay_ratio * len(fresh))), len(pool))
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 7919 + 17)
        drawn = [pool[i] for i in torch.randperm(len(pool), generator=gen)[:want].tolist()]
        kept, deltas, stale = [], [], 0
        if drawn:
            ids, att = self._pad([grp[0] for _, grp in drawn])
            resp = torch.cat([grp[1] for _, grp in drawn])
            mask = torch.cat([grp[2] for _, grp in drawn])
            behaviour = torch.cat([grp[4] for _, grp in drawn])
            with torch.no_grad():
                pi_t = token_logprobs(model, ids.repeat_interleave(k, 0), att.repeat_interleave(k, 0), resp,
                                      cfg.sampling_temperature)
            delta = _seq_mean(pi_t - behaviour, mask).view(len(drawn), k).double()
            limit = self.method.replay_max_abs_s
            for j, (_, grp) in enumerate(drawn):
                if limit is not None and float(delta[j].abs().max()) > limit:
                    stale += 1
                    continue
                kept.append((grp, pi_t[j * k:(j + 1) * k]))
                deltas.append(delta[j])
        groups = [(grp, grp[4]) for grp in fresh] + kept  # (group, pi_t log-probs)
        ids, att = self._pad([grp[0] for grp, _ in groups])
        out_delta = torch.zeros(len(groups), k, dtype=torch.float64)
        if deltas:
            out_delta[len(fresh):] = torch.stack(deltas)
        order = torch.randperm(len(groups), generator=gen).tolist()
        stats = {"replay_groups": float(len(kept)), "replay_drawn": float(len(drawn)), "replay_dropped": float(stale)}
        if drawn:
            stats["replay_abs_s_max"] = float(delta.abs().max())
        if deltas:
            stats["replay_ess"] = behaviour_stats(torch.stack(deltas))["ess_sum"] / len(deltas)
        return (ids.repeat_interleave(k, 0), att.repeat_interleave(k, 0), torch.cat([grp[1] for grp, _ in groups]),
                torch.cat([grp[2] for grp, _ in groups]), torch.cat([old for _, old in groups]),
                torch.stack([grp[3] for grp, _ in groups]), out_delta.to(torch.float32), order, stats)


def run_inprocess(method: Method, cfg: RLConfig, model_path: str,
                  on_row: Optional[Callable[[Dict], None]] = None, progress: bool = True,
                  desc: Optional[str] = None, start_eval: Optional[Dict] = None) -> Dict:
    """Train ``model_path``'s model with ``method`` for ``cfg.steps`` steps; return a summary.

    ``on_row`` receives one metrics dict per step (write it out as it arrives), preceded by a
    step-0 row with the held-out metrics of the starting model. ``start_eval`` may pass those in
    (they are the same for every method of a seed) instead of computing them again.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_lpo.demo.heldout import evaluate_heldout
    from openrlhf_lpo.demo.policy import decode, encode_prompts, sample_responses, token_logprobs
    from openrlhf_lpo.demo.task import extract_answer, get_task
    from openrlhf_lpo.demo.warmup import _bar

    cfg.validate()
    task = get_task(cfg.task)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Same prompts for every method: the stream depends on cfg.seed only.
    stream = task.stream(cfg.seed + 17, split="train")
    heldout_cfg = cfg.heldout()
    eval_steps = set(cfg.eval_steps())
    k, g = cfg.k, cfg.prompts_per_step
    g_mb = g // cfg.mini_batches
    schedule = method.divergence_schedule() if method.is_lpo else None
    replay = InprocessReplay(method, cfg, tokenizer.pad_token_id) if method.replay_batches else None
    t0 = time.time()
    rows = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    if 0 in eval_steps:
        ev = dict(start_eval) if start_eval is not None else evaluate_heldout(model, tokenizer, task, heldout_cfg)
        emit({"method": method.name, "step": 0, "backend": "inprocess", "elapsed_s": time.time() - t0, **ev})
    bar = _bar(cfg.steps, desc or method.name, progress)
    try:
        for step in range(1, cfg.steps + 1):
            ts = time.time()
            problems = [next(stream) for _ in range(g)]
            prompt_ids, prompt_mask = encode_prompts(tokenizer, [q for q, _ in problems])
            torch.manual_seed(cfg.seed * 1_000_003 + step)
            model.eval()
            responses, mask = sample_responses(model, tokenizer, prompt_ids, prompt_mask, k,
                                               task.max_answer_chars + 2, cfg.sampling_temperature)
            answers = [extract_answer(t) for t in decode(tokenizer, responses)]
            rewards = torch.tensor([float(task.is_correct(a, problems[i // k][1])) for i, a in enumerate(answers)],
                                   dtype=torch.float32).view(g, k)
            ids_rep = prompt_ids.repeat_interleave(k, dim=0)
            att_rep = prompt_mask.repeat_interleave(k, dim=0)
            with torch.no_grad():
                old_logp = token_logprobs(model, ids_rep, att_rep, responses, cfg.sampling_temperature)
            model.train()
            t_update = step - 1  # updates completed before this one (the schedule's step)
            divergence = schedule.divergence(t_update) if method.is_lpo else None
            # the step's groups: the fresh ones, plus replayed ones (with s_t = delta against their own
            # behaviour log-probs) under --lpo.replay_batches; fresh-only keeps the order and no delta
            b_ids, b_att, b_resp, b_mask, b_old, b_rewards, delta = ids_rep, att_rep, responses, mask, old_logp, \
                rewards, None
            order = list(range(g))
            replay_stats = {}
            if replay is not None:
                fresh_groups = [(prompt_ids[i][prompt_mask[i].bool()], responses[i * k:(i + 1) * k],
                                 mask[i * k:(i + 1) * k], rewards[i], old_logp[i * k:(i + 1) * k]) for i in range(g)]
                (b_ids, b_att, b_resp, b_mask, b_old, b_rewards, delta, order,
                 replay_stats) = replay.step_batch(model, tokenizer, fresh_groups, t_update, cfg)
                replay.add(fresh_groups, t_update)
            tau = listwise.group_temperature(b_rewards, method.temperature) * method.temperature_scale
            target = listwise.gibbs_target(b_rewards, tau, delta)
            advantages = listwise.pg_advantages(b_rewards, method.estimator) if not method.is_lpo else None
            grad_norms, entropies, losses = [], [], []
            for lo in range(0, len(order), g_mb):
                groups_mb = order[lo:lo + g_mb]
                gs = torch.tensor(groups_mb)
                rs = (gs[:, None] * k + torch.arange(k)).reshape(-1)
                n_mb = len(groups_mb)
                logp, ent = token_logprobs(model, b_ids[rs], b_att[rs], b_resp[rs],
                                           cfg.sampling_temperature, with_entropy=True)
                entropies.append(_seq_mean(ent.detach(), b_mask[rs]).mean().item())
                if method.is_lpo:
                    s = listwise.sequence_log_ratio(logp, b_old[rs], b_mask[rs], cfg.clip_eps).view(n_mb, k)
                    if delta is not None:
                        s = s + delta[gs]
                    loss = listwise.listwise_loss(s, target[gs], divergence)
                else:
                    loss = grpo_loss(logp, b_old[rs], b_mask[rs], advantages[gs].reshape(-1), cfg.clip_eps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)))
                opt.step()
                losses.append(loss.item())
            entropy = sum(entropies) / len(entropies)
            switched = schedule.observe(t_update, entropy) if method.is_lpo else False
            target = target[:g]  # the fresh groups' targets, for the KL after the update
            with torch.no_grad():
                new_logp = token_logprobs(model, ids_rep, att_rep, responses, cfg.sampling_temperature)
                s_after = _seq_mean(new_logp - old_logp, mask).view(g, k)
                kl = listwise.listwise_divergence(s_after, target, "fwd").mean().item()
            informative = 1.0 - listwise.degenerate_groups(rewards).float().mean().item()
            row = {
                "method": method.name, "step": step, "reward": rewards.mean().item(),
                "entropy": entropy, "grad_norm": sum(grad_norms) / len(grad_norms),
                "optimizer_steps": len(grad_norms), "fresh_rollouts": step * g * k,
                "kl_target": kl, "loss": sum(losses) / len(losses),
                "response_length": mask.sum(-1).float().mean().item(),
                "degenerate_groups": 1.0 - informative, "informative_groups": informative,
                "group_distinct_correct": group_distinct_correct(answers, rewards),
                "prompt_digest": digest(*[q for q, _ in problems]), "rollout_digest": digest(responses),
                "step_s": time.time() - ts, "elapsed_s": time.time() - t0, "backend": "inprocess",
            }
            if method.is_lpo and (method.schedule or method.temperature_scale != 1.0):
                row.update({"divergence_stage": float(schedule.stage(t_update)), "divergence_switched": float(switched),
                            "tau_mean": float(tau[torch.isfinite(tau)].mean()) if bool(torch.isfinite(tau).any())
                            else math.nan})
            row.update(replay_stats)
            if step in eval_steps:
                row.update(evaluate_heldout(model, tokenizer, task, heldout_cfg))
            emit(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.2f}", kl=f"{kl:.3f}")
    finally:
        if bar is not None:
            bar.close()
    last = [r for r in rows if "heldout_greedy" in r]
    return {"method": method.name, "config": asdict(cfg),
            "greedy_accuracy_start": last[0]["heldout_greedy"] if last and last[0]["step"] == 0 else math.nan,
            "greedy_accuracy_end": last[-1]["heldout_greedy"] if last else math.nan,
            "wall_s": time.time() - t0, "steps": sum(1 for r in rows if r["step"] > 0)}
