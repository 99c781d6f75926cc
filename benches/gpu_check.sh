#!/usr/bin/env bash
# The one prepared script for a lent GPU machine: unattended, at most about 7 minutes (each step
# has its own time limit, so one hung step costs its slot, not the run's log), everything it
# writes under $OUT (a temporary folder when unset). That machine has no network and no Rust
# toolchain; its Python 3.12 has torch, Triton, transformers, safetensors, aiohttp, numpy and
# pytest. So first, here:
#     bash benches/gpu_bundle.sh        # .whl/: our abi3 wheel and the wheels that image lacks
# then carry .whl/ (ignored by git) and, on the device, from the repository root:
#     bash benches/gpu_check.sh
# Steps: (0) benches/gpu_compile.py's table for this GPU's target, built by the Triton there;
# (1) the parity, offload and kernel tests on CUDA, with our Triton decode kernel and
# again with the torch fallback (and FlashInfer, if it is installed there); (2) a
# Llama-3-8B-shaped bf16 model: its worst iteration against the activation plan, then neo vs none
# at equal load (benches/gpu_check.py); (3) the start-up perf profile and model config, the input
# of `python -m neo_rs.sim --calibrate`.
# One table at the end; JSON and logs in $OUT.
# `--bench` runs step (2) alone: a rerun inside one lease, once the tests have passed.
# `--kernels` runs step (0) and the Triton kernels' and CUDA graphs' tests alone (a kernel change,
# checked in a minute and a half of a lease).
# `--cpu-smoke` runs the same steps in this repository's .venv on the CPU, with a tiny one-layer
# model and one small test file, so that CI keeps the script from rotting.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export NEO_RS_CACHE_DIR="$OUT/cache"
status=0

if [ "${1:-}" = "--cpu-smoke" ]; then
    PY=.venv/bin/python
    TESTS="tests/python/test_transfer.py"
    FALLBACK_TESTS="tests/python/test_transfer.py"
    CHECK_ARGS=--smoke
    PYTEST_GPU=
else
    PY=python3
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/neo_rs_site .whl/*.whl
    export PYTHONPATH=/tmp/neo_rs_site${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
    TESTS="tests/python/test_model_parity.py tests/python/test_offload.py tests/python/test_engine.py
        tests/python/test_transfer.py tests/python/test_triton_decode.py tests/python/test_device_decode.py
        tests/python/test_triton_prefill.py tests/python/test_prefix_cache.py tests/python/test_cuda_graphs.py
        tests/python/test_grouped_gemm.py"
    FALLBACK_TESTS="tests/python/test_model_parity.py tests/python/test_offload.py"
    # The image has pytest-xdist and pytest-timeout: Triton's compiles spread over its 16 cores,
    # and a test that hangs on CUDA fails alone instead of taking its whole step's log with it.
    PYTEST_GPU="-n 8 --timeout 120"
    # A smaller stack than Llama-3-8B's 32 layers by default, to fit a lease; set GPU_CHECK_ARGS.
    CHECK_ARGS=${GPU_CHECK_ARGS:---layers 8 --requests 64}
fi
"$PY" -c "import torch, neo_rs; print('neo_rs', neo_rs.__version__, 'torch', torch.__version__,
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')" | tee "$OUT/versions.txt"

if [ "${1:-}" = "--bench" ]; then TESTS= FALLBACK_TESTS=; fi
if [ "${1:-}" = "--kernels" ]; then
    TESTS="tests/python/test_triton_decode.py tests/python/test_triton_prefill.py
        tests/python/test_device_decode.py tests/python/test_cuda_graphs.py tests/python/test_grouped_gemm.py"
    FALLBACK_TESTS= SKIP_BENCH=1
fi
# SKIP_COMPILE=1 leaves step (0) out (kernels unchanged since the last lease; saves a minute).
if [ -n "$TESTS" ] && [ -n "$PYTEST_GPU" ] && [ -z "${SKIP_COMPILE:-}" ]; then  # `make test` compiles for every target
    ARCH=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
    timeout 120 "$PY" benches/gpu_compile.py --targets "$ARCH" --no-cache 2>&1 \
        | tee "$OUT/gpu_compile.log" || status=1
fi
# shellcheck disable=SC2086  # the test lists are word lists
[ -z "$TESTS" ] || NEO_RS_DEVICE_ATTENTION=triton timeout 180 "$PY" -m pytest -q -p no:cacheprovider $PYTEST_GPU $TESTS 2>&1 \
    | tee "$OUT/tests_triton.log" || status=1
# shellcheck disable=SC2086
[ -z "$FALLBACK_TESTS" ] || NEO_RS_DEVICE_ATTENTION=torch timeout 80 "$PY" -m pytest -q -p no:cacheprovider $PYTEST_GPU $FALLBACK_TESTS 2>&1 \
    | tee "$OUT/tests_torch_fallback.log" || status=1
if [ -n "$FALLBACK_TESTS" ] && "$PY" -c "import flashinfer" 2>/dev/null; then  # only if its wheels travelled
    # shellcheck disable=SC2086
    NEO_RS_DEVICE_ATTENTION=flashinfer timeout 80 "$PY" -m pytest -q -p no:cacheprovider $PYTEST_GPU $FALLBACK_TESTS 2>&1 \
        | tee "$OUT/tests_flashinfer.log" || status=1
fi
# shellcheck disable=SC2086  # CHECK_ARGS is a word list
[ -n "${SKIP_BENCH:-}" ] || timeout 200 "$PY" benches/gpu_check.py --out "$OUT" $CHECK_ARGS 2>&1 \
    | tee "$OUT/gpu_check.log" || status=1

echo "== summary ($OUT)"
if [ -f "$OUT/gpu_compile.log" ]; then grep -A 5 "^kernel " "$OUT/gpu_compile.log" | sed 's/^/compile: /'; fi
for f in tests_triton:"Triton decode:  " tests_torch_fallback:"torch fallback: "; do
    if [ -f "$OUT/${f%%:*}.log" ]; then tail -n 1 "$OUT/${f%%:*}.log" | sed "s/^/tests, ${f#*:}/"; fi
done
if [ -f "$OUT/tests_flashinfer.log" ]; then tail -n 1 "$OUT/tests_flashinfer.log" | sed 's/^/tests, FlashInfer:     /'; fi
if [ -f "$OUT/gpu_check.log" ]; then grep -A 3 "^mode " "$OUT/gpu_check.log" || true; fi
if [ -f "$OUT/gpu_check.log" ]; then grep "^memory plan" "$OUT/gpu_check.log" || true; fi
exit $status
