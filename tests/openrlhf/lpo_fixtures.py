"""Set-up for the LPO OpenRLHF tests (imported by tests, the gloo workers and the benchmarks).

Building things: the tiny Qwen3 and lpo-train's parse of a small recipe, the stand-in strategy, actors,
rollout samples (text, equal-length, benchmark-sized), experiences (also through the listwise replay
buffer, with planted behaviour log-probs), trainers and one ppo_train of them, plus sample identities
and the two gradient-comparison helpers. The independent references are in lpo_references.py, the
gradient-exactness matrix in lpo_matrix.py.

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
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.utils.deepspeed import DeepspeedStrategy

from openrlhf_lpo.cli.train_ppo_ray import build_parser_and_parse
from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer
from openrlhf_lpo.openrlhf.experience_maker import LPOExperienceMaker
from openrlhf_lpo.openrlhf.vlm import mm_forward_kwargs
from openrlhf_lpo.testing.tiny import build_tiny_model

MODEL_KW = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def tiny_model(root: str) -> str:
    return build_tiny_model(os.path.join(root, "tiny-qwen3-h32"), arch="qwen3", seed=0, **MODEL_KW)


def parse_args(model_dir, *, K=4, G=4, micro=4, train_batch=None, dp=1, estimator="lpo", packing=False,
               extra=()):
    """lpo-train's parse of a small recipe (later ``extra`` flags override the defaults)."""
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
        # DeepSpeed's gas: train/(micro*world), or 1 under dynamic batching (the trainer steps itself)
        self.accumulated_gradient = 1 if args.train.dynamic_batch_enable else max(
            1, self.train_batch_size // self.micro_train_batch_size // self.world_size)
        self.ds_device_mesh = None
        self.micro_steps = 0
        self.boundary = None  # DeepSpeed's set_gradient_accumulation_boundary (None: counter-managed)
        self.step_grads: List[List[torch.Tensor]] = []
        self._last_norm = 0.0

    # the engine methods the LPO trainer calls on ``actor.model`` (attached by make_trainer)
    def set_gradient_accumulation_boundary(self, is_boundary):
        self.boundary = is_boundary

    def gradient_accumulation_steps(self):
        return self.accumulated_gradient

    def backward(self, loss, model, optimizer, **kwargs):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        self.micro_steps += 1
        at_boundary = self.boundary if self.boundary is not None else self.micro_steps % self.accumulated_gradient == 0
        if not at_boundary:
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
        inner = getattr(model, "model", model)
        inner.global_steps = int(getattr(inner, "global_steps", 0)) + 1  # DeepSpeed's optimizer-step count

    def get_grad_norm(self, model):
        return self._last_norm

    def all_reduce(self, data, op="mean"):
        if isinstance(data, dict):
            return {k: self.all_reduce(v, op) for k, v in data.items()}
        is_tensor = isinstance(data, torch.Tensor)
        # tensors keep their dtype, as DeepspeedStrategy.all_reduce does (stock code reduces int counts)
        t = data.detach().clone() if is_tensor else torch.tensor([float(data)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "mean":
                t = t / self.world_size
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


# ----------------------------------------------------------------------------- rollout samples


def group_rewards(gi, K, g):
    """Rewards of group ``gi``: group 0 all equal (degenerate), group 1 one success, others random."""
    if gi == 0:
        return torch.ones(K)
    if gi == 1:
        rewards = torch.zeros(K)
        rewards[0] = 1.0
        return rewards
    return torch.rand(K, generator=g).round(decimals=2)


def rollout_sample(prompt, response, reward, prompt_text, images=None, mm=None):
    """One single-sample Experience as OpenRLHF's SamplesGenerator makes it."""
    seq = torch.cat([prompt, response])
    n, plen = seq.numel(), prompt.numel()
    action_mask = torch.zeros(n - 1, dtype=torch.long)
    action_mask[plen - 1:] = 1
    r = float(reward)
    return Experience(
        sequences=seq.unsqueeze(0), attention_mask=torch.ones(1, n, dtype=torch.long),
        action_mask=action_mask.unsqueeze(0), prompts=[prompt_text], labels=[""],
        images=[images], mm_train_inputs=[mm],
        rewards=torch.tensor([r]), scores=torch.tensor([r]),
        response_length=torch.tensor([response.numel()]), truncated=torch.tensor([False]),
        total_length=torch.tensor([float(n)]),
        info={"reward": torch.tensor([r]), "response_clip_ratio": torch.tensor([False])},
    )


def make_rollout_samples(G, K, seed=0, vocab=(4, 90), pad_id=0):
    """Single-sample Experiences as SamplesGenerator makes them; group 0 has equal rewards."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for gi in range(G):
        plen = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(*vocab, (plen,), generator=g)
        rewards = group_rewards(gi, K, g)
        for k in range(K):
            rlen = int(torch.randint(1, 10, (1,), generator=g))
            resp = torch.randint(*vocab, (rlen,), generator=g)
            samples.append(rollout_sample(prompt, resp, rewards[k], f"prompt-{gi}"))
    return samples


def equal_length_samples(seed: int, n_groups: int, group_size: int, length: int) -> list:
    """Rollout samples whose responses all have ``length`` tokens (token-mean = sequence-mean weighting);
    group 0 has rewards (1, 0, ..., 0), the others random tenths."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for gi in range(n_groups):
        prompt = torch.randint(4, 90, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        first = torch.zeros(group_size)
        first[0] = 1.0
        rewards = torch.rand(group_size, generator=g).round(decimals=1) if gi else first
        for k in range(group_size):
            samples.append(rollout_sample(prompt, torch.randint(4, 90, (length,), generator=g), rewards[k],
                                          f"prompt-{gi}"))
    return samples


def benchmark_inputs(root, G, K, resp_len, hidden, layers, seed=0):
    """The benchmarks' tiny Qwen3 (hidden ``hidden``, ``layers`` layers) and G x K rollout samples with
    responses of ~``resp_len`` tokens (uniform in [0.5, 1.5) x resp_len): (model_dir, samples)."""
    model_dir = build_tiny_model(os.path.join(root, "tiny"), hidden_size=hidden, num_layers=layers, num_heads=4,
                                 num_kv_heads=2, head_dim=hidden // 4, intermediate_size=3 * hidden)
    gen = torch.Generator().manual_seed(seed)
    samples = make_rollout_samples(G, K, seed=seed)
    for s in samples:
        plen = int(s.action_mask.shape[1] - s.action_mask.sum() + 1)
        rlen = max(1, int(resp_len * (0.5 + torch.rand(1, generator=gen).item())))
        seq = torch.cat([s.sequences[0, :plen], torch.randint(4, 90, (rlen,), generator=gen)])
        mask = torch.zeros(seq.numel() - 1, dtype=torch.long)
        mask[plen - 1:] = 1
        s.sequences, s.attention_mask, s.action_mask = seq[None], torch.ones(1, seq.numel(), dtype=torch.long), mask[None]
        s.response_length, s.total_length = torch.tensor([rlen]), torch.tensor([float(seq.numel())])
    return model_dir, samples


# ----------------------------------------------------------------------------- experiences and trainers


class _Tok:
    pad_token_id = 0


def make_experiences(args, strategy, actor, samples, noise=0.0, seed=1, maker_cls=LPOExperienceMaker,
                     behaviour_noise=0.0, reference_noise=0.0):
    """split_rollout_samples -> old log-probs from ``actor`` -> advantages.

    ``noise`` perturbs the old log-probs themselves (s != 0 at the start: only for metrics of PG
    estimators, whose trainer never assumes the old log-probs are the actor's). ``behaviour_noise``
    makes the rollout's behaviour log-probs (``rollout_log_probs`` = old + noise): the off-policy
    data LPO corrects for with s_t (offpolicy.py)."""
    maker = maker_cls(None, None, None, None, FixedKLController(0.0), strategy, _Tok())
    exps = maker.split_rollout_samples(copy.deepcopy(samples))
    g = torch.Generator().manual_seed(seed)
    for e in exps:
        with torch.no_grad():
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask, **mm_forward_kwargs(actor, e))
        if noise:
            lp = lp + noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype) * e.action_mask
        if behaviour_noise:
            e.rollout_log_probs = (lp + behaviour_noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype)) \
                * e.action_mask
        e.action_log_probs = lp
        if reference_noise:  # a reference policy near the actor, for --algo.kl.use_loss
            e.base_action_log_probs = (lp + reference_noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype)) \
                * e.action_mask
        e.kl = torch.zeros_like(lp)
        e.values = None
        e.info["kl"] = torch.zeros(len(e.sequences))
    return maker.compute_advantages_and_returns(exps)


def make_trainer(cls, args, strategy, actor, lr=0.0):
    optim = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    # the DeepSpeed engine's accumulation interface, as DeepSpeed implements it (see CPUStrategy)
    actor.model.set_gradient_accumulation_boundary = strategy.set_gradient_accumulation_boundary
    actor.model.gradient_accumulation_steps = strategy.gradient_accumulation_steps
    actor.model.global_steps = 0  # DeepSpeed's engine counts optimizer steps (the window shuffle reads it)
    with cpu_cuda_queries(0):
        return cls(strategy, actor, None, optim, sched, micro_train_batch_size=args.train.micro_batch_size,
                   tokenizer=None, dataloader_pin_memory=False, eps_clip=args.actor.eps_clip, vllm_engines=None)


def rank_chunk(experiences, rank, dp):
    """OpenRLHF's RayActorGroup.async_run_method_batch split: ceil(E/dp) consecutive experiences."""
    size = math.ceil(len(experiences) / dp)
    return experiences[rank * size:(rank + 1) * size]


def run_lpo_step(args, actor, experiences, rank=0, dp=1, lr=0.0, kl_ctl=0.0):
    """One ppo_train of the real LPOActorTrainer; returns (step gradients, status, trainer)."""
    strategy = CPUStrategy(args)
    trainer = make_trainer(LPOActorTrainer, args, strategy, actor, lr=lr)
    for e in rank_chunk(experiences, rank, dp):
        trainer.replay_buffer.append(copy.deepcopy(e))
    with cpu_cuda_queries():
        status = trainer.ppo_train(kl_ctl)
    return strategy.step_grads, status, trainer


def plan_group_windows(trainer, items, world=1):
    """The global group ids of each optimizer window of the trainer's last plan (all ranks)."""
    mine = [sorted({int(items[i].info["lpo_gid"]) for mb in w.micro_batches for i in mb})
            for w in trainer.last_update.windows]
    if world == 1:
        return mine
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return [sorted(set().union(*(r[w] for r in gathered))) for w in range(len(mine))]


def flat_items(experiences):
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    items = []
    for e in experiences:
        items.extend(remove_padding_in_sequences(split_experience_batch(copy.deepcopy(e))))
    return sorted(items, key=lambda it: int(it.info["lpo_gid"]))


def sample_key(item):
    """A sample's identity: its unpadded token ids."""
    return tuple(item.sequences.reshape(-1)[item.attention_mask.reshape(-1).bool()].tolist())


def max_abs_diff(a, b):
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def max_abs(a):
    return max(float(x.double().abs().max()) for x in a)


# ----------------------------------------------------------------------------- listwise replay


def replay_buffer_groups(actor, n_groups, K, seed):
    """``n_groups`` old prompt groups (prompts 'old-prompt-i') whose behaviour log-probs are planted: the
    actor's own plus per-group Gaussian noise of growing scale (0.02 ... 0.6), so some groups are stale.
    Returns (groups of single-sample Experiences with rollout_log_probs, {sample_key: planted log-probs},
    a staleness threshold between the groups' max |s_t| values: their median)."""
    import numpy as np

    samples = make_rollout_samples(n_groups, K, seed=seed, vocab=(4, 90))
    g = torch.Generator().manual_seed(seed)
    scales = np.linspace(0.02, 0.6, n_groups)
    groups, planted = [], {}
    for gi in range(n_groups):
        members = samples[gi * K:(gi + 1) * K]
        for m in members:
            m.prompts = [f"old-prompt-{gi}"]
            with torch.no_grad():
                lp = actor(m.sequences, m.action_mask, attention_mask=m.attention_mask).double()
            mu = ((lp + scales[gi] * torch.randn(lp.shape, generator=g, dtype=lp.dtype)) * m.action_mask).float()
            m.rollout_log_probs = mu
            planted[sample_key(m)] = mu.double()[0].numpy()
        groups.append(members)
    limit = float(np.median([_max_abs_s(actor, grp, planted) for grp in groups]))
    return groups, planted, limit


def _buffer(old_groups, seed):
    """The replay buffer make_replay_experiences starts from: the old groups as two earlier batches."""
    from openrlhf_lpo.openrlhf.replay import ReplayBuffer

    buf = ReplayBuffer(2, seed)
    half = len(old_groups) // 2
    for batch, born in ((old_groups[:half], 1), (old_groups[half:], 2)):
        if batch:
            buf.add(batch, step=born)
    return buf


def _max_abs_s(actor, group, behaviour):
    """max_k |mean_t (log pi_t - log mu)| of a group: pi_t from ``actor`` (one sample at a time), mu planted."""
    worst = 0.0
    for m in group:
        with torch.no_grad():
            lp = actor(m.sequences, m.action_mask, attention_mask=m.attention_mask).double()[0].numpy()
        mask = m.action_mask[0].double().numpy()
        mu = behaviour[sample_key(m)][:mask.shape[0]]
        worst = max(worst, abs(float(((lp - mu) * mask).sum() / max(mask.sum(), 1))))
    return worst


def keep_threshold(actor, old_groups, behaviour, seed, n_draw, keep, step=3):
    """A staleness threshold between the ``keep``-th and the next smallest max |s_t| of the groups the
    seeded draw of make_replay_experiences picks."""
    worst = sorted(_max_abs_s(actor, g, behaviour) for g in _buffer(old_groups, seed).draw(n_draw, step))
    return (worst[keep - 1] + worst[keep]) / 2


def make_replay_experiences(args, strategy, actor, fresh, old_groups, behaviour=None, seed=1, step=3,
                            behaviour_noise=0.0):
    """LPOExperienceMaker.make_experience_batch's replay path (replay_samples -> the old-log-prob forward,
    done here with ``actor`` -> after_replay_forward -> advantages) with a buffer holding ``old_groups``
    as two earlier rollout batches. Returns (experiences, info): the drawn groups' keys and, from the
    planted ``behaviour`` and the actor's own per-sample forward at the start parameters, their max |s_t|."""
    maker = LPOExperienceMaker(None, None, None, None, FixedKLController(0.0), strategy, _Tok())
    maker.replay = _buffer(old_groups, int(args.train.seed))
    maker.replay_step = step
    want = int(args.lpo.replay_ratio * (len(fresh) // args.rollout.n_samples_per_prompt))
    drawn_groups = copy.deepcopy(maker.replay).draw(want, step)  # the same seeded draw, to name the groups
    drawn = [tuple(sample_key(m) for m in grp) for grp in drawn_groups]
    worst = [_max_abs_s(actor, grp, behaviour) for grp in drawn_groups] if behaviour else []
    fresh = copy.deepcopy(fresh)
    if behaviour_noise:  # the engine's log-probs of the fresh rollout (the correction is on)
        g = torch.Generator().manual_seed(seed)
        for m in fresh:
            with torch.no_grad():
                lp = actor(m.sequences, m.action_mask, attention_mask=m.attention_mask)
            m.rollout_log_probs = ((lp + behaviour_noise * torch.randn(lp.shape, generator=g, dtype=lp.dtype))
                                   * m.action_mask).float()
    samples_list, draw = maker.replay_samples(fresh)
    for e in samples_list:
        with torch.no_grad():
            lp = actor(e.sequences, e.action_mask, attention_mask=e.attention_mask, **mm_forward_kwargs(actor, e))
        e.action_log_probs = lp
        e.kl = torch.zeros_like(lp)
        e.values = None
        e.info["kl"] = torch.zeros(len(e.sequences))
    exps = maker.after_replay_forward(samples_list, draw)
    exps = maker.compute_advantages_and_returns(exps)
    return exps, {"drawn": drawn, "worst": worst, "status": dict(maker.last_replay_stats), "buffer": maker.replay}
