"""Test harness for the LPO OpenRLHF integration (imported by tests and by the gloo workers).

Real OpenRLHF 0.11.2 classes throughout: Actor (HF tiny Qwen3, sdpa), Experience,
RemoteExperienceMaker/LPOExperienceMaker, NaiveReplayBuffer, ActorPPOTrainer/LPOActorTrainer
(ppo_train, training_step), PolicyLoss, iter_grad_accum_global_norm. The only stand-in is the
strategy: ``CPUStrategy`` is DeepspeedStrategy with its DeepSpeed-engine/CUDA parts done in
plain torch (backward scaled by 1/gas, gradients averaged over the gloo DP group at the
accumulation boundary, exactly what the DeepSpeed engine does), and it records the gradient
of every optimizer step. Two CUDA queries (current_device / synchronize) are answered for
the CPU while the stock trainer/replay buffer are constructed.
"""

from __future__ import annotations

import copy
import math
import os
from contextlib import contextmanager
from typing import List
from unittest import mock

import sys

import torch
import torch.distributed as dist

# flash-attn's Triton cross-entropy kernel is importable here but needs a GPU; OpenRLHF's
# log_probs_from_logits falls back to plain torch when the import fails.
if not torch.cuda.is_available():
    sys.modules.setdefault("flash_attn.ops.triton.cross_entropy", None)

from openrlhf.models import Actor
from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
from openrlhf.utils.deepspeed import DeepspeedStrategy

from openrlhf_lpo import listwise
from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker
from openrlhf_lpo.openrlhf.vlm import mm_forward_kwargs
from openrlhf_lpo.tiny import build_tiny_model

MODEL_KW = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def tiny_model(root: str) -> str:
    return build_tiny_model(os.path.join(root, "tiny-qwen3-h32"), arch="qwen3", seed=0, **MODEL_KW)


def parse_args(model_dir, *, K=4, G=4, micro=4, train_batch=None, dp=1, estimator="lpo", packing=False,
               extra=()):
    argv = [
        "--actor.model_name_or_path", model_dir,
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", str(dp),
        "--rollout.n_samples_per_prompt", str(K), "--rollout.batch_size", str(G),
        "--rollout.micro_batch_size", str(K),
        "--train.batch_size", str(train_batch or G * K), "--train.micro_batch_size", str(micro),
        "--train.max_epochs", "1", "--vllm.num_engines", "1", "--reward.remote_url", "http://unused",
        "--ds.attn_implementation", "sdpa", "--algo.kl.init_coef", "0",
        "--algo.advantage.estimator", estimator,
    ]
    if packing:
        argv.append("--ds.packing_samples")
    return build_parser_and_parse(argv + list(extra))


class CPUStrategy(DeepspeedStrategy):
    """DeepspeedStrategy whose engine-side steps run in plain torch on the CPU (see module doc)."""

    def __init__(self, args):
        super().__init__(seed=args.train.seed, max_norm=0.0, micro_train_batch_size=args.train.micro_batch_size,
                         train_batch_size=args.train.batch_size, zero_stage=args.ds.zero_stage, args=args)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.accumulated_gradient = max(1, self.train_batch_size // self.micro_train_batch_size // self.world_size)
        self.ds_device_mesh = None
        self.micro_steps = 0
        self.step_grads: List[List[torch.Tensor]] = []
        self._last_norm = 0.0

    def backward(self, loss, model, optimizer, **kwargs):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        self.micro_steps += 1
        if self.micro_steps % self.accumulated_gradient:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dist.is_initialized() and self.world_size > 1:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world_size
        self.step_grads.append([p.grad.detach().clone() for p in params])
        self._last_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def get_grad_norm(self, model):
        return self._last_norm

    def all_reduce(self, data, op="mean"):
        if isinstance(data, dict):
            return {k: self.all_reduce(v, op) for k, v in data.items()}
        is_tensor = isinstance(data, torch.Tensor)
        t = data.detach().clone().double() if is_tensor else torch.tensor([float(data)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "mean":
                t /= self.world_size
        return t if is_tensor else t.item()

    def is_rank_0(self):
        return not dist.is_initialized() or dist.get_rank() == 0

    def print(self, *msg):
        pass


@contextmanager
def cpu_cuda_queries(device="cpu"):
    """Answer the CUDA queries the stock constructors (device index 0: a device object is only
    built, never used) and the stock ppo_train (where data goes: "cpu") make."""
    with mock.patch("torch.cuda.current_device", return_value=device), mock.patch("torch.cuda.synchronize"):
        yield


def make_actor(model_dir, packing=False, dtype=torch.float64):
    actor = Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", packing_samples=packing)
    actor.model.to(dtype)
    return actor


def make_rollout_samples(G, K, seed=0, vocab=(4, 90), pad_id=0):
    """Single-sample Experiences as SamplesGenerator makes them; group 0 has equal rewards."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for gi in range(G):
        plen = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(*vocab, (plen,), generator=g)
        if gi == 0:
            rewards = torch.ones(K)
        elif gi == 1:
            rewards = torch.zeros(K)
            rewards[0] = 1.0
        else:
            rewards = torch.rand(K, generator=g).round(decimals=2)
        for k in range(K):
            rlen = int(torch.randint(1, 10, (1,), generator=g))
            resp = torch.randint(*vocab, (rlen,), generator=g)
            seq = torch.cat([prompt, resp])
            n = seq.numel()
            action_mask = torch.zeros(n - 1, dtype=torch.long)
            action_mask[plen - 1:] = 1
            r = float(rewards[k])
            samples.append(Experience(
                sequences=seq.unsqueeze(0), attention_mask=torch.ones(1, n, dtype=torch.long),
                action_mask=action_mask.unsqueeze(0), prompts=[f"prompt-{gi}"], labels=[""],
                images=[None], mm_train_inputs=[None],
                rewards=torch.tensor([r]), scores=torch.tensor([r]),
                response_length=torch.tensor([rlen]), truncated=torch.tensor([False]),
                total_length=torch.tensor([float(n)]),
                info={"reward": torch.tensor([r]), "response_clip_ratio": torch.tensor([False])},
            ))
    return samples


class _Tok:
    pad_token_id = 0


def make_experiences(args, strategy, actor, samples, noise=0.05, seed=1, maker_cls=LPOExperienceMaker):
    """split_rollout_samples -> old log-probs from ``actor`` (+ noise, so s != 0) -> advantages."""
    maker = maker_cls(None, None, None, None, FixedKLController(0.0), strategy, _Tok())
    exps = maker.split_rollout_samples(copy.deepcopy(samples))
    g = torch.Generator().manual_seed(seed)
    for e in exps:
        with torch.no_grad():
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask, **mm_forward_kwargs(actor, e))
        if noise:
            lp = lp + noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype) * e.action_mask
        e.action_log_probs = lp
        e.kl = torch.zeros_like(lp)
        e.values = None
        e.info["kl"] = torch.zeros(len(e.sequences))
    return maker.compute_advantages_and_returns(exps)


def make_trainer(cls, args, strategy, actor, lr=0.0):
    optim = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    with cpu_cuda_queries(0):
        return cls(strategy, actor, None, optim, sched, micro_train_batch_size=args.train.micro_batch_size,
                   tokenizer=None, dataloader_pin_memory=False, eps_clip=args.actor.eps_clip, vllm_engines=None)


def rank_chunk(experiences, rank, dp):
    """OpenRLHF's RayActorGroup.async_run_method_batch split: ceil(E/dp) consecutive experiences."""
    size = math.ceil(len(experiences) / dp)
    return experiences[rank * size:(rank + 1) * size]


def run_lpo_step(args, actor, experiences, rank=0, dp=1):
    """One ppo_train of the real LPOActorTrainer; returns (step gradients, status, trainer)."""
    strategy = CPUStrategy(args)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor)
    for e in rank_chunk(experiences, rank, dp):
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries():
        status = trainer.ppo_train(0.0)
    return strategy.step_grads, status, trainer


def full_batch_listwise_grads(args, model_dir, state_dict, experiences, divergence, projection="listwise"):
    """Reference: one autograd call of the full-batch listwise loss (mean over all groups)."""
    K = args.rollout.n_samples_per_prompt
    actor = make_actor(model_dir, packing=False)
    actor.model.load_state_dict(state_dict)
    items = []
    for e in experiences:
        from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch
        items.extend(remove_padding_in_sequences(split_experience_batch(copy.deepcopy(e))))
    items.sort(key=lambda it: int(it.info["lpo_gid"]))
    batch = make_experience_batch(items)
    lp = actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask,
               **mm_forward_kwargs(actor, batch))
    s = listwise.sequence_log_ratio(lp.double(), batch.action_log_probs.double(), batch.action_mask, args.actor.eps_clip_low_high)
    target = torch.stack([torch.as_tensor(t) for t in batch.info["lpo_target"]]).double()
    loss = listwise.listwise_loss(s.view(-1, K), target.view(-1, K), divergence, projection)
    params = [p for p in actor.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params)), float(loss.detach())


def max_abs_diff(a, b):
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def max_abs(a):
    return max(float(x.double().abs().max()) for x in a)


# ----------------------------------------------------------------------------- gradient matrix

DIVERGENCE_CASES = ("fwd", "rev", "js")
PACKING_CASES = (False, True)


def micro_cases(K):
    return (1, K // 2, K, 2 * K)


def gradient_matrix(model_dir, dp=1, rank=0, K=4, G=4, seed=0, samples_fn=None, packing_cases=PACKING_CASES,
                    divergences=DIVERGENCE_CASES):
    """Run every (packing, micro, divergence) case of one optimizer step on this rank.

    Returns {case: {"grads": [...], "two_pass": float}} and, on rank 0, the references
    {divergence: grads} of the full-batch listwise loss (one autograd call).
    ``samples_fn(G, K, seed)`` makes the rollout samples (default: text, make_rollout_samples).
    """
    samples = (samples_fn or make_rollout_samples)(G, K, seed=seed)
    base = make_actor(model_dir, packing=False)
    state = {k: v.clone() for k, v in base.model.state_dict().items()}
    actors = {p: (base if not p else make_actor(model_dir, packing=True)) for p in packing_cases}
    results, refs = {}, {}
    exps_by_div = {}
    for div in divergences:
        args = parse_args(model_dir, K=K, G=G, micro=K, dp=dp, extra=["--lpo.divergence", div])
        base.model.load_state_dict(state)
        exps_by_div[div] = make_experiences(args, CPUStrategy(args), base, samples, seed=seed + 1)
        if rank == 0:
            refs[div], _ = full_batch_listwise_grads(args, model_dir, state, exps_by_div[div], div)
    for packing in packing_cases:
        for micro in micro_cases(K):
            for div in divergences:
                args = parse_args(model_dir, K=K, G=G, micro=micro, dp=dp, packing=packing,
                                  extra=["--lpo.divergence", div])
                actor = actors[packing]
                actor.model.load_state_dict(state)
                grads, status, _ = run_lpo_step(args, actor, exps_by_div[div], rank=rank, dp=dp)
                assert len(grads) == 1, f"expected one optimizer step, got {len(grads)}"
                results[(packing, micro, div)] = {"grads": grads[0], "two_pass": status["lpo/two_pass"]}
    return results, refs


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
                       **mm_forward_kwargs(actor, e)).double()
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
            tau = {"std": lambda: r.std(ddof=1), "one": lambda: 1.0, "mean": lambda: r.mean()}[temperature]() \
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
