# krait: what the README's two commands (./bootstrap.sh serve|test) run once make exists, and a few helpers.
#   make serve   install missing Debian packages, build the krait executable only, serve the embedded
#                default model (OpenAI API on :8000)
#   make test    install missing Debian packages, build (warnings as errors, ASan+UBSan), run every test
#   make build   everything in Release: krait, the tests and the benchmarks (what docs/PERF.md measures)
#   make fuzz    build the libFuzzer harnesses (clang, ASan+UBSan) and run each: RUNS=N executions (default
#                100000) or FUZZ_SECONDS=S, FUZZ=name for one, FUZZ_JOBS=J in parallel (docs/FUZZING.md);
#                make fuzz-merge minimises the checked-in corpora with what the runs found
JOBS ?= $(shell nproc)
BUILD ?= build
TEST_BUILD ?= build-test
CUDA_BUILD ?= build-cuda
FUZZ_BUILD ?= build-fuzz
RUNS ?= 100000
FUZZ_JOBS ?= 1
MODEL ?= models/small-hybrid
PORT ?= 8000

.PHONY: deps build build-krait serve test test-sdk test-deploy test-megatron test-cuda-build fuzz fuzz-build fuzz-merge bench clean

deps:
	@./tools/install-deps.sh

# Tests and benchmarks are set ON explicitly: build-krait leaves them OFF in the same cache.
build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DKR_BUILD_TESTS=ON -DKR_BUILD_BENCH=ON
	cmake --build $(BUILD) -j $(JOBS)

# Only what serving needs: no test, benchmark or GPU test target is configured, and only krait is
# built (with the CUDA backend when nvcc is found, as KR_WITH_CUDA=AUTO decides).
build-krait: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DKR_BUILD_TESTS=OFF -DKR_BUILD_BENCH=OFF
	cmake --build $(BUILD) -j $(JOBS) --target krait

serve: build-krait
	./$(BUILD)/krait serve $(MODEL) --port $(PORT)

test: deps
	cmake -S . -B $(TEST_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKR_WITH_CUDA=OFF -DKR_WERROR=ON \
	  -DKR_SANITIZE="address;undefined"
	cmake --build $(TEST_BUILD) -j $(JOBS)
	cd $(TEST_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS)
	@$(MAKE) --no-print-directory test-sdk
	@$(MAKE) --no-print-directory test-deploy
	@$(MAKE) --no-print-directory test-megatron
	@$(MAKE) --no-print-directory test-cuda-build

# OpenAI Node SDK compatibility (runs wherever node and npm are present, as in CI).
test-sdk:
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
	  cd tests/sdk && npm ci --no-audit --no-fund --silent && \
	  ASAN_OPTIONS=detect_leaks=1 node test.mjs ../../$(TEST_BUILD)/krait ../../models/tiny-hybrid; \
	else echo "node/npm not found: skipping the OpenAI SDK compatibility test"; fi

# deploy/: every Kustomize overlay rendered and validated offline against the Kubernetes API and CRD
# schemas, and against the flags and defaults of the krait just built; the Dockerfiles linted
# (tests/deploy/check.mjs, docs/DEPLOY.md). Runs wherever node and npm are present, as in CI.
test-deploy:
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
	  cd tests/deploy && npm ci --no-audit --no-fund --silent && \
	  ASAN_OPTIONS=detect_leaks=1 node check.mjs ../../$(TEST_BUILD)/krait; \
	else echo "node/npm not found: skipping the deployment manifests check"; fi

# The Megatron converter (tools/megatron, docs/MEGATRON.md): fixtures of every family written as
# Megatron checkpoints (torch_dist and legacy, TP/PP/EP splits), converted back, held to the fixtures'
# tensors bit for bit and to their krait logprobs exactly. Needs PyTorch: Debian's, installed here for
# this test only (Debian's python3, not another one first on PATH). Where it cannot be installed (no
# mirror, no disk) the test says it did not run, as the GPU tests do without a GPU.
test-megatron:
	@./tools/install-deps.sh python3-torch || echo "test-megatron: python3-torch could not be installed"
	@if /usr/bin/python3 -c 'import torch' 2>/dev/null; then \
	  /usr/bin/python3 tests/megatron/roundtrip.py --krait $(TEST_BUILD)/krait; \
	else echo "test-megatron: NOT RUN: Debian's python3 cannot import torch (apt-get install python3-torch)"; fi

# The CUDA build must keep compiling wherever nvcc exists; its GPU tests run (tests/gpu/run.sh on a GPU
# machine) or skip with a message where no GPU is present.
test-cuda-build:
	@if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  cmake -S . -B $(CUDA_BUILD) -DCMAKE_BUILD_TYPE=Release -DKR_WITH_CUDA=ON -DKR_WERROR=ON -DKR_BUILD_TESTS=ON && \
	  cmake --build $(CUDA_BUILD) -j $(JOBS) && \
	  (cd $(CUDA_BUILD) && ctest --output-on-failure -V -L gpu > gpu-tests.log 2>&1; rc=$$?; \
	   grep -aE "test_cuda:|Synthesis|tests passed|Failed|Skipped|did not run" gpu-tests.log; exit $$rc); \
	else echo "nvcc not found: skipping the CUDA build check"; fi

# Not part of make test: the fuzz build is clang's with coverage instrumentation. make test replays the
# checked-in corpora (the fuzz_replay_* tests) under gcc's ASan+UBSan.
fuzz-build: deps
	@command -v clang >/dev/null 2>&1 || { echo "make fuzz needs clang and libFuzzer (Debian: apt-get install clang libfuzzer-14-dev)" >&2; exit 1; }
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DKR_FUZZ=ON -DKR_WITH_CUDA=OFF -DKR_WERROR=ON \
	  -DKR_BUILD_TESTS=OFF -DKR_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(FUZZ_BUILD) -j $(JOBS)

fuzz: fuzz-build
	RUNS=$(RUNS) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ=$(FUZZ) FUZZ_JOBS=$(FUZZ_JOBS) ./tools/fuzz.sh $(FUZZ_BUILD)

fuzz-merge: fuzz-build
	FUZZ=$(FUZZ) FUZZ_MERGE=1 ./tools/fuzz.sh $(FUZZ_BUILD)

bench: build
	./$(BUILD)/bench/bench_cpu

clean:
	rm -rf $(BUILD) $(TEST_BUILD) $(CUDA_BUILD) $(FUZZ_BUILD)
