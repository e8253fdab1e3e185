"""``--backend megatron`` flag group for ``lpo-train`` (loaded by openrlhf_lpo.cli as a plugin).

The group is bound to the backend (``FlagGroup(backend="megatron")``): its validation, ``before_train`` and plan lines
run only with ``--backend megatron`` (``--backend`` itself is cli/flags.py's, its choices the training-backend table;
this backend's entry: :mod:`openrlhf_lpo.megatron.training_backend`).

Flags: ``--megatron.tp N``,
``--megatron.pp M``, ``--megatron.vpp V`` (virtual pipeline stages, interleaved 1F1B, needs PP > 1),
``--megatron.sequence_parallel`` (needs TP > 1), ``--megatron.cp`` (1 only: context parallelism
needs Transformer Engine, see ``CP_REFUSAL``), ``--megatron.params_dtype {bf16,fp32}``,
``--megatron.distributed_optimizer``, ``--megatron.timeout_minutes`` (process groups' NCCL/gloo
timeout, default 60 as OpenRLHF's DeepSpeed strategy), ``--megatron.sync_bucket_mb`` (the weight sync's bucket
size, default 512 MiB: :mod:`.weight_sync`).

Stock flags the Megatron actor honours: ``--actor.gradient_checkpointing_enable`` (full layer
recompute), ``--actor.eps_clip_low_high``, ``--actor.lr_scheduler`` / ``--actor.lr_warmup_ratio`` /
``--actor.min_lr_ratio`` (OpenRLHF's schedules, :mod:`.schedule`), ``--algo.kl.use_loss``,
``--actor.entropy_coef``, ``--train.dynamic_batch_enable`` / ``--train.max_tokens_per_gpu``,
``--ds.packing_samples`` (native), ``--train.async_enable``, ``--train.partial_rollout_enable``,
``--algo.advantage.is_correction_*``, ``--vllm.sync_with_ray``, ``--vllm.enable_prefix_caching``,
``--ckpt.max_num`` / ``--ckpt.max_mem``, ``--train.colocate_all`` with ``--vllm.enable_sleep`` and
``--ds.enable_sleep`` (the Megatron meaning: offload the actor to host memory between phases; weights to
the colocated engines by IPC, :mod:`.weight_sync`). Refused with a message instead of ignored (ring
attention, DeepSpeed TP, ``--ds.enable_sleep`` without colocation, EMA, LoRA, the MoE aux loss, schedules
OpenRLHF cannot run, a colocated layout whose engines do not fill the actor's GPUs): see ``_validate``.
Before any actor starts, the layout is placed on the running Ray cluster (:func:`layout_fit`, registered with
``openrlhf_lpo.cli.capacity``, which also makes a restart of ``--ckpt.auto_resume`` wait for the GPUs).

With ``--backend megatron`` the policy actor group is built from
:mod:`openrlhf_lpo.megatron.ray_actor` instead of OpenRLHF's DeepSpeed ``PolicyModelActor``
(whatever class the other flag groups swapped in), as a :class:`~openrlhf_lpo.megatron.actor_group.MegatronPolicyGroup`
with ``duplicate_actors = tp*pp`` so each model replica gets one chunk of experiences (patch point
``megatron-policy-group``, megatron/patch_points.py). The reference model (KL) stays on DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import List

from openrlhf_lpo.cli.capacity import register_layout_fit
from openrlhf_lpo.cli.flags import FlagError, FlagGroup, register_flag_group
from openrlhf_lpo.megatron import patch_points  # noqa: F401  (registers the backend's points: lpo-train checks them)

# why context parallelism (and with it ring attention) is refused, and what to use instead
CP_REFUSAL = (
    "context parallelism is not supported by --backend megatron: megatron-core 0.16.1 runs it only inside "
    "Transformer Engine's attention (its local DotProductAttention asserts context_parallel_size == 1), so "
    "it can be neither built nor tested without TE. For long sequences use --megatron.sequence_parallel "
    "(activations split over the TP ranks) with --actor.gradient_checkpointing_enable and a larger "
    "--megatron.tp / --megatron.pp, or the DeepSpeed backend's ring attention (--ds.ring_attn_size)"
)
# mixture-of-experts checkpoints (docs/megatron.md, "Mixture of experts: the plan")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "megatron.tp" for a in parser._actions):
        return
    g = parser.add_argument_group("Megatron-core actor backend (--backend megatron)")
    g.add_argument("--megatron.tp", type=int, default=1, help="tensor-parallel size of the Megatron actor")
    g.add_argument("--megatron.pp", type=int, default=1, help="pipeline-parallel size of the Megatron actor")
    g.add_argument("--megatron.vpp", type=int, default=1,
                   help="virtual pipeline stages per PP rank (interleaved 1F1B; needs --megatron.pp > 1)")
    g.add_argument("--megatron.sequence_parallel", action="store_true", default=False,
                   help="sequence parallelism: norms/residuals hold 1/tp of the tokens (needs --megatron.tp > 1)")
    g.add_argument("--megatron.cp", type=int, default=1,
                   help="context-parallel size; only 1 (context parallelism needs Transformer Engine)")
    g.add_argument("--megatron.params_dtype", type=str, choices=("bf16", "fp32"), default="bf16")
    g.add_argument("--megatron.distributed_optimizer", action="store_true", default=False,
                   help="shard optimizer state over data-parallel ranks")
    g.add_argument("--megatron.timeout_minutes", type=int, default=60,
                   help="timeout of the Megatron actor's process groups (NCCL/gloo), minutes")
    g.add_argument("--megatron.te", choices=("auto", "on", "off"), default="off",
                   help="Transformer Engine layer spec: off (default: megatron's local spec, the path every test runs), "
                   "on (required: the run stops at start when transformer_engine is not importable), auto (TE when "
                   "importable and an accelerator is present; NGC images ship it). docs/megatron.md, Transformer Engine")
    g.add_argument("--megatron.sync_bucket_mb", type=float, default=512.0,
                   help="weight sync into the rollout engines: small tensors travel in flat buckets of at most this "
                   "many MiB, one engine call per bucket (a larger tensor goes alone), on the broadcast and the IPC "
                   "route; a sync holds at most 3 buckets and one tensor per GPU (docs/megatron.md, Weights by IPC) (default 512)")
    g.add_argument("--megatron.save_timeout_minutes", type=int, default=360,
                   help="how long ranks wait for a checkpoint or HF export to be written (a gloo group of its own, "
                   "so a slow filesystem never trips the training groups' --megatron.timeout_minutes), minutes")


def _validate(args: argparse.Namespace) -> None:
    from openrlhf_lpo.megatron.parallel_layout import validate_layout
    from openrlhf_lpo.megatron.model import SUPPORTED_MODEL_TYPES

    from openrlhf_lpo.megatron.ray_actor import refuse_unsupported

    m = args.megatron
    world = args.actor.num_nodes * args.actor.num_gpus_per_node
    try:
        refuse_unsupported(args)
    except ValueError as e:
        raise FlagError(str(e)) from None
    if m.timeout_minutes < 1:
        raise FlagError(f"--megatron.timeout_minutes must be >= 1, got {m.timeout_minutes}")
    if m.save_timeout_minutes < 1:
        raise FlagError(f"--megatron.save_timeout_minutes must be >= 1, got {m.save_timeout_minutes}")
    from openrlhf_lpo.megatron.weight_sync import MAX_BUCKET_MB

    if not (0 < m.sync_bucket_mb <= MAX_BUCKET_MB):  # (nan fails both comparisons)
        raise FlagError(f"--megatron.sync_bucket_mb must be > 0 and <= {MAX_BUCKET_MB:g} MiB, got {m.sync_bucket_mb:g}: "
                        "the size of the flat buffer each weight-sync call carries (default 512)")
    if m.cp != 1:
        raise FlagError(f"--megatron.cp {m.cp}: {CP_REFUSAL}")
    if args.ds.ring_attn_size > 1:
        raise FlagError(f"--ds.ring_attn_size > 1 is not supported with --backend megatron: {CP_REFUSAL}")
    if m.sequence_parallel and m.tp < 2:
        raise FlagError("--megatron.sequence_parallel needs --megatron.tp > 1: it splits each layer's "
                        "norm/residual activations over the tensor-parallel ranks")
    gpn = args.actor.num_gpus_per_node
    if m.tp > gpn or gpn % m.tp:
        raise FlagError(
            f"--megatron.tp {m.tp} must divide --actor.num_gpus_per_node {gpn}: tensor-parallel groups stay "
            "inside one node"
        )
    hf_config = None
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.actor.model_name_or_path)
    except Exception as e:  # noqa: BLE001
        raise FlagError(f"--backend megatron: cannot read the HF config of --actor.model_name_or_path: {e}") from None
    if hasattr(hf_config, "vision_config") or args.data.max_images_per_prompt > 0:
        raise FlagError(
            f"--backend megatron does not support vision-language models (model_type {hf_config.model_type!r}, "
            f"--data.max_images_per_prompt {args.data.max_images_per_prompt}): the Megatron actor has no vision "
            "tower. Train VLMs such as Qwen2.5-VL on the DeepSpeed backend (drop --backend megatron; "
            "configs/tasks/geometry_qwen2.5-vl-3b.sh)"
        )
    if hf_config.model_type in MOE_MODEL_TYPES or getattr(hf_config, "num_experts", None):
        raise FlagError(
            f"--backend megatron does not support mixture-of-experts models yet (model_type "
            f"{hf_config.model_type!r}): the HF<->Megatron conversion of routers and experts and expert "
            "parallelism are not built (plan: docs/megatron.md, 'Mixture of experts'). Train MoE models on the "
            "DeepSpeed backend (drop --backend megatron)"
        )
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise FlagError(
            f"--backend megatron supports model_type {SUPPORTED_MODEL_TYPES}, got {hf_config.model_type!r}"
        )
    try:
        validate_layout(world, m.tp, m.pp, hf_config, m.vpp)
    except ValueError as e:
        raise FlagError(f"--backend megatron: {e}") from None
    # (ring attention is refused above; --ds.packing_samples, which the stock parser switches on for it,
    # is native to the Megatron actor: THD micro-batches)
    unsupported = [
        (args.ds.tensor_parallel_size > 1, "--ds.tensor_parallel_size > 1",
         "DeepSpeed tensor parallelism; use --megatron.tp"),
        (args.train.enable_ema, "--train.enable_ema",
         "the Megatron actor keeps no EMA copy of the weights; train it on the DeepSpeed backend"),
        (args.ds.lora.rank > 0, "--ds.lora.rank",
         "the Megatron actor trains full weights (no LoRA adapters); train LoRA on the DeepSpeed backend"),
        (args.actor.aux_loss_coef > 0, "--actor.aux_loss_coef",
         "the mixture-of-experts load-balancing loss: the Megatron actor builds dense models only"),
    ]
    for bad, flag, why in unsupported:
        if bad:
            raise FlagError(f"{flag} is not supported with --backend megatron: {why}")
    _validate_colocation(args, world)
    try:
        from openrlhf_lpo.megatron.schedule import check_lr_scheduler

        check_lr_scheduler(args.actor.lr_scheduler, args.actor.lr_warmup_ratio, args.actor.min_lr_ratio)
    except ValueError as e:
        raise FlagError(str(e)) from None
    from openrlhf_lpo.core.config import dp_size

    dp = dp_size(args)  # world / (tp x pp)
    if args.train.batch_size % dp:
        raise FlagError(
            f"--train.batch_size {args.train.batch_size} must be divisible by the Megatron data-parallel size "
            f"{dp} = {world} / (--megatron.tp {m.tp} x --megatron.pp {m.pp})"
        )


def _validate_colocation(args: argparse.Namespace, world: int) -> None:
    """``--train.colocate_all`` (not async): one engine worker per actor GPU, each engine inside a node."""
    from openrlhf_lpo.megatron.ray_actor import colocated

    engines, vtp = args.vllm.num_engines or 0, args.vllm.tensor_parallel_size
    if not colocated(args) or engines <= 0:
        return
    if engines * vtp != world:
        raise FlagError(
            f"--train.colocate_all puts one vLLM worker on each actor GPU: --vllm.num_engines {engines} x "
            f"--vllm.tensor_parallel_size {vtp} = {engines * vtp} must equal the actor's {world} GPUs "
            f"(--actor.num_nodes x --actor.num_gpus_per_node)"
        )
    if args.actor.num_gpus_per_node % vtp:
        raise FlagError(
            f"--train.colocate_all: --vllm.tensor_parallel_size {vtp} must divide --actor.num_gpus_per_node "
            f"{args.actor.num_gpus_per_node}, so that each engine's GPUs sit on one node"
        )


@contextlib.contextmanager
def use_megatron_policy(args: argparse.Namespace):
    """Inside, the stock ``train()`` builds its policy group as a ``MegatronPolicyGroup`` of the Megatron Ray actor
    (``--megatron.tp`` x ``--megatron.pp`` ranks per replica) and every other group as upstream's: patch point
    ``megatron-policy-group``, the name ``RayActorGroup`` in the stock CLI's module (restored on exit). Yields the
    Megatron Ray actor class."""
    import importlib

    from openrlhf_lpo.megatron.actor_group import policy_group_builder
    from openrlhf_lpo.megatron.patch_points import STOCK_CLI
    from openrlhf_lpo.megatron.ray_actor import remote_class

    stock = importlib.import_module(STOCK_CLI)
    remote = remote_class()
    original = stock.RayActorGroup
    stock.RayActorGroup = policy_group_builder(original, remote, int(args.megatron.tp), int(args.megatron.pp))
    try:
        yield remote
    finally:
        stock.RayActorGroup = original


def layout_fit(args: argparse.Namespace, node_gpus: List[float]):
    """``cli/capacity.py``'s fit of a Megatron layout: every block that must share a node (each TP group, each
    vLLM engine's GPUs, the reference model's) placed on the nodes' GPUs (:func:`.cluster.plan_placement`)."""
    from openrlhf_lpo.megatron.cluster import PlacementError, demands_from_args, plan_placement

    try:
        placed = plan_placement(node_gpus, demands_from_args(args))
    except PlacementError as e:
        return f"--backend megatron: {e}", None
    used = "; ".join(f"node {i}: " + ", ".join(f"{r} x{g}" for r, g in blocks) for i, blocks in enumerate(placed) if blocks)
    return None, f"[megatron] placement on the Ray cluster fits: {used}"


register_layout_fit("megatron", layout_fit)


def _plan_lines(args: argparse.Namespace):
    from openrlhf_lpo.megatron.pipeline_plan import pipeline_plan_lines

    return memory_plan_lines(args) + pipeline_plan_lines(args)  # pipeline: PP > 1 only


def memory_plan_lines(args: argparse.Namespace) -> List[str]:
    """The actor's memory per GPU (:func:`megatron.memory.actor_memory` at the run's layout, one packed micro-batch
    of ``--train.micro_batch_size`` x ``--data.max_len`` tokens) and the disk its checkpoints take
    (:func:`cli.disk.run_disk_need`), from the model's config.json (a local folder; a hub id is not read here)."""
    import json
    import os

    from openrlhf_lpo.cli.disk import human_size, run_disk_need
    from openrlhf_lpo.megatron.memory import GB, Shape, actor_memory
    from openrlhf_lpo.core.config import dp_size

    path = os.path.join(str(args.actor.model_name_or_path), "config.json")
    if not os.path.isfile(path):
        return [f"actor memory and checkpoint disk: not estimated ({args.actor.model_name_or_path} is not a local "
                "folder; python -m openrlhf_lpo.megatron.memory --config <config.json> ... estimates the memory)"]
    with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf) if "num_hidden_layers" not in hf else hf
    m, micro = args.megatron, args.train.micro_batch_size
    max_len = args.data.max_len or hf.get("max_position_embeddings")
    if not max_len:
        return ["actor memory and checkpoint disk: not estimated (no --data.max_len and no max_position_embeddings)"]
    new_tokens = min(args.rollout.max_new_tokens or max_len, max_len)  # unset: up to the whole sequence
    try:
        mem = actor_memory(hf, m.tp, m.pp, dp_size(args), micro * max_len, micro * new_tokens,
                           sequence_parallel=m.sequence_parallel,
                           recompute=bool(getattr(args.actor, "gradient_checkpointing_enable", False)),
                           distributed_optimizer=m.distributed_optimizer)
    except (KeyError, TypeError, ValueError) as e:  # a config without the dims the formula reads
        return [f"actor memory and checkpoint disk: not estimated ({path}: {type(e).__name__}: {e})"]
    lines = [f"actor memory per GPU (megatron/memory.py, most loaded stage, {micro * max_len}-token "
             f"micro-batch): static {mem['static total'] / GB:.1f} GB, forward/backward "
             f"{mem['forward/backward peak'] / GB:.1f} GB, optimizer step {mem['optimizer step peak'] / GB:.1f} GB, "
             f"peak {mem['peak'] / GB:.1f} GB (with the CUDA context / NCCL allowance)"]
    need = run_disk_need(args, Shape.of(hf).parameters, None)
    lines.append(f"checkpoint disk at its peak (config.json's {Shape.of(hf).parameters / 1e9:.1f}B parameters; "
                 f"--ckpt.max_num {args.ckpt.max_num}): " + "; ".join(what for what, _, _ in need.parts) +
                 f" = {human_size(need.total)}")
    return lines


register_flag_group(
    FlagGroup(name="megatron", add_arguments=_add_arguments, validate=_validate, before_train=use_megatron_policy,
              plan_lines=_plan_lines, backend="megatron")
)
