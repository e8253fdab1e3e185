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

Weights to vLLM (``broadcast_to_vllm``): the HF-named stream of :func:`convert.export_hf_weights`
in the engines' dtype (OpenRLHF 0.11.2 builds its vLLM engines in bfloat16 and asserts the dtype of
every tensor it receives), over OpenRLHF's model-update group (NCCL, or Ray collectives with
``--vllm.sync_with_ray``), then the engines' prefix caches are reset as upstream does. Engines that
take state dicts (the CPU rollout engines) get one dict through Ray and a parity check.
Colocated (``--train.colocate_all``, not async: the engines on the actor's GPUs, where NCCL refuses a
group of two ranks on one GPU): the same export on every rank of every replica, handed over by IPC
(:mod:`.weight_sync`, OpenRLHF's ``update_weight_cuda_ipc``; on CPU the shared-memory stand-in).

Sleep (``--ds.enable_sleep``, the Megatron meaning: offload the actor between phases; with
``--train.colocate_all``): after start-up and after every ``fit`` (OpenRLHF's trainer calls
``offload_states``) the parameters, DDP gradient buffers and optimizer state go to host memory
(:class:`.offload.HostOffload`, bit-exact); ``reload_states`` brings them back before ``fit``. The weights
alone come back for the old-log-prob ``forward`` and stay until the next offload, and for the weight sync
(offloaded again after it, since generation follows); checkpoints bring everything back for the save.

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

import contextlib
import os
from typing import Dict, List, Optional

import torch

from dataclasses import replace

from openrlhf_lpo.megatron.device import group_device as _group_device
from openrlhf_lpo.megatron.losses import LossSpec

# OpenRLHF 0.11.2's create_vllm_engines builds every engine with dtype="bfloat16" and its worker
# asserts that each synced tensor has that dtype (tests/megatron check this contract upstream)
VLLM_ENGINE_DTYPE = torch.bfloat16

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

# checkpoints live where OpenRLHF's PPOTrainer looks for the policy's (ckpt.path/_actor)
CKPT_SUBDIR = "_actor"


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
            **common,
        )
    adv = _get(args, "algo.advantage")
    correction = tuple(getattr(adv, k, d) for k, d in (("is_correction_level", "off"), ("is_correction_mode", "clip"),
                                                        ("is_correction_gating", "ratio"),
                                                        ("is_correction_threshold", (0.5, 5.0))))
    return LossSpec(name="pg", clip_eps=(lo, hi), loss_agg_mode=getattr(args.actor, "loss_agg_mode", "seq-mean-token-mean"),
                    dual_clip=_get(args, "actor.dual_clip"), policy_loss_type=_get(args, "actor.policy_loss_type", "ppo"),
                    is_correction=correction, **common)


def _seed_of(args) -> int:
    train = getattr(args, "train", None)
    return int(getattr(train, "seed", None) or getattr(args, "seed", 42))


SYNC_IN_FLIGHT = 3  # weight-sync broadcasts rank 0 issues before waiting for the oldest (cluster review 2, N7)
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


def colocated(args) -> bool:
    """``--train.colocate_all`` without ``--train.async_enable``: the rollout engines share the actor's GPUs and
    take the weights by IPC (as OpenRLHF's hybrid engine; async runs colocate the trained models only)."""
    return bool(_get(args, "train.colocate_all", False)) and not bool(_get(args, "train.async_enable", False))


def refuse_unsupported(args) -> None:
    """Raise ``ValueError`` naming a flag the Megatron actor cannot honour (checked again at start-up)."""
    if _get(args, "ds.enable_sleep", False) and not _get(args, "train.colocate_all", False):
        raise ValueError(
            "--ds.enable_sleep without --train.colocate_all: with --backend megatron it offloads the actor to "
            "host memory between phases, which only frees memory for vLLM engines that share the actor's GPUs; "
            "add --train.colocate_all (with --vllm.enable_sleep), or drop --ds.enable_sleep"
        )


def _is_weight(where: str) -> bool:
    """Tensors a forward reads (parameters, module buffers, DDP parameter buffers), by ``offload.tensors_of``'s
    names; the rest of a model (gradients, DDP gradient buffers) is training state."""
    return not where.endswith((".grad", ".main_grad", ".grad_data"))


class MegatronPolicyActor:
    """Mixin body; :func:`remote_class` binds it onto OpenRLHF's ``BaseModelActor``."""

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

    # --------------------------------------------------------------------- weights
    def _engines_take_state_dicts(self) -> bool:
        return bool(self.vllm_engines) and all(hasattr(e, "update_weights") for e in self.vllm_engines)

    def broadcast_to_vllm(self):
        """Stream the HF-named weights (TP gather, PP broadcast, un-fused) to the rollout engines."""
        with self._awake(state=False):  # asleep: the weights alone, offloaded again after (generation follows)
            self._broadcast_to_vllm()

    def _broadcast_to_vllm(self):
        import ray
        import torch.distributed as dist

        rank = dist.get_rank()
        first_replica = self.actor.ps.get_data_parallel_rank() == 0  # the export is collective per replica
        if colocated(self.args) and self.vllm_engines:
            self._ipc_to_vllm()
        elif self._engines_take_state_dicts():  # CPU rollout engines: one state dict via Ray, actor dtype
            state = {}
            if first_replica:  # the stream reaches rank 0 only (each tensor sent once per stage)
                for name, t in self.actor.export_hf_weights(dst=0):
                    state[name] = t.detach().cpu().clone()
            if rank == 0:
                ref = ray.put(state)
                ray.get([e.update_weights.remote(ref) for e in self.vllm_engines])
            self._check_engine_parity(len(state) if rank == 0 else 0)
        elif first_replica:
            self._stream_to_vllm(rank)
        dist.barrier()

    def _stream_to_vllm(self, rank: int) -> None:
        """Tensor by tensor, in the engines' dtype, over OpenRLHF's model-update group: each tensor reaches rank 0
        once (``export_hf_weights(dst=0)``), and up to ``SYNC_IN_FLIGHT`` broadcasts are in flight before rank 0
        waits for the engines' oldest ``update_weight``."""
        from collections import deque

        import ray

        args = self.args
        use_ray = bool(getattr(args.vllm, "sync_with_ray", False))
        engines = self.vllm_engines or []
        in_flight: deque = deque()  # (refs, tensor): a tensor stays alive until its engines took it
        for name, t in self.actor.export_hf_weights(VLLM_ENGINE_DTYPE, dst=0):
            if not engines:
                continue
            t = t.contiguous()
            refs = [e.update_weight.remote(name, dtype=t.dtype, shape=t.shape, empty_cache=False) for e in engines]
            if use_ray:
                import ray.util.collective as collective

                collective.broadcast(t, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(t, src=0)
            in_flight.append((refs, t))
            if len(in_flight) > SYNC_IN_FLIGHT:
                ray.get(in_flight.popleft()[0])
        while in_flight:
            ray.get(in_flight.popleft()[0])
        if rank == 0 and engines and getattr(args.vllm, "enable_prefix_caching", False):
            # cached KV blocks were computed with the old weights
            ray.get([e.reset_prefix_cache.remote() for e in engines])

    def _ipc_to_vllm(self) -> None:
        """Colocated engines: every rank of every replica receives each full HF tensor
        (``export_hf_weights(dst=None)``, the NCCL stream's resharding and naming) and hands its engine worker an
        IPC handle of it (:func:`.weight_sync.send_weights`); vLLM's ``load_weights`` cuts its own TP shard out of
        the full tensor. vLLM engines get bf16 (their worker asserts it); the CPU engines the actor's dtype and a
        parity check, as their state-dict sync."""
        import torch.distributed as dist

        from openrlhf_lpo.megatron import weight_sync

        cpu_engines = self._engines_take_state_dicts()
        transport = weight_sync.transport_for(self.actor.device)
        info = weight_sync.send_weights(
            self.actor.export_hf_weights(None if cpu_engines else VLLM_ENGINE_DTYPE), self.vllm_engines, transport,
            in_flight=SYNC_IN_FLIGHT, reset_prefix_cache=bool(getattr(self.args.vllm, "enable_prefix_caching", False)))
        self.last_sync = {"route": "ipc", "transport": transport.name, **info}
        if cpu_engines:
            self._check_engine_parity(info["tensors"] if dist.get_rank() == 0 else 0, route="ipc",
                                      transport=transport.name, device_ids=info["device_ids"])

    def _check_engine_parity(self, num_tensors: int, **record) -> None:
        """After a state-dict sync: engines' log-probs of a fixed probe sequence must equal the
        actor's (max |diff| <= LPO_CPU_PARITY_TOL, default 1e-4); appended to LPO_CPU_PARITY_LOG."""
        import torch.distributed as dist

        from openrlhf_lpo.runtime.parity import check_engine_parity, probe_sequence

        ids = probe_sequence(self.tokenizer)
        seq = torch.tensor([ids], dtype=torch.long)
        batch = {"sequences": seq, "attention_mask": torch.ones_like(seq),
                 "action_mask": torch.ones((1, len(ids) - 1), dtype=torch.bool)}
        actor_lp = self.actor.log_probs(batch)[0].double().cpu()  # collective
        if dist.get_rank() != 0:
            return
        check_engine_parity(self.vllm_engines, ids, actor_lp, float(self.actor.cfg.temperature),
                            backend="megatron", num_tensors=num_tensors, **record)

    # --------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """``ckpt.path/_actor/<tag>`` (OpenRLHF passes ``global_step<N>``); ``--ckpt.max_num`` /
        ``--ckpt.max_mem`` prune the oldest; ``--ckpt.save_hf`` also writes ``<tag>_hf`` (rotated with them)."""
        with self._awake():  # asleep: everything comes back for the save, and goes again after it
            self._save_checkpoint(tag, client_states)

    def _save_checkpoint(self, tag, client_states=None):
        args = self.args
        state = {"client_states": client_states or {}}
        self.actor.save_checkpoint(os.path.join(args.ckpt.path, CKPT_SUBDIR), tag, state,
                                   max_num=getattr(args.ckpt, "max_num", None),
                                   max_mem_gb=getattr(args.ckpt, "max_mem", None))
        if getattr(args.ckpt, "save_hf", False):
            self._save_hf(os.path.join(args.ckpt.path, f"{tag}_hf"))
            import torch.distributed as dist

            from openrlhf_lpo.runtime.hf_exports import rotate_for_args

            if dist.get_rank() == 0:  # the exports follow the state's rotation (--ckpt.max_num / --ckpt.hf_max_num)
                rotate_for_args(args.ckpt, CKPT_SUBDIR, keep=[tag])

    def get_checkpoint_states(self):
        return self.checkpoint_states

    def _save_hf(self, out_dir: str):
        import torch.distributed as dist

        from openrlhf_lpo.megatron.checkpoint import save_barrier

        self.actor.save_hf(out_dir)
        if dist.get_rank() == 0:
            self.tokenizer.save_pretrained(out_dir)
        save_barrier(self.actor.cfg.save_timeout_minutes)  # rank 0 wrote the export

    def save_model(self):
        with self._awake(state=False):
            self._save_hf(self.args.ckpt.output_dir)

    # --------------------------------------------------------------------- sleep (--ds.enable_sleep)
    def reload_states(self):
        """Before ``fit`` (OpenRLHF's trainer, ``--ds.enable_sleep``): everything back on the device, bit-exact."""
        self._onload()

    def offload_states(self):
        """After ``fit`` and at start-up (``--ds.enable_sleep``): parameters, DDP gradient buffers and the
        optimizer's state (main shards, Adam moments) to host memory; nothing of them stays on the device.
        Each rank logs the bytes moved and the parameter bytes left on the device (0)."""
        import sys

        import torch.distributed as dist

        moved = self._offload()
        params = sum(p.untyped_storage().nbytes() for p in self.actor.model.parameters())
        entry = {"rank": dist.get_rank(), "weights_bytes": moved.get("weights", 0),
                 "state_bytes": moved.get("state", 0), "param_bytes_resident": params,
                 "tracked_bytes_resident": sum(o.resident_bytes() for o in (self._weights_off, self._state_off) if o)}
        self.sleep_log.append(entry)
        print(f"[megatron] rank {entry['rank']} asleep: {entry['weights_bytes']} weight bytes and "
              f"{entry['state_bytes']} gradient/optimizer bytes moved to host memory; parameter bytes on the "
              f"device: {params}", file=sys.stderr, flush=True)

    def empty_cache(self):
        """Hand the allocator's cached blocks back to the device (the engines use them while the actor sleeps)."""
        from openrlhf_lpo.megatron.device import accelerator_available

        if accelerator_available():
            torch.accelerator.empty_cache()

    def _offload(self, weights: bool = True, state: bool = True) -> Dict[str, int]:
        """Offload the training state and / or the weights (whatever is still resident); bytes moved of each."""
        from openrlhf_lpo.megatron.offload import HostOffload

        moved: Dict[str, int] = {}
        model, optimizer = self.actor.model, self.actor.optimizer
        weights_off = HostOffload([model], where=_is_weight) if weights and self._weights_off is None else None
        if state and self._state_off is None:  # built while the weights' storages can still be told apart
            off = HostOffload([model], [optimizer], exclude=[weights_off or HostOffload([model], where=_is_weight)])
            moved["state"] = off.offload()
            self._state_off = off
        if weights_off is not None:
            moved["weights"] = weights_off.offload()
            self._weights_off = weights_off
        self.empty_cache()
        return moved

    def _onload(self, weights: bool = True, state: bool = True) -> None:
        if weights and getattr(self, "_weights_off", None) is not None:
            self._weights_off.onload()
            self._weights_off = None
        if state and getattr(self, "_state_off", None) is not None:
            self._state_off.onload()
            self._state_off = None

    @contextlib.contextmanager
    def _awake(self, state: bool = True):
        """Inside: the weights (and the training state unless ``state=False``) on the device; what was offloaded
        before goes back to host memory after."""
        was = (getattr(self, "_weights_off", None) is not None, getattr(self, "_state_off", None) is not None)
        self._onload(state=state)
        try:
            yield
        finally:
            if was[0] or (state and was[1]):
                self._offload(weights=was[0], state=state and was[1])


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
