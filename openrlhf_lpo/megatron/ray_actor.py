"""Ray policy actor backed by :class:`MegatronActor`: the Megatron stand-in for OpenRLHF's
DeepSpeed ``PolicyModelActor`` (0.11.2), with the methods OpenRLHF's trainer calls on the
policy actor group:

``init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)``, ``forward``
(old log-probs, batched through ``execute_batch``), ``append(experience)``, ``fit(kl_ctl)``,
``broadcast_to_vllm()``, ``save_checkpoint(tag, client_states)``, ``get_checkpoint_states()``,
``save_model()``, ``reload_states()`` / ``offload_states()`` / ``empty_cache()``.

Rank order: megatron is initialised with ``order="tp-cp-ep-pp-dp"`` so the ``tp*pp`` ranks of
one model replica are consecutive Ray actors; with ``duplicate_actors = tp*pp`` in the
``RayActorGroup`` every replica receives one chunk of experiences, as OpenRLHF's chunking
expects (see :func:`openrlhf_lpo.megatron.flags`).

Weights to the rollout engines (:mod:`.vllm_sync`), sleep between phases (:mod:`.sleep`) and checkpoints
(:mod:`.actor_checkpoints`) are mixins of :class:`MegatronPolicyActor`.

Training (``fit``): the replica's experiences are merged into one padded batch and handed to
``core.update.run_update`` (the update loop written once for both backends: windows of whole prompt groups
for LPO or of ``--train.batch_size / dp`` samples for a policy-gradient estimator, shuffled from
``--train.seed``, micro-batches of ``--train.micro_batch_size`` samples or ``--train.max_tokens_per_gpu``
tokens, where each window's c comes from, the metric set of core/metrics.py) with :class:`MegatronEngine`:
one :meth:`MegatronActor.train_step` per window, its no-grad ``log_probs`` for s, reductions over the
data-parallel group. KL loss (``--algo.kl.use_loss``, reference log-probs from OpenRLHF's DeepSpeed
reference actor as upstream) and the entropy bonus are token means over the window, as on DeepSpeed.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

from dataclasses import replace

from openrlhf_lpo.core.update import (StepResult, UpdateBatch, UpdateEngine, UpdateSettings, Window, WindowMode,
                                      run_update)
from openrlhf_lpo.megatron.actor_checkpoints import CKPT_SUBDIR, CheckpointMixin
from openrlhf_lpo.megatron.device import group_device as _group_device
from openrlhf_lpo.megatron.losses import LossSpec
from openrlhf_lpo.megatron.sleep import SleepMixin, _is_weight  # noqa: F401  (_is_weight: tests)
from openrlhf_lpo.megatron.vllm_sync import SYNC_IN_FLIGHT, VLLM_ENGINE_DTYPE, VLLMSyncMixin, colocated  # noqa: F401

_BaseModelActor = None


def _base():
    global _BaseModelActor
    if _BaseModelActor is None:
        from openrlhf.trainer.ray.launcher import BaseModelActor

        _BaseModelActor = BaseModelActor
    return _BaseModelActor


# ----------------------------------------------------------------------------- batching


def merge_experiences(experiences) -> Dict[str, torch.Tensor]:
    """Concatenate OpenRLHF ``Experience`` objects (possibly different prompt/response widths)
    into one batch: prompts re-left-padded to the widest prompt, responses right-padded."""
    P = max(e.sequences.shape[1] - e.action_mask.shape[1] for e in experiences)
    A = max(e.action_mask.shape[1] for e in experiences)
    out: Dict[str, List[torch.Tensor]] = {k: [] for k in ("sequences", "attention_mask", "action_mask", "old_log_probs")}
    extra: Dict[str, List[torch.Tensor]] = {}
    for e in experiences:
        b, S = e.sequences.shape
        a = e.action_mask.shape[1]
        p = S - a
        seq = torch.zeros(b, P + A, dtype=e.sequences.dtype)
        am = torch.zeros(b, P + A, dtype=torch.long)
        seq[:, P - p : P + a] = e.sequences.cpu()
        am[:, P - p : P + a] = e.attention_mask.cpu().long()
        act = torch.zeros(b, A, dtype=torch.bool)
        act[:, :a] = e.action_mask.cpu().bool()
        old = torch.zeros(b, A, dtype=torch.float32)
        old[:, :a] = e.action_log_probs.cpu().float()
        for k, v in (("sequences", seq), ("attention_mask", am), ("action_mask", act), ("old_log_probs", old)):
            out[k].append(v)
        for src, dst in (("advantages", "advantages"), ("base_action_log_probs", "base_log_probs"),
                         ("rollout_log_probs", "rollout_log_probs")):
            if getattr(e, src, None) is not None:  # per action token, right-padded like old_log_probs
                t = torch.zeros(b, A, dtype=torch.float32)
                t[:, :a] = getattr(e, src).cpu().float()
                extra.setdefault(dst, []).append(t)
        info = getattr(e, "info", None) or {}
        for key in ("lpo_target", "lpo_gid", "lpo_prev_log_ratio", "lpo_reward", "lpo_tau"):
            if key in info and info[key] is not None:
                v = info[key]
                v = torch.as_tensor(v) if not isinstance(v, torch.Tensor) else v
                extra.setdefault(key, []).append(v.reshape(-1).cpu())
    batch = {k: torch.cat(v) for k, v in out.items()}
    batch.update({k: torch.cat(v) for k, v in extra.items()})
    if "lpo_target" in batch:  # float64 until use, as on DeepSpeed (exact targets)
        batch["target"] = batch.pop("lpo_target").double()
    if "lpo_prev_log_ratio" in batch:  # s_t, already inside w* = softmax(R/tau + s_t); kept for metrics
        batch["prev_log_ratio"] = batch.pop("lpo_prev_log_ratio").double()
    return batch


from openrlhf_lpo.megatron.pipeline_plan import _get  # noqa: E402  (args.a.b with a default)


def loss_spec_from_args(args, kl_ctl: float = 0.0) -> LossSpec:
    """The loss of ``fit``'s windows from the flags: ``listwise`` for LPO (each window's plan picks one pass or the
    surrogate, and the update's divergence), ``pg`` (OpenRLHF's ``PolicyLoss`` or a registered type) otherwise."""
    est = args.algo.advantage.estimator
    K = args.rollout.n_samples_per_prompt
    lo, hi = getattr(args.actor, "eps_clip_low_high", None) or (args.actor.eps_clip, args.actor.eps_clip)
    use_kl = bool(_get(args, "algo.kl.use_loss", False)) and float(_get(args, "algo.kl.init_coef", 0.0)) > 0
    common = dict(group_size=K, kl_coef=float(kl_ctl) if use_kl else 0.0,
                  kl_estimator=_get(args, "algo.kl.estimator", "k1"),
                  kl_unbiased_gradient=bool(_get(args, "algo.kl.unbiased_gradient", False)),
                  entropy_coef=float(_get(args, "actor.entropy_coef", 0.0) or 0.0))
    if est == "lpo":
        from openrlhf_lpo.core.config import LPOConfig
        from openrlhf_lpo.core.offpolicy import correction_from_args

        lpo = LPOConfig.from_args(args)
        level = _get(args, "algo.advantage.is_correction_level", "off")
        return LossSpec(
            name="listwise",
            divergence=lpo.divergence,
            projection=lpo.projection,
            clip_eps=(lo, hi) if lo != hi else lo,
            correction=correction_from_args(args) if level not in (None, "off") else None,
            score=lpo.score,
            **common,
        )
    adv = _get(args, "algo.advantage")
    correction = tuple(getattr(adv, k, d) for k, d in (("is_correction_level", "off"), ("is_correction_mode", "clip"),
                                                        ("is_correction_gating", "ratio"),
                                                        ("is_correction_threshold", (0.5, 5.0))))
    from openrlhf_lpo.core.policy_loss import policy_loss_options

    return LossSpec(name="pg", clip_eps=(lo, hi), loss_agg_mode=getattr(args.actor, "loss_agg_mode", "seq-mean-token-mean"),
                    dual_clip=_get(args, "actor.dual_clip"), policy_loss_type=_get(args, "actor.policy_loss_type", "ppo"),
                    is_correction=correction, type_options=policy_loss_options(args), seed=int(args.train.seed), **common)


class MegatronEngine(UpdateEngine):
    """core.update's engine over one replica's merged batch: ``MegatronActor.train_step`` per window, its no-grad
    ``log_probs`` for s, the reductions over the data-parallel group."""

    def __init__(self, policy: "MegatronPolicyActor", batch: Dict[str, torch.Tensor], spec: LossSpec):
        self.actor = policy.actor
        self.batch = batch
        self.spec = spec
        self.group = self.actor.ps.get_data_parallel_group()

    def update_index(self) -> int:
        return int(self.actor.step)  # optimizer steps before this update (restored by a resume)

    def all_reduce(self, values: List[float], op: str) -> List[float]:
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        t = torch.tensor(values, dtype=torch.float64, device=_group_device(self.group))
        dist.all_reduce(t, op=ops[op], group=self.group)
        return t.tolist()

    def forward_s(self, micro_batches: List[List[int]], extra: int = 0) -> torch.Tensor:
        from openrlhf_lpo.core.loss import log_ratio

        rows = [i for mb in micro_batches for i in mb]
        if not rows:  # (a data-parallel peer's forwards do not wait on this replica)
            return torch.zeros(0, dtype=torch.float64)
        b = self.batch
        lp = self.actor.log_probs({k: b[k] for k in ("sequences", "attention_mask", "action_mask")},
                                  micro_batches=micro_batches).double().cpu()
        idx = torch.tensor(rows, dtype=torch.long)
        rollout, prev = b.get("rollout_log_probs"), b.get("prev_log_ratio")
        lpo = self.spec.name != "pg"
        return log_ratio(lp[idx], b["old_log_probs"][idx].double(), b["action_mask"][idx],
                         rollout[idx] if rollout is not None else None,
                         prev[idx] if prev is not None and lpo else None, self.spec.clip_eps,
                         self.spec.correction if lpo else None, self.spec.score if lpo else "mean_clip")

    def step(self, window: Window) -> StepResult:
        plan = window.plan
        idx = torch.tensor(plan.indices, dtype=torch.long)
        sub = {k: v[idx] for k, v in self.batch.items() if isinstance(v, torch.Tensor) and k != "lpo_gid"}
        micro, lo = [], 0
        for mb in plan.micro_batches:  # rows of ``sub`` are the plan's indices in order
            micro.append(list(range(lo, lo + len(mb))))
            lo += len(mb)
        spec = self.spec
        if plan.mode is not None:
            spec = replace(spec, name="listwise" if plan.mode is WindowMode.ONE_PASS else "listwise_surrogate",
                           divergence=window.divergence)
        out = self.actor.train_step(sub, spec, micro_batches=micro, coefficients=window.coefficients)
        return StepResult(sums=out["sums"], grad_norm=out["grad_norm"], lr=out["lr"], s=out["s"])


TE_CHOICES = {"auto": None, "on": True, "off": False}  # --megatron.te -> MegatronActorConfig.use_te


def megatron_config_from_args(args):
    from openrlhf_lpo.megatron.actor import MegatronActorConfig

    m = args.megatron
    adam = args.actor.adam
    betas = tuple(getattr(adam, "betas", (0.9, 0.95)))
    return MegatronActorConfig(
        tp=m.tp,
        pp=m.pp,
        vpp=getattr(m, "vpp", 1),
        params_dtype=getattr(m, "params_dtype", "bf16"),
        lr=adam.lr,
        weight_decay=getattr(adam, "weight_decay", 0.0),
        adam_betas=betas,
        adam_eps=getattr(adam, "eps", 1e-8),
        clip_grad=args.actor.max_norm,
        use_distributed_optimizer=bool(getattr(m, "distributed_optimizer", False)),
        micro_batch_size=args.train.micro_batch_size,
        temperature=args.rollout.temperature,
        seed=int(args.train.seed),
        recompute=bool(getattr(args.actor, "gradient_checkpointing_enable", False)),
        sequence_parallel=bool(getattr(m, "sequence_parallel", False)),
        timeout_minutes=int(getattr(m, "timeout_minutes", 60)),
        save_timeout_minutes=int(getattr(m, "save_timeout_minutes", 360)),
        use_te=TE_CHOICES[getattr(m, "te", "off")],
        lr_scheduler=getattr(args.actor, "lr_scheduler", "constant"),
        lr_warmup_ratio=float(getattr(args.actor, "lr_warmup_ratio", 0.0)),
        min_lr_ratio=float(getattr(args.actor, "min_lr_ratio", 0.1)),
    )


def refuse_unsupported(args) -> None:
    """Raise ``ValueError`` naming a flag the Megatron actor cannot honour (checked again at start-up)."""
    if _get(args, "ds.enable_sleep", False) and not _get(args, "train.colocate_all", False):
        raise ValueError(
            "--ds.enable_sleep without --train.colocate_all: with --backend megatron it offloads the actor to "
            "host memory between phases, which only frees memory for vLLM engines that share the actor's GPUs; "
            "add --train.colocate_all (with --vllm.enable_sleep), or drop --ds.enable_sleep"
        )


class MegatronPolicyActor(VLLMSyncMixin, SleepMixin, CheckpointMixin):
    """Mixin body; :func:`remote_class` binds it onto OpenRLHF's ``BaseModelActor``. The weight sync, sleep and
    checkpoints live in :mod:`.vllm_sync`, :mod:`.sleep` and :mod:`.actor_checkpoints`."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        from datetime import timedelta

        import torch.distributed as dist
        from transformers import AutoConfig, AutoTokenizer

        from openrlhf_lpo.megatron.actor import MegatronActor
        from openrlhf_lpo.megatron.device import init_default_group, set_local_device
        from openrlhf_lpo.megatron.hub import resolve_pretrained

        self.strategy = strategy
        args = self.args = strategy.args
        refuse_unsupported(args)
        self.vllm_engines = vllm_engines
        self.max_steps = max_steps
        cfg = megatron_config_from_args(args)
        cfg.scheduler_steps = max_steps  # the DeepSpeed actor's scheduler_steps (OpenRLHF's max_steps)
        set_local_device(int(os.environ.get("LOCAL_RANK", "0")))
        # a hub id is downloaded before the process group exists: no communicator (and no NCCL watchdog) is
        # live while a node fetches the weights; ranks that finish first wait in the group's rendezvous,
        # bounded by --megatron.timeout_minutes (cluster review 2, N10; docs/megatron.md)
        local = resolve_pretrained(pretrain)
        if not dist.is_initialized():
            init_default_group(timedelta(minutes=cfg.timeout_minutes))
        self.hf_config = AutoConfig.from_pretrained(local)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.pretrain = local
        self.actor = MegatronActor(self.hf_config, cfg, hf_weights=local)
        self.buffer = []
        self.lpo_divergence = None  # --lpo.divergence_schedule: set by the driver before an update that changes it
        self.checkpoint_states = {}
        root = os.path.join(args.ckpt.path, CKPT_SUBDIR)
        if args.ckpt.load_enable and os.path.exists(os.path.join(root, "latest")):
            # the window shuffle follows the restored optimizer-step count (core.update.window_generator)
            state = self.actor.load_checkpoint(root)
            self.checkpoint_states = state.get("client_states", {})
        self._model_update_group = None
        if dist.get_rank() == 0:  # what lpo-train --dry-run warns about the pipeline (PP > 1), in the run's log
            import sys

            from openrlhf_lpo.megatron.pipeline_plan import pipeline_warnings

            for line in pipeline_warnings(args):
                print(f"[megatron] WARNING: {line}", file=sys.stderr, flush=True)
        if vllm_engines and not colocated(args) and not self._engines_take_state_dicts() and dist.get_rank() == 0:
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

            ActorPPOTrainer._init_vllm_sync_group(self, getattr(args.vllm, "sync_backend", "nccl"))
        self._weights_off = self._state_off = None  # HostOffloads while asleep
        self.sleep_log: List[dict] = []
        dist.barrier()
        if _get(args, "ds.enable_sleep", False):  # the first phase is generation (OpenRLHF offloads at start too)
            self.offload_states()

    # --------------------------------------------------------------------- experience side
    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None, mm_train_inputs_list=None):
        if packed_seq_lens is not None:  # OpenRLHF 0.11.2 never passes them; the actor packs (THD) itself
            raise ValueError("the Megatron actor packs each micro-batch itself (THD, --ds.packing_samples is "
                             "native): pass padded sequences, not packed_seq_lens")
        if mm_train_inputs_list and any(m is not None for item in mm_train_inputs_list
                                        for m in (item if isinstance(item, list) else [item])):
            raise ValueError("--backend megatron does not support image inputs (vision-language models): "
                             "use the DeepSpeed backend")
        if not isinstance(action_mask, torch.Tensor):
            raise ValueError("--backend megatron needs the action mask as a tensor")
        batch = {
            "sequences": sequences.cpu(),
            "attention_mask": attention_mask.cpu(),
            "action_mask": action_mask.cpu(),
        }
        self._onload(state=False)  # asleep: the weights come back (vLLM sleeps while experiences are made)
        plan = None
        if _get(self.args, "train.dynamic_batch_enable", False):  # the chunk's forwards follow the token budget
            from openrlhf_lpo.core import layout

            lengths = batch["attention_mask"].sum(1).tolist()
            plan = layout.forward_chunks([list(range(len(lengths)))], lengths=lengths,
                                         budget=int(self.args.train.max_tokens_per_gpu))[0]
        return self.actor.log_probs(batch, micro_batches=plan).cpu()

    def append(self, experience):
        self.buffer.append(experience)

    # --------------------------------------------------------------------- training
    def set_lpo_divergence(self, divergence: str) -> None:
        """--lpo.divergence_schedule: the divergence of the next updates (the driver's schedule calls it on
        every rank before an update whose divergence changes, as on DeepSpeed)."""
        from openrlhf_lpo import listwise

        listwise.parse_divergence(divergence)
        self.lpo_divergence = divergence

    def fit(self, kl_ctl: float = 0):
        """One update of this replica's experiences: core.update's loop with :class:`MegatronEngine`."""
        import torch.distributed as dist

        from openrlhf_lpo.core.metrics import experience_info

        self._onload()  # (the trainer's reload_states did it already when --ds.enable_sleep is on)
        info = experience_info(self.buffer)
        batch = merge_experiences(self.buffer)
        self.buffer = []
        settings = UpdateSettings.from_args(self.args, self.actor.ps.get_data_parallel_world_size())
        spec = loss_spec_from_args(self.args, kl_ctl)
        N = batch["sequences"].shape[0]
        has_targets = "target" in batch and "lpo_gid" in batch
        update = UpdateBatch(
            lengths=[int(x) for x in batch["attention_mask"].sum(1).tolist()],
            gids=[int(g) for g in batch["lpo_gid"].tolist()] if has_targets else None,
            target=batch["target"].double() if has_targets else None,
            prev=batch.get("prev_log_ratio", torch.zeros(N, dtype=torch.float64)).double() if has_targets else None,
            reward=batch["lpo_reward"].double() if "lpo_reward" in batch else None,
            tau=batch["lpo_tau"].double() if "lpo_tau" in batch else None, info=info)
        status, self.last_update = run_update(update, settings, MegatronEngine(self, batch, spec),
                                              divergence=self.lpo_divergence)
        dist.barrier()
        return status


from openrlhf.trainer.ray.launcher import RayActorGroup as _RayActorGroup  # noqa: E402


from openrlhf_lpo.megatron.ray_wait import await_all_refs  # noqa: E402


class MegatronActorGroup(_RayActorGroup):
    """The policy ``RayActorGroup`` of a Megatron run (``duplicate_actors = tp*pp``).

    Every rank of a model replica runs each batched call (the forward is collective), but only
    the replica's first rank's results are returned: OpenRLHF's experience maker de-duplicates
    with the DeepSpeed factor (``ring_attn_size * ds.tensor_parallel_size``), which is 1 here.
    Each returned ref resolves only when every rank of its replica has finished, and fails as soon
    as any of them fails (cluster review F8: an OOM on TP rank 3 is an error in seconds, not the
    NCCL timeout while the trainer waits on rank 0). ``async_run_method`` (``fit``, ...) stays stock:
    it returns every rank's ref and ``ray.get`` of a list raises at the first failure (tested). Calls on one actor run in submission order, so
    later calls (``fit``) still see every ``append``. The driver builds the policy group as
    its subclass ``MegatronPolicyGroup`` (:mod:`.actor_group`), pickled by reference, so the PPO trainer actor
    (another process) uses these methods too.
    """

    def async_run_method_batch(self, method_name, **kwargs):
        refs = super().async_run_method_batch(method_name=method_name, **kwargs)
        mp = self.duplicate_actors
        out = []
        for start in range(0, len(refs), mp):
            out += await_all_refs(refs[start:start + mp], [0])
        return out


def plain_class():
    """``MegatronPolicyActor`` mixed into OpenRLHF's ``BaseModelActor`` (not yet a Ray class)."""
    return type("MegatronPolicyModelActor", (MegatronPolicyActor, _base()), {})


def remote_class():
    import ray

    return ray.remote(num_gpus=1)(plain_class())
