"""CPU placeholder for flash-attn's compiled extension (installed by scripts/setup_env.sh).

flash_attn's Python package imports ``flash_attn_2_cuda`` at import time but only calls it inside
kernels. On machines without the compiled kernels this module lets the import succeed and makes
any kernel call fail loudly instead.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise RuntimeError(
        f"flash_attn_2_cuda.{name}: flash-attn CUDA kernels are not built on this machine; "
        "run without --flash_attn / use attn_implementation='sdpa' or 'eager'"
    )
