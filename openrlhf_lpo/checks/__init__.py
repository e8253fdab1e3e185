"""Device diagnostics: the DeepSpeed trainer check, the GPU checks behind examples/scripts/gpu_check.sh and the
Megatron smoke run."""
