#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (no network there; torch and transformers are
# in its image, Rust is not). Build the wheel here first and carry it:
#     maturin build --release -o .whl      # .whl/ is ignored by git
# then on the device, in the repo root, with .whl carried:
#     bash benches/gpu_check.sh
# Steps (about 8 minutes): install the wheel, run the parity and offload tests on CUDA, then
# the Llama-3-8B-shaped neo vs none comparison. Prints one table at the end.
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/neo_rs-*.whl
export PYTHONPATH=/tmp/site
export NEO_RS_CACHE_DIR=/tmp/neo_rs_cache
python3 -c "import torch, neo_rs; assert torch.cuda.is_available(); print(neo_rs.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/python/test_model_parity.py tests/python/test_offload.py tests/python/test_engine.py
timeout 300 python3 benches/gpu_check.py
