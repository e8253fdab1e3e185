"""Megatron-core LPO actor, independent of Ray: log-prob pass, training step, checkpoints.

One instance lives in every rank of a ``torch.distributed`` world of ``tp * pp * dp`` ranks.
Each data-parallel replica receives its own batch (whole prompt groups, prompt-major: the K
responses of a prompt are consecutive); every TP/PP rank of a replica receives the same batch.

Batch layout (OpenRLHF's): ``sequences [B,S]`` whose real tokens (``attention_mask [B,S]``) form
one contiguous run per row, ``action_mask [B,A]`` for the last ``A`` columns. Token log-probs are
those of ``sequences[:, S-A:]`` given everything before, exactly OpenRLHF's
``Actor.forward(...)[:, -A:]``.

Every micro-batch runs as **one packed row without padding** (:mod:`.packing`: THD layout with
``cu_seqlens``/``PackedSeqParams``; the attention never builds an ``S x S`` mask or score matrix,
see :mod:`.attention`). A sequence's log-probs therefore do not depend on how it was padded or
with which others it was batched: the old-log-prob pass and the training pass see the same numbers.

* :meth:`MegatronActor.log_probs` — forward-only pass with Megatron's schedule; the last stage
  takes ``-vocab_parallel_cross_entropy`` of the vocab-sharded logits of the response rows only
  (``action_mask``; no full-logit gather, no prompt rows) and broadcasts the ``[B,A]`` result over the
  pipeline group.
* :meth:`MegatronActor.train_step` — one optimizer step over the batch: forward/backward
  schedule (1F1B under PP) over the given micro-batches (fixed size, or a token-budget plan),
  loss from ``losses.POLICY_LOSSES`` on the last stage plus the KL / entropy terms,
  ``finalize_model_grads`` (DP reduce, tied-embedding and q/k-norm grads), Megatron optimizer
  with gradient clipping at the learning rate of ``--actor.lr_scheduler`` (:mod:`.schedule`).
  ``listwise_surrogate`` takes its coefficients from the caller (s_t in the first window, -w* for the
  pointwise projection) or runs a no-grad coefficient pass first.
  ``recompute=True`` (``--actor.gradient_checkpointing_enable``) recomputes every layer.
* Sequence parallelism (``sequence_parallel=True``, TP > 1): every sequence of a packed row is
  padded at its tail to a multiple of TP (so the row splits evenly over the TP ranks); the pads
  are never read by a real token (causal attention) and no loss or log-prob reads them.
* Virtual pipeline stages (``vpp > 1``, PP > 1): ``self.model`` is a :class:`ModelChunks` of
  ``vpp`` DDP-wrapped chunks run by megatron's interleaved 1F1B schedule; the micro-batch count
  is padded to a multiple of PP with one-sequence micro-batches that carry no loss (the schedule
  needs ``M % pp == 0``), and every packed row of a pass to the longest one (a trailing pad
  segment: the interleaved schedule sends fixed shapes).

Host syncs: micro-batches are packed on the host before the schedule starts (their indices, counts and
row positions go to the device in one go); inside the schedule our code never waits for the device (no
``.item()``, no boolean indexing); the step's statistics stay on the device and are read once, after
the optimizer step. What megatron itself still syncs (docs/megatron.md, "Host syncs"): with PP > 1 and
VPP 1 (``variable_seq_lengths``) every p2p call of the schedule first exchanges the tensor's shape and
then synchronizes the device and reads it (a device-wide synchronize and ``.tolist()`` in
``_communicate_shapes``), and the batched p2p synchronizes again after the exchange (``batch_p2p_sync``);
the grad norm is read once per step. Without Transformer Engine, megatron's unfused THD RoPE would read
``cu_seqlens`` on the host for q and k in every layer; :mod:`.rope` replaces it with the same rotation built
from the micro-batch's host bounds. With TE, RoPE runs TE's fused THD kernel (``apply_rope_fusion``).
* :meth:`save_checkpoint` / :meth:`load_checkpoint` — :mod:`.checkpoint`: layout-free
  ``global_stepN`` directories (safetensors + JSON), resumable in another TP/PP layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from openrlhf_lpo.megatron import attention, convert, rope
from openrlhf_lpo.megatron.device import group_device, local_device
from openrlhf_lpo.megatron.parallel_layout import validate_layout
from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss
from openrlhf_lpo.megatron.model import attention_span, build_gpt_model, transformer_config_from_hf
from openrlhf_lpo.megatron.packing import PackedMicroBatch, pack_micro_batch, pad_to_tokens
from openrlhf_lpo.megatron.schedule import LRSchedule, restore_schedule, with_schedule

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NO_LOSS_STATS: dict = {}  # what a schedule-padding micro-batch reports (dropped from the results)


def _no_loss(output):
    """Loss of a schedule-padding micro-batch: zero, counting no response, connected to the graph."""
    return output.sum() * 0.0, torch.zeros((), dtype=torch.int, device=output.device), _NO_LOSS_STATS


@dataclass
class MegatronActorConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    params_dtype: str = "fp32"
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: Tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    micro_batch_size: int = 8
    temperature: float = 1.0
    seed: int = 42
    use_te: Optional[bool] = None
    recompute: bool = False  # --actor.gradient_checkpointing_enable: full recompute of every layer
    sequence_parallel: bool = False  # --megatron.sequence_parallel (needs tp > 1)
    lr_scheduler: str = "constant"  # --actor.lr_scheduler (transformers' names, as OpenRLHF)
    lr_warmup_ratio: float = 0.0  # --actor.lr_warmup_ratio
    min_lr_ratio: float = 0.1  # --actor.min_lr_ratio (cosine_with_min_lr / cosine_warmup_with_min_lr)
    scheduler_steps: Optional[int] = None  # optimizer steps of the run (OpenRLHF's max_steps)
    timeout_minutes: int = 60  # NCCL/gloo timeout of megatron's process groups (OpenRLHF: 60)
    save_timeout_minutes: int = 360  # the waits around checkpoint / HF writes (checkpoint.save_barrier)
    extra: dict = field(default_factory=dict)


def initialize_parallel(tp: int, pp: int, hf_config=None, vpp: int = 1, timeout_minutes: int = 60) -> None:
    """Validate the layout and (re)initialise megatron's parallel state on the current world."""
    from megatron.core import parallel_state as ps

    from openrlhf_lpo.megatron import groups
    from openrlhf_lpo.megatron.cluster import check_tp_groups_within_nodes

    if not dist.is_initialized():
        raise ValueError("torch.distributed must be initialised before building the Megatron actor")
    validate_layout(dist.get_world_size(), tp, pp, hf_config, vpp)
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp
                and (ps.get_virtual_pipeline_model_parallel_world_size() or 1) == vpp):
            return
        groups.release(ps)
    check_tp_groups_within_nodes(tp)
    # DP outermost: the tp*pp ranks of one model replica are consecutive (OpenRLHF's Ray actor
    # groups hand consecutive actors the same chunk of experiences)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, order="tp-cp-ep-pp-dp",
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=int(timeout_minutes),
    )


def _seed(seed: int) -> None:
    from openrlhf_lpo.megatron.device import seed_model_parallel

    seed_model_parallel(seed)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the full vocabulary from TP-sharded logits [..., V/tp] (no grad)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        x = logits.float()
        m = x.max(-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m)
        z = e.sum(-1, keepdim=True)
        ex = (e * (x - m)).sum(-1, keepdim=True)
        dist.all_reduce(z, group=group)
        dist.all_reduce(ex, group=group)
        return (torch.log(z) - ex / z).squeeze(-1)


class ModelChunks(torch.nn.ModuleList):
    """The ``vpp`` DDP-wrapped model chunks of one PP rank, used where a single DDP model is
    (``train``/``eval``/``parameters``/``zero_grad_buffer``/``broadcast_params``)."""

    def zero_grad_buffer(self):
        for chunk in self:
            chunk.zero_grad_buffer()

    def broadcast_params(self):
        for chunk in self:
            chunk.broadcast_params()


def model_chunk_list(model) -> list:
    """The chunks of ``model`` (a :class:`ModelChunks`, or one model)."""
    return list(model) if isinstance(model, ModelChunks) else [model]


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - sum_v p_v x_v' over the full vocabulary from TP-sharded logits, differentiable:
    dH/dx_v = -p_v (log p_v + H) (p and log p local to the shard, H and Z all-reduced)."""

    @staticmethod
    def forward(ctx, logits, group):
        x = logits.float()
        m = x.max(-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m
        z = torch.exp(x).sum(-1, keepdim=True)
        dist.all_reduce(z, group=group)
        log_p = x - torch.log(z)
        ex = (torch.exp(log_p) * x).sum(-1, keepdim=True)
        dist.all_reduce(ex, group=group)
        h = torch.log(z) - ex
        ctx.save_for_backward(log_p, h)
        return h.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_h):
        log_p, h = ctx.saved_tensors
        grad = -grad_h.unsqueeze(-1) * torch.exp(log_p) * (log_p + h)
        return grad, None


def vocab_parallel_entropy_with_grad(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    return _VocabParallelEntropy.apply(logits, ps.get_tensor_model_parallel_group())


def config_overrides(use_te: bool) -> dict:
    """TransformerConfig settings that follow the layer spec: with Transformer Engine, RoPE runs its
    fused THD kernel (megatron's unfused THD path splits every sequence on the host, per layer)."""
    return {"apply_rope_fusion": bool(use_te)}


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host -> device without waiting for the device (pinned memory, non-blocking copy)."""
    if dev.type == "cpu" or t.device == dev:
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


class MegatronActor:
    """Megatron-core policy for one rank. ``hf_weights``: an HF checkpoint dir, a mapping or
    getter of HF tensors, or a :class:`convert.TensorReader` (None: megatron's random init)."""

    def __init__(self, hf_config, cfg: MegatronActorConfig, hf_weights=None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from openrlhf_lpo.megatron.model import te_available

        self.hf_config = hf_config
        self.cfg = cfg
        if cfg.params_dtype not in DTYPES:
            raise ValueError(f"--megatron.params_dtype {cfg.params_dtype!r}: choose one of {sorted(DTYPES)}")
        if cfg.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
        if cfg.sequence_parallel and cfg.tp < 2:
            raise ValueError("--megatron.sequence_parallel needs --megatron.tp > 1 (it splits the sequence over TP ranks)")
        if cfg.use_te and not te_available():
            raise ValueError("--megatron.te on: Transformer Engine is not importable here, or no accelerator is "
                             "present; install the transformer-engine build docs/install.md names, or use "
                             "--megatron.te off (megatron's local spec)")
        initialize_parallel(cfg.tp, cfg.pp, hf_config, cfg.vpp, cfg.timeout_minutes)
        _seed(cfg.seed)
        dtype = DTYPES[cfg.params_dtype]
        use_te = te_available() if cfg.use_te is None else bool(cfg.use_te)
        if not use_te:
            rope.install()  # THD RoPE from the micro-batch's host bounds (megatron's own reads them per layer)
        self.tconfig = transformer_config_from_hf(hf_config, cfg.tp, cfg.pp, params_dtype=dtype,
                                                  recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                                                  vpp=cfg.vpp, **config_overrides(use_te))
        self.attention_span = attention_span(hf_config)
        # one chunk per virtual stage (vpp 1: the rank's whole stage)
        chunks = [build_gpt_model(hf_config, config=self.tconfig, use_te=use_te,
                                  vp_stage=v if cfg.vpp > 1 else None) for v in range(cfg.vpp)]
        for chunk in chunks:
            chunk.to(local_device())  # norms and other small params are built on the CPU (NCCL rejects them)
        self.uses_te = convert.uses_te_names(chunks)
        self.weights_read = 0  # elements of HF tensors this rank read (its stage, its TP slices)
        if hf_weights is not None:
            reader = convert.as_reader(hf_weights)
            convert.load_hf_weights(chunks, reader, hf_config)
            self.weights_read = reader.elements_read
        self.half = dtype != torch.float32
        if self.half:
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(self.tconfig, chunk) for chunk in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        # later chunks without bucketing, as Megatron-LM builds interleaved models
        chunks = [DDP(self.tconfig, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
        self.model = chunks[0] if cfg.vpp == 1 else ModelChunks(chunks)
        self.model.broadcast_params()
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_betas[0],
            adam_beta2=cfg.adam_betas[1],
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, chunks)
        self.lr_schedule = LRSchedule(cfg.lr, cfg.lr_scheduler, cfg.lr_warmup_ratio, cfg.min_lr_ratio,
                                      cfg.scheduler_steps)
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.no_sync_func = chunks[0].no_sync if cfg.vpp == 1 else [c.no_sync for c in chunks]
        self.step = 0
        self.ps = ps

    # ------------------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return next(convert.unwrap(self.model).parameters()).device

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    @property
    def pad_multiple(self) -> int:
        """Every packed sequence is padded to this many tokens: TP under sequence parallelism."""
        return self.cfg.tp if self.cfg.sequence_parallel else 1

    def fixed_micro_batches(self, n: int, mbs: Optional[int] = None) -> List[List[int]]:
        """Consecutive micro-batches of ``mbs`` rows (the last one may be shorter)."""
        mbs = mbs or self.cfg.micro_batch_size
        return [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]

    def _micro_batches(self, batch: Dict[str, torch.Tensor], index_lists: List[List[int]]) -> List[Dict]:
        """Pack each micro-batch (row indices into ``batch``, host tensors) into one THD row on the host
        (plus the interleaved schedule's padding), then move it with its precomputed response-row
        positions and counts to the device, so the schedule never waits for the device to learn a shape
        or a count."""
        A = batch["action_mask"].shape[1]
        out = []
        for idx in index_lists:
            sel = torch.as_tensor(idx, dtype=torch.long)
            mb = {k: (v.index_select(0, sel) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            act = mb["action_mask"].bool()
            pk = pack_micro_batch(mb["sequences"], mb["attention_mask"], A, self.pad_multiple)
            self._check_span(pk)
            valid = pk.action_valid & act  # response rows only: OpenRLHF's action mask spans the prompt too
            b = act.shape[0]
            mb["rows"] = pk.action_index[valid]  # packed logit positions, in row-major (b, a) order
            mb["row_pos"] = valid.reshape(-1).nonzero().squeeze(1)  # their flat positions in [b * A]
            mb["row_tokens"] = pk.action_tokens[valid]
            mb["n_responses"] = torch.tensor(b, dtype=torch.int)
            mb["n_tokens"] = act.sum().to(torch.int)
            mb["n_nonempty"] = (act.sum(-1) > 0).sum().to(torch.int)
            mb["counts"] = {"responses": b, "tokens": int(act.sum()), "nonempty": int((act.sum(-1) > 0).sum())}
            mb["packed"] = pk
            out.append(mb)
        real = sum(mb["packed"].num_tokens for mb in out)
        out += self._schedule_padding(len(out), batch["sequences"])
        if self.cfg.vpp > 1:  # fixed shapes for the interleaved schedule: one packed length per pass
            total = max(mb["packed"].num_tokens for mb in out)
            for mb in out:
                mb["packed"] = pad_to_tokens(mb["packed"], total)
            # tokens computed per real token (pipeline_plan.vpp_padding_factor): max/mean of the rows
            self.vpp_padding = total * len(out) / real
            self._warn_vpp_padding(len(out))
        dev = self.device
        for i, mb in enumerate(out):
            pk = mb["packed"]
            mb["bounds"] = [int(x) for x in pk.cu_seqlens.tolist()]  # host copy for the local THD attention
            mb = {k: (_to(v, dev) if isinstance(v, torch.Tensor) else v) for k, v in mb.items()}
            pk.tokens, pk.position_ids, pk.cu_seqlens = _to(pk.tokens, dev), _to(pk.position_ids, dev), _to(pk.cu_seqlens, dev)
            out[i] = mb
        return out

    def _warn_vpp_padding(self, rows: int) -> None:
        """Once per process, on global rank 0: a VPP pass computing >= 1.5x its real tokens."""
        from openrlhf_lpo.megatron.pipeline_plan import vpp_padding_warning

        line = vpp_padding_warning(self.vpp_padding, rows)
        if line and not getattr(self, "_vpp_warned", False) and (not dist.is_initialized() or dist.get_rank() == 0):
            import sys

            self._vpp_warned = True
            print(f"[megatron] WARNING: {line}", file=sys.stderr, flush=True)

    def _schedule_padding(self, num: int, sequences: torch.Tensor) -> List[Dict]:
        """Loss-free micro-batches that bring the count to a multiple of PP for the interleaved
        schedule (it needs ``M % pp == 0``): one sequence of ``pad_multiple`` pad tokens each."""
        pp = self.cfg.pp
        if self.cfg.vpp == 1 or num % pp == 0:
            return []
        n = self.pad_multiple
        seq = torch.zeros(1, n + 1, dtype=sequences.dtype, device=sequences.device)
        mask = torch.ones_like(seq)
        mask[0, 0] = 0  # n real (pad-id) tokens, one action column
        packed = pack_micro_batch(seq, mask, 1, self.pad_multiple)
        zero = {"responses": 0, "tokens": 0, "nonempty": 0}
        return [{"packed": packed, "schedule_padding": True, "counts": zero} for _ in range(pp - num % pp)]

    def _check_span(self, packed: PackedMicroBatch) -> None:
        span = self.attention_span
        if span is not None and max(packed.seq_lens) > span:
            raise ValueError(
                f"a sequence of {max(packed.seq_lens)} tokens exceeds the model's sliding window of {span} "
                "(sliding_window in the HF config): --backend megatron computes full causal attention, exact "
                "only up to the window; lower --data.max_len or use the DeepSpeed backend"
            )

    def _token_log_probs(self, output: torch.Tensor, mb, entropy: str = "none"):
        """Last stage: packed logits [1,T,V/tp] -> response-token log-probs [b,A] (0 elsewhere) and, with
        ``entropy`` "detached" or "grad", their entropies [b,A]; only the response rows of the packed row
        go through the fp32 copy, the CE and the entropy."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        b, A = mb["action_mask"].shape
        # a fresh fp32 tensor of the response rows: the CE kernel shifts it in place
        logits = output[0].index_select(0, mb["rows"]).float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        ent = None
        if entropy != "none":  # before the CE, which overwrites ``logits``
            rows = (vocab_parallel_entropy_with_grad(logits) if entropy == "grad" else vocab_parallel_entropy(logits))
            ent = torch.zeros(b * A, dtype=rows.dtype, device=rows.device).index_put((mb["row_pos"],), rows).view(b, A)
        lp_rows = -vocab_parallel_cross_entropy(logits.contiguous(), mb["row_tokens"].contiguous())
        logp = torch.zeros(b * A, dtype=lp_rows.dtype, device=lp_rows.device).index_put((mb["row_pos"],), lp_rows)
        return logp.view(b, A), ent

    def _forward_step(self, data_iterator, model, loss_fn):
        mb = next(data_iterator)
        pk: PackedMicroBatch = mb["packed"]
        kwargs = {"fp32_output": False} if self.half else {}  # logits stay bf16; action rows upcast
        params = pk.packed_seq_params()
        attention.attach_bounds(params, mb["bounds"])  # attention.segment_bounds: no device read per forward
        rope.attach_bounds(params.cu_seqlens_q_padded, mb["bounds"])  # rope.py: the local spec's RoPE, no read
        out = model(pk.tokens, pk.position_ids, None, packed_seq_params=params, **kwargs)
        if mb.get("schedule_padding"):
            return out, _no_loss
        return out, partial(loss_fn, mb)

    def _run(self, mbatches: List[Dict], loss_fn, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forwards = getattr(self, "forwards", 0) + len(mbatches)  # micro-batch forwards (tests count them)
        fb = get_forward_backward_func()
        chunks = model_chunk_list(self.model)
        outs = fb(
            forward_step_func=partial(self._forward_step, loss_fn=loss_fn),
            # the interleaved schedule reads one iterator per chunk, each over every micro-batch
            data_iterator=[iter(mbatches) for _ in chunks] if len(chunks) > 1 else iter(mbatches),
            model=chunks,
            num_microbatches=len(mbatches),
            # one packed row per micro-batch; with PP the stages exchange each row's length
            # (variable_seq_lengths in the config), so this is only an upper bound
            seq_length=max(m["packed"].num_tokens for m in mbatches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return [o for o in outs if o is not _NO_LOSS_STATS]

    def _broadcast_from_last_stage(self, t: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return t
        group = self.ps.get_pipeline_model_parallel_group()
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=group_device(group))
        t = t.to(group_device(group)).contiguous()
        dist.broadcast(t, src=self.ps.get_pipeline_model_parallel_last_rank(), group=group)
        return t

    def _share_stats(self, vals: Dict[str, torch.Tensor], keys: List[str]) -> Dict[str, float]:
        """The last stage's statistics (0-d tensors, any device) on every rank of the pipeline; one host read for
        the whole step. ``keys`` is the same list on every rank. Not reduced over data-parallel ranks (the
        update's caller reduces once, at the end)."""
        t = None
        if self.is_last_stage:
            t = torch.stack([vals[k].detach().to(torch.float64).reshape(()) if k in vals
                             else torch.zeros((), dtype=torch.float64, device=self.device) for k in keys])
        t = self._broadcast_from_last_stage(t, (len(keys),), torch.float64)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    def _window_totals(self, mbatches: List[Dict]) -> Dict[str, float]:
        """The optimizer window's global responses / tokens / non-empty responses (host numbers,
        all-reduced over DP: one small collective per step)."""
        local = [float(sum(m["counts"][k] for m in mbatches)) for k in ("responses", "tokens", "nonempty")]
        group = self.ps.get_data_parallel_group()
        t = torch.tensor(local, dtype=torch.float64, device=group_device(group))
        dist.all_reduce(t, group=group)
        return dict(zip(("responses", "tokens", "nonempty"), t.tolist()))

    # ------------------------------------------------------------------------------ API
    @torch.no_grad()
    def log_probs(self, batch: Dict[str, torch.Tensor], with_entropy: bool = False,
                  micro_batches: Optional[List[List[int]]] = None):
        """Action log-probs ``[B,A]`` (0 where ``action_mask`` is 0; and entropy ``[B,A]``) on every
        rank of this replica. ``micro_batches``: row indices per forward (default: fixed micro-batches
        of ``micro_batch_size``); the result is in ``batch`` order."""
        self.model.eval()
        batch = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        B, A = batch["action_mask"].shape
        index_lists = micro_batches or self.fixed_micro_batches(B, min(self.cfg.micro_batch_size, B))

        def loss_fn(mb, output):
            logp, ent = self._token_log_probs(output, mb, "detached" if with_entropy else "none")
            return torch.zeros((), device=logp.device), {"logp": logp, "ent": ent}

        outs = self._run(self._micro_batches(batch, index_lists), loss_fn, forward_only=True)
        logp = ent = None
        if self.is_last_stage:
            order = torch.as_tensor([i for idx in index_lists for i in idx], device=outs[0]["logp"].device)
            logp = torch.empty((B, A), dtype=torch.float32, device=order.device)
            logp[order] = torch.cat([o["logp"] for o in outs])
            if with_entropy:
                ent = torch.empty_like(logp)
                ent[order] = torch.cat([o["ent"] for o in outs])
        logp = self._broadcast_from_last_stage(logp, (B, A), torch.float32)
        if with_entropy:
            ent = self._broadcast_from_last_stage(ent, (B, A), torch.float32)
            return logp, ent
        return logp

    def train_step(self, batch: Dict[str, torch.Tensor], spec: LossSpec,
                   micro_batches: Optional[List[List[int]]] = None,
                   coefficients: Optional[torch.Tensor] = None) -> Dict[str, object]:
        """One optimizer step on this replica's batch (all replicas call it together): the engine side of
        ``core.update``'s ``step``.

        ``micro_batches``: row indices per micro-batch (default: ``micro_batch_size`` rows each); every
        rank of a replica passes the same plan. ``coefficients`` [B] (``listwise_surrogate``): the window's c_k
        from the update plan (shortcut, pre-pass or pointwise). Returns ``{"sums", "grad_norm", "lr", "s"}``:
        this replica's sums of core/metrics.py's ``STEP_SUMS`` (shared over the pipeline, not reduced over
        data-parallel ranks), the global gradient norm before clipping, the learning rate of the next step (as
        DeepSpeed's scheduler reports it after a step; ``applied_lr``: this step's) and,
        for the listwise losses, s of every row at this step's parameters (float64, host)."""
        from openrlhf_lpo.core.loss import token_statistics
        from openrlhf_lpo.core.metrics import STEP_SUMS
        from openrlhf_lpo.megatron.losses import clip_bounds, count_key, policy_loss_module

        loss = get_policy_loss(spec.name)
        batch = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        B = batch["sequences"].shape[0]
        index_lists = micro_batches or self.fixed_micro_batches(B)
        if spec.name == "listwise_surrogate":
            if coefficients is None:
                raise ValueError("listwise_surrogate: the window's coefficients come from the update plan "
                                 "(core.update.window_coefficients)")
            batch["coefficients"] = coefficients.detach().cpu().double()
        if spec.name == "listwise":
            bad = sorted({len(i) for i in index_lists if len(i) % spec.group_size})
            if bad:
                raise ValueError(f"micro-batches of {bad} responses do not hold whole groups of K={spec.group_size} "
                                 "for one-pass LPO; use the two-pass surrogate (listwise_surrogate)")
        use_kl = bool(spec.kl_coef) and "base_log_probs" in batch
        if spec.kl_coef and not use_kl:
            raise ValueError("--algo.kl.use_loss: the experiences carry no reference log-probs "
                             "(base_action_log_probs); the reference model runs when --algo.kl.init_coef > 0")
        entropy_mode = "grad" if spec.entropy_coef else "detached"
        mbatches = self._micro_batches(batch, index_lists)
        if spec.name == "pg":
            fn = policy_loss_module(spec, step=self.step)  # a registered type's seeded draw reads the step
            for mb in mbatches:
                mb["_policy_loss_fn"] = fn
        aux_scale = None
        if use_kl or spec.entropy_coef:
            # token means over the window: coef * sum(term * mask) / T globally (see losses.py)
            totals = self._window_totals(mbatches)
            main = {"n_responses": "responses", "n_tokens": "tokens", "n_nonempty": "nonempty"}[count_key(spec)]
            aux_scale = totals[main] / max(totals["tokens"], 1.0)
        band = spec.correction_band
        clip_eps = clip_bounds(spec.clip_eps)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_fn(mb, output):
            logp, ent = self._token_log_probs(output, mb, entropy_mode)
            total, count, stats = loss(logp, mb, spec)
            mask = mb["action_mask"]
            fmask = mask.to(logp.dtype)
            ent_sum = (ent * fmask).sum()
            rollout = mb.get("rollout_log_probs")
            stats = dict(stats, entropy_sum=ent_sum.detach(),
                         **token_statistics(logp, mb["old_log_probs"], mask, clip_eps,
                                            rollout if band is not None else None, band))
            if spec.name == "pg":
                stats["loss_count"] = count
            if spec.entropy_coef:
                total = total - spec.entropy_coef * aux_scale * ent_sum
            if use_kl:
                from openrlhf.models.utils import compute_approx_kl

                kl = compute_approx_kl(logp, mb["base_log_probs"].to(logp.dtype), log_probs_old=mb["old_log_probs"],
                                       kl_estimator=spec.kl_estimator, unbiased_gradient=spec.kl_unbiased_gradient)
                kl_sum = (kl * fmask).sum()
                total = total + spec.kl_coef * aux_scale * kl_sum
                stats["kl_loss_sum"] = kl_sum.detach()
            return total, count, stats

        outs = self._run(mbatches, loss_fn, forward_only=False)
        lr = self.lr_schedule.apply(self.optimizer)
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.lr_schedule.step()
        self.step += 1
        local, s_parts = {}, []
        if self.is_last_stage:
            for o in outs:
                for k, v in o.items():
                    if k == "s_rows":  # per response, not summed
                        s_parts.append(v)
                        continue
                    local[k] = v if k not in local else local[k] + v
        sums = self._share_stats(local, list(STEP_SUMS))
        out = {"sums": sums, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
               "lr": self.lr_schedule.lr, "applied_lr": lr, "update_ok": bool(ok), "s": None}
        if spec.name.startswith("listwise"):  # s of every row at this step's parameters
            s_rows = None
            if self.is_last_stage:
                s_rows = torch.empty(B, dtype=torch.float64, device=self.device)
                order = torch.as_tensor([i for idx in index_lists for i in idx], dtype=torch.long, device=self.device)
                s_rows[order] = torch.cat([p.to(self.device, torch.float64).reshape(-1) for p in s_parts])
            out["s"] = self._broadcast_from_last_stage(s_rows, (B,), torch.float64).cpu()
        return out

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        max_num: Optional[int] = None, max_mem_gb: Optional[float] = None, read=None) -> str:
        """``root/<tag>`` (default ``global_step<step>``), ``latest`` written last; see :mod:`.checkpoint`.
        The learning-rate schedule's state rides in ``client_state`` (``_lr_schedule``). ``read``: where the
        optimizer state is read from (the colocated actor asleep: host memory; :func:`.checkpoint.save`)."""
        from openrlhf_lpo.megatron import checkpoint

        state = with_schedule(client_state, self.lr_schedule)
        kw = {} if read is None else {"read": read}
        return checkpoint.save(self, root, tag or f"global_step{self.step}", state, max_num, max_mem_gb, **kw)

    def load_checkpoint(self, root: str, tag: Optional[str] = None) -> dict:
        """Restore the latest (or ``tag``) checkpoint under ``root`` into this layout (the learning-rate
        schedule included); returns client_state."""
        from openrlhf_lpo.megatron import checkpoint

        return restore_schedule(checkpoint.load(self, root, tag), self.lr_schedule)

    # ------------------------------------------------------------------------------ weights
    def export_hf_weights(self, dtype: Optional[torch.dtype] = None,
                          dst: Optional[int] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every rank (``dst=None``) or global rank 0 alone (``dst=0``); see :func:`convert.export_hf_weights`."""
        return convert.export_hf_weights(self.model, self.hf_config, dtype, dst=dst)

    def save_hf(self, out_dir: str, dtype: Optional[torch.dtype] = None):
        return convert.save_hf_checkpoint(self.model, self.hf_config, out_dir, dtype)
