"""The model's Triton kernels (CUDA; CI runs them under Triton's interpreter)."""
