"""Tensor parallelism on torch.distributed: the shard math (``shards``), the collectives
(``group``) and rank 0's worker processes (``workers``)."""
