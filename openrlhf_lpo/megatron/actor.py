"""Megatron-core LPO actor, independent of Ray: log-prob pass, training step, checkpoints.

One instance lives in every rank of a ``torch.distributed`` world of ``tp * pp * dp`` ranks.
Each data-parallel replica receives its own batch (whole prompt groups, prompt-major: the K
responses of a prompt are consecutive); every TP/PP rank of a replica receives the same batch.

Batch layout (OpenRLHF's non-packed format): ``sequences [B,S]`` (prompt left-padded, response
right-padded), ``attention_mask [B,S]``, ``action_mask [B,A]`` for the last ``A`` tokens.
Token log-probs are those of ``sequences[:, S-A:]`` given everything before, exactly
OpenRLHF's ``Actor.forward(...)[:, -A:]``.

* :meth:`MegatronActor.log_probs` — forward-only pass with Megatron's schedule; the last stage
  takes ``-vocab_parallel_cross_entropy`` of the vocab-sharded logits (no full-logit gather)
  and broadcasts the ``[B,A]`` result over the pipeline group.
* :meth:`MegatronActor.train_step` — one optimizer step over the batch: forward/backward
  schedule (1F1B under PP), loss from ``losses.POLICY_LOSSES`` on the last stage,
  ``finalize_model_grads`` (DP reduce, tied-embedding and q/k-norm grads), Megatron optimizer
  with gradient clipping. ``listwise_surrogate`` runs a no-grad coefficient pass first.
* :meth:`save_checkpoint` / :meth:`load_checkpoint` — per-rank model + optimizer state,
  written atomically; resume requires the same layout (use the HF export to change layouts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron import convert
from openrlhf_lpo.megatron.layout import validate_layout
from openrlhf_lpo.megatron.losses import LossSpec, get_policy_loss
from openrlhf_lpo.megatron.model import _get, build_gpt_model, transformer_config_from_hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    extra: dict = field(default_factory=dict)


def initialize_parallel(tp: int, pp: int, hf_config=None, vpp: int = 1) -> None:
    """Validate the layout and (re)initialise megatron's parallel state on the current world."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise ValueError("torch.distributed must be initialised before building the Megatron actor")
    validate_layout(dist.get_world_size(), tp, pp, hf_config, vpp)
    if vpp != 1:
        raise ValueError(f"--megatron.vpp {vpp}: virtual pipeline stages are not supported yet (use 1)")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp:
            return
        ps.destroy_model_parallel()
    # DP outermost: the tp*pp ranks of one model replica are consecutive (OpenRLHF's Ray actor
    # groups hand consecutive actors the same chunk of experiences)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, order="tp-cp-ep-pp-dp"
    )


def _seed(seed: int) -> None:
    from openrlhf_lpo.megatron.device import seed_model_parallel

    seed_model_parallel(seed)


def padded_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B,S] 0/1 key validity -> [B,1,S,S] bool, True = masked (causal or padded key)."""
    S = attention_mask.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad = ~attention_mask.bool()
    return (causal.unsqueeze(0) | pad[:, None, :]).unsqueeze(1)


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


class MegatronActor:
    """Megatron-core policy for one rank. ``hf_weights``: an HF checkpoint dir or a getter."""

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
        initialize_parallel(cfg.tp, cfg.pp, hf_config, cfg.vpp)
        _seed(cfg.seed)
        dtype = DTYPES[cfg.params_dtype]
        self.tconfig = transformer_config_from_hf(hf_config, cfg.tp, cfg.pp, params_dtype=dtype)
        model = build_gpt_model(hf_config, config=self.tconfig, use_te=cfg.use_te)
        self.uses_te = convert.uses_te_names(model)
        if hf_weights is not None:
            getter = convert.hf_tensor_getter(hf_weights) if isinstance(hf_weights, str) else hf_weights
            convert.load_hf_weights(model, getter, hf_config)
        if dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.tconfig, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        self.model = DDP(self.tconfig, ddp_config, model)
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
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.no_sync_func = self.model.no_sync
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

    def _micro_batches(self, batch: Dict[str, torch.Tensor], mbs: int) -> List[Dict[str, torch.Tensor]]:
        B = batch["sequences"].shape[0]
        if B % mbs:
            raise ValueError(f"batch of {B} sequences is not divisible by micro_batch_size={mbs}")
        return [{k: v[i : i + mbs] for k, v in batch.items()} for i in range(0, B, mbs)]

    def _token_log_probs(self, output: torch.Tensor, mb, with_entropy: bool):
        """Last stage: [b,S,V/tp] logits -> action log-probs [b,A] (and entropy) of mb."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        seq = mb["sequences"]
        S, A = seq.shape[1], mb["action_mask"].shape[1]
        logits = output[:, S - A - 1 : S - 1, :].float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        ent = vocab_parallel_entropy(logits) if with_entropy else None
        labels = seq[:, S - A :]
        # the CE kernel shifts its (fp32) input in place: hand it a private contiguous copy
        logp = -vocab_parallel_cross_entropy(logits.clone().contiguous(), labels.contiguous())
        return logp, ent

    def _forward_step(self, data_iterator, model, loss_fn):
        mb = next(data_iterator)
        am = mb["attention_mask"]
        pos = (am.long().cumsum(-1) - 1).clamp(min=0)
        out = model(mb["sequences"], pos, attention_mask=padded_attention_mask(am))
        return out, partial(loss_fn, mb)

    def _run(self, batch, loss_fn, forward_only: bool, mbs: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbatches = self._micro_batches(batch, mbs)
        fb = get_forward_backward_func()
        return fb(
            forward_step_func=partial(self._forward_step, loss_fn=loss_fn),
            data_iterator=iter(mbatches),
            model=[self.model],
            num_microbatches=len(mbatches),
            seq_length=batch["sequences"].shape[1],
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, t: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return t
        group = self.ps.get_pipeline_model_parallel_group()
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        t = t.contiguous()
        dist.broadcast(t, src=self.ps.get_pipeline_model_parallel_last_rank(), group=group)
        return t

    def _reduce_stats(self, vals: Dict[str, float]) -> Dict[str, float]:
        """Sum stats of the last stage over DP, then share over PP."""
        keys = sorted(vals) if vals else []
        dev = self.device
        n = self._broadcast_from_last_stage(
            torch.tensor([len(keys)], dtype=torch.float64, device=dev) if self.is_last_stage else None,
            (1,),
            torch.float64,
        )
        if not self.is_last_stage:
            keys = None
        obj = [keys]
        if self.ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                obj, src=self.ps.get_pipeline_model_parallel_last_rank(), group=self.ps.get_pipeline_model_parallel_group()
            )
        keys = obj[0]
        t = torch.tensor([vals[k] for k in keys], dtype=torch.float64, device=dev) if self.is_last_stage else None
        t = self._broadcast_from_last_stage(t, (int(n.item()),), torch.float64)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------------------ API
    @torch.no_grad()
    def log_probs(self, batch: Dict[str, torch.Tensor], with_entropy: bool = False):
        """Action log-probs ``[B,A]`` (and entropy ``[B,A]``) on every rank of this replica."""
        self.model.eval()
        batch = self._to_device(batch)
        B, A = batch["action_mask"].shape

        def loss_fn(mb, output):
            logp, ent = self._token_log_probs(output, mb, with_entropy)
            return torch.zeros(()), {"logp": logp, "ent": ent}

        mbs = min(self.cfg.micro_batch_size, B)
        outs = self._run(batch, loss_fn, forward_only=True, mbs=mbs)
        logp = ent = None
        if self.is_last_stage:
            logp = torch.cat([o["logp"] for o in outs])
            if with_entropy:
                ent = torch.cat([o["ent"] for o in outs])
        logp = self._broadcast_from_last_stage(logp, (B, A), torch.float32)
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
            return total, count, stats

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
        return metrics

    def surrogate_coefficients(self, batch, spec: LossSpec) -> torch.Tensor:
        """c_k = dD/ds_k (``listwise.listwise_coefficients``) from a no-grad pass at the current
        parameters; the replica's batch holds whole groups."""
        logp = self.log_probs(batch)
        s = listwise.sequence_log_ratio(logp, batch["old_log_probs"], batch["action_mask"], spec.clip_eps)
        K = spec.group_size
        c = listwise.listwise_coefficients(
            listwise.to_groups(s, K), listwise.to_groups(batch["target"].float(), K), spec.divergence
        )
        return c.reshape(-1)

    # ------------------------------------------------------------------------------ weights
    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        return convert.export_hf_weights(self.model, self.hf_config, dtype)

    def save_hf(self, out_dir: str, dtype: Optional[torch.dtype] = None):
        return convert.save_hf_checkpoint(self.model, self.hf_config, out_dir, dtype)

    def _rank_file(self, ckpt_dir: str) -> str:
        ps = self.ps
        return os.path.join(
            ckpt_dir,
            f"mp_tp{ps.get_tensor_model_parallel_rank():02d}_pp{ps.get_pipeline_model_parallel_rank():02d}"
            f"_dp{ps.get_data_parallel_rank():03d}.pt",
        )

    def _inner_optimizers(self):
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def save_checkpoint(self, ckpt_dir: str, client_state: Optional[dict] = None) -> None:
        """Per-rank model + optimizer state (atomic); ``latest`` written last by rank 0."""
        os.makedirs(ckpt_dir, exist_ok=True)
        inner = self._inner_optimizers()
        state = {
            "model": convert.unwrap(self.model).state_dict(),
            "optim": [o.state_dict() for o in inner],
            "main_params": [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in inner],
            "step": self.step,
            "layout": (self.cfg.tp, self.cfg.pp, dist.get_world_size()),
            "client_state": client_state or {},
        }
        path = self._rank_file(ckpt_dir)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:
                f.write(str(self.step))
            os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        """Restore what :meth:`save_checkpoint` wrote (same TP/PP/world size); returns client_state."""
        if not os.path.exists(os.path.join(ckpt_dir, "latest")):
            raise ValueError(f"no complete Megatron checkpoint in {ckpt_dir!r} (missing 'latest')")
        state = torch.load(self._rank_file(ckpt_dir), map_location="cpu", weights_only=False)
        layout = (self.cfg.tp, self.cfg.pp, dist.get_world_size())
        if tuple(state["layout"]) != layout:
            raise ValueError(
                f"checkpoint layout (tp, pp, world)={tuple(state['layout'])} differs from the current {layout}; "
                "resume with the same layout or start from the exported HF weights"
            )
        convert.unwrap(self.model).load_state_dict(state["model"], strict=False)
        with torch.no_grad():
            for o, sd, mains in zip(self._inner_optimizers(), state["optim"], state["main_params"]):
                params = [p for g in o.param_groups for p in g["params"]]
                for p, v in zip(params, mains):
                    p.copy_(v)
                o.load_state_dict(sd)
        # main params -> model params for mixed precision (a no-op copy for fp32)
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_copy_main_params_to_model_params"):
                opt._copy_main_params_to_model_params()
        self.step = state["step"]
        return state["client_state"]
