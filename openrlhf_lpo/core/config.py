"""Settings shared by the CLI (``openrlhf_lpo.cli``) and the OpenRLHF extension: the estimators we
add, the temperature that pairs each group policy-gradient estimator with LPO, and when a run
logs the listwise metrics. The CLI imports this module; nothing here imports the CLI.

Public names (stable):
    LPO_ESTIMATORS, EXTRA_ESTIMATORS, PAIRED_TEMPERATURE, dp_size(args),
    listwise_metrics_enabled(args), uses_lpo_classes(args)
"""

from __future__ import annotations

__all__ = ["LPO_ESTIMATORS", "EXTRA_ESTIMATORS", "PAIRED_TEMPERATURE", "dp_size", "listwise_metrics_enabled",
           "uses_lpo_classes"]

LPO_ESTIMATORS = ("lpo",)
EXTRA_ESTIMATORS = ("lpo", "maxrl")
# Group-baseline policy-gradient estimators and the temperature of their LPO pairing: with
# --lpo.end_kl they log the same KL(w*||P) as LPO (metrics only), so the two can be compared.
PAIRED_TEMPERATURE = {"group_norm": "std", "dr_grpo": "one", "maxrl": "mean", "rloo": "loo",
                      "reinforce_baseline": "batch_std"}


def dp_size(args) -> int:
    """Effective data-parallel size of the actor (what OpenRLHF chunks experiences by): the actor
    GPUs divided by what one model replica spans, ``--megatron.tp x --megatron.pp`` with
    ``--backend megatron``, DeepSpeed's ring-attention and tensor-parallel sizes otherwise."""
    world = args.actor.num_nodes * args.actor.num_gpus_per_node
    if getattr(args, "backend", "deepspeed") == "megatron":
        m = args.megatron
        return world // max(int(m.tp) * int(m.pp), 1)
    return world // max(args.ds.ring_attn_size, 1) // max(args.ds.tensor_parallel_size, 1)


def listwise_metrics_enabled(args) -> bool:
    """True when a non-LPO estimator logs the listwise KL (the LPO classes must be installed)."""
    est = args.algo.advantage.estimator
    return est not in LPO_ESTIMATORS and est in PAIRED_TEMPERATURE and bool(getattr(args.lpo, "end_kl", False))


def uses_lpo_classes(args) -> bool:
    """True when the run needs our trainer / experience maker / actor classes."""
    return args.algo.advantage.estimator in EXTRA_ESTIMATORS or listwise_metrics_enabled(args)
