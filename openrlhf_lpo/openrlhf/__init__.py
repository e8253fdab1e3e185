"""LPO inside OpenRLHF 0.11.2's Ray PPO pipeline (subclasses + named patch points).

Modules: ``experience_maker`` (LPOExperienceMaker), ``actor_trainer`` (LPOActorTrainer,
LPOPolicyLoss), ``ray_classes`` (LPOPolicyActor, LPOTrainer), ``patches`` (the DeepSpeed backend's patch
points in :mod:`openrlhf_lpo.upstream`, apply_patches), ``training_backend`` (its entry in the backend table).
Import the submodules directly; importing this package imports nothing from openrlhf.
"""
