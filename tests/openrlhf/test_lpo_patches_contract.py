"""Contract of every patch point against openrlhf 0.11.2, megatron-core 0.16.1 and torch (the registry:
openrlhf_lpo/upstream; the DeepSpeed backend's points and swaps: openrlhf_lpo/openrlhf/patches.py; the Megatron
backend's: openrlhf_lpo/megatron/patch_points.py). Upstream changes are made by editing the object a contract inspects
or the source it reads (``upstream.module_source``)."""

import inspect

import pytest

from openrlhf_lpo import upstream
from openrlhf_lpo.checks import trainer_check  # noqa: F401  (the rooms that patch register their points when imported)
from openrlhf_lpo.cli import train_ppo_ray
from openrlhf_lpo.cpu import mode as cpu_mode
from openrlhf_lpo.megatron import patch_points as megatron_points
from openrlhf_lpo.openrlhf import patches


def test_installed_openrlhf_matches_every_patch_point():
    upstream.check_contracts()
    kinds = {p.kind for p in upstream.PATCH_POINTS}
    assert kinds == set(upstream.KINDS)  # swap, scoped-swap, contract; process-swap (CPU mode), stand-in (checks)
    names = [p.name for p in upstream.PATCH_POINTS]
    assert len(names) == len(set(names))


def test_apply_patches_swaps_and_restores():
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_lpo.openrlhf.ray_classes import LPOPolicyActor, LPOTrainer
    from openrlhf_lpo.upstream import ray_class

    stock_actor, stock_trainer = ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer
    namespace = {"PolicyModelActor": stock_actor, "other": 1}
    with patches.apply_patches():
        assert ray_class(ppo_actor.PolicyModelActor) is LPOPolicyActor
        assert ray_class(ppo_trainer.PPOTrainer) is LPOTrainer
        with patches.rebind(namespace):
            assert namespace["PolicyModelActor"] is ppo_actor.PolicyModelActor
        assert namespace["PolicyModelActor"] is stock_actor
    assert ppo_actor.PolicyModelActor is stock_actor and ppo_trainer.PPOTrainer is stock_trainer
    # the LPO classes subclass the stock ones (same Ray methods), with the stock resource request
    assert issubclass(LPOPolicyActor, ray_class(stock_actor))
    assert issubclass(LPOTrainer, ray_class(stock_trainer))


def test_scoped_actor_trainer_swap_targets_the_call_time_lookup():
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_lpo.openrlhf.actor_trainer import LPOActorTrainer

    src = inspect.getsource(ppo_actor.PolicyModelActor.__ray_actor_class__.init_model_from_pretrained)
    assert "self.trainer = ActorPPOTrainer(" in src  # module-global lookup at call time
    assert issubclass(LPOActorTrainer, ppo_actor.ActorPPOTrainer)


def test_training_step_calls_actor_loss_fn_with_the_policy_loss_convention():
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    src = inspect.getsource(ppo_actor.ActorPPOTrainer.training_step)
    assert "self.actor_loss_fn(" in src
    assert "actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(" in src


def test_check_contracts_detects_a_changed_signature(monkeypatch):
    import openrlhf.models.loss as loss

    def forward(self, log_probs, old_log_probs, advantages):
        raise AssertionError

    monkeypatch.setattr(loss.PolicyLoss, "forward", forward)
    with pytest.raises(RuntimeError, match="policy-loss"):
        upstream.check_contracts()


def test_every_estimator_s_classes_swap_and_restore():
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as async_mod
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_lpo.openrlhf import ray_classes as rc
    from openrlhf_lpo.upstream import ray_class

    stock = (ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer, async_mod.PPOTrainerAsync)
    with patches.apply_patches():
        assert ray_class(ppo_actor.PolicyModelActor) is rc.LPOPolicyActor
        assert ray_class(ppo_trainer.PPOTrainer) is rc.LPOTrainer
        assert ray_class(async_mod.PPOTrainerAsync) is rc.LPOTrainerAsync
    assert (ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer, async_mod.PPOTrainerAsync) == stock


def test_seeded_samples_generator_swap_is_scoped():
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as async_mod
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from openrlhf_lpo.openrlhf.request_seeds import SeededSamplesGenerator, seeded_samples_generator

    with seeded_samples_generator():
        assert ppo_trainer.SamplesGenerator is SeededSamplesGenerator is async_mod.SamplesGenerator
    assert ppo_trainer.SamplesGenerator is SamplesGenerator is async_mod.SamplesGenerator


def test_check_contracts_detects_a_dispatch_that_no_longer_calls_the_engines(monkeypatch):
    from openrlhf.trainer.ppo_utils import samples_generator as sg

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        return [engine.generate.remote(p) for engine, p in zip(self.vllm_engines, prompts)]

    monkeypatch.setattr(sg.SamplesGenerator, "_dispatch_prompts_to_vllm", _dispatch_prompts_to_vllm)
    with pytest.raises(RuntimeError, match="patch point dispatch-prompts"):
        upstream.check_contracts()


def test_actor_group_placement_swap_is_active_inside_and_restored():
    from openrlhf.trainer.ray import launcher

    stock = launcher.RayActorGroup.__dict__["_initiate_actors"]
    with patches.apply_patches():
        swapped = launcher.RayActorGroup.__dict__["_initiate_actors"]
        assert swapped is not stock and swapped.__module__ == "openrlhf_lpo.openrlhf.placement"
        assert swapped.__wrapped__ is stock  # upstream's actor start, with the node-major bundle order
    assert launcher.RayActorGroup.__dict__["_initiate_actors"] is stock


def test_check_contracts_detects_actor_groups_that_no_longer_index_bundles_by_rank(monkeypatch):
    from openrlhf.trainer.ray import launcher

    def _initiate_actors(self, pg, num_gpus_per_actor):
        if self._num_gpus_per_node > 1 and pg is None:
            pass
        if pg:
            self._actor_handlers = [dict(placement_group_bundle_index=0)]

    monkeypatch.setattr(launcher.RayActorGroup, "_initiate_actors", _initiate_actors)
    with pytest.raises(RuntimeError, match="actor-group-placement.*placement_group_bundle_index=rank"):
        upstream.check_contracts()


def test_check_contracts_detects_a_trainer_that_no_longer_builds_policy_loss_by_name(monkeypatch):
    """Patch point policy-loss-types: the scoped swap of ppo_actor.PolicyLoss only works while
    ActorPPOTrainer.__init__ builds its loss from that module-level name with --actor.policy_loss_type."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    def __init__(self, strategy, actor, ema_model, actor_optim, actor_scheduler, **kwargs):
        from openrlhf.models.loss import PolicyLoss as _Loss

        self.actor_loss_fn = _Loss(policy_loss_type="ppo")

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "__init__", __init__)
    # (lpo-train's start check; the CPU mode's cpu-ppo-actor relies on this __init__ too)
    with pytest.raises(RuntimeError, match="patch point policy-loss-types"):
        upstream.check_contracts(exclude_kinds=("process-swap",))


def test_check_contracts_detects_upstream_gaining_a_registered_policy_loss_type(monkeypatch):
    import openrlhf.models.loss as loss

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        if self.policy_loss_type == "cispo":
            raise NotImplementedError

    monkeypatch.setattr(loss.PolicyLoss, "forward", forward)
    with pytest.raises(RuntimeError, match=r"upstream PolicyLoss now implements \['cispo'\]"):
        upstream.check_contracts()


def test_lpo_train_stops_on_another_openrlhf_or_a_broken_contract(monkeypatch, capsys):
    """lpo-train checks the installed OpenRLHF at start: another version stops a dry run and a run with exit 2
    naming it; a run (which imports every patched module) also checks every contract, before Ray starts."""
    import openrlhf
    import openrlhf.models.loss as loss

    from openrlhf_lpo.cli.train_ppo_ray import main

    argv = ["--actor.model_name_or_path", "unused", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
            "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "4", "--train.batch_size", "16",
            "--train.micro_batch_size", "2", "--vllm.num_engines", "1", "--reward.remote_url", "http://unused",
            "--algo.advantage.estimator", "lpo", "--preflight", "off"]
    monkeypatch.setattr(openrlhf, "__version__", "0.11.3", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv + ["--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "openrlhf 0.11.3 installed" in err and "pip install openrlhf==0.11.2" in err
    monkeypatch.setattr(openrlhf, "__version__", upstream.OPENRLHF_VERSION, raising=False)

    def forward(self, log_probs, old_log_probs, advantages):
        raise AssertionError

    monkeypatch.setattr(loss.PolicyLoss, "forward", forward)
    main(argv + ["--dry-run"])  # a dry run checks the version only
    assert "flags are valid" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lpo-train: patch point policy-loss" in err


# ----------------------------------------------------------------------------- every upstream patch in the registry
# The CPU mode (cpu/mode.py, cpu/megatron_redirect.py), the stock-CLI runner (cli/train_ppo_ray.py), the Megatron
# backend (megatron/patch_points.py) and the trainer check's stand-ins (checks/trainer_check.py) register their points
# when imported (lpo-train imports the first three).

MEGATRON_POINTS = {"megatron-policy-group", "megatron-vllm-sync-group", "megatron-rope", "megatron-cu-seqlens-bounds",
                   "megatron-packed-seq-bounds", "megatron-process-groups"}
NEW_POINTS = {
    "cpu-torch", "cpu-megatron-core", "cpu-megatron-accelerator", "cpu-dtype", "cpu-deepspeed-strategy",
    "cpu-deepspeed-comm", "cpu-replay-buffer", "cpu-ppo-actor", "cpu-vllm-engine", "cpu-flash-attn-fallback",
    "cpu-args-adjuster", "stock-cli-parse-args", "stock-cli-train", "trainer-check-ray-package",
    "trainer-check-strategy", "trainer-check-dtype",
} | MEGATRON_POINTS


def test_every_registered_point_holds_on_the_installed_packages():
    """megatron-core and vLLM are installed here: no point is left unchecked."""
    import argparse
    import sys

    import torch

    names = [p.name for p in upstream.PATCH_POINTS]
    assert NEW_POINTS <= set(names) and len(names) == len(set(names))
    assert all(p.kind in upstream.KINDS for p in upstream.PATCH_POINTS)
    assert all(p.contract is not None for p in upstream.PATCH_POINTS if p.name in NEW_POINTS)
    assert {p.name for p in upstream.PATCH_POINTS if p.backend == "megatron"} == MEGATRON_POINTS
    assert {p.backend for p in upstream.PATCH_POINTS} == {"", "megatron"}
    megatron_before = "megatron.core" in sys.modules
    before = (argparse.ArgumentParser.parse_args, torch.cuda.current_device, torch.Tensor.type)
    assert upstream.check_contracts() == []
    # checking applies nothing: no patch, no import of megatron-core (whose import would run the CPU mode's hook)
    assert (argparse.ArgumentParser.parse_args, torch.cuda.current_device, torch.Tensor.type) == before
    assert ("megatron.core" in sys.modules) == megatron_before


def test_every_cpu_mode_patch_is_a_registered_point():
    """A patch added to the CPU mode's import hook without its patch point fails here."""
    cpu_points = {p.module for p in upstream.PATCH_POINTS if p.kind == "process-swap" and p.name.startswith("cpu-")}
    assert set(cpu_mode.PATCHES) <= cpu_points, set(cpu_mode.PATCHES) - cpu_points


def test_the_registry_refuses_a_second_point_under_a_taken_name():
    count = len(upstream.PATCH_POINTS)
    with pytest.raises(ValueError, match="patch point 'cpu-replay-buffer' is already registered"):
        upstream.register_patch_point(upstream.PatchPoint("cpu-replay-buffer", "x", "y", "contract", "another point"))
    with pytest.raises(ValueError, match="kind 'monkey'"):
        upstream.register_patch_point(upstream.PatchPoint("new-point", "x", "y", "monkey", "an unknown kind"))
    # the same definition again (a module run as __main__ and imported under its name) keeps the first
    first = next(p for p in upstream.PATCH_POINTS if p.name == "stock-cli-train")
    again = upstream.PatchPoint(first.name, first.module, first.attribute, first.kind, first.why,
                               contract=first.contract, requires=first.requires, imports=first.imports)
    assert upstream.register_patch_point(again) is first and len(upstream.PATCH_POINTS) == count


def test_optional_packages_absent_are_reported_not_installed(monkeypatch):
    installed = upstream.installed
    monkeypatch.setattr(upstream, "installed",
                        lambda name: not name.startswith(("megatron", "vllm")) and installed(name))
    notes = upstream.check_contracts()
    assert sorted(notes) == sorted(["cpu-megatron-core: megatron.core not installed: not checked",
                                    "cpu-vllm-engine: vllm not installed: not checked"] +
                                   [f"{name}: megatron.core not installed: not checked"  # (the order: imports')
                                    for name in ("megatron-rope", "megatron-cu-seqlens-bounds",
                                                 "megatron-packed-seq-bounds")])


def test_cpu_mode_contract_detects_a_changed_ema_signature(monkeypatch, capsys):
    from openrlhf.utils.deepspeed import deepspeed as ds_mod

    def moving_average(self, model, model_ema, beta=0.992):  # no device: the CPU mode's wrapper would pass one
        raise AssertionError

    monkeypatch.setattr(ds_mod.DeepspeedStrategy, "moving_average", moving_average)
    with pytest.raises(RuntimeError, match=r"patch point cpu-deepspeed-strategy: DeepspeedStrategy.moving_average"):
        upstream.check_contracts()
    # a GPU run does not apply the CPU mode's patches: lpo-train's start check leaves them out ...
    upstream.check_contracts(exclude_kinds=("process-swap",))
    # ... and the CPU mode checks them when it turns on, before it patches anything (exit 2 naming the point)
    from types import SimpleNamespace

    args = SimpleNamespace(cpu=SimpleNamespace(mode="on", engine=None, trust_remote_code=False, active=None))
    with pytest.raises(SystemExit) as e:
        cpu_mode._cpu_before_train(args)
    assert e.value.code == 2 and args.cpu.active is True
    assert "openrlhf.utils.deepspeed.deepspeed" not in cpu_mode._STATE["applied"]  # nothing was patched
    assert "the CPU mode cannot patch this installation: patch point cpu-deepspeed-strategy" in capsys.readouterr().err


def test_cpu_mode_contract_detects_a_replay_buffer_that_no_longer_sets_its_device(monkeypatch):
    from openrlhf.trainer.ppo_utils import replay_buffer

    def __init__(self, sample_batch_size, limit=0, cpu_offload=True, packing_samples=False, dynamic_batch=False):
        self.items = []

    monkeypatch.setattr(replay_buffer.NaiveReplayBuffer, "__init__", __init__)
    with pytest.raises(RuntimeError, match="patch point cpu-replay-buffer: .*self.target_device"):
        upstream.check_contracts()


def test_cpu_mode_contract_detects_a_missing_upstream_function(monkeypatch):
    import importlib

    comm = importlib.import_module("deepspeed.comm.torch")  # (`import ... as` would bind deepspeed.comm's `torch`)
    monkeypatch.delattr(comm, "build_shm_op")
    with pytest.raises(RuntimeError, match=r"patch point cpu-deepspeed-comm: deepspeed.comm.torch.build_shm_op is "
                                           r"missing"):
        upstream.check_contracts()


def test_megatron_redirect_contract_reads_megatron_without_importing_it(monkeypatch):
    source = upstream.module_source

    def module_source(name):
        text = source(name)
        # upstream renames the helper the redirect replaces (and its callers)
        return text.replace("_set_cuda_rng_state", "_set_device_rng_state") \
            if name == "megatron.core.tensor_parallel.random" else text

    monkeypatch.setattr(upstream, "module_source", module_source)
    with pytest.raises(RuntimeError, match="patch point cpu-megatron-core: megatron.core.tensor_parallel.random no "
                                           "longer defines _set_cuda_rng_state"):
        upstream.check_contracts()
    monkeypatch.setattr(upstream, "module_source", lambda name: source(name).replace(
        "_get_cuda_rng_state(graph_safe=self.use_cudagraphable_rng)", "torch.get_rng_state()"))  # fork: no helper
    with pytest.raises(RuntimeError, match="patch point cpu-megatron-core: CudaRNGStatesTracker.fork no longer "
                                           "calls _get_cuda_rng_state"):
        upstream.check_contracts()


def _stock_cli_source(monkeypatch, edit):
    """The stock CLI's file as the runner's loader reads it, edited."""
    import importlib.machinery

    loader = importlib.machinery.SourceFileLoader
    get_source = loader.get_source

    def edited(self, name):
        text = get_source(self, name)
        return edit(text) if name == train_ppo_ray.STOCK_CLI else text

    monkeypatch.setattr(loader, "get_source", edited)


def test_stock_cli_runner_contract_detects_a_main_block_without_train(monkeypatch):
    _stock_cli_source(monkeypatch, lambda text: text.replace("\n    train(args)\n", "\n    run_training(args)\n"))
    with pytest.raises(RuntimeError, match=r"patch point stock-cli-train: the __main__ block no longer calls "
                                           r"train\(args\)"):
        upstream.check_contracts()


def test_stock_cli_runner_contract_detects_an_estimator_option_without_choices(monkeypatch):
    def edit(text):
        start = text.index('"--algo.advantage.estimator",')
        choices = text.index("choices=[", start)
        return text[:choices] + 'metavar="E"' + text[text.index("]", choices) + 1:]  # the choices list, gone

    _stock_cli_source(monkeypatch, edit)
    with pytest.raises(RuntimeError, match="patch point stock-cli-parse-args: the __main__ block no longer adds "
                                           "--algo.advantage.estimator with a list of choices"):
        upstream.check_contracts()


def test_trainer_check_contract_detects_a_changed_optimizer_step(monkeypatch):
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    def optimizer_step(self, optimizer, model, scheduler, **kwargs):  # name= gone
        raise AssertionError

    monkeypatch.setattr(DeepspeedStrategy, "optimizer_step", optimizer_step)
    with pytest.raises(RuntimeError, match="patch point trainer-check-strategy: DeepspeedStrategy.optimizer_step"):
        upstream.check_contracts()


def test_trainer_check_contract_detects_a_ray_package_that_binds_more(monkeypatch):
    """The stand-in package skips openrlhf/trainer/ray/__init__.py: a name it gains would be missing there."""
    import sys

    getsource = inspect.getsource

    def source(obj):
        text = getsource(obj)
        return text + "from .launcher import RayActorGroup\n" if obj is sys.modules.get("openrlhf.trainer.ray") \
            else text

    upstream.check_contracts()  # (imports the package)
    monkeypatch.setattr(inspect, "getsource", source)
    with pytest.raises(RuntimeError, match="patch point trainer-check-ray-package: .*from .launcher import"):
        upstream.check_contracts()


# ----------------------------------------------------------------------------- the Megatron backend's points
# (megatron/patch_points.py): a changed upstream breaks each contract with a message naming the point; lpo-train checks
# them before a --backend megatron run only


def _edit_source(monkeypatch, module, old, new):
    """``upstream.module_source(module)`` with ``old`` (there exactly once) replaced by ``new``."""
    source = upstream.module_source

    def edited(name):
        text = source(name)
        if name == module:
            assert text.count(old) == 1, (module, old)
            return text.replace(old, new, 1)
        return text

    monkeypatch.setattr(upstream, "module_source", edited)


def _check(name):
    return upstream.check_point(upstream.registered(name))


def test_policy_group_contract_detects_a_train_that_builds_the_policy_group_otherwise(monkeypatch):
    _edit_source(monkeypatch, megatron_points.STOCK_CLI,
                 "        args.actor.num_gpus_per_node,\n        PolicyModelActor,\n",
                 "        args.actor.num_gpus_per_node,\n        actor_class,\n")
    with pytest.raises(RuntimeError, match=r"patch point megatron-policy-group: train\(\) no longer builds the policy "
                                           r"group once as RayActorGroup\(num_nodes, num_gpus_per_node, "
                                           r"PolicyModelActor"):
        _check("megatron-policy-group")


def test_policy_group_contract_detects_a_changed_group_constructor(monkeypatch):
    from openrlhf.trainer.ray import launcher

    def __init__(self, num_nodes, num_gpus_per_node, ray_actor_type, pg=None, num_gpus_per_actor=1,
                 duplicate_actors=1, resources=None, num_resources_per_node=None, node_group=None):
        raise AssertionError

    monkeypatch.setattr(launcher.RayActorGroup, "__init__", __init__)
    with pytest.raises(RuntimeError, match=r"patch point megatron-policy-group: RayActorGroup.__init__\[.*"
                                           r"'node_group'\] != "):
        _check("megatron-policy-group")


def test_vllm_sync_group_contract_detects_a_borrowed_method_that_reads_more_of_self(monkeypatch):
    """The Megatron actor has strategy, vllm_engines and _model_update_group (ray_actor.py sets them before it calls
    the borrowed method); upstream reading another attribute of self would fail inside the actor at start."""
    import inspect

    from openrlhf.trainer.ray import ppo_actor

    from openrlhf_lpo.megatron import ray_actor

    init = inspect.getsource(ray_actor.MegatronPolicyActor.init_model_from_pretrained)
    assert all(f"self.{name} = " in init for name in megatron_points.VLLM_SYNC_SELF)

    def _init_vllm_sync_group(self, backend):
        world = self.strategy.args.vllm.num_engines * self.strategy.args.vllm.tensor_parallel_size + 1
        refs = [engine.init_process_group.remote("addr", 0, i + 1, world, "g", backend=backend)  # noqa: F841
                for i, engine in enumerate(self.vllm_engines)]
        self._model_update_group = self.actor.model_update_group

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "_init_vllm_sync_group", _init_vllm_sync_group)
    with pytest.raises(RuntimeError, match=r"patch point megatron-vllm-sync-group: _init_vllm_sync_group now uses "
                                           r"self.actor, which the Megatron policy actor does not have"):
        _check("megatron-vllm-sync-group")


def test_rope_contract_detects_a_changed_megatron_function(monkeypatch):
    """A parameter added to megatron's apply_rotary_pos_emb: the contract names the point, and rope.install (the
    actor's call, in its process) refuses before it swaps anything."""
    _edit_source(monkeypatch, megatron_points.ROPE_UTILS,
                 "    config: TransformerConfig,\n    cu_seqlens: Optional[Tensor] = None,\n",
                 "    config: TransformerConfig,\n    cu_seqlens: Optional[Tensor] = None,\n    cp_rank: int = 0,\n")
    with pytest.raises(RuntimeError, match=r"patch point megatron-rope: rope_utils.apply_rotary_pos_emb\[.*'cp_rank'"):
        _check("megatron-rope")
    from megatron.core.transformer import attention

    from openrlhf_lpo.megatron import rope

    stock = attention.apply_rotary_pos_emb
    assert stock is not rope.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="patch point megatron-rope"):
        rope.install()
    assert attention.apply_rotary_pos_emb is stock  # nothing swapped


def test_cu_seqlens_bounds_contract_detects_a_copied_tensor(monkeypatch):
    _edit_source(monkeypatch, megatron_points.ATTENTION, "cu_seqlens_q = packed_seq_params.cu_seqlens_q_padded\n",
                 "cu_seqlens_q = packed_seq_params.cu_seqlens_q_padded.clone()\n")
    with pytest.raises(RuntimeError, match=r"patch point megatron-cu-seqlens-bounds: Attention.forward no longer "
                                           r"rotates with cu_seqlens=packed_seq_params.cu_seqlens_q_padded"):
        _check("megatron-cu-seqlens-bounds")


def test_packed_seq_bounds_contract_detects_a_frozen_params_class(monkeypatch):
    _edit_source(monkeypatch, megatron_points.PACKED_SEQ_PARAMS, "@dataclass\nclass PackedSeqParams",
                 "@dataclass(frozen=True)\nclass PackedSeqParams")
    with pytest.raises(RuntimeError, match="patch point megatron-packed-seq-bounds: PackedSeqParams is no longer a "
                                           "plain mutable @dataclass"):
        _check("megatron-packed-seq-bounds")


def test_process_groups_contract_detects_a_torch_without_the_map(monkeypatch):
    from types import SimpleNamespace

    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "_world", SimpleNamespace(pg_names={}))
    with pytest.raises(RuntimeError, match=r"patch point megatron-process-groups: torch.distributed.distributed_c10d."
                                           r"_world.pg_map is missing"):
        _check("megatron-process-groups")


def test_lpo_train_checks_the_megatron_points_for_megatron_runs_only(monkeypatch, capsys):
    """lpo-train's start check (cli/train_ppo_ray.py): a broken Megatron point stops a --backend megatron run with
    exit 2 naming it, and is not checked for a DeepSpeed run."""
    from openrlhf_lpo.cli.train_ppo_ray import _check_upstream_or_exit

    # (every run's points: the contract test checks them all; one here keeps this test short)
    every_run = [upstream.registered("stock-cli-train")]
    monkeypatch.setattr(upstream, "PATCH_POINTS", every_run + [upstream.registered(n) for n in sorted(MEGATRON_POINTS)])
    _edit_source(monkeypatch, megatron_points.PACKED_SEQ_PARAMS, "@dataclass\nclass PackedSeqParams",
                 "@dataclass(slots=True)\nclass PackedSeqParams")
    _check_upstream_or_exit("lpo-train", full=True, backend="deepspeed")
    with pytest.raises(SystemExit) as e:
        _check_upstream_or_exit("lpo-train", full=True, backend="megatron")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lpo-train: patch point megatron-packed-seq-bounds" in err
    assert f"megatron-core {upstream.MEGATRON_CORE_VERSION}" in err
