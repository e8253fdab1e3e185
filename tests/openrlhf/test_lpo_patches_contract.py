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
