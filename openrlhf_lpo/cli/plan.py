"""The run plan of ``lpo-train``: GPUs per role, the shape of every rollout batch, and a cluster check.

Public names (stable):
    gpu_roles(args) -> list of (role, gpus, note): the placement groups OpenRLHF 0.11.2's ``train()``
                       will ask Ray for (colocated roles share one group and count once)
    gpus_needed(args) -> int
    check_cluster(args, resources) -> None    raises ClusterTooSmall naming GPUs needed per role vs present
    dataset_rows(args) -> (rows or None, note)
    plan_lines(args, preflight=None) -> list of str   what ``lpo-train --dry-run`` prints (with the
                                              preflight's summary: data, tokens, reward, disk, resume)
    method_line(args) -> str         the method's settings in effect (advantage or temperature, policy loss
                                     and clip band, aggregation, dynamic sampling, overlong shaping)
    ClusterTooSmall

``--dry-run`` validates every flag (the stock parser and validation, every flag group), prints the
plan and exits 0 without starting Ray or loading a model; it needs no GPU, so a recipe's needs can be
read on a laptop. A real launch runs ``check_cluster`` against the Ray cluster's GPUs before any actor is
created (through :mod:`openrlhf_lpo.cli.capacity`, the DeepSpeed layout's fit), so a recipe that cannot fit
fails at once (exit 5) instead of waiting forever for a placement group.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from openrlhf_lpo.core.config import LPO_ESTIMATORS, dp_size
from openrlhf_lpo.core.training_backends import backend_of

__all__ = ["gpu_roles", "gpus_needed", "check_cluster", "dataset_rows", "plan_lines", "method_line", "ClusterTooSmall"]

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


class ClusterTooSmall(RuntimeError):
    """The Ray cluster has fewer GPUs than the recipe's placement groups need."""


def gpu_roles(args) -> List[Tuple[str, int, str]]:
    """(role, GPUs, note) per placement group, following ``openrlhf.cli.train_ppo_ray.train``."""
    train = args.train
    actor = args.actor.num_nodes * args.actor.num_gpus_per_node
    engines = (args.vllm.num_engines or 0) * max(args.vllm.tensor_parallel_size, 1)
    has_ref = args.algo.kl.init_coef > 0
    has_critic = bool(getattr(args.critic, "model_name_or_path", None))
    has_reward = not args.reward.remote_url
    backend = backend_of(args)
    roles = []
    actor_note = f"{backend.name} actor, {backend.layout_note(args, dp_size(args))}"
    if train.colocate_all:
        shared = ["actor"] + (["ref"] if has_ref else []) + (["critic"] if has_critic else []) + \
                 (["reward"] if has_reward else [])
        if not train.async_enable and engines:
            shared.append("vLLM engines")
        roles.append(("actor", actor, f"{actor_note}; shared with " + ", ".join(shared[1:]) if len(shared) > 1
                      else actor_note))
        if train.async_enable and engines:
            roles.append(("vLLM engines", engines, f"{args.vllm.num_engines} x TP {args.vllm.tensor_parallel_size} "
                          "(async: not colocated)"))
        return roles
    if train.colocate_actor_ref and has_ref:
        roles.append(("actor", actor, f"{actor_note}; shared with ref"))
    else:
        roles.append(("actor", actor, actor_note))
        if has_ref:
            roles.append(("ref", args.ref.num_nodes * args.ref.num_gpus_per_node, "reference model (KL)"))
    if engines:
        roles.append(("vLLM engines", engines, f"{args.vllm.num_engines} x TP {args.vllm.tensor_parallel_size}"))
    critic = args.critic.num_nodes * args.critic.num_gpus_per_node
    reward = args.reward.num_nodes * args.reward.num_gpus_per_node
    if has_critic and has_reward and train.colocate_critic_reward:
        roles.append(("critic", critic, "shared with reward"))
    else:
        if has_critic:
            roles.append(("critic", critic, "value model"))
        if has_reward:
            roles.append(("reward", reward, "reward model"))
    return roles


def gpus_needed(args) -> int:
    return sum(g for _, g, _ in gpu_roles(args))


def check_cluster(args, resources: dict) -> None:
    """Raise ClusterTooSmall when ``resources`` (``ray.cluster_resources()``) has fewer GPUs than needed."""
    need = gpus_needed(args)
    have = float(resources.get("GPU", 0.0))
    if have + 1e-9 < need:
        roles = ", ".join(f"{role} {g}" for role, g, _ in gpu_roles(args))
        raise ClusterTooSmall(
            f"this recipe needs {need} GPUs ({roles}) but the Ray cluster has {have:g}; add nodes or shrink "
            "--actor.num_nodes/--actor.num_gpus_per_node, --vllm.num_engines/--vllm.tensor_parallel_size "
            "(or colocate with --train.colocate_all). `lpo-train ... --dry-run` prints the plan."
        )


def dataset_rows(args) -> Tuple[Optional[int], str]:
    """Rows the prompt dataset will give (capped by --data.max_samples), read from local files only."""
    specs = [p.strip() for p in str(args.data.prompt_dataset or "").split(",") if p.strip()]
    if not specs:
        return None, "no --data.prompt_dataset"
    total = 0
    for spec in specs:
        path = spec.split("@")[0]
        if os.path.isfile(path):
            total += _count_rows(path)
        elif os.path.isdir(path):
            try:
                from datasets import load_from_disk

                ds = load_from_disk(path)
                total += len(ds[args.data.prompt_split] if hasattr(ds, "keys") else ds)
            except Exception as e:  # noqa: BLE001  (an unreadable folder: say so, plan without it)
                return None, f"{path}: {type(e).__name__}: {e}"
        elif path.endswith(DATA_SUFFIXES):
            raise FileNotFoundError(
                f"--data.prompt_dataset {path}: no such file (prepare it, e.g. python -m openrlhf_lpo.data.prepare)"
            )
        else:
            return None, f"{spec} is not a local path (a hub dataset): its size is known only at run time"
    cap = args.data.max_samples
    return (min(total, cap) if cap else total), "local files"


def _count_rows(path: str) -> int:
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    from datasets import load_dataset

    kind = {".json": "json", ".csv": "csv", ".arrow": "arrow"}[os.path.splitext(path)[1]]
    return len(load_dataset(kind, data_files=path, split="train"))


def _batch_shape(args, groups: int) -> str:
    """Windows and passes of one rollout batch of ``groups`` prompts (lpo), from the update's own planner
    (core/update.plan_update, as every rank would run it with every sample at --data.max_len tokens)."""
    from collections import Counter

    import torch

    from openrlhf_lpo.core.update import UpdateBatch, UpdateSettings, plan_update

    K, dp = args.rollout.n_samples_per_prompt, dp_size(args)
    used = groups - groups % dp
    if used == 0:
        return f"{groups} prompts < {dp} ranks: skipped"
    per_rank = used // dp
    n = per_rank * K
    batch = UpdateBatch(lengths=[int(args.data.max_len)] * n, gids=[i // K for i in range(n)],
                        target=torch.full((n,), 1.0 / K, dtype=torch.float64), prev=torch.zeros(n, dtype=torch.float64))
    plans = plan_update(batch, UpdateSettings.from_args(args, dp), lambda values, op: list(values), 0)
    epochs = args.train.max_epochs
    windows = len(plans) // max(epochs, 1)
    modes = Counter(p.mode.value for p in plans)
    if args.lpo.projection == "pointwise":
        passes = "pointwise (no extra pass)"
    elif args.lpo.force_two_pass:
        passes = "a no-grad pre-pass in every window (--lpo.force_two_pass)"
    elif modes["one_pass"] == len(plans):
        passes = ("one pass while each group's tokens fit --train.max_tokens_per_gpu" if args.train.dynamic_batch_enable
                  else "one pass in every window (micro-batches hold whole groups)")
    else:
        later = modes["pre_pass"]
        split = ("groups may exceed --train.max_tokens_per_gpu (at --data.max_len)" if args.train.dynamic_batch_enable
                 else "micro-batches split groups")
        passes = f"{split}; first window: c from s_t, no extra forward"
        passes += f"; {later} later window(s): one no-grad pre-pass each" if later else ""
    dropped = f", {groups - used} dropped to keep ranks equal" if groups != used else ""
    return (f"{per_rank} groups per rank{dropped}; {windows} optimizer window(s) x {epochs} epoch(s) = "
            f"{len(plans)} step(s); {passes}")


def _placement_lines(args) -> List[str]:
    """The actor's rank-to-node map as lpo-train will place it (openrlhf/placement.py)."""
    from openrlhf_lpo.openrlhf.placement import planned_layout

    tp, pp = backend_of(args).model_parallel(args)  # the blocks of ranks one model replica spans
    nodes, gpn = args.actor.num_nodes, args.actor.num_gpus_per_node
    head = f"  actor ranks by node (node-major: each node's Ray bundles in rank order, {nodes} x {gpn} GPUs):"
    return [head] + [f"    {line}" for line in planned_layout(nodes, gpn, tp, pp)]


def _flag_group_plan_lines(args) -> List[str]:
    """What the run's flag groups add to the plan (``FlagGroup.plan_lines``; e.g. the Megatron backend's
    pipeline efficiency): a plugin imports the CLI, never the reverse."""
    from openrlhf_lpo.cli.flags import flag_groups

    return [line for group in flag_groups(args) if group.plan_lines for line in group.plan_lines(args)]


# the advantage each group / batch estimator computes (OpenRLHF 0.11.2's experience maker; maxrl is ours)
ADVANTAGES = {"group_norm": "(R - mean)/std per group", "dr_grpo": "R - mean per group",
              "rloo": "R - mean of the other K-1 = K/(K-1)(R - mean)", "maxrl": "(R - mean)/mean per group",
              "reinforce_baseline": "R - group mean, whitened over the rollout batch",
              "reinforce": "R, whitened over the rollout batch", "flash_reinforce": "R - rollout-batch mean",
              "gae": "GAE(gamma, lambda) with the critic, whitened"}


# --actor.policy_loss_type -> what its loss does with the ratio, from the actor flags (ppo: the default below)
POLICY_LOSS_BANDS = {
    "gspo": lambda a, lo, hi: f"sequence ratio clipped to [1-{lo:g}, 1+{hi:g}]",
    "cispo": lambda a, lo, hi: f"detached token ratio clipped to [{max(1.0 - lo, 0.0):g}, {1.0 + hi:g}] as a weight",
    "clip_cov": lambda a, lo, hi: (
        f"token ratio clipped to [1-{lo:g}, 1+{hi:g}]; Clip-Cov detaches max(1, {a.clip_cov_ratio:g} x tokens) of "
        f"each micro-batch, drawn among those with covariance in ({a.clip_cov_lb:g}, {a.clip_cov_ub:g}), seeded by "
        "--train.seed and the step"),
    "kl_cov": lambda a, lo, hi: (
        f"token ratio unclipped; KL-Cov adds {a.kl_cov_coef:g} x |log r| on the max(1, {a.kl_cov_ratio:g} x tokens) "
        "of largest covariance in each micro-batch"),
}


def _is_tpo(lpo) -> bool:
    """The flags of configs/methods/tpo.sh: Target Policy Optimization as a configuration of the listwise loss."""
    return (getattr(lpo, "score", None), getattr(lpo, "anchor", None), lpo.temperature, lpo.divergence,
            lpo.projection) == ("sum", "old", "pop_std", "fwd", "listwise")


def _listwise_name(args) -> str:
    return "TPO (Target Policy Optimization, arXiv 2604.06159) as LPO " if _is_tpo(args.lpo) else "LPO "


def _score_text(args, lo: float, hi: float) -> str:
    score = getattr(args.lpo, "score", "mean_clip")
    if score == "mean_clip":
        return f"s clips token log-ratios to [log(1-{lo:g}), log(1+{hi:g})]"
    return {"sum": "s sums the token log-ratios (no clip, no length normalisation)",
            "mean": "s averages the token log-ratios (no clip)"}.get(score, f"s is the {score} score")


def method_line(args) -> str:
    """One line naming the method's settings in effect: the estimator's advantage (and its paired LPO
    temperature) or LPO's temperature and token clip of s, the policy loss and its clip band, the loss
    aggregation, dynamic sampling and overlong shaping (docs/methods.md)."""
    from openrlhf_lpo.core.config import PAIRED_TEMPERATURE

    est = args.algo.advantage.estimator
    lo, hi = args.actor.eps_clip_low_high
    if est in LPO_ESTIMATORS:
        parts = [_listwise_name(args) + f"{args.lpo.projection} (divergence {args.lpo.divergence}), temperature "
                 f"{args.lpo.temperature}", _score_text(args, lo, hi)]
        if getattr(args.lpo, "anchor", "none") == "old":
            parts.append("anchor l_old = old log-probs aggregated as s: P = softmax(s + l_old), "
                         "w* = softmax(R/tau + l_old)")
        parts.append("loss: mean over prompts of the per-group loss")
    else:
        kind = args.actor.policy_loss_type
        adv = ADVANTAGES.get(est, est)
        if est == "reinforce_baseline" and args.algo.advantage.no_std_norm:
            adv = "R - group mean, centred over the rollout batch"
        paired = PAIRED_TEMPERATURE.get(est)
        band = POLICY_LOSS_BANDS.get(kind, lambda a, lo, hi: f"token ratio clipped to [1-{lo:g}, 1+{hi:g}]")(
            args.actor, lo, hi)
        agg = "seq-mean-token-mean" if kind == "gspo" else args.actor.loss_agg_mode
        parts = [f"advantage {adv}" + (f" (paired LPO temperature {paired})" if paired else ""),
                 f"policy loss {kind}: {band}" + (f", dual clip {args.actor.dual_clip:g}" if args.actor.dual_clip else ""),
                 f"aggregation {agg}"]
    if args.algo.dynamic_filtering_enable:
        a, b = args.algo.dynamic_filtering_range
        parts.append(f"dynamic sampling (group mean score in ({a:g}, {b:g}))")
    if args.reward.overlong_buffer_len is not None:
        parts.append(f"overlong shaping over the last {args.reward.overlong_buffer_len:g} of "
                     f"{args.rollout.max_new_tokens or args.data.max_len} tokens (x{args.reward.overlong_penalty_factor:g})")
    return "method: " + "; ".join(parts)


def plan_lines(args, preflight=None) -> List[str]:
    """The plan; ``preflight`` (a ``cli.preflight.Preflight``, None for ``--preflight off``) adds the rows it
    read as upstream reads them (hub datasets included) and its summary."""
    from openrlhf_lpo.cli.preflight import summary_lines

    lines = _plan_lines(args, preflight)
    if preflight is not None or getattr(args, "preflight", "on") == "off":
        lines += summary_lines(preflight)
    return lines


def _plan_lines(args, preflight) -> List[str]:
    est = args.algo.advantage.estimator
    K, dp = args.rollout.n_samples_per_prompt, dp_size(args)
    B = args.rollout.batch_size
    lines = [f"estimator {est}" + (f" (divergence {args.lpo.divergence}, temperature {args.lpo.temperature}, "
                                  f"projection {args.lpo.projection})" if est in LPO_ESTIMATORS else ""),
             method_line(args), f"GPUs needed: {gpus_needed(args)}"]
    if est in LPO_ESTIMATORS:  # effective tau, divergence schedule, listwise replay (cli/flags.py)
        from openrlhf_lpo.cli.flags import research_plan_lines

        lines[2:2] = research_plan_lines(args)
    lines += [f"  {role}: {g} ({note})" for role, g, note in gpu_roles(args)]
    lines += _placement_lines(args)
    lines.append(f"rollout batch: {B} prompts x K={K} = {B * K} samples; train batch {args.train.batch_size} samples "
                 f"(micro {args.train.micro_batch_size}); data-parallel ranks {dp}")
    if est in LPO_ESTIMATORS:
        lines.append("  old-log-prob forward chunks: " + (
            f"up to {args.rollout.max_tokens_per_gpu} tokens (dynamic batching)" if args.train.dynamic_batch_enable
            else f"{args.rollout.micro_batch_size} sample(s)"))
        lines.append(f"  full batch: {_batch_shape(args, B)}")
    lines += _flag_group_plan_lines(args)  # Megatron with PP > 1: each pass's pipeline efficiency
    if preflight is not None and preflight.train_rows is not None:
        rows, note = preflight.train_rows, "read by the preflight"  # as upstream reads them
    else:
        rows, note = dataset_rows(args)
    if rows is None:
        lines.append(f"dataset: size unknown ({note})")
        return lines
    full, last = divmod(rows, B)
    steps = full + (1 if last else 0)
    lines.append(f"dataset: {rows} prompts -> {steps} rollout batches per episode x {args.train.num_episodes} episode(s)"
                 + (" (dynamic filtering may consume more prompts per batch)" if args.algo.dynamic_filtering_enable else ""))
    if last:
        if est in LPO_ESTIMATORS:
            lines.append(f"  last batch of each episode: {last} prompts: {_batch_shape(args, last)}")
        else:
            lines.append(f"  last batch of each episode: {last} prompts (stock OpenRLHF trains on what it gets)")
    else:
        lines.append("  no partial batch")
    return lines
