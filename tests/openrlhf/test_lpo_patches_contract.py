"""Contract of every patch point against openrlhf 0.11.2 (openrlhf_lpo/openrlhf/patches.py)."""

import inspect

import pytest

from openrlhf_lpo.openrlhf import patches


def test_installed_openrlhf_matches_every_patch_point():
    patches.check_contracts()
    kinds = {p.kind for p in patches.PATCH_POINTS}
    assert kinds == {"swap", "scoped-swap", "contract"}
    names = [p.name for p in patches.PATCH_POINTS]
    assert len(names) == len(set(names))


def test_apply_patches_swaps_and_restores():
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_lpo.openrlhf.ray_classes import LPOPolicyActor, LPOTrainer, unwrap_ray_class

    stock_actor, stock_trainer = ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer
    namespace = {"PolicyModelActor": stock_actor, "other": 1}
    with patches.apply_patches():
        assert unwrap_ray_class(ppo_actor.PolicyModelActor) is LPOPolicyActor
        assert unwrap_ray_class(ppo_trainer.PPOTrainer) is LPOTrainer
        with patches.rebind(namespace):
            assert namespace["PolicyModelActor"] is ppo_actor.PolicyModelActor
        assert namespace["PolicyModelActor"] is stock_actor
    assert ppo_actor.PolicyModelActor is stock_actor and ppo_trainer.PPOTrainer is stock_trainer
    # the LPO classes subclass the stock ones (same Ray methods), with the stock resource request
    assert issubclass(LPOPolicyActor, unwrap_ray_class(stock_actor))
    assert issubclass(LPOTrainer, unwrap_ray_class(stock_trainer))


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
        patches.check_contracts()


def test_runtime_classes_for_other_estimators_swap_and_restore():
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_trainer_async as async_mod
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf_lpo.openrlhf import ray_classes as rc

    stock = (ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer, async_mod.PPOTrainerAsync)
    with patches.apply_patches(lpo=False):
        assert rc.unwrap_ray_class(ppo_actor.PolicyModelActor) is rc.RuntimePolicyActor
        assert rc.unwrap_ray_class(ppo_trainer.PPOTrainer) is rc.RuntimePPOTrainer
        assert rc.unwrap_ray_class(async_mod.PPOTrainerAsync) is rc.RuntimePPOTrainerAsync
    assert (ppo_actor.PolicyModelActor, ppo_trainer.PPOTrainer, async_mod.PPOTrainerAsync) == stock
    # the safety nets only wrap the stock behaviour: train_step, save_checkpoint, the samples generator
    own = {name for cls in (rc.RuntimePPOTrainer, rc.RuntimePolicyActor, rc.RuntimeTrainingActor)
           for klass in cls.__mro__ if klass.__module__.startswith("openrlhf_lpo") for name in vars(klass)
           if callable(vars(klass)[name]) and not name.startswith("__")}
    assert own == {"train_step", "save_checkpoint", "init_checkpoint_states", "broadcast_to_vllm", "init_model_from_pretrained"}


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
        patches.check_contracts()


def test_actor_group_placement_swap_is_active_inside_and_restored():
    from openrlhf.trainer.ray import launcher

    stock = launcher.RayActorGroup.__dict__["_initiate_actors"]
    with patches.apply_patches(lpo=False):
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
        patches.check_contracts()


def test_check_contracts_detects_a_trainer_that_no_longer_builds_policy_loss_by_name(monkeypatch):
    """Patch point policy-loss-types: the scoped swap of ppo_actor.PolicyLoss only works while
    ActorPPOTrainer.__init__ builds its loss from that module-level name with --actor.policy_loss_type."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    def __init__(self, strategy, actor, ema_model, actor_optim, actor_scheduler, **kwargs):
        from openrlhf.models.loss import PolicyLoss as _Loss

        self.actor_loss_fn = _Loss(policy_loss_type="ppo")

    monkeypatch.setattr(ppo_actor.ActorPPOTrainer, "__init__", __init__)
    with pytest.raises(RuntimeError, match="patch point policy-loss-types"):
        patches.check_contracts()


def test_check_contracts_detects_upstream_gaining_a_registered_policy_loss_type(monkeypatch):
    import openrlhf.models.loss as loss

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        if self.policy_loss_type == "cispo":
            raise NotImplementedError

    monkeypatch.setattr(loss.PolicyLoss, "forward", forward)
    with pytest.raises(RuntimeError, match=r"upstream PolicyLoss now implements \['cispo'\]"):
        patches.check_contracts()


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
    monkeypatch.setattr(openrlhf, "__version__", patches.OPENRLHF_VERSION, raising=False)

    def forward(self, log_probs, old_log_probs, advantages):
        raise AssertionError

    monkeypatch.setattr(loss.PolicyLoss, "forward", forward)
    main(argv + ["--dry-run"])  # a dry run checks the version only
    assert "flags are valid" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lpo-train: patch point policy-loss" in err
