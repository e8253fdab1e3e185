"""Megatron-core actor backend (``--backend megatron``): model builder, HF<->Megatron
conversion, the Ray-independent LPO actor, and its Ray policy-actor wrapper. See docs/megatron.md.

Submodules are imported on demand (megatron-core is only needed when this backend is used).
"""
