"""The model dtype the engine picks per device: the checkpoint's for "auto", except that a GPU
before sm_80 (a T4) has no bfloat16, where "auto" takes float16 and says so, and an explicit
bfloat16 is refused, as vLLM does."""

from __future__ import annotations

import logging

import pytest
import torch
from neo_rs import InvalidArgumentError
from neo_rs.config import resolve_dtype

T4, A100 = (7, 5), (8, 0)


@pytest.mark.parametrize("capability", [None, A100, (9, 0)])
def test_auto_keeps_the_checkpoints_dtype_where_bf16_exists(capability: tuple[int, int] | None) -> None:
    assert resolve_dtype("auto", torch.bfloat16, capability) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.float32, capability) == torch.bfloat16


def test_a_t4_runs_a_bf16_checkpoint_in_fp16_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="neo_rs.config"):
        assert resolve_dtype("auto", torch.bfloat16, T4) == torch.float16
    assert "no bfloat16" in caplog.text and "float16" in caplog.text


def test_a_t4_keeps_other_dtypes() -> None:
    assert resolve_dtype("auto", torch.float32, T4) == torch.float32
    assert resolve_dtype("float16", torch.bfloat16, T4) == torch.float16


@pytest.mark.parametrize("asked", ["bfloat16", torch.bfloat16])
def test_explicit_bf16_on_a_t4_is_refused_naming_the_fix(asked: str | torch.dtype) -> None:
    with pytest.raises(InvalidArgumentError, match="compute capability 8.0.*float16"):
        resolve_dtype(asked, torch.float32, T4)
