"""LPO inside OpenRLHF 0.11.2's Ray PPO pipeline (subclasses + named patch points).

Modules: ``experience_maker`` (LPOExperienceMaker), ``actor_trainer`` (LPOActorTrainer,
LPOPolicyLoss), ``ray_classes`` (LPOPolicyActor, LPOTrainer), ``patches`` (every patch point,
apply_patches, check_contracts). Import the submodules directly; importing this package
imports nothing from openrlhf.
"""
