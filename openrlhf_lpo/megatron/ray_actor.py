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

Training (``fit``): the rank's experiences are merged into one padded batch, split into
optimizer windows of ``train.batch_size / dp`` responses made of whole prompt groups
(group-level shuffle, seeded), and each window is one :meth:`MegatronActor.train_step`; the
data-parallel replicas agree on the number of windows (LPO: equal by construction, checked;
policy-gradient estimators: a partial batch dealt 520 / 512 samples gives both replicas the same
number of windows, each replica's samples split evenly over them). Micro-batches hold
``--train.micro_batch_size`` samples or, with ``--train.dynamic_batch_enable``, up to
``--train.max_tokens_per_gpu`` tokens (the group-aware planner of ``openrlhf_lpo/core/layout.py``,
counts agreed over the replicas; every rank of a replica plans the same). Like the DeepSpeed trainer,
LPO takes c per window from one of three places: one pass (micro-batches hold whole groups), the
shortcut (the first window of a rollout batch runs at the parameters that produced the old log-probs,
so s = s_t and c needs no forward) or a no-grad pre-pass (later windows); the pointwise projection's
c = -w* needs none. Every other estimator uses OpenRLHF's ``PolicyLoss`` with its advantages.
KL loss (``--algo.kl.use_loss``, reference log-probs from OpenRLHF's DeepSpeed reference actor as
upstream) and the entropy bonus are token means over the window, as on DeepSpeed.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from dataclasses import replace

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


# MegatronActor.train_step metric -> the name OpenRLHF's ppo_train reports
STATUS_KEYS = {"grad_norm": "actor_grad_norm", "entropy": "response_entropy"}


def plan_windows(num: int, window: int, generator, num_windows: Optional[int] = None) -> List[torch.Tensor]:
    """Index sets of the optimizer windows of a policy-gradient estimator (no groups): a random order cut
    every ``window`` samples, or into ``num_windows`` near-equal windows when the replicas hold different
    numbers of samples (see :func:`agree_windows`). LPO's windows of whole groups: ``core.update``."""
    order = torch.randperm(num, generator=generator)
    if num_windows is not None:
        if num < num_windows:
            raise ValueError(f"{num} samples cannot fill the {num_windows} optimizer windows the other "
                             "data-parallel replicas run")
        return list(torch.tensor_split(order, num_windows))
    return [order[i : i + window] for i in range(0, num, window)]


def agree_windows(num: int, window: int, group) -> Optional[int]:
    """Collective over the data-parallel group: None when every replica holds ``num`` samples (each cuts
    its own windows of ``window``), else the largest window count any replica needs, which all of them
    then run (every ``train_step`` is collective over DP: a replica that stops early leaves the others
    waiting in the gradient all-reduce until the NCCL timeout)."""
    import torch.distributed as dist

    from openrlhf_lpo.megatron.device import group_device

    n_w = -(-num // window)
    t = torch.tensor([n_w, num, -num], dtype=torch.float64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, n_max, n_min = int(t[0]), int(t[1]), -int(t[2])
    return None if n_max == n_min else most


from openrlhf_lpo.megatron.pipeline_plan import _get  # noqa: E402  (args.a.b with a default)


def loss_spec_from_args(args, micro_batch_size: int, kl_ctl: float = 0.0) -> LossSpec:
    """The loss of ``fit``'s windows from the flags (LPO: ``listwise`` when micro-batches of fixed size hold
    whole groups, else the surrogate; the pointwise / shortcut / pre-pass choice is per window)."""
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
        two_pass = lpo.force_two_pass or micro_batch_size % K != 0 or bool(_get(args, "train.dynamic_batch_enable", False))
        return LossSpec(
            name="listwise_surrogate" if two_pass else "listwise",
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
                    is_correction=correction, type_options=policy_loss_options(args), seed=_seed_of(args), **common)


def _seed_of(args) -> int:
    train = getattr(args, "train", None)
    return int(getattr(train, "seed", None) or getattr(args, "seed", 42))


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
        seed=_seed_of(args),
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
    def _micro_plan(self, sub, spec: LossSpec, whole_groups_fixed: bool):
        """Micro-batches of one window (row indices of ``sub``, groups K consecutive for LPO) and whether
        each holds whole groups. Token budgets: the group-aware planner, counts agreed over DP."""
        import torch.distributed as dist

        from openrlhf_lpo.megatron.device import group_device
        from openrlhf_lpo.core import layout

        n = sub["sequences"].shape[0]
        self._local_micro_count = None
        if not _get(self.args, "train.dynamic_batch_enable", False):
            return self.actor.fixed_micro_batches(n), whole_groups_fixed
        K = spec.group_size if spec.name.startswith("listwise") else 1
        lengths = sub["attention_mask"].sum(1).tolist()
        groups = [list(range(g * K, (g + 1) * K)) for g in range(n // K)]
        whole, per_sample = layout.budget_micro_count(groups, lengths, int(self.args.train.max_tokens_per_gpu))
        group = self.actor.ps.get_data_parallel_group()
        dev = group_device(group)
        flag = torch.tensor([0.0 if (whole is None or K == 1) else 1.0], dtype=torch.float64, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        all_whole = bool(flag.item() > 0)
        count = torch.tensor([float(whole if all_whole else per_sample)], dtype=torch.float64, device=dev)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        n_micro = min(int(count.item()), len(groups) if all_whole else n)
        self._local_micro_count = whole if all_whole else per_sample  # before agreement (tests read it)
        return layout.budget_micro_batches(groups, lengths, n_micro, all_whole), all_whole or K == 1

    def set_lpo_divergence(self, divergence: str) -> None:
        """--lpo.divergence_schedule: the divergence of the next updates (the driver's schedule calls it on
        every rank before an update whose divergence changes, as on DeepSpeed)."""
        from openrlhf_lpo import listwise

        listwise.parse_divergence(divergence)
        self.lpo_divergence = divergence

    def _reducers(self):
        """Sum and maximum of a few floats over the data-parallel group (on the group's device)."""
        import torch.distributed as dist

        group = self.actor.ps.get_data_parallel_group()

        def reduce(op):
            def run(values: List[float]) -> List[float]:
                t = torch.tensor(values, dtype=torch.float64, device=_group_device(group))
                dist.all_reduce(t, op=op, group=group)
                return t.tolist()
            return run

        return reduce(dist.ReduceOp.SUM), reduce(dist.ReduceOp.MAX)

    def fit(self, kl_ctl: float = 0):
        from openrlhf_lpo.core import update
        from openrlhf_lpo.core.update import WindowMode

        args = self.args
        import torch.distributed as dist

        self._onload()  # (the trainer's reload_states did it already when --ds.enable_sleep is on)
        dp = self.actor.ps.get_data_parallel_world_size()
        dp_group = self.actor.ps.get_data_parallel_group()
        batch = merge_experiences(self.buffer)
        self.buffer = []
        mbs = self.actor.cfg.micro_batch_size
        spec = loss_spec_from_args(args, mbs, kl_ctl)
        lpo = spec.name.startswith("listwise")
        if lpo and "target" not in batch:
            raise ValueError("estimator lpo: experiences carry no info['lpo_target'] (use the LPO experience maker)")
        if lpo and self.lpo_divergence is not None:
            spec = replace(spec, divergence=self.lpo_divergence)
        self.last_spec = spec  # inspection/tests
        K = spec.group_size
        window = args.train.batch_size // dp
        from openrlhf_lpo.core.config import LPOConfig

        settings = LPOConfig.from_args(args)
        force_two_pass = settings.force_two_pass
        all_sum, all_max = self._reducers()
        update_index = self.actor.step  # optimizer steps before this update (restored by a resume)
        status: Dict[str, float] = {}
        modes = {m.value: 0 for m in WindowMode}
        self.last_plan: List[dict] = []  # per optimizer step: where c came from, its samples, micro-batch sizes
        n = 0
        N = batch["sequences"].shape[0]
        prev_all = batch.get("prev_log_ratio", torch.zeros(N, dtype=torch.float64)).double()
        last_s = prev_all.clone()
        abs_coef_sum, coef_count = 0.0, 0
        for epoch in range(args.train.max_epochs):
            generator = update.window_generator(_seed_of(args), update_index, epoch)
            if lpo:  # whole groups, K consecutive rows each
                groups = update.group_windows(batch["lpo_gid"].tolist(), K,
                                              update.groups_per_window(args.train.batch_size, dp, K), generator)
                update.check_window_count(len(groups), all_max)
                windows = [torch.tensor([i for g in win for i in g], dtype=torch.long) for win in groups]
            else:
                windows = plan_windows(N, window, generator, agree_windows(N, window, dp_group))
            for w, idx in enumerate(windows):
                sub = {k: v[idx] for k, v in batch.items() if k != "lpo_gid"}
                micro, whole = self._micro_plan(sub, spec, mbs % K == 0)
                step_spec, coefficients, mode = spec, None, "pg"
                if lpo:
                    mode = update.choose_mode(spec.projection, whole, epoch == 0 and w == 0, force_two_pass)
                    if mode in (WindowMode.SHORTCUT, WindowMode.POINTWISE):  # s = s_t at the rollout's parameters
                        coefficients = update.window_coefficients(mode, sub["target"], spec.divergence,
                                                                  spec.projection, K, s=prev_all[idx])
                    modes[mode.value] += 1
                    step_spec = replace(spec, name="listwise" if mode is WindowMode.ONE_PASS else "listwise_surrogate")
                m = self.actor.train_step(sub, step_spec, micro_batches=micro, coefficients=coefficients)
                s_rows, c_rows = m.pop("s", None), m.pop("c", None)
                if lpo:
                    last_s[idx] = s_rows.double()
                    if c_rows is None:  # one pass: the c its loss differentiated, at the same s
                        c_rows = update.window_coefficients(WindowMode.PRE_PASS, sub["target"], spec.divergence,
                                                            spec.projection, K, s=s_rows)
                    abs_coef_sum += float(c_rows.abs().sum())
                    coef_count += len(idx)
                self.last_plan.append({"mode": str(mode), "samples": idx.tolist(), "micro": [len(i) for i in micro],
                                       "micro_tokens": [int(sub["attention_mask"][i].sum()) for i in micro],
                                       "local_micro_count": getattr(self, "_local_micro_count", None),
                                       "grad_norm": m["grad_norm"], "lr": m["lr"]})
                for k, v in m.items():
                    status[k] = status.get(k, 0.0) + v
                n += 1
        last_lr = self.actor.lr_schedule.lr
        status = {STATUS_KEYS.get(k, k): v / max(n, 1) for k, v in status.items() if k not in ("lr", "next_lr")}
        status["actor_lr"] = last_lr  # as DeepSpeed's: the scheduler's learning rate after the last step
        status["optimizer_steps"] = float(n)
        end_kl = settings.end_kl
        if lpo:
            from openrlhf_lpo.core.listwise_metrics import update_metrics

            s_end = self._end_log_ratio(batch) if end_kl else None
            status.update(update_metrics(
                batch["lpo_gid"].tolist(), batch["target"], prev_all, batch.get("lpo_reward", torch.zeros(N)),
                batch.get("lpo_tau", torch.full((N,), float("nan"))), last_s, abs_coef_sum, coef_count, modes, K,
                spec.divergence, all_sum, all_max, correction=spec.correction is not None, s_end=s_end))
            if s_end is not None:
                status.update(self._listwise_end_metrics(batch, s_end))
        elif end_kl:
            status.update(self._listwise_end_metrics(batch))
        dist.barrier()
        return status

    def _end_log_ratio(self, batch) -> torch.Tensor:
        """s of the rank's rollout batch at the current parameters (one no-grad forward), against the
        behaviour policy plus s_t as in w* (0 on-policy)."""
        from openrlhf_lpo.megatron.losses import listwise_log_ratio

        args = self.args
        lp = self.actor.log_probs({k: batch[k] for k in ("sequences", "attention_mask", "action_mask")})
        spec = loss_spec_from_args(args, self.actor.cfg.micro_batch_size)
        spec = replace(spec, clip_eps=tuple(args.actor.eps_clip_low_high)) if spec.name != "pg" else \
            LossSpec(clip_eps=tuple(args.actor.eps_clip_low_high))
        return listwise_log_ratio(lp.double().cpu(), batch, spec)

    def _listwise_end_metrics(self, batch, s_end: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """--lpo.end_kl: KL(w*||P) of the rank's rollout batch before and after this update,
        P = softmax(s) at the current parameters, reduced over DP."""
        from openrlhf_lpo.core.listwise_metrics import listwise_update_metrics
        from openrlhf_lpo.megatron.device import group_device

        if "target" not in batch or "lpo_gid" not in batch:
            raise ValueError("--lpo.end_kl: experiences carry no info['lpo_target'] / info['lpo_gid'] "
                             "(the LPO experience maker writes them)")
        s_end = self._end_log_ratio(batch) if s_end is None else s_end
        s_start = batch.get("prev_log_ratio", torch.zeros_like(s_end)).double()
        group = self.actor.ps.get_data_parallel_group()
        return listwise_update_metrics(batch["lpo_gid"].long(), s_start, s_end, batch["target"].double(),
                                       self.args.rollout.n_samples_per_prompt, group=group, device=group_device(group))


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
    later calls (``fit``) still see every ``append``. The instance is re-classed in the driver and
    pickled by reference, so the PPO trainer actor (another process) uses these methods too.
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
