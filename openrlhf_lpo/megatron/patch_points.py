"""The Megatron backend's patch points: where ``--backend megatron`` relies on OpenRLHF, megatron-core 0.16.1 and
torch beyond their public API, each with a contract (the registry: :mod:`openrlhf_lpo.upstream`).

========================== ============== ================================================================
point                      kind           what
========================== ============== ================================================================
megatron-policy-group      scoped-swap    the stock ``train()``'s ``RayActorGroup`` name builds the policy group
                                          as a ``MegatronPolicyGroup`` (megatron/actor_group.py, flags.py)
megatron-vllm-sync-group   contract       ``ActorPPOTrainer._init_vllm_sync_group`` borrowed by the Megatron
                                          actor (ray_actor.py ``init_model_from_pretrained``)
megatron-rope              process-swap   megatron's ``apply_rotary_pos_emb`` in ``Attention.forward`` (rope.py)
megatron-cu-seqlens-bounds contract       ``_lpo_bounds`` on the ``cu_seqlens`` tensor handed to the RoPE (rope.py)
megatron-packed-seq-bounds contract       ``_lpo_bounds`` on megatron's ``PackedSeqParams`` (attention.py)
megatron-process-groups    contract       torch's private ``_world.pg_map`` (groups.py)
========================== ============== ================================================================

Registered when this module is imported (megatron/flags.py imports it, so ``lpo-train`` has them when it loads its
plugins, and checks them before a ``--backend megatron`` run: cli/train_ppo_ray.py). The contracts read
megatron-core from its files (``imports=False``): a check imports no megatron-core, whose import would run the
CPU mode's hook where that is installed. This module imports the registry leaf alone.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

from openrlhf_lpo import upstream
from openrlhf_lpo.upstream import MEGATRON_CORE_VERSION, ContractBroken, calls, definition, params, patch_point

__all__ = ["STOCK_CLI", "BOUNDS_ATTR", "ATTENTION", "ROPE_UTILS", "PACKED_SEQ_PARAMS"]

STOCK_CLI = "openrlhf.cli.train_ppo_ray"
ATTENTION = "megatron.core.transformer.attention"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
PACKED_SEQ_PARAMS = "megatron.core.packed_seq_params"
DOT_PRODUCT_ATTENTION = "megatron.core.transformer.dot_product_attention"
BOUNDS_ATTR = "_lpo_bounds"  # a packed micro-batch's host bounds, hung on megatron's objects (rope.py, attention.py)

_MEGATRON = dict(requires="megatron.core", imports=False, backend="megatron")


def _arg_names(fn: ast.FunctionDef):
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is(node, dotted: str) -> bool:
    """``node`` is the expression ``dotted`` (a name or an attribute chain)."""
    return node is not None and ast.unparse(node) == dotted


def _forward(module: str, cls: str) -> ast.FunctionDef:
    return definition(upstream.source_tree(module), f"{cls}.forward")


# ----------------------------------------------------------------------------- OpenRLHF


@patch_point("megatron-policy-group", STOCK_CLI, "RayActorGroup", "scoped-swap",
             "inside lpo-train's run the stock train() builds every actor group through its module-level name "
             "RayActorGroup; ours (megatron/actor_group.py) builds the policy group, the one of PolicyModelActor, as "
             "MegatronPolicyGroup(num_nodes, num_gpus_per_node, <the Megatron Ray actor>, pg=, num_gpus_per_actor=, "
             "tp=, pp=) and every other group as upstream's; read from the file (the contract imports no trainer)",
             imports=False, backend="megatron")
def _policy_group() -> None:
    """The stock CLI imports ``RayActorGroup`` from the launcher at module level and its ``train()`` builds the
    policy group once, as ``RayActorGroup(<nodes>, <GPUs per node>, PolicyModelActor, ...)`` with keywords only
    after those three; upstream's constructor takes the arguments ``MegatronPolicyGroup`` passes on, and starts its
    actors from ``__init__`` (``node_block`` is set before, for the placement)."""
    tree = upstream.source_tree(STOCK_CLI)
    if not any(isinstance(n, ast.ImportFrom) and n.module == "openrlhf.trainer.ray.launcher" and
               any(a.name == "RayActorGroup" and a.asname is None for a in n.names) for n in tree.body):
        raise ContractBroken(f"{STOCK_CLI} no longer imports RayActorGroup from openrlhf.trainer.ray.launcher at "
                             "module level")
    policy = [c for c in calls(definition(tree, "train"), "RayActorGroup")
              if len(c.args) >= 3 and _is(c.args[2], "PolicyModelActor")]
    if len(policy) != 1 or len(policy[0].args) != 3 or any(k.arg is None for k in policy[0].keywords):
        raise ContractBroken("train() no longer builds the policy group once as RayActorGroup(num_nodes, "
                             "num_gpus_per_node, PolicyModelActor, <keywords>)")
    from openrlhf.trainer.ray import launcher

    init = launcher.RayActorGroup.__init__
    expected = ["self", "num_nodes", "num_gpus_per_node", "ray_actor_type", "pg", "num_gpus_per_actor",
                "duplicate_actors", "resources", "num_resources_per_node"]
    if params(init) != expected:
        raise ContractBroken(f"RayActorGroup.__init__{params(init)} != {expected}")
    upstream.needles(inspect.getsource(init), ("self._initiate_actors(pg, num_gpus_per_actor)",),
                     "RayActorGroup.__init__")


# the attributes of self that the borrowed method may read: what MegatronPolicyActor has when it calls it
VLLM_SYNC_SELF = ("strategy", "vllm_engines", "_model_update_group")


@patch_point("megatron-vllm-sync-group", "openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer._init_vllm_sync_group",
             "contract",
             "borrowed: MegatronPolicyActor.init_model_from_pretrained calls it with itself as self (ray_actor.py) "
             "to open the weight-sync group to the engines (not colocated); it may read only self.strategy (.args."
             "vllm), self.vllm_engines, and sets self._model_update_group: a torch process group, or the group name "
             "with --vllm.sync_with_ray, which megatron/vllm_sync.py broadcasts on", backend="megatron")
def _vllm_sync_group() -> None:
    from openrlhf.trainer.ray import ppo_actor

    fn = ppo_actor.ActorPPOTrainer._init_vllm_sync_group
    if params(fn) != ["self", "backend"]:
        raise ContractBroken(f"ActorPPOTrainer._init_vllm_sync_group{params(fn)} != ['self', 'backend']")
    source = textwrap.dedent(inspect.getsource(fn))
    read = {n.attr for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    extra = sorted(read - set(VLLM_SYNC_SELF))
    if extra:
        raise ContractBroken(f"_init_vllm_sync_group now uses self.{', self.'.join(extra)}, which the Megatron policy "
                             f"actor does not have (it has {', '.join(VLLM_SYNC_SELF)})")
    upstream.needles(source, ("engine.init_process_group.remote(", "self._model_update_group = group_name",
                              "self._model_update_group = stateless_init_process_group("), "_init_vllm_sync_group")


# ----------------------------------------------------------------------------- megatron-core


@patch_point("megatron-rope", ATTENTION, "apply_rotary_pos_emb", "process-swap",
             "rope.install() puts rope.apply_rotary_pos_emb (the THD RoPE from the micro-batch's host bounds, no "
             "device reads) where Attention.forward looks it up, for the rest of the process, when the actor builds "
             "megatron's local spec; calls it does not cover go to megatron's own, which it mirrors", **_MEGATRON)
def _rope() -> None:
    """attention.py imports ``apply_rotary_pos_emb`` from rope_utils at module level and ``Attention.forward``
    calls it by that name; megatron's function keeps its parameters and sends THD rows to
    ``_apply_rotary_pos_emb_thd`` (the case ours replaces), and ``_apply_rotary_pos_emb_bshd``, which ours calls on
    the packed frequencies, keeps its own."""
    tree = upstream.source_tree(ATTENTION)
    if not any(isinstance(n, ast.ImportFrom) and n.module == ROPE_UTILS and
               any(a.name == "apply_rotary_pos_emb" and a.asname is None for a in n.names) for n in tree.body):
        raise ContractBroken(f"{ATTENTION} no longer imports apply_rotary_pos_emb from rope_utils at module level")
    if not [c for c in calls(definition(tree, "Attention.forward"), "apply_rotary_pos_emb")
            if isinstance(c.func, ast.Name)]:
        raise ContractBroken("Attention.forward no longer calls apply_rotary_pos_emb(...) by its module-level name")
    rope_utils = upstream.source_tree(ROPE_UTILS)
    apply = definition(rope_utils, "apply_rotary_pos_emb")
    expected = ["t", "freqs", "config", "cu_seqlens", "mscale", "cp_group"]
    if _arg_names(apply) != expected:
        raise ContractBroken(f"rope_utils.apply_rotary_pos_emb{_arg_names(apply)} != {expected} "
                             f"(openrlhf_lpo.megatron.rope targets megatron-core {MEGATRON_CORE_VERSION})")
    if not calls(apply, "_apply_rotary_pos_emb_thd"):
        raise ContractBroken("rope_utils.apply_rotary_pos_emb no longer sends packed rows to _apply_rotary_pos_emb_thd")
    bshd = ["t", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale"]
    if _arg_names(definition(rope_utils, "_apply_rotary_pos_emb_bshd")) != bshd:
        raise ContractBroken(f"rope_utils._apply_rotary_pos_emb_bshd no longer takes {bshd}")


@patch_point("megatron-cu-seqlens-bounds", ATTENTION, "Attention.forward", "contract",
             f"rope.attach_bounds hangs the micro-batch's host bounds on the cu_seqlens tensor as {BOUNDS_ATTR} "
             "(megatron/actor.py _forward_step, on PackedSeqParams.cu_seqlens_q_padded); rope.apply_rotary_pos_emb "
             "reads them back: Attention.forward must hand that tensor object itself to the RoPE", **_MEGATRON)
def _cu_seqlens_bounds() -> None:
    """In ``Attention.forward`` the packed (THD) query and key are rotated with ``cu_seqlens=`` the padded
    cumulative lengths of ``packed_seq_params`` (the same tensor objects, no copy), and a torch tensor takes a
    Python attribute."""
    forward = _forward(ATTENTION, "Attention")
    assigned = {(ast.unparse(t), ast.unparse(n.value)) for n in ast.walk(forward) if isinstance(n, ast.Assign)
                for t in n.targets}
    rotated = {ast.unparse(_keyword(c, "cu_seqlens")) for c in calls(forward, "apply_rotary_pos_emb")
               if isinstance(c.func, ast.Name) and _keyword(c, "cu_seqlens") is not None}
    for side in ("q", "kv"):
        if (f"cu_seqlens_{side}", f"packed_seq_params.cu_seqlens_{side}_padded") not in assigned or \
                f"cu_seqlens_{side}" not in rotated:
            raise ContractBroken(f"Attention.forward no longer rotates with cu_seqlens=packed_seq_params."
                                 f"cu_seqlens_{side}_padded (the tensor the bounds hang on)")
    import torch

    probe = torch.zeros(2, dtype=torch.int32)
    setattr(probe, BOUNDS_ATTR, [0, 2])
    if getattr(probe, BOUNDS_ATTR, None) != [0, 2]:
        raise ContractBroken(f"a torch tensor no longer keeps the Python attribute {BOUNDS_ATTR}")


@patch_point("megatron-packed-seq-bounds", PACKED_SEQ_PARAMS, "PackedSeqParams", "contract",
             f"megatron/actor.py hangs each micro-batch's host bounds on its PackedSeqParams as {BOUNDS_ATTR} and "
             "attention.PackedDotProductAttention (a DotProductAttention that takes THD rows) reads them there, so "
             "a forward reads no cu_seqlens from the device", **_MEGATRON)
def _packed_seq_bounds() -> None:
    """``PackedSeqParams`` is a plain (not frozen, not slotted) dataclass with the THD fields we fill and no field
    of ours' name, ``Attention.forward`` hands it on to the core attention as ``packed_seq_params=``, and
    ``DotProductAttention.forward`` has the parameters ``PackedDotProductAttention.forward`` mirrors."""
    cls = definition(upstream.source_tree(PACKED_SEQ_PARAMS), "PackedSeqParams")
    deco = next((d for d in cls.decorator_list if ast.unparse(d).split("(")[0] == "dataclass"), None)
    if deco is None or any(k.arg in ("frozen", "slots") and ast.unparse(k.value) == "True"
                           for k in getattr(deco, "keywords", ())):
        raise ContractBroken(f"PackedSeqParams is no longer a plain mutable @dataclass (it must take {BOUNDS_ATTR})")
    body_names = {ast.unparse(t) for n in cls.body if isinstance(n, (ast.AnnAssign, ast.Assign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    missing = {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
               "max_seqlen_q", "max_seqlen_kv"} - body_names
    if missing or "__slots__" in body_names or BOUNDS_ATTR in body_names:
        raise ContractBroken(f"PackedSeqParams's fields changed (missing {sorted(missing)}, or __slots__ / "
                             f"{BOUNDS_ATTR} defined)")
    if not [c for c in ast.walk(_forward(ATTENTION, "Attention")) if isinstance(c, ast.Call) and
            "self.core_attention" in ast.unparse(c.func) and _is(_keyword(c, "packed_seq_params"), "packed_seq_params")]:
        raise ContractBroken("Attention.forward no longer hands packed_seq_params= to self.core_attention")
    expected = ["self", "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
                "packed_seq_params"]
    got = _arg_names(_forward(DOT_PRODUCT_ATTENTION, "DotProductAttention"))
    if got != expected:
        raise ContractBroken(f"DotProductAttention.forward{got} != {expected} (PackedDotProductAttention mirrors it)")


# ----------------------------------------------------------------------------- torch


@patch_point("megatron-process-groups", "torch.distributed.distributed_c10d", "_world.pg_map, group.WORLD",
             "contract",
             "groups.release reads torch's private map of live process groups to shut down, before megatron's "
             "parallel state is built again, only the groups megatron holds that are still alive (their gloo loop "
             "threads otherwise keep polling)", backend="megatron")
def _process_groups() -> None:
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    live = c10d._world.pg_map
    if not isinstance(live, dict):
        raise ContractBroken(f"_world.pg_map is a {type(live).__name__}, not the dict of live process groups")
    if params(c10d.destroy_process_group)[:1] != ["group"]:
        raise ContractBroken(f"destroy_process_group{params(c10d.destroy_process_group)} no longer takes the group")
    # a destroyed group leaves the map: a group in it is alive
    upstream.needles(inspect.getsource(c10d.destroy_process_group), ("del _world.pg_map[pg]",), "destroy_process_group")
