"""Device kernels (Triton), imported only when the device is CUDA or a test runs them under
Triton's interpreter. See ``cuda/README.md`` at the repository root for what runs where."""
