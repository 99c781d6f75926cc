"""The public surface: every name ``neo_rs.__all__`` lists imports from the package root, and the
three entry points start (``--help``). The package's layers are kept by import-linter (``make
lint``); this guards what users and vLLM-style scripts import."""

from __future__ import annotations

import subprocess
import sys

import neo_rs
import pytest


@pytest.mark.parametrize("name", neo_rs.__all__)
def test_each_public_name_imports_from_the_root(name: str) -> None:
    assert getattr(neo_rs, name) is not None


def test_the_user_facing_names_are_public() -> None:
    wanted = {"LLM", "SamplingParams", "StructuredOutputsParams", "NeoRsError", "InvalidArgumentError"}
    errors = {
        "BackendError", "DTypeError", "EngineDeadError", "EngineStepError", "ModelLoadError", "ShapeError"
    }  # fmt: skip
    assert wanted | errors <= set(neo_rs.__all__)
    assert all(issubclass(getattr(neo_rs, e), neo_rs.NeoRsError) for e in errors)


@pytest.mark.parametrize("module", ["neo_rs.serve", "neo_rs.bench", "neo_rs.sim", "neo_rs.demo"])
def test_entry_points_start(module: str) -> None:
    cmd = [sys.executable, "-m", module, "--help"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
