"""Which part of the model each tensor-parallel rank holds (Megatron-style): the attention heads
and the FFN's intermediate columns are split evenly; QKV and gate/up are column-parallel (rows of
their weights), O and down row-parallel (columns of theirs, summed by an all-reduce); the embedding
and the LM head are vocab-parallel (rows, the last rank's padded). When there are more ranks than
KV heads, each KV head is replicated on ``size / num_kv_heads`` consecutive ranks, as vLLM does,
so a rank's query heads always share its one KV head."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neo_rs.config import ModelConfig
from neo_rs.errors import InvalidArgumentError


@dataclass(frozen=True)
class TpShard:
    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        """Raise ``InvalidArgumentError`` unless ``cfg`` splits evenly over ``size`` ranks."""
        n, heads, kv = self.size, cfg.num_heads, cfg.num_kv_heads
        if heads % n:
            raise InvalidArgumentError(
                f"tensor_parallel_size {n} must divide the model's {heads} attention heads"
            )
        if (kv >= n and kv % n) or (kv < n and n % kv):
            raise InvalidArgumentError(
                f"tensor_parallel_size {n} and the model's {kv} KV heads must divide one another"
            )
        if cfg.intermediate_size % n:
            raise InvalidArgumentError(
                f"tensor_parallel_size {n} must divide the model's intermediate size {cfg.intermediate_size}"
            )
        if cfg.moe is not None and cfg.moe.intermediate_size % n:
            size = cfg.moe.intermediate_size
            raise InvalidArgumentError(
                f"tensor_parallel_size {n} must divide the experts' intermediate size {size}"
            )
        if cfg.qk_norm == "projection" and n > 1:
            # Its q/k norms take the mean over every head, which no rank holds.
            raise InvalidArgumentError(f"{cfg.architecture} does not support tensor parallelism")

    def _part(self, total: int) -> range:
        per = total // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def heads(self, cfg: ModelConfig) -> range:
        """This rank's query heads."""
        return self._part(cfg.num_heads)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """This rank's KV heads: its share, or the one it replicates."""
        if cfg.num_kv_heads >= self.size:
            return self._part(cfg.num_kv_heads)
        head = self.rank * cfg.num_kv_heads // self.size
        return range(head, head + 1)

    def ffn(self, cfg: ModelConfig) -> range:
        """This rank's intermediate columns of the FFN."""
        return self._part(cfg.intermediate_size)

    def moe_ffn(self, cfg: ModelConfig) -> range:
        """This rank's intermediate columns of every expert."""
        assert cfg.moe is not None, "a dense model has no experts"
        return self._part(cfg.moe.intermediate_size)

    def vocab(self, cfg: ModelConfig) -> range:
        """This rank's rows of the embedding and LM head (fewer than the other ranks' on the last
        rank when the vocabulary does not divide; its module is padded)."""
        per = -(-cfg.vocab_size // self.size)
        return range(min(self.rank * per, cfg.vocab_size), min((self.rank + 1) * per, cfg.vocab_size))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules have (its heads, FFN columns and padded vocab rows)."""
        if self.size == 1:
            return cfg
        heads, kv_heads, ffn, vocab = rank_shapes(
            self.size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size
        )
        moe = cfg.moe and dataclasses.replace(
            cfg.moe, intermediate_size=cfg.moe.intermediate_size // self.size
        )
        return dataclasses.replace(
            cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab, moe=moe
        )


def rank_shapes(size: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> tuple[int, int, int, int]:
    """Heads, KV heads, FFN columns and vocab rows of each of ``size`` ranks (the simulator's
    per-rank model: the same split as the engine's)."""
    return heads // size, max(1, kv_heads // size), ffn // size, -(-vocab // size)


SINGLE = TpShard(0, 1)
