"""The DeepSpeed backend's patch points: where openrlhf_lpo touches OpenRLHF 0.11.2, and the swaps.

Public names (stable):
    apply_patches()  context manager: the "swap" points (restored on exit)
    rebind(namespace)        context manager: names in ``namespace`` (e.g. the stock CLI's globals,
                             imported before the swaps) follow the active swaps

The points register in the neutral registry :mod:`openrlhf_lpo.upstream` (PatchPoint, check_contracts, the
contract helpers) when this module is imported; ``lpo-train`` imports it before it checks. The "swap" points are
replaced while ``apply_patches()`` is active: this project's classes for every estimator (the one update loop, the
runtime safety nets: reward-error window, HF export rotation, seeded prompts; ray_classes.py). The Megatron
backend registers its own points (megatron/patch_points.py).

The contract test (tests/openrlhf/test_lpo_patches_contract.py) runs ``check_contracts`` and more.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Callable, Dict, List, Optional, Tuple

from openrlhf_lpo.upstream import PATCH_POINTS, ContractBroken, PatchPoint, needles, params, patch_point, \
    ray_class, register_patch_point

__all__ = ["apply_patches", "rebind"]


def _point(name: str, module: str, attribute: str, kind: str, why: str,
           contract: Optional[Callable[[], Optional[str]]] = None) -> None:
    register_patch_point(PatchPoint(name, module, attribute, kind, why, contract=contract))


# ----------------------------------------------------------------------------- helpers for the contracts below


def _signature(fn, expected: List[str]) -> None:
    if params(fn) != expected:
        raise ContractBroken(f"signature {params(fn)} != {expected}")


def _method(module: str, cls: str, name: str):
    """``module.cls.name``, through the Ray actor class to the class it wraps."""
    return getattr(ray_class(getattr(importlib.import_module(module), cls)), name)


def _calls(module: str, cls: str, name: str, needle: str) -> Callable[[], None]:
    """A contract: ``module.cls.name`` still calls ``needle`` (looked up at call time, so a swap of it takes)."""

    def contract() -> None:
        fn = _method(module, cls, name)
        if needle not in inspect.getsource(fn):
            raise ContractBroken(f"{fn.__qualname__} no longer calls {needle[:-1]}")

    return contract


def _trainer_base():
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    return BasePPOTrainer


# ----------------------------------------------------------------------------- the DeepSpeed backend's points

_point("policy-actor-class", "openrlhf.trainer.ray.ppo_actor", "PolicyModelActor", "swap",
       "cli/train_ppo_ray.py imports it at module level and builds the actor RayActorGroup from it")


@patch_point("save-checkpoint", "openrlhf.trainer.ray.ppo_actor", "PolicyModelActor.save_checkpoint", "contract",
             "writes <ckpt.path>/<tag>_hf with --ckpt.save_hf after the state in <ckpt.path>/_actor; "
             "HFExportRotation prunes the exports after it returns")
def _save_checkpoint() -> None:
    src = inspect.getsource(_method("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor", "save_checkpoint"))
    if 'f"{tag}_hf"' not in src or '"_actor"' not in src:
        raise ContractBroken("save_checkpoint no longer writes <tag>_hf beside _actor")


@patch_point("samples-generator", "openrlhf.trainer.ppo_trainer", "SamplesGenerator", "scoped-swap",
             "PPOTrainer.__init__ builds it (as GenerateSamplesActor.__init__ does from ppo_trainer_async); "
             "SeededSamplesGenerator gives every sample its own seed (request_seeds.py)")
def _samples_generator() -> None:
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async
    from openrlhf.trainer.ppo_utils import samples_generator as sg

    for mod, cls_name in ((ppo_trainer, "PPOTrainer"), (ppo_trainer_async, "GenerateSamplesActor")):
        init = ray_class(getattr(mod, cls_name)).__init__
        if "SamplesGenerator(" not in inspect.getsource(init) or mod.SamplesGenerator is not sg.SamplesGenerator:
            raise ContractBroken(f"{cls_name}.__init__ no longer builds SamplesGenerator")


@patch_point("rollout-actor-class", "openrlhf.trainer.ray.vllm_engine", "RolloutRayActor", "swap",
             "create_vllm_engines looks it up at call time; SeededRolloutRayActor adds per-sample settings to "
             "generate_responses and the bucketed weight sync (openrlhf/seeded_vllm.py: it swaps the "
             "worker_extension_cls create_vllm_engines names for engines/vllm_worker.py's subclass); the CPU mode's "
             "engine class is left in place")
def _rollout_actor_class() -> None:
    from openrlhf.trainer.ray import vllm_engine

    rollout = getattr(vllm_engine.RolloutRayActor, "__ray_actor_class__", None)
    if rollout is None:  # (the CPU mode's engine class stands there in CPU mode)
        return
    needles(inspect.getsource(vllm_engine.create_vllm_engines),
            ('"worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"',), "create_vllm_engines")
    needles(inspect.getsource(rollout.__init__), ("vllm.AsyncEngineArgs(*args, **self.kwargs)",),
            "RolloutRayActor.__init__")
    if params(rollout.generate_responses) != ["self", "prompt", "label", "sampling_params", "max_length",
                                              "hf_tokenizer", "num_samples", "images"] or \
            "self.executor.execute(" not in inspect.getsource(rollout.generate_responses):
        raise ContractBroken("RolloutRayActor.generate_responses changed")


@patch_point("dispatch-prompts", "openrlhf.trainer.ppo_utils.samples_generator",
             "SamplesGenerator._dispatch_prompts_to_vllm", "contract",
             "one SamplingParams (with a seed field) per dispatch, then per prompt in order "
             "self.vllm_engines[i].generate_responses.remote(..., sampling_params=, num_samples=) whose "
             "result is one list of num_samples outputs; SeededSamplesGenerator hands it seeding handles")
def _dispatch_prompts() -> None:
    from openrlhf.trainer.ppo_utils import samples_generator as sg

    dispatch_src = inspect.getsource(sg.SamplesGenerator._dispatch_prompts_to_vllm)
    needles(dispatch_src, ("self.vllm_engines[", ".generate_responses.remote(", "sampling_params=sampling_params",
                            "num_samples=n_samples", "SamplingParams("), "_dispatch_prompts_to_vllm")
    if "seed" not in getattr(sg.SamplingParams, "__struct_fields__", ()) and \
            "seed" not in inspect.signature(sg.SamplingParams).parameters:
        raise ContractBroken("vllm.SamplingParams has no per-request seed")


@patch_point("resume-position", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer.init_checkpoint_states", "contract",
             "returns total_consumed_prompts (the prompt position the seeds continue from on resume; the async "
             "generator gets it as GenerateSamplesActor.fit(episode, total_consumed_prompts))")
def _resume_position() -> None:
    fit = _method("openrlhf.trainer.ppo_trainer_async", "GenerateSamplesActor", "fit")
    if "total_consumed_prompts" not in inspect.getsource(_trainer_base().init_checkpoint_states) or \
            params(fit)[:3] != ["self", "episode", "total_consumed_prompts"]:
        raise ContractBroken("the prompt position is no longer restored as expected")


@patch_point("train-step", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer.train_step", "contract",
             "called once per rollout batch with every sample before the experience maker; "
             "RewardErrorGuard counts reward errors there (reward_guard.py)")
def _train_step() -> None:
    step = _trainer_base().train_step
    # (Ray's tracing adds a trailing _ray_trace_ctx to methods of classes it made remote)
    if params(step)[:3] != ["self", "rollout_samples", "global_step"] or \
            "make_experience_batch(rollout_samples)" not in inspect.getsource(step):
        raise ContractBroken("BasePPOTrainer.train_step(rollout_samples, global_step) changed")


_point("ppo-trainer-class", "openrlhf.trainer.ppo_trainer", "PPOTrainer", "swap",
       "train() imports it lazily (sync mode) and calls PPOTrainer.remote(...)")
_point("async-trainer-class", "openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync", "swap",
       "train() imports it lazily (--train.async_enable) and calls PPOTrainer.remote(...)")
_point("async-training-actor", "openrlhf.trainer.ppo_trainer_async", "TrainingActor", "scoped-swap",
       "PPOTrainerAsync.__init__ looks it up at call time and starts TrainingActor.remote(...)",
       _calls("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync", "__init__", "TrainingActor.remote("))
_point("async-samples-actor", "openrlhf.trainer.ppo_trainer_async", "GenerateSamplesActor", "scoped-swap",
       "PPOTrainerAsync.__init__ starts it; ours seeds the prompt order first",
       _calls("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync", "__init__", "GenerateSamplesActor.remote("))
_point("evaluate", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer.save_best_checkpoint", "contract",
       "PPOTrainer.fit calls self.evaluate(global_step, **generate_kwargs) and passes its logs here; "
       "LPOTrainer.evaluate grades with evaluation.training_eval",
       _calls("openrlhf.trainer.ppo_trainer", "PPOTrainer", "fit", "self.evaluate(global_step"))
_point("async-eval-metrics", "openrlhf.trainer.ppo_trainer_async", "compute_eval_metrics", "scoped-swap",
       "GenerateSamplesActor._run_eval calls it; ours passes the tokenizer to evaluation.training_eval's",
       _calls("openrlhf.trainer.ppo_trainer_async", "GenerateSamplesActor", "_run_eval", "compute_eval_metrics("))
_point("balance-experiences", "openrlhf.trainer.ppo_trainer", "balance_experiences", "scoped-swap",
       "BasePPOTrainer.train_step calls it under dynamic batching; lpo hands each rank its own groups",
       _calls("openrlhf.trainer.ppo_trainer", "BasePPOTrainer", "train_step", "balance_experiences("))
_point("entropy", "openrlhf.models.actor", "compute_entropy", "scoped-swap",
       "Actor.forward calls it for return_entropy; with --actor.entropy_coef 0 it runs without a graph",
       _calls("openrlhf.models.actor", "Actor", "forward", "compute_entropy("))


@patch_point("actor-trainer-class", "openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer", "scoped-swap",
             "PolicyModelActor.init_model_from_pretrained looks it up at call time")
def _actor_trainer_class() -> None:
    init_src = inspect.getsource(_method("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor",
                                         "init_model_from_pretrained"))
    if "ActorPPOTrainer(" not in init_src:
        raise ContractBroken("init_model_from_pretrained no longer builds ActorPPOTrainer")


_point("experience-maker", "openrlhf.trainer.ppo_trainer", "RemoteExperienceMaker", "contract",
       "BasePPOTrainer.__init__ builds self.experience_maker; LPOTrainer replaces the instance")
_point("split-rollout", "openrlhf.trainer.ppo_utils.experience_maker", "RemoteExperienceMaker.split_rollout_samples",
       "contract", "overridden: group-aligned experiences, E/dp per rank")
_point("advantages", "openrlhf.trainer.ppo_utils.experience_maker",
       "RemoteExperienceMaker.compute_advantages_and_returns", "contract",
       "overridden for lpo/maxrl, super() otherwise")


@patch_point("actor-group-placement", "openrlhf.trainer.ray.launcher", "RayActorGroup._initiate_actors", "swap",
             "gives rank r bundle r of a PACK group, which Ray does not keep node-contiguous above 16 bundles; "
             "ours starts the same actors on the bundles in node-major order (openrlhf/placement.py)")
def _actor_group_placement() -> None:
    from openrlhf.trainer.ray import launcher

    if params(launcher.RayActorGroup._initiate_actors) != ["self", "pg", "num_gpus_per_actor"] or \
            not hasattr(launcher, "PlacementGroupSchedulingStrategy"):
        raise ContractBroken("RayActorGroup._initiate_actors(pg, num_gpus_per_actor) "
                             "or launcher.PlacementGroupSchedulingStrategy changed")
    needles(inspect.getsource(launcher.RayActorGroup._initiate_actors),
             ("placement_group_bundle_index=0", "placement_group_bundle_index=rank", "if pg:",
              "self._num_gpus_per_node > 1 and pg is None"), "_initiate_actors")


_point("dp-chunking", "openrlhf.trainer.ray.launcher", "RayActorGroup.async_run_method_batch", "contract",
       "hands rank r the r-th run of ceil(E/dp) consecutive experiences")
_point("replay-items", "openrlhf.trainer.ppo_utils.replay_buffer", "NaiveReplayBuffer.collate_fn", "contract",
       "single-sample items keep Experience.info; collate_fn re-batches a list of them")


@patch_point("ppo-train", "openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer.ppo_train", "contract",
             "overridden for lpo (group windows), super() otherwise")
def _ppo_train() -> None:
    from openrlhf.trainer.ray import ppo_actor

    _signature(ppo_actor.ActorPPOTrainer.ppo_train, ["self", "kl_ctl"])


@patch_point("training-step", "openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer.training_step", "contract",
             "called per micro-batch; calls self.actor_loss_fn(log_probs, old, adv, action_mask=, "
             "rollout_log_probs=, **loss_batch_info) and expects a 5-tuple")
def _training_step() -> None:
    from openrlhf.trainer.ray import ppo_actor

    _signature(ppo_actor.ActorPPOTrainer.training_step, ["self", "experience", "kl_ctl", "step", "loss_batch_info"])
    src = inspect.getsource(ppo_actor.ActorPPOTrainer.training_step)
    for needle, why in (("self.actor_loss_fn(", "calls self.actor_loss_fn"),
                        ("dynamic_optimizer_step[step]", "reads replay_buffer.dynamic_optimizer_step[step]"),
                        ("**loss_batch_info", "passes loss_batch_info to the loss")):
        if needle not in src:
            raise ContractBroken(f"training_step no longer {why}")


@patch_point("policy-loss", "openrlhf.models.loss", "PolicyLoss.forward", "contract",
             "LPOPolicyLoss mirrors its signature and return value")
def _policy_loss() -> None:
    from openrlhf.models.loss import PolicyLoss

    _signature(PolicyLoss.forward, ["self", "log_probs", "old_log_probs", "advantages", "action_mask",
                                    "rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size"])


@patch_point("policy-loss-types", "openrlhf.trainer.ray.ppo_actor", "PolicyLoss", "scoped-swap",
             "ActorPPOTrainer.__init__ looks it up at call time and builds actor_loss_fn with "
             "policy_loss_type=--actor.policy_loss_type; cispo.policy_loss_types() swaps in ExtendedPolicyLoss "
             "(CISPO, openrlhf/cispo.py; ppo/gspo go to the stock forward) around the policy actor's "
             "init_model_from_pretrained")
def _policy_loss_types() -> None:
    """ExtendedPolicyLoss mirrors PolicyLoss's constructor and forward, the trainer builds its loss from the
    module-level name with --actor.policy_loss_type, upstream aggregates with aggregate_loss(loss, loss_mask,
    token_level_loss, dp_size, batch_num_tokens, global_batch_size), and no registered type shadows one that
    upstream has gained since 0.11.2."""
    from openrlhf.models import loss as loss_mod
    from openrlhf.models.loss import PolicyLoss as policy_loss
    from openrlhf.trainer.ray import ppo_actor

    from openrlhf_lpo.openrlhf.cispo import POLICY_LOSS_TYPES, ExtendedPolicyLoss

    init = ["self", "clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
            "is_correction_level", "is_correction_mode", "is_correction_gating", "is_correction_threshold"]
    for fn, ours, expected in ((policy_loss.__init__, ExtendedPolicyLoss.__init__, init),
                               (policy_loss.forward, ExtendedPolicyLoss.forward, params(policy_loss.forward))):
        if params(fn) != expected or params(ours) != expected:
            raise ContractBroken(f"PolicyLoss.{fn.__name__}{params(fn)} != "
                                 f"ExtendedPolicyLoss.{ours.__name__}{params(ours)}")
    if params(loss_mod.aggregate_loss) != ["loss", "loss_mask", "token_level_loss", "dp_size", "batch_num_tokens",
                                          "global_batch_size"]:
        raise ContractBroken("aggregate_loss's signature changed")
    src = inspect.getsource(ppo_actor.ActorPPOTrainer.__init__)
    if "self.actor_loss_fn = PolicyLoss(" not in src or \
            "policy_loss_type=self.args.actor.policy_loss_type" not in src or ppo_actor.PolicyLoss is not policy_loss:
        raise ContractBroken("ActorPPOTrainer.__init__ no longer builds "
                             "PolicyLoss(policy_loss_type=args.actor.policy_loss_type) from ppo_actor's global name")
    forward_src = inspect.getsource(policy_loss.forward)
    native = [name for name in POLICY_LOSS_TYPES if f'"{name}"' in forward_src]
    if native:
        raise ContractBroken(f"upstream PolicyLoss now implements {native} itself; "
                             "drop our registration (openrlhf_lpo/openrlhf/cispo.py)")


_point("loss-normaliser", "openrlhf.models.loss", "aggregate_loss", "contract",
       "KL / entropy terms: masked sum / batch_num_tokens * dp_size; lpo passes each window's "
       "global counts / gas (actor_trainer.LPOActorTrainer._loss_norm)")
_point("dynamic-step-flags", "openrlhf.trainer.ppo_utils.replay_buffer", "NaiveReplayBuffer.setup_dynamic_batch",
       "contract", "training_step reads replay_buffer.dynamic_optimizer_step[step]; lpo fills it from its own plan")


def _signature_and_needle(method: str, expected: List[str], source_of: Callable, needle: str) -> Callable[[], None]:
    """A contract: BasePPOTrainer.<method>'s signature, and ``needle`` in the source of ``source_of()``."""

    def contract() -> None:
        _signature(getattr(_trainer_base(), method), expected)
        fn = source_of()
        if needle not in inspect.getsource(fn):
            raise ContractBroken(f"{fn.__qualname__} no longer contains {needle!r}")

    return contract


_point("save-logs-and-checkpoints", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer.save_logs_and_checkpoints",
       "contract", "overridden by the LPO trainers: the divergence schedule's and replay buffer's state joins "
       "client_states, the replay buffer is written on checkpoint steps (openrlhf/research.py)",
       _signature_and_needle("save_logs_and_checkpoints", ["self", "global_step", "logs_dict", "client_states"],
                             lambda: _trainer_base().save_logs_and_checkpoints, "client_states=client_states"))
_point("checkpoint-states", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer.init_checkpoint_states", "contract",
       "called by the LPO trainers on resume: the actor's client_states of the loaded checkpoint",
       _signature_and_needle("init_checkpoint_states", ["self"], lambda: _trainer_base().init_checkpoint_states,
                             "get_checkpoint_states"))
_point("rollout-stats", "openrlhf.trainer.ppo_trainer", "BasePPOTrainer._compute_rollout_stats", "contract",
       "overridden by the LPO trainers: with listwise replay, rollout/* over the fresh samples only",
       _signature_and_needle("_compute_rollout_stats", ["self", "experiences"], lambda: _trainer_base().train_step,
                             "self._compute_rollout_stats("))


@patch_point("vlm-merge", "openrlhf.utils.vlm_utils", "merge_mm_train_inputs", "contract",
             "LPO's no-grad passes batch a micro-batch's images as training_step does (openrlhf/vlm.py)")
def _vlm_merge() -> None:
    from openrlhf.utils import vlm_utils

    if params(vlm_utils.merge_mm_train_inputs) != ["mm_train_inputs_list", "device"]:
        raise ContractBroken("merge_mm_train_inputs(mm_train_inputs_list, device) changed")


@patch_point("vlm-rollout", "openrlhf.utils.agent", "SingleTurnAgentExecutor.execute", "contract",
             "tokenizes image prompts with the processor (process_prompt_with_images) and calls "
             "llm_engine.generate(ids, params, multi_modal_data={'image': [...]}) (engines/cpu_vlm.py)")
def _vlm_rollout() -> None:
    from openrlhf.utils import agent

    exec_src = inspect.getsource(agent.SingleTurnAgentExecutor.execute)
    if "multi_modal_data=" not in exec_src or "process_prompt_with_images" not in exec_src:
        raise ContractBroken("the executor no longer hands images to llm_engine.generate")


# ----------------------------------------------------------------------------- the swaps

_active: Dict[Tuple[str, str], Tuple[object, object]] = {}


@contextlib.contextmanager
def apply_patches():
    """Swap the stock Ray classes (kind "swap") for this project's (every estimator: openrlhf/ray_classes.py),
    restore them on exit."""
    from openrlhf_lpo.openrlhf import ray_classes as rc

    actor, trainer, trainer_async = rc.RemoteLPOPolicyActor, rc.RemoteLPOTrainer, rc.RemoteLPOTrainerAsync
    from openrlhf.trainer.ray import vllm_engine

    from openrlhf.trainer.ray import launcher

    from openrlhf_lpo.openrlhf.placement import node_major_initiate_actors
    from openrlhf_lpo.openrlhf.request_seeds import seeded_rollout_actor

    replacements = {
        ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor"): actor,
        ("openrlhf.trainer.ppo_trainer", "PPOTrainer"): trainer,
        ("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync"): trainer_async,
        ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor"): seeded_rollout_actor(vllm_engine.RolloutRayActor),
        ("openrlhf.trainer.ray.launcher", "RayActorGroup._initiate_actors"):
            node_major_initiate_actors(launcher.RayActorGroup.__dict__["_initiate_actors"]),
    }
    assert {(p.module, p.attribute) for p in PATCH_POINTS if p.kind == "swap"} == set(replacements)
    saved = []
    try:
        for (mod_name, attr), new in replacements.items():
            owner = importlib.import_module(mod_name)
            *path, name = attr.split(".")
            for part in path:  # "Class.method": the class owns the attribute
                owner = getattr(owner, part)
            old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, old, (mod_name, attr)))
            setattr(owner, name, new)
            _active[(mod_name, attr)] = (old, new)
        yield replacements
    finally:
        for owner, name, old, key in reversed(saved):
            setattr(owner, name, old)
            _active.pop(key, None)


@contextlib.contextmanager
def rebind(namespace: dict):
    """Point names in ``namespace`` that hold a swapped original at its replacement (restored on exit)."""
    changed = []
    for (_, attr), (old, new) in list(_active.items()):
        if "." not in attr and namespace.get(attr) is old:
            namespace[attr] = new
            changed.append((attr, old))
    try:
        yield
    finally:
        for attr, old in changed:
            namespace[attr] = old
