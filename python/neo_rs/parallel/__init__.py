"""Tensor parallelism's primitives on torch.distributed, low enough for the model's layers to use:
the shard math (``shards``) and the process group with its collectives (``group``). Rank 0's
worker processes are in ``worker/tp_workers.py``."""
