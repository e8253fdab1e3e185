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
  takes ``-vocab_parallel_cross_entropy`` of the vocab-sharded logits of the action positions only
  (no full-logit gather) and broadcasts the ``[B,A]`` result over the pipeline group.
* :meth:`MegatronActor.train_step` — one optimizer step over the batch: forward/backward
  schedule (1F1B under PP), loss from ``losses.POLICY_LOSSES`` on the last stage,
  ``finalize_model_grads`` (DP reduce, tied-embedding and q/k-norm grads), Megatron optimizer
  with gradient clipping. ``listwise_surrogate`` runs a no-grad coefficient pass first.
  ``recompute=True`` (``--actor.gradient_checkpointing_enable``) recomputes every layer.
* Sequence parallelism (``sequence_parallel=True``, TP > 1): every sequence of a packed row is
  padded at its tail to a multiple of TP (so the row splits evenly over the TP ranks); the pads
  are never read by a real token (causal attention) and no loss or log-prob reads them.
* Virtual pipeline stages (``vpp > 1``, PP > 1): ``self.model`` is a :class:`ModelChunks` of
  ``vpp`` DDP-wrapped chunks run by megatron's interleaved 1F1B schedule; the micro-batch count
  is padded to a multiple of PP with one-sequence micro-batches that carry no loss (the schedule
  needs ``M % pp == 0``), and every packed row of a pass to the longest one (a trailing pad
  segment: the interleaved schedule sends fixed shapes).
* :meth:`save_checkpoint` / :meth:`load_checkpoint` — :mod:`.checkpoint`: layout-free
  ``global_stepN`` directories (safetensors + JSON), resumable in another TP/PP layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron import convert
from openrlhf_lpo.megatron.device import group_device, local_device
from openrlhf_lpo.megatron.layout import validate_layout
from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss
from openrlhf_lpo.megatron.model import attention_span, build_gpt_model, transformer_config_from_hf
from openrlhf_lpo.megatron.packing import PackedMicroBatch, pack_micro_batch, pad_to_tokens

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
    timeout_minutes: int = 60  # NCCL/gloo timeout of megatron's process groups (OpenRLHF: 60)
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


class MegatronActor:
    """Megatron-core policy for one rank. ``hf_weights``: an HF checkpoint dir, a mapping or
    getter of HF tensors, or a :class:`convert.TensorReader` (None: megatron's random init)."""

    def __init__(self, hf_config, cfg: MegatronActorConfig, hf_weights=None):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.hf_config = hf_config
        self.cfg = cfg
        if cfg.params_dtype not in DTYPES:
            raise ValueError(f"--megatron.params_dtype {cfg.params_dtype!r}: choose one of {sorted(DTYPES)}")
        if cfg.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {cfg.micro_batch_size}")
        if cfg.sequence_parallel and cfg.tp < 2:
            raise ValueError("--megatron.sequence_parallel needs --megatron.tp > 1 (it splits the sequence over TP ranks)")
        initialize_parallel(cfg.tp, cfg.pp, hf_config, cfg.vpp, cfg.timeout_minutes)
        _seed(cfg.seed)
        dtype = DTYPES[cfg.params_dtype]
        self.tconfig = transformer_config_from_hf(hf_config, cfg.tp, cfg.pp, params_dtype=dtype,
                                                  recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel,
                                                  vpp=cfg.vpp)
        self.attention_span = attention_span(hf_config)
        # one chunk per virtual stage (vpp 1: the rank's whole stage)
        chunks = [build_gpt_model(hf_config, config=self.tconfig, use_te=cfg.use_te,
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
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.no_sync_func = chunks[0].no_sync if cfg.vpp == 1 else [c.no_sync for c in chunks]
        self.step = 0
        self.ps = ps

    # ------------------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return next(convert.unwrap(self.model).parameters()).device

    def _to_device(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        dev = self.device
        return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage()

    @property
    def pad_multiple(self) -> int:
        """Every packed sequence is padded to this many tokens: TP under sequence parallelism."""
        return self.cfg.tp if self.cfg.sequence_parallel else 1

    def _micro_batches(self, batch: Dict[str, torch.Tensor], mbs: int) -> List[Dict]:
        """Split into micro-batches of ``mbs`` rows and pack each into one THD row."""
        B = batch["sequences"].shape[0]
        if B % mbs:
            raise ValueError(f"batch of {B} sequences is not divisible by micro_batch_size={mbs}")
        A = batch["action_mask"].shape[1]
        out = []
        for i in range(0, B, mbs):
            mb = {k: v[i : i + mbs] for k, v in batch.items()}
            mb["packed"] = pack_micro_batch(mb["sequences"], mb["attention_mask"], A, self.pad_multiple)
            self._check_span(mb["packed"])
            out.append(mb)
        out += self._schedule_padding(len(out), batch["sequences"])
        if self.cfg.vpp > 1:  # fixed shapes for the interleaved schedule: one packed length per pass
            total = max(mb["packed"].num_tokens for mb in out)
            for mb in out:
                mb["packed"] = pad_to_tokens(mb["packed"], total)
        return out

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
        return [{"packed": packed, "schedule_padding": True} for _ in range(pp - num % pp)]

    def _check_span(self, packed: PackedMicroBatch) -> None:
        span = self.attention_span
        if span is not None and max(packed.seq_lens) > span:
            raise ValueError(
                f"a sequence of {max(packed.seq_lens)} tokens exceeds the model's sliding window of {span} "
                "(sliding_window in the HF config): --backend megatron computes full causal attention, exact "
                "only up to the window; lower --data.max_len or use the DeepSpeed backend"
            )

    def _token_log_probs(self, output: torch.Tensor, mb, with_entropy: bool):
        """Last stage: packed logits [1,T,V/tp] -> action log-probs [b,A] (and entropy) of mb."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        pk: PackedMicroBatch = mb["packed"]
        valid = pk.action_valid
        # the action rows only, as a fresh tensor: the CE kernel may shift it in place
        logits = output[0, pk.action_index[valid]].float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        ent_rows = vocab_parallel_entropy(logits) if with_entropy else None
        lp_rows = -vocab_parallel_cross_entropy(logits.contiguous(), pk.action_tokens[valid].contiguous())
        logp = torch.zeros(valid.shape, dtype=lp_rows.dtype, device=lp_rows.device)
        logp = logp.masked_scatter(valid, lp_rows)
        ent = None
        if with_entropy:
            ent = torch.zeros(valid.shape, dtype=ent_rows.dtype, device=ent_rows.device).masked_scatter(valid, ent_rows)
        return logp, ent

    def _forward_step(self, data_iterator, model, loss_fn):
        mb = next(data_iterator)
        pk: PackedMicroBatch = mb["packed"]
        kwargs = {"fp32_output": False} if self.half else {}  # logits stay bf16; action rows upcast
        out = model(pk.tokens, pk.position_ids, None, packed_seq_params=pk.packed_seq_params(), **kwargs)
        if mb.get("schedule_padding"):
            return out, _no_loss
        return out, partial(loss_fn, mb)

    def _run(self, batch, loss_fn, forward_only: bool, mbs: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbatches = self._micro_batches(batch, mbs)
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

    def _reduce_stats(self, vals: Dict[str, float]) -> Dict[str, float]:
        """Sum stats of the last stage over DP, then share over PP."""
        keys = sorted(vals) if vals else None
        if self.ps.get_pipeline_model_parallel_world_size() > 1:
            obj = [keys if self.is_last_stage else None]
            dist.broadcast_object_list(
                obj, src=self.ps.get_pipeline_model_parallel_last_rank(), group=self.ps.get_pipeline_model_parallel_group()
            )
            keys = obj[0]
        keys = keys or []
        t = torch.tensor([vals[k] for k in keys], dtype=torch.float64) if self.is_last_stage else None
        t = self._broadcast_from_last_stage(t, (len(keys),), torch.float64)
        dp_group = self.ps.get_data_parallel_group()
        t = t.to(group_device(dp_group))
        dist.all_reduce(t, group=dp_group)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------------------ API
    @torch.no_grad()
    def log_probs(self, batch: Dict[str, torch.Tensor], with_entropy: bool = False):
        """Action log-probs ``[B,A]`` (0 where ``action_mask`` is 0; and entropy ``[B,A]``) on every
        rank of this replica."""
        self.model.eval()
        batch = self._to_device(batch)
        B, A = batch["action_mask"].shape

        def loss_fn(mb, output):
            logp, ent = self._token_log_probs(output, mb, with_entropy)
            return torch.zeros((), device=logp.device), {"logp": logp, "ent": ent}

        mbs = min(self.cfg.micro_batch_size, B)
        outs = self._run(batch, loss_fn, forward_only=True, mbs=mbs)
        logp = ent = None
        if self.is_last_stage:
            logp = torch.cat([o["logp"] for o in outs])
            if with_entropy:
                ent = torch.cat([o["ent"] for o in outs])
        logp = self._broadcast_from_last_stage(logp, (B, A), torch.float32)
        mask = batch["action_mask"].to(device=logp.device, dtype=logp.dtype)
        logp = logp * mask  # OpenRLHF's contract: 0 outside the action mask
        if with_entropy:
            ent = self._broadcast_from_last_stage(ent, (B, A), torch.float32)
            return logp, ent
        return logp

    def train_step(self, batch: Dict[str, torch.Tensor], spec: LossSpec) -> Dict[str, float]:
        """One optimizer step on this replica's batch (all replicas call it together)."""
        loss = get_policy_loss(spec.name)
        batch = self._to_device(batch)
        if spec.name == "listwise_surrogate":
            batch["coefficients"] = self.surrogate_coefficients(batch, spec)
        if spec.name == "listwise" and self.cfg.micro_batch_size % spec.group_size:
            raise ValueError(
                f"micro_batch_size={self.cfg.micro_batch_size} must be a multiple of the group size "
                f"K={spec.group_size} for whole-group LPO; use the two-pass surrogate otherwise"
            )
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_fn(mb, output):
            logp, ent = self._token_log_probs(output, mb, with_entropy=True)
            total, count, stats = loss(logp, mb, spec)
            mask = mb["action_mask"].float()
            stats = {k: float(v) for k, v in stats.items()}
            stats["entropy_sum"] = float((ent * mask).sum())
            stats["tokens"] = float(mask.sum())
            stats["responses"] = float(logp.shape[0])
            return total, count.to(logp.device), stats

        outs = self._run(batch, loss_fn, forward_only=False, mbs=self.cfg.micro_batch_size)
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        local = {}
        if self.is_last_stage:
            for o in outs:
                for k, v in o.items():
                    local[k] = local.get(k, 0.0) + v
        tot = self._reduce_stats(local)
        metrics = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "update_ok": float(ok)}
        metrics["entropy"] = tot.get("entropy_sum", 0.0) / max(tot.get("tokens", 1.0), 1.0)
        if "loss_sum" in tot:
            denom = tot.get("loss_count", tot["responses"])
            metrics["policy_loss"] = tot["loss_sum"] / max(denom, 1.0)
        if "clip_sum" in tot:
            metrics["ppo_clip_ratio"] = tot["clip_sum"] / max(tot.get("tokens", 1.0), 1.0)
        return metrics

    def surrogate_coefficients(self, batch, spec: LossSpec) -> torch.Tensor:
        """c_k = dL/ds_k of the projection's loss (``listwise.projection_coefficients``: dD/ds for
        ``listwise``, -w* for ``pointwise``) from a no-grad pass at the current parameters; the
        replica's batch holds whole groups."""
        logp = self.log_probs(batch)
        s = listwise.sequence_log_ratio(logp, batch["old_log_probs"], batch["action_mask"], spec.clip_eps)
        K = spec.group_size
        c = listwise.projection_coefficients(
            listwise.to_groups(s, K), listwise.to_groups(batch["target"].float(), K), spec.divergence,
            spec.projection,
        )
        return c.reshape(-1)

    # ------------------------------------------------------------------------------ weights
    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        return convert.export_hf_weights(self.model, self.hf_config, dtype)

    def save_hf(self, out_dir: str, dtype: Optional[torch.dtype] = None):
        return convert.save_hf_checkpoint(self.model, self.hf_config, out_dir, dtype)

    def save_checkpoint(self, root: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        max_num: Optional[int] = None, max_mem_gb: Optional[float] = None) -> str:
        """``root/<tag>`` (default ``global_step<step>``), ``latest`` written last; see :mod:`.checkpoint`."""
        from openrlhf_lpo.megatron import checkpoint

        return checkpoint.save(self, root, tag or f"global_step{self.step}", client_state or {}, max_num, max_mem_gb)

    def load_checkpoint(self, root: str, tag: Optional[str] = None) -> dict:
        """Restore the latest (or ``tag``) checkpoint under ``root`` into this layout; returns client_state."""
        from openrlhf_lpo.megatron import checkpoint

        return checkpoint.load(self, root, tag)
