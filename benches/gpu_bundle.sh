#!/usr/bin/env bash
# Prepares .whl/ (ignored by git) for benches/gpu_check.sh on a GPU machine with no network and no
# Rust: our abi3 wheel, built here, and the wheels of our dependencies that machine's image
# (Python 3.12 with torch, Triton, transformers, safetensors, aiohttp, numpy, pytest) lacks.
# Carry .whl/ with the repository (it must stay well under the 64 MiB the copy may hold).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
mkdir -p .whl
.venv/bin/python -m pip wheel -q --no-deps -w .whl .
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    prometheus-client tqdm "llguidance$(.venv/bin/python -c 'import importlib.metadata as m; print("==" + m.version("llguidance"))')"
du -sh .whl
ls .whl
