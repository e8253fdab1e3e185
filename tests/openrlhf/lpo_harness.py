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


def check_matrix_row(row, rel_tol):
    """One exactness case: a non-trivial reference, every step within ``rel_tol`` of it, the expected
    source of c per window (two windows x two epochs; more with replayed groups), and P really moved
    between windows. Replay cases: the staleness filter kept exactly the drawn groups whose planted
    |s_t| is within the threshold, and dropped some."""
    assert row["scale"] > 1e-3, "reference gradient is trivially small; the check would be vacuous"
    assert row["rel"] < rel_tol, f"max |grad - reference| = {row['err']:.3e} ({row['rel']:.1e} relative)"
    n = row.get("n_steps", 4)
    expected = ["one_pass"] * n if row["whole"] else ["shortcut"] + ["pre_pass"] * (n - 1)
    assert row["modes"] == expected
    assert row["kl_moved"] > 1e-3, "the updates did not move P: later windows would not test fresh coefficients"
    if "replay" in row:
        rp = row["replay"]
        assert rp["trained"] and rp["stale"], f"the case must train replayed groups and drop stale ones: {rp}"
        assert rp["trained"] == rp["expected_trained"], rp
        assert rp["logged"] == {"lpo/replay_groups": len(rp["trained"]), "lpo/replay_dropped_stale": len(rp["stale"]),
                                "lpo/replay_drawn": len(rp["worst"]), "lpo/replay_dropped_layout": rp["trim"]}, rp


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


def max_abs_diff(a, b):
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def max_abs(a):
    return max(float(x.double().abs().max()) for x in a)


# ----------------------------------------------------------------------------- independent reference


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


def flat_items(experiences):
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    items = []
    for e in experiences:
        items.extend(remove_padding_in_sequences(split_experience_batch(copy.deepcopy(e))))
    return sorted(items, key=lambda it: int(it.info["lpo_gid"]))


def sample_key(item):
    """A sample's identity: its unpadded token ids."""
    return tuple(item.sequences.reshape(-1)[item.attention_mask.reshape(-1).bool()].tolist())


def reference_steps(model_dir, state_dict, experiences, windows, *, K, divergence="fwd", temperature="std",
                    correction=None, eps=(0.2, 0.2), lr=0.0, projection="listwise", kl_coef=0.0, entropy_coef=0.0,
                    behaviour=None, temperature_scale=1.0):
    """Window by window at the updated parameters: the gradient of the listwise loss averaged over
    each window's groups (one autograd call per window), then an SGD step of ``lr``. ``windows`` lists
    the global group ids of each optimizer step in training order. Targets and s_t are computed here
    independently (numpy) from the rewards and the behaviour log-probs (``behaviour``: the planted
    log-probs of replayed samples by :func:`sample_key`, whose s_t is the untruncated mean log-ratio
    unless ``correction`` is set; ``temperature_scale`` multiplies tau). ``kl_coef`` adds the k3 KL to
    the reference log-probs (``base_action_log_probs``) and ``entropy_coef`` subtracts the entropy, each
    as a token mean over the window. Returns the list of gradients."""
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
        grads.append([x.detach().clone() for x in g])
        with torch.no_grad():
            for p, x in zip(params, g):
                p -= lr * x
    return grads


def plan_group_windows(trainer, items, world=1):
    """The global group ids of each optimizer window of the trainer's last plan (all ranks)."""
    mine = [sorted({int(items[i].info["lpo_gid"]) for mb in w.micro_batches for i in mb})
            for w in trainer.last_window_plan]
    if world == 1:
        return mine
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return [sorted(set().union(*(r[w] for r in gathered))) for w in range(len(mine))]


# ----------------------------------------------------------------------------- gradient matrix

DIVERGENCE_CASES = ("fwd", "rev", "js")
FAMILY_CASES = ("hellinger", "tv", "alpha:0.5", "alpha:2", "alpha:-0.5")
PACKING_CASES = (False, True)
MATRIX_LR = 0.5  # large enough that later windows see s far from s_t (checked)


def micro_cases(K):
    return (1, K // 2, K, 2 * K)


def matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction=None, temperature="std", epochs=2,
                     budget=None, extra=()):
    """Two optimizer windows per rollout batch and two epochs: four steps per ppo_train. ``budget``:
    dynamic batching with that many tokens per micro-batch (OpenRLHF then forces packing)."""
    extra = ["--lpo.divergence", div, "--lpo.temperature", str(temperature), "--train.max_epochs", str(epochs),
             *extra]
    if budget is not None:
        extra += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(budget),
                  "--rollout.max_tokens_per_gpu", str(budget)]
    if correction is not None:
        mode, low, high = correction
        extra += ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", mode,
                  "--algo.advantage.is_correction_threshold", str(low), str(high)]
    return parse_args(model_dir, K=K, G=G, micro=micro, dp=dp, packing=packing, train_batch=G * K // 2,
                      extra=extra)


def run_matrix_case(model_dir, state, actor, samples, *, K, G, micro, dp, rank, packing, div, correction=None,
                    temperature="std", behaviour_noise=0.0, seed=1, budget=None, whole=None, composed=False,
                    replay=False, temperature_scale=1.0, replay_keep=None):
    extra = ["--algo.kl.use_loss", "--algo.kl.init_coef", "0.1", "--algo.kl.estimator", "k3",
             "--actor.entropy_coef", "0.01"] if composed else []
    if temperature_scale != 1.0:
        extra += ["--lpo.temperature_scale", str(temperature_scale)]
    behaviour, replay_info = None, None
    if replay:
        actor.model.load_state_dict(state)
        old_groups, behaviour, limit = replay_buffer_groups(actor, G + 2, K, seed=seed + 100)
        if replay_keep is not None:  # a threshold that lets exactly replay_keep of the drawn groups pass
            seed_args = matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction, temperature)
            limit = keep_threshold(actor, old_groups, behaviour, int(seed_args.train.seed), G, replay_keep)
        extra += ["--lpo.replay_batches", "2", "--lpo.replay_ratio", "1", "--lpo.replay_max_abs_s", repr(limit)]
    args = matrix_case_args(model_dir, K, G, micro, dp, packing, div, correction, temperature, budget=budget,
                            extra=extra)
    actor.model.load_state_dict(state)
    if replay:
        exps, replay_info = make_replay_experiences(args, CPUStrategy(args), actor, samples, old_groups, behaviour,
                                                    seed=seed, behaviour_noise=behaviour_noise)
    else:
        exps = make_experiences(args, CPUStrategy(args), actor, samples, seed=seed, behaviour_noise=behaviour_noise,
                                reference_noise=0.2 if composed else 0.0)
    actor.model.load_state_dict(state)
    grads, status, trainer = run_lpo_step(args, actor, exps, rank=rank, dp=dp, lr=MATRIX_LR,
                                          kl_ctl=0.1 if composed else 0.0)
    windows = plan_group_windows(trainer, trainer.replay_buffer.items, dp)
    result = {"grads": grads, "status": status, "modes": [w.mode for w in trainer.last_window_plan]}
    if rank == 0:
        result["refs"] = reference_steps(model_dir, state, exps, windows, K=K, divergence=div,
                                         temperature=temperature, correction=correction,
                                         eps=args.actor.eps_clip_low_high, lr=MATRIX_LR,
                                         kl_coef=0.1 if composed else 0.0, entropy_coef=0.01 if composed else 0.0,
                                         behaviour=behaviour, temperature_scale=temperature_scale)
        if replay:
            result["replay"] = replay_check(exps, replay_info, limit, dp, G)
    return result


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


def replay_check(experiences, info, limit, dp, n_fresh):
    """The drawn groups the staleness filter must keep (max |s_t| <= limit, computed by the harness), in
    draw order with the last ones trimmed until fresh + kept divides over the ranks, against what trained."""
    trained_keys = {sample_key(it) for it in flat_items(experiences)}
    passing = [g for g, w in enumerate(info["worst"]) if w <= limit]
    trim = (n_fresh + len(passing)) % dp
    trained = []
    for g, keys in enumerate(info["drawn"]):
        inside = [k in trained_keys for k in keys]
        assert all(inside) or not any(inside), "a replayed group was split"
        if all(inside):
            trained.append(g)
    st = info["status"]
    return {"trained": trained, "expected_trained": passing[:len(passing) - trim], "trim": trim,
            "stale": [g for g, w in enumerate(info["worst"]) if w > limit], "worst": info["worst"], "limit": limit,
            "logged": {k: int(st[k]) for k in ("lpo/replay_groups", "lpo/replay_dropped_stale", "lpo/replay_drawn",
                                               "lpo/replay_dropped_layout")}}


def matrix_cases(K, dp):
    """(name, kwargs) of the exactness matrix. dp 1: packing x micro (1, K/2, K, 2K) x divergence,
    the off-policy corrections and the temperatures; dp 2 (two processes, so a subset): micro-batches
    of at most the rank's window (K), fwd and js, one off-policy case per mode, one temperature."""
    micros = micro_cases(K) if dp == 1 else (1, K // 2, K)
    divs = DIVERGENCE_CASES if dp == 1 else ("fwd", "js")
    cases = [(f"packing={int(p)},micro={m},div={d}", dict(packing=p, micro=m, div=d))
             for p in PACKING_CASES for m in micros for d in divs]
    off_micros, off_divs = ((K // 2, K), ("fwd", "rev")) if dp == 1 else ((K // 2,), ("rev",))
    cases += [(f"offpolicy={mode},micro={m},div={d}", dict(packing=False, micro=m, div=d, behaviour_noise=0.3,
                                                            correction=(mode, 0.5, 1.5)))
              for mode in ("clip", "mask") for m in off_micros for d in off_divs]
    temps = ("one", "mean", 0.7) if dp == 1 else ("mean",)
    cases += [(f"temperature={t},micro={K // 2}", dict(packing=False, micro=K // 2, div="fwd", temperature=t))
              for t in temps]
    # dynamic batching (packing forced): a budget below a group's tokens splits groups (samples as
    # items, c from s_t / a pre-pass); larger budgets keep whole groups (one pass)
    budgets = ((16, False), (64, True), (1000, True)) if dp == 1 else ((16, False), (1000, True))
    cases += [(f"dynamic={b},micro=1,div={d}", dict(packing=True, micro=1, div=d, budget=b, whole=w))
              for b, w in budgets for d in (("fwd", "rev") if dp == 1 else ("fwd",))]
    # the stock KL loss (k3, coefficient 0.1) and entropy bonus (0.01) on top of the listwise loss
    cases += [(f"composed=kl+entropy,micro={m}", dict(packing=False, micro=m, div="fwd", composed=True))
              for m in ((K // 2, K) if dp == 1 else (K // 2,))]
    # the divergence family: closed-form c (two-pass) and autograd of the value (one pass)
    family = FAMILY_CASES if dp == 1 else ("alpha:0.5", "tv")
    cases += [(f"family={d},micro={m}", dict(packing=False, micro=m, div=d))
              for d in family for m in ((K // 2, K) if dp == 1 else (K // 2,))]
    cases += [(f"temperature=std,scale={x},micro={K // 2}", dict(packing=False, micro=K // 2, div="fwd",
                                                                  temperature_scale=x))
              for x in ((0.5, 2.0) if dp == 1 else (0.5,))]
    # listwise replay: fresh groups + replayed ones with planted behaviour log-probs, some stale
    replay = ([("fwd", K // 2, None), ("alpha:0.5", K, None), ("rev", K // 2, ("clip", 0.5, 1.5))] if dp == 1
              else [("rev", K // 2, None), ("fwd", 1, None)])
    cases += [(f"replay,micro={m},div={d}" + (f",offpolicy={c[0]}" if c else ""),
               dict(packing=False, micro=m, div=d, replay=True, correction=c, behaviour_noise=0.3 if c else 0.0))
              for d, m, c in replay]
    if dp == 2:  # 3 of the 4 drawn groups pass the filter: one more is dropped so both ranks hold 3 groups
        cases.append((f"replay,keep=3,micro={K // 2},div=fwd",
                      dict(packing=False, micro=K // 2, div="fwd", replay=True, replay_keep=3)))
    return cases


def gradient_matrix(model_dir, dp=1, rank=0, K=4, G=4, seed=0, samples_fn=None, cases=None):
    """Every (packing, micro, divergence) case, plus off-policy corrections and temperatures.

    Each case is one ppo_train of the real LPOActorTrainer with SGD (lr 0.5): two windows per
    rollout batch, two epochs, so the steps after the first see updated parameters. Returns, on
    rank 0, {case: {"err": max |step grad - reference| over steps, "scale", "modes"}}.
    ``samples_fn(G, K, seed=)`` makes the rollout samples (default: text, make_rollout_samples);
    ``cases`` the (name, kwargs) list (default: matrix_cases(K, dp)); vlm_harness.py passes both."""
    samples = (samples_fn or make_rollout_samples)(G, K, seed=seed)
    base = make_actor(model_dir, packing=False)
    state = {k: v.clone() for k, v in base.model.state_dict().items()}
    actors = {False: base}
    cases = matrix_cases(K, dp) if cases is None else cases
    table = {}
    for name, kw in cases:
        if kw["packing"] not in actors:
            actors[kw["packing"]] = make_actor(model_dir, packing=kw["packing"])
        r = run_matrix_case(model_dir, state, actors[kw["packing"]], samples, K=K, G=G, dp=dp, rank=rank, **kw)
        whole = kw.get("whole")
        if rank == 0:
            assert len(r["grads"]) == len(r["refs"]) and (len(r["grads"]) == 4 or kw.get("replay")), \
                (name, len(r["grads"]), len(r["refs"]))
            table[name] = {
                "n_steps": len(r["grads"]),
                **({"replay": r["replay"]} if "replay" in r else {}),
                "err": max(max_abs_diff(a, b) for a, b in zip(r["grads"], r["refs"])),
                "rel": max(max_abs_diff(a, b) / max_abs(b) for a, b in zip(r["grads"], r["refs"])),
                "scale": min(max_abs(b) for b in r["refs"]),
                "modes": r["modes"],
                "whole": kw["micro"] % K == 0 if whole is None else whole,
                "kl_moved": abs(r["status"]["lpo/kl_last"] - r["status"]["lpo/kl_start"]),
                "n_params": len(r["grads"][0]),
            }
    return table


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
