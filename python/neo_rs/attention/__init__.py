"""Attention over the paged KV pools: the per-iteration metadata (``metadata``), a layer's
attention across the device and the host (``layer``), the CUDA decode backends
(``device_decode``) and their Triton kernels (``cuda/``)."""
