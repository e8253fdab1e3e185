"""CPU mode: the whole pipeline on CPUs (mode.py: the import hook, Ray, the weight sync; megatron_redirect.py:
megatron-core on CPU; the weight-sync parity probe is ``openrlhf_lpo.runtime.parity``). The rollout engines are in ``openrlhf_lpo.engines``."""
