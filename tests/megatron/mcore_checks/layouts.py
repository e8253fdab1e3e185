"""Parity of the Megatron actor with HF and plain torch, layout by layout and architecture by architecture.

For every :class:`Layout` of a model: log-probs vs HF float64, tensor names vs the converter's expected
local names, the HF export bit-exact before the step, then one training step whose grad norm and updated
weights equal the float64 plain-torch step (:func:`references.reference_step`). Negative controls: a naive
[q; k; v] fusion (qwen3) and Llama 3's RoPE scaling left out (llama) must show in the HF comparison.
"""

import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from openrlhf_lpo import listwise
from openrlhf_lpo.megatron import convert
from openrlhf_lpo.megatron.actor import MegatronActor, MegatronActorConfig
from openrlhf_lpo.megatron.losses import LossSpec

from . import world as W
from .references import CLIP, EPS, K, LR, dp_slice, masked_maxdiff, reference_inputs, reference_step, state_maxdiff
from .registry import check


@dataclass(frozen=True)
class Layout:
    """One actor of a parity run: megatron's parallel sizes, the optimizer, the loss, the micro-batch size."""

    tp: int
    pp: int
    # "listwise", "listwise_surrogate", "pg", "pg_hi" (PG with clip-higher, eps 0.2 / 0.28, on ratios in
    # (1.2, 1.28)), or "<loss>@<projection>@<divergence>" (e.g. "listwise@pointwise@fwd")
    spec: str = "listwise"
    micro_batch_size: int = 2
    distributed_optimizer: bool = False

    @property
    def key(self) -> str:
        """The record key under the model's name, e.g. ``tp1pp2_distopt/listwise/mbs2``."""
        distopt = "_distopt" if self.distributed_optimizer else ""
        return f"tp{self.tp}pp{self.pp}{distopt}/{self.spec}/mbs{self.micro_batch_size}"

    def parts(self):
        """(loss name, projection, divergence) of :attr:`spec`."""
        if "@" in self.spec:
            name, proj, div = (self.spec.split("@") + ["listwise", "fwd"])[:3]
        else:
            name, proj, div = self.spec, "listwise", "fwd"
        return ("pg" if self.spec == "pg_hi" else name), proj, div

    def loss(self) -> LossSpec:
        name, proj, div = self.parts()
        return LossSpec(name=name, group_size=K, divergence=div, projection=proj,
                        clip_eps=(0.2, 0.28) if self.spec == "pg_hi" else 0.2)

    @property
    def reference_key(self) -> str:
        """The plain-torch reference step it is compared with (a surrogate has the listwise gradient)."""
        _, proj, div = self.parts()
        return self.spec if self.spec.startswith("pg") else f"listwise@{proj}@{div}"

    def actor_config(self) -> MegatronActorConfig:
        return MegatronActorConfig(tp=self.tp, pp=self.pp, micro_batch_size=self.micro_batch_size, lr=LR,
                                   adam_eps=EPS, clip_grad=CLIP, use_distributed_optimizer=self.distributed_optimizer)


@dataclass
class ParityRun:
    """What the layouts of one model share: the tiny HF model, the batch, the float64 references."""

    name: str  # e.g. "qwen3_tied": the prefix of its records' keys
    tied: bool
    cfg: object
    hf: torch.nn.Module
    hf_sd: dict
    batch: dict
    ref_lp: torch.Tensor
    mask: torch.Tensor  # the action mask in float64
    extra: dict  # old log-probs, listwise target, GRPO advantages
    extra_far: dict  # old log-probs 0.215 below: ratios in (1.2, 1.28), cut by the symmetric clip only

    @classmethod
    def of(cls, arch: str, tied: bool) -> "ParityRun":
        cfg, hf, hf_sd, batch, rewards, ref_lp, old = reference_inputs(arch, tied)
        target = listwise.gibbs_target(rewards, listwise.group_temperature(rewards, "std")).reshape(-1).float()
        advantages = listwise.pg_advantages(rewards, "grpo").reshape(-1).float()
        extra = {"old_log_probs": old, "target": target, "advantages": advantages}
        # ratios in (1.2, 1.28): the symmetric clip cuts them, clip-higher (eps_high 0.28) does not
        extra_far = dict(extra, old_log_probs=(ref_lp - 0.215 + 0.02 * torch.randn(ref_lp.shape, dtype=torch.float64)).float())
        return cls(f"{arch}_{'tied' if tied else 'untied'}", tied, cfg, hf, hf_sd, batch, ref_lp,
                   batch["action_mask"].double(), extra, extra_far)


def prepass_coefficients(actor: MegatronActor, batch: dict, spec: LossSpec):
    """The surrogate's c as the update plan's pre-pass makes it (core/update.py): s from a no-grad pass at the current
    parameters, c = dL/ds of the projection's loss (None for the other losses)."""
    if spec.name != "listwise_surrogate":
        return None
    from openrlhf_lpo.core.loss import log_ratio
    from openrlhf_lpo.core.update import WindowMode, window_coefficients

    s = log_ratio(actor.log_probs(batch).double(), batch["old_log_probs"].double(), batch["action_mask"],
                  batch.get("rollout_log_probs"), batch.get("prev_log_ratio"), spec.clip_eps, spec.correction)
    return window_coefficients(WindowMode.PRE_PASS, batch["target"], spec.divergence, spec.projection,
                               spec.group_size, s=s)


def run_layouts(run: ParityRun, layouts: Sequence[Layout],
                after_step: Optional[Callable[[MegatronActor, Layout, LossSpec], dict]] = None) -> dict:
    """Each layout's parity record, keyed ``<model>/<layout key>``; ``after_step(actor, layout, spec)`` adds
    its own entries to a layout's record after the training step (checkpoints.py)."""
    cfg, hf, hf_sd, batch, ref_lp, mask, tied = run.cfg, run.hf, run.hf_sd, run.batch, run.ref_lp, run.mask, run.tied
    out, refs = {}, {}
    for lay in layouts:
        ex = run.extra_far if lay.spec == "pg_hi" else run.extra
        spec = lay.loss()
        if lay.reference_key not in refs:
            refs[lay.reference_key] = reference_step(hf, batch, ex, spec)
        if lay.spec == "pg_hi" and "pg_sym_far" not in refs:  # sensitivity: the symmetric clip differs
            refs["pg_sym_far"] = reference_step(hf, batch, ex, LossSpec(name="pg", group_size=K, clip_eps=0.2))
        ref_norm, ref_sd, _ = refs[lay.reference_key]
        t = time.time()
        actor = MegatronActor(cfg, lay.actor_config(), hf_weights=hf_sd.__getitem__)
        rec = {}
        lp = actor.log_probs(batch)
        rec["logp_vs_hf"] = masked_maxdiff(lp, ref_lp, mask)
        rec["logp"] = (lp * batch["action_mask"]).tolist()
        ps = actor.ps
        rec["names_match"] = set(convert.local_tensors(actor.model)) == set(
            convert.expected_local_names(cfg, lay.tp, lay.pp, ps.get_pipeline_model_parallel_rank())
        )
        exported = dict(actor.export_hf_weights())
        rec["export_bitexact"] = all(torch.equal(exported[k], hf_sd[k]) for k in exported) and (
            set(exported) == set(hf_sd) - ({"lm_head.weight"} if tied else set())
        )
        local = dp_slice({**batch, **ex}, actor)
        m = actor.train_step(local, spec, coefficients=prepass_coefficients(actor, local, spec))
        rec["grad_norm"] = m["grad_norm"]
        rec["grad_norm_ref"] = ref_norm
        if lay.spec == "pg_hi":
            rec["grad_norm_sym_ref"] = refs["pg_sym_far"][0]
            rec["clip_ratio"] = W.step_metrics(actor, m)["clip_ratio"]
        rec["entropy"] = W.step_metrics(actor, m)["entropy"]
        after = dict(actor.export_hf_weights())
        rec["weights_vs_ref"] = state_maxdiff(after, ref_sd, tied)
        rec["weights_moved"] = max(float((after[k] - hf_sd[k]).abs().max()) for k in after)
        if after_step is not None:
            rec.update(after_step(actor, lay, spec))
        rec["seconds"] = time.time() - t
        out[f"{run.name}/{lay.key}"] = rec
        del actor
    return out


def wrong_qkv(run: ParityRun) -> float:
    """Negative control: a naive [q; k; v] concatenation must be caught by the HF comparison."""
    good = convert.fuse_qkv
    convert.fuse_qkv = lambda q, k, v, c, tp=1: torch.cat([q, k, v], 0)
    try:
        actor = MegatronActor(run.cfg, MegatronActorConfig(tp=1, pp=1, micro_batch_size=4),
                              hf_weights=run.hf_sd.__getitem__)
        return masked_maxdiff(actor.log_probs(run.batch), run.ref_lp, run.mask)
    finally:
        convert.fuse_qkv = good


def wrong_rope(run: ParityRun) -> float:
    """Negative control: the same Llama 3.1 model with its RoPE scaling left out must differ from HF."""
    plain = copy.deepcopy(run.cfg)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": run.cfg.rope_parameters["rope_theta"]}
    actor = MegatronActor(plain, MegatronActorConfig(tp=1, pp=1, micro_batch_size=4), hf_weights=run.hf_sd)
    diff = masked_maxdiff(actor.log_probs(run.batch), run.ref_lp, run.mask)
    del actor
    return diff


# Qwen3 with tied embeddings: every TP / PP combination of the 4 ranks, the distributed optimizer, every
# loss (the two layouts with a save / resume and the weight stream are checkpoints.py's)
QWEN3_TIED = (
    Layout(tp=1, pp=1),
    Layout(tp=2, pp=1),
    Layout(tp=1, pp=2),
    Layout(tp=2, pp=1, distributed_optimizer=True),
    Layout(tp=2, pp=2, spec="listwise_surrogate", micro_batch_size=1),
    Layout(tp=2, pp=2, spec="listwise_surrogate@pointwise@fwd", micro_batch_size=1),
    Layout(tp=2, pp=1, spec="pg"),
    Layout(tp=1, pp=2, spec="pg_hi"),
    Layout(tp=2, pp=1, spec="listwise@pointwise@fwd"),
    Layout(tp=1, pp=2, spec="listwise@listwise@js"),
)
ONE_AND_FOUR_RANKS = (Layout(tp=1, pp=1), Layout(tp=2, pp=2, micro_batch_size=4))
TP2_AND_PP2 = (Layout(tp=2, pp=1), Layout(tp=1, pp=2))


@check("layouts_qwen3_tied")
def layouts_qwen3_tied():
    run = ParityRun.of("qwen3", tied=True)
    out = run_layouts(run, QWEN3_TIED)
    out[f"{run.name}/wrong_qkv"] = {"logp_vs_hf": wrong_qkv(run)}
    return out


@check("layouts_qwen3_untied")
def layouts_qwen3_untied():
    return run_layouts(ParityRun.of("qwen3", tied=False), ONE_AND_FOUR_RANKS)


@check("layouts_qwen2_untied")
def layouts_qwen2_untied():
    return run_layouts(ParityRun.of("qwen2", tied=False), ONE_AND_FOUR_RANKS)


@check("layouts_llama_untied")
def layouts_llama_untied():
    """The paper's model-diversity runs: Llama 3.1 (RoPE scaling), with its negative control."""
    run = ParityRun.of("llama", tied=False)
    out = run_layouts(run, TP2_AND_PP2)
    out[f"{run.name}/wrong_rope"] = {"logp_vs_hf": wrong_rope(run)}
    return out


@check("layouts_mistral_untied")
def layouts_mistral_untied():
    """The paper's model-diversity runs: Mistral (a sliding window longer than the test sequences)."""
    return run_layouts(ParityRun.of("mistral", tied=False), TP2_AND_PP2)
